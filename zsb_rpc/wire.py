"""The wire, from bytes up: LSP base-protocol framing on stdio, then JSON-RPC 2.0 on pygls.

pygls' own stdio loop trusts its input: a body that is not JSON, an envelope
without ``jsonrpc``, a huge ``Content-Length`` or invalid params end in a
logged exception and no response, and an internal error carries a traceback.
A sandbox server must answer every request exactly once and keep serving, so
this module frames and validates messages itself and hands well-formed
requests, with params structured by the protocol's converter, to pygls'
dispatch and cancellation machinery.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
import threading
import traceback
from concurrent.futures import Future
from typing import Any

from lsprotocol.types import CANCEL_REQUEST, ResponseError
from pygls.exceptions import JsonRpcException
from pygls.protocol import JsonRPCProtocol

from .protocol import errors
from .protocol.convert import structure_params
from .protocol.methods import CLIENT_NOTIFICATIONS, REQUESTS

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 * 1024 * 1024
MAX_HEADER_LINE = 64 * 1024
WRITE_BUFFER_HIGH = 2 * 1024 * 1024
_MISSING = object()


async def read_frames(reader: asyncio.StreamReader, on_body: Any, on_error: Any) -> None:
    """Call ``on_body`` for each framed message until EOF; ``on_error`` for each broken frame."""
    while True:
        length: int | None = None
        problem: str | None = None
        seen_header = False
        while True:
            try:
                line = await reader.readuntil(b"\n")
            except asyncio.IncompleteReadError:
                return
            except asyncio.LimitOverrunError as overrun:
                await reader.readexactly(overrun.consumed)
                problem = "header line too long"
                seen_header = True
                continue
            line = line.rstrip(b"\r\n")
            if not line:
                if seen_header:
                    break
                continue  # stray blank line between messages
            seen_header = True
            name, sep, value = line.partition(b":")
            if not sep:
                problem = "malformed header line (expected 'Name: value')"
            elif name.strip().lower() == b"content-length":
                digits = value.strip()
                if digits.isdigit() and len(digits) <= 18:
                    length = int(digits)
                else:
                    problem = "Content-Length must be a non-negative integer"
        if problem is None and length is None:
            problem = "missing Content-Length header"
        if problem is not None:
            on_error(problem)
            continue
        assert length is not None
        if length > MAX_BODY_BYTES:
            remaining = length
            while remaining:
                chunk = await reader.read(min(remaining, 1 << 16))
                if not chunk:
                    return
                remaining -= len(chunk)
            on_error(f"message of {length} bytes exceeds the limit of {MAX_BODY_BYTES} bytes")
            continue
        try:
            body = await reader.readexactly(length)
        except asyncio.IncompleteReadError:
            return
        on_body(body)


def _valid_id(value: Any) -> bool:
    return isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))


class ZsbProtocol(JsonRPCProtocol):
    """JSON-RPC over pygls with the protocol's registry, strict params and no tracebacks on the wire."""

    def __init__(self, server: Any, converter: Any) -> None:
        super().__init__(server, converter)
        self._stdout: asyncio.StreamWriter | None = None
        self._sync_out: Any = None
        # Ids from arrival to answer. pygls forgets an id as soon as it is cancelled, so a
        # request reusing it then would share its bookkeeping with the one still finishing.
        self._in_flight: set[Any] = set()

    # -- output ---------------------------------------------------------

    def attach_output(self, writer: asyncio.StreamWriter | None, sync_out: Any = None) -> None:
        self._stdout = writer
        self._sync_out = sync_out

    def _send_data(self, data: Any) -> None:
        if hasattr(data, "__attrs_attrs__"):
            data = self._converter.unstructure(data)
        try:
            body = json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode("utf-8")
        except UnicodeEncodeError:
            # Lone surrogates a client sent us, echoed in a message: escape them.
            body = json.dumps(data, separators=(",", ":"), allow_nan=False).encode("ascii")
        self._write_frame(b"Content-Length: %d\r\n\r\n" % len(body) + body)

    def _write_frame(self, frame: bytes) -> None:
        if self._stdout is not None:
            if not self._stdout.is_closing():
                self._stdout.write(frame)
        elif self._sync_out is not None:
            self._sync_out.write(frame)
            self._sync_out.flush()

    def send_output(self, run_id: str | int, session_id: str, stream: str, data: str) -> None:
        """A ``run/output`` frame, assembled directly: the one message whose speed matters.

        json.dumps of a whole message runs at about half the speed of escaping
        the one long string in it, and streaming is bound by exactly that.
        """
        if data.isascii():
            escaped = json.encoder.encode_basestring_ascii(data).encode("ascii")
        else:
            escaped = json.encoder.encode_basestring(data).encode("utf-8", "surrogatepass")
        head = ('{"jsonrpc":"2.0","method":"run/output","params":{"runId":%s,"sessionId":%s,"stream":"%s","data":'
                % (json.dumps(run_id), json.dumps(session_id), stream)).encode("utf-8")
        length = len(head) + len(escaped) + 2
        frame = b"".join((b"Content-Length: %d\r\n\r\n" % length, head, escaped, b"}}"))
        self._write_frame(frame)

    async def drain(self) -> None:
        """Wait until the client has taken what was sent: back-pressure for streamed output."""
        if self._stdout is not None and not self._stdout.is_closing():
            try:
                await self._stdout.drain()
            except (ConnectionError, BrokenPipeError):
                pass

    def send_error(self, msg_id: Any, code: int, message: str, data: Any = None) -> None:
        error: dict[str, Any] = {"code": code, "message": message}
        if data is not None:
            error["data"] = data
        self._send_data({"jsonrpc": "2.0", "id": msg_id, "error": error})

    def _send_response(self, msg_id: Any, result: Any = None, error: ResponseError | None = None) -> None:
        if error is not None:
            self.send_error(msg_id, error.code, error.message, error.data)
        else:
            if hasattr(result, "__attrs_attrs__"):
                result = self._converter.unstructure(result)
            self._send_data({"jsonrpc": "2.0", "id": msg_id, "result": result})

    def _send_handler_result(self, future: Future[Any], *, msg_id: Any) -> None:
        self._request_futures.pop(msg_id, None)
        self._in_flight.discard(msg_id)
        if future.cancelled():
            self.send_error(msg_id, errors.REQUEST_CANCELLED, f"request {msg_id!r} was cancelled")
            return
        error = future.exception()
        if error is None:
            self._send_response(msg_id, result=future.result())
        elif isinstance(error, errors.ZsbError):
            self.send_error(msg_id, error.code, error.message, error.data)
        elif isinstance(error, JsonRpcException):
            self.send_error(msg_id, error.code, error.message)
        else:
            # The traceback goes to stderr; the client gets the error's type and text only.
            logger.error("request %r failed:\n%s", msg_id,
                         "".join(traceback.format_exception(type(error), error, error.__traceback__)))
            self.send_error(msg_id, errors.INTERNAL_ERROR, f"internal error: {type(error).__name__}: {error}")

    # -- input ----------------------------------------------------------

    def framing_error(self, problem: str) -> None:
        self.send_error(None, errors.PARSE_ERROR, f"framing: {problem}")

    def handle_body(self, body: bytes) -> None:
        try:
            message = json.loads(body)
        except (ValueError, RecursionError) as error:
            self.send_error(None, errors.PARSE_ERROR, f"body is not valid JSON: {str(error)[:200]}")
            return
        if isinstance(message, list):
            # LSP framing carries one message per frame; answer each request of a
            # batch, so none goes unanswered.
            if not message:
                self.send_error(None, errors.INVALID_REQUEST, "empty batch")
            for entry in message:
                entry_id = entry.get("id") if isinstance(entry, dict) else None
                if isinstance(entry, dict) and "method" in entry and not _valid_id(entry_id):
                    continue  # a notification gets no response
                self.send_error(entry_id if _valid_id(entry_id) else None, errors.INVALID_REQUEST,
                                "batches are not supported; send each request in its own frame")
            return
        try:
            self.handle_envelope(message)
        except Exception as error:  # never let one message take the server down
            logger.exception("unhandled error on a message")
            msg_id = message.get("id") if isinstance(message, dict) else None
            self.send_error(msg_id if _valid_id(msg_id) else None, errors.INTERNAL_ERROR,
                            f"internal error: {type(error).__name__}")

    def handle_envelope(self, message: Any) -> None:
        if not isinstance(message, dict):
            self.send_error(None, errors.INVALID_REQUEST, "a message must be a JSON object")
            return
        has_id = "id" in message
        msg_id = message.get("id")
        if has_id and not _valid_id(msg_id):
            self.send_error(None, errors.INVALID_REQUEST, "id must be a string or an integer")
            return
        reply_id = msg_id if has_id else None
        if message.get("jsonrpc") != "2.0":
            if has_id:
                self.send_error(reply_id, errors.INVALID_REQUEST, 'jsonrpc must be "2.0"')
            return
        if "method" not in message:
            return  # a response from the client: this server sends no requests
        method = message["method"]
        if not isinstance(method, str):
            if has_id:
                self.send_error(reply_id, errors.INVALID_REQUEST, "method must be a string")
            return
        params = message.get("params", _MISSING)
        if not has_id:
            self._notification(method, params)
            return
        spec = REQUESTS.get(method)
        if spec is None:
            self.send_error(msg_id, errors.METHOD_NOT_FOUND, f"method not found: {method[:200]!r}")
            return
        if msg_id in self._request_futures or msg_id in self._in_flight:
            self.send_error(msg_id, errors.INVALID_REQUEST, f"a request with id {msg_id!r} is still in flight")
            return
        if params is _MISSING or params is None:
            if spec.params_required:
                self.send_error(msg_id, errors.INVALID_PARAMS, f"params: is required for {method} (an object)",
                                {"field": "params"})
                return
            params = {}
        try:
            structured = structure_params(self._converter, params, spec.params)
        except errors.ZsbError as error:
            self.send_error(msg_id, error.code, error.message, error.data)
            return
        self._in_flight.add(msg_id)
        self._handle_request(msg_id, method, structured)  # type: ignore[arg-type]  # checked by _valid_id

    def _notification(self, method: str, params: Any) -> None:
        spec = CLIENT_NOTIFICATIONS.get(method)
        if spec is None:
            logger.debug("ignoring notification %r", method)
            return
        try:
            structured = structure_params(self._converter, params, spec.params)
        except errors.ZsbError as error:
            logger.warning("ignoring %s: %s", method, error.message)
            return
        if method == CANCEL_REQUEST:
            # A cancel that crossed its request's answer is normal, not worth a warning.
            if structured.id in self._request_futures:
                self._handle_cancel_notification(structured.id)


def _pollable(stream: Any) -> bool:
    import stat

    try:
        mode = os.fstat(stream.fileno()).st_mode
    except (OSError, ValueError):
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)


async def open_stdio(protocol: ZsbProtocol) -> asyncio.StreamReader:
    """Connect stdin/stdout to the event loop; pipes are non-blocking, anything else falls back to a thread."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=MAX_HEADER_LINE)
    if sys.stdin is None or sys.stdout is None:
        # Started with no stdin (or stdout) at all: there is no client, so nothing to serve.
        reader.feed_eof()
        protocol.attach_output(None, None)
        return reader
    try:
        # epoll takes pipes and sockets; a file or /dev/null (no stdin in CI) needs the thread.
        if not _pollable(sys.stdin.buffer):
            raise ValueError("stdin cannot be polled")
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin.buffer)
    except (ValueError, OSError):
        def pump() -> None:
            while chunk := sys.stdin.buffer.read1(1 << 16):  # type: ignore[union-attr]
                loop.call_soon_threadsafe(reader.feed_data, chunk)
            loop.call_soon_threadsafe(reader.feed_eof)

        # A daemon thread: a blocked read must not hold up the server's exit.
        threading.Thread(target=pump, name="stdin", daemon=True).start()
    try:
        if not _pollable(sys.stdout.buffer):
            raise ValueError("stdout cannot be polled")
        # A larger pipe to the client: fewer wake-ups per megabyte streamed.
        with contextlib.suppress(OSError, AttributeError):
            import fcntl

            fcntl.fcntl(sys.stdout.fileno(), getattr(fcntl, "F_SETPIPE_SZ", 1031), 1024 * 1024)
        transport, stream_protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin, sys.stdout.buffer)
        # drain() waits from the high mark down to the low one: with the default 64 KiB a
        # single chunk of output stops the pump until the client has read nearly all of it.
        # A few MiB keep both sides busy and memory bounded.
        transport.set_write_buffer_limits(high=WRITE_BUFFER_HIGH, low=WRITE_BUFFER_HIGH // 4)
        protocol.attach_output(asyncio.StreamWriter(transport, stream_protocol, None, loop))
    except (ValueError, OSError):
        protocol.attach_output(None, sys.stdout.buffer)
    return reader
