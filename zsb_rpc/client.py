"""A thin Python client of the zsb-rpc server: sandboxed commands with a ``subprocess.run``-like API.

::

    from zsb_rpc.client import SandboxSession

    with SandboxSession("/work/project", memory="512MB", cpus=1, cpu_seconds=60) as sb:
        sb.run("python build.py", check=True)
        print(sb.run("ls dist").stdout)

    with SandboxSession(memory="256MB", timeout=30) as sb:      # private workspace, gone afterwards
        (sb.workspace / "job.py").write_text(code)
        result = sb.run(["python3", "job.py"], check=True)

    async with SandboxSession() as sb:                          # runs of one session run concurrently
        results = await asyncio.gather(*(sb.arun(["sleep", "1"]) for _ in range(8)))

How it is built:

* A ``SandboxServer`` is one server child (``python -m zsb_rpc``) on stdin/stdout
  pipes plus one background thread running an asyncio event loop. That loop alone
  touches the pipes: it frames requests, reads responses and notifications and
  routes each to the caller waiting for it.
* A caller never runs on that loop. It starts a request and then waits on a queue
  of its own: a ``queue.SimpleQueue`` in a synchronous call, an ``asyncio.Queue``
  on the caller's loop in ``arun`` and the other ``a*`` methods. The loop thread
  puts streamed output and then the response there, in the order they arrived, so
  ``on_stdout``/``on_stderr`` run in the caller's thread (or task) and have all been
  called when ``run`` returns.
* A caller that stops waiting (its task cancelled, Ctrl-C, a callback raising) sends
  ``$/cancelRequest``; the server kills the run's process tree and answers, and the
  caller waits (briefly) for that answer before the exception propagates, so after
  ``await task`` raises ``CancelledError`` the process is already gone.
* The server exits when its stdin closes, killing every run and removing private
  workspaces. Closing a ``SandboxServer``, garbage-collecting it and interpreter
  exit close that pipe (``weakref.finalize``), wait for the child briefly and kill
  it if needed. If this process dies instead, the kernel closes the pipe: the
  server never outlives its client.

This module imports ``zsb_rpc.protocol`` (data only) and nothing of the server.
"""

from __future__ import annotations

import asyncio
import base64
import codecs
import concurrent.futures
import contextlib
import itertools
import json

try:
    # Streamed output is mostly JSON strings full of escapes ("\n"), which the
    # standard library decodes at about 150 MB/s; orjson does it at several times that.
    from orjson import loads as _loads
except ImportError:  # pragma: no cover - orjson is a dependency, but the client works without it
    _loads = json.loads  # type: ignore[assignment]
import logging
import os
import queue
import re
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

from .protocol import errors as codes

__all__ = [
    "BackendInfo",
    "Capabilities",
    "Resources",
    "RunResult",
    "SandboxCancelledError",
    "SandboxCommandError",
    "SandboxConnectionError",
    "SandboxError",
    "SandboxPolicyError",
    "SandboxServer",
    "SandboxSession",
    "SandboxSessionError",
    "SandboxUnavailableError",
    "Truncated",
    "WrapResult",
    "parse_size",
]

logger = logging.getLogger(__name__)

Command = str | Sequence[str | os.PathLike[str]]
PathArg = str | os.PathLike[str]
Size = int | float | str

#: How long ``close()`` waits for the server to tear its sessions down and exit
#: before it is killed (the server answers in-flight requests within 1 s of EOF).
SHUTDOWN_TIMEOUT_SECONDS = 5.0
#: How long a cancelled call waits for the server to confirm that the run's tree is dead.
CANCEL_GRACE_SECONDS = 10.0
_MAX_HEADER_LINE = 64 * 1024


class _Default:
    """The "not given" marker where ``None`` means something (``timeout=None``: no timeout)."""

    def __repr__(self) -> str:
        return "<session default>"


DEFAULT: Any = _Default()


# -- errors -------------------------------------------------------------------


class SandboxError(Exception):
    """An error of the sandbox. Server errors carry the JSON-RPC ``code``, ``message`` and ``data``."""

    def __init__(self, message: str, *, code: int | None = None, data: Any = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.data = data

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, code={self.code!r})"


class SandboxPolicyError(SandboxError):
    """A parameter breaks a rule (-32602); the message names the wire field, e.g. ``params.limits.processes``."""


class SandboxUnavailableError(SandboxError):
    """The backend cannot run here (-32002), or isolation was required and is not available (-32004)."""


class SandboxSessionError(SandboxError):
    """No such session (-32001), or it was closed while the request ran (-32003)."""


class SandboxCancelledError(SandboxError):
    """The server cancelled the request (-32800) although this caller did not ask for it."""


class SandboxConnectionError(SandboxError):
    """The server child is gone (it exited, was closed, or its pipes broke); ``code`` is None."""


class SandboxCommandError(SandboxError):
    """``run(..., check=True)``: the command exited non-zero or timed out. ``result`` is its RunResult."""

    def __init__(self, result: RunResult) -> None:
        if result.timed_out:
            what = f"timed out after {result.duration_seconds:.3g} s"
        elif result.exit_code < 0:
            what = f"was killed by signal {-result.exit_code}"
        else:
            what = f"exited with status {result.exit_code}"
        message = f"command {result.command!r} {what}"
        tail = result.stderr.strip()[-500:]
        if tail:
            message += f"; stderr ends with: {tail}"
        super().__init__(message)
        self.result = result

    @property
    def exit_code(self) -> int:
        return self.result.exit_code

    returncode = exit_code

    @property
    def stdout(self) -> str:
        return self.result.stdout

    @property
    def stderr(self) -> str:
        return self.result.stderr


_ERROR_CLASSES: dict[int, type[SandboxError]] = {
    codes.INVALID_PARAMS: SandboxPolicyError,
    codes.SANDBOX_UNAVAILABLE: SandboxUnavailableError,
    codes.ISOLATION_REQUIRED: SandboxUnavailableError,
    codes.SESSION_NOT_FOUND: SandboxSessionError,
    codes.SESSION_CLOSED: SandboxSessionError,
    codes.REQUEST_CANCELLED: SandboxCancelledError,
}


def _error_from_wire(error: Any) -> SandboxError:
    if not isinstance(error, dict):
        return SandboxError(f"malformed error from the server: {error!r}")
    code = error.get("code")
    cls = _ERROR_CLASSES.get(code, SandboxError) if isinstance(code, int) else SandboxError
    return cls(str(error.get("message", "")), code=code, data=error.get("data"))


# -- results --------------------------------------------------------------------


@dataclass(frozen=True)
class Truncated:
    """Which streams of a result were cut at the output limit."""

    stdout: bool = False
    stderr: bool = False


@dataclass(frozen=True)
class Resources:
    """Limits of a run, how each was enforced, what was used (where measured) and hit."""

    peak_memory_bytes: int | None = None
    cpu_seconds: float | None = None
    limits_hit: tuple[str, ...] = ()
    mechanisms: Mapping[str, str] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()

    @classmethod
    def _from_wire(cls, wire: Mapping[str, Any]) -> Resources:
        return cls(
            peak_memory_bytes=wire.get("peakMemoryBytes"),
            cpu_seconds=wire.get("cpuSeconds"),
            limits_hit=tuple(wire.get("limitsHit", ())),
            mechanisms=dict(wire.get("mechanisms", {})),
            warnings=tuple(wire.get("warnings", ())),
        )


@dataclass(frozen=True)
class RunResult:
    """The outcome of ``run``, like ``subprocess.CompletedProcess``.

    ``exit_code`` is negative (the signal number) when a signal ended the command.
    When ``input`` was bytes, the output was transferred as bytes and is decoded
    here as UTF-8 with ``errors="replace"``.
    """

    command: str | tuple[str, ...]
    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool
    truncated: Truncated
    isolated: bool
    duration_seconds: float
    resources: Resources

    @property
    def returncode(self) -> int:
        return self.exit_code

    @property
    def succeeded(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    def check_returncode(self) -> None:
        """Raise SandboxCommandError unless the command succeeded."""
        if not self.succeeded:
            raise SandboxCommandError(self)

    @classmethod
    def _from_wire(cls, command: str | tuple[str, ...], wire: Mapping[str, Any], binary: bool) -> RunResult:
        truncated = wire.get("truncated") or {}
        stdout, stderr = wire.get("stdout", ""), wire.get("stderr", "")
        if binary:
            # A stream cut at the limit may end inside a character: keep that
            # half character out instead of turning it into U+FFFD.
            stdout = _decode_base64_text(stdout, final=not truncated.get("stdout", False))
            stderr = _decode_base64_text(stderr, final=not truncated.get("stderr", False))
        return cls(
            command=command,
            exit_code=wire["exitCode"],
            stdout=stdout,
            stderr=stderr,
            timed_out=wire.get("timedOut", False),
            truncated=Truncated(stdout=truncated.get("stdout", False), stderr=truncated.get("stderr", False)),
            isolated=wire.get("isolated", False),
            duration_seconds=wire.get("durationSeconds", 0.0),
            resources=Resources._from_wire(wire.get("resources") or {}),
        )


@dataclass(frozen=True)
class WrapResult:
    """A sandboxed command line that nothing has run: spawn ``argv`` in ``cwd`` with exactly ``env``."""

    argv: tuple[str, ...]
    cwd: str
    env: Mapping[str, str]
    warnings: tuple[str, ...]


@dataclass(frozen=True)
class BackendInfo:
    name: str
    available: bool
    isolated: bool
    reason: str | None


@dataclass(frozen=True)
class Capabilities:
    """What the server's machine can enforce; each limit field names its mechanism (``none`` when not enforced)."""

    server_version: str
    protocol_version: str
    platform: str
    backend: str | None
    isolated: bool
    memory: str
    cpu_seconds: str
    cpu_percent: str
    processes: str
    file_size_bytes: str
    open_files: str
    core_dumps: str
    backends: tuple[BackendInfo, ...]
    warnings: tuple[str, ...]

    @classmethod
    def _from_wire(cls, wire: Mapping[str, Any]) -> Capabilities:
        return cls(
            server_version=wire.get("serverVersion", ""),
            protocol_version=wire.get("protocolVersion", ""),
            platform=wire.get("platform", ""),
            backend=wire.get("backend"),
            isolated=wire.get("isolated", False),
            memory=wire.get("memory", "none"),
            cpu_seconds=wire.get("cpuSeconds", "none"),
            cpu_percent=wire.get("cpuPercent", "none"),
            processes=wire.get("processes", "none"),
            file_size_bytes=wire.get("fileSizeBytes", "none"),
            open_files=wire.get("openFiles", "none"),
            core_dumps=wire.get("coreDumps", "none"),
            backends=tuple(
                BackendInfo(name=b.get("name", ""), available=b.get("available", False),
                            isolated=b.get("isolated", False), reason=b.get("reason"))
                for b in wire.get("backends", ())
            ),
            warnings=tuple(wire.get("warnings", ())),
        )


# -- option conversion ------------------------------------------------------------

_SIZE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*(?:([kmgt])(?:i?b)?|b)?", re.IGNORECASE)
_SIZE_EXPONENTS = {None: 0, "k": 1, "m": 2, "g": 3, "t": 4}


def parse_size(value: Size) -> int:
    """Bytes from an int or a string like ``"512MB"``, ``"512MiB"``, ``"1.5G"``, ``"64k"`` or ``"100B"``.

    K, M, G and T are powers of 1024 with or without ``B``/``iB``, in any case;
    fractions of a byte are dropped. Raises ValueError or TypeError.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TypeError(f"a size must be a number of bytes or a string like '512MB', not {type(value).__name__}")
    if isinstance(value, str):
        match = _SIZE.fullmatch(value.strip())
        if match is None:
            raise ValueError(f"not a size: {value!r} (a number of bytes, or a number with K, M, G or T, e.g. '512MB')")
        try:
            # Decimal, so that "1.5G" is exactly 1610612736 and not a float's neighbour.
            number = Decimal(match.group(1)) * 1024 ** _SIZE_EXPONENTS[(match.group(2) or "").lower() or None]
        except InvalidOperation:
            raise ValueError(f"not a size: {value!r}") from None
        return int(number)
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"not a size: {value!r}")
    if value < 0:
        raise ValueError(f"a size cannot be negative: {value!r}")
    return int(value)


def _size_option(value: Size | None, name: str) -> int | None:
    if value is None:
        return None
    try:
        return parse_size(value)
    except (TypeError, ValueError) as error:
        raise type(error)(f"{name}: {error}") from None


def _whole(value: Any) -> Any:
    # 60.0 seconds is the integer the wire wants; anything else goes as given
    # and the server names the field and the rule.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _absolute(path: PathArg) -> str:
    # The server wants absolute paths ("~" it expands itself); a relative path
    # is relative to this program's working directory, as everywhere in Python.
    text = os.fspath(path)
    if not isinstance(text, str):
        raise TypeError(f"paths must be str or os.PathLike[str], not {type(text).__name__}")
    if text == "~" or text.startswith("~/"):
        return text
    return os.path.abspath(text)


def _path_list(value: PathArg | Iterable[PathArg] | None, name: str) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, (str, os.PathLike)):
        value = [value]  # one path, not its characters
    try:
        return [_absolute(p) for p in value]
    except TypeError as error:
        raise TypeError(f"{name}: {error}") from None


def _names(value: str | Iterable[str] | None) -> list[str] | None:
    if value is None:
        return None
    return [value] if isinstance(value, str) else list(value)


def _command(command: Command) -> str | list[str]:
    if isinstance(command, str):
        return command
    if isinstance(command, (bytes, os.PathLike)):
        raise TypeError("command must be a str (run by /bin/sh -c) or a sequence of str (run directly)")
    argv = [os.fspath(arg) for arg in command]
    for arg in argv:
        if not isinstance(arg, str):
            raise TypeError(f"command arguments must be str, not {type(arg).__name__}")
    return argv


def _network(value: bool | str | None) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "full" if value else "none"
    raise TypeError(f"network must be True, False or a mode string ('none', 'full'), not {type(value).__name__}")


def _cpu_percent(cpus: float | None) -> int | None:
    if cpus is None:
        return None
    if isinstance(cpus, bool) or not isinstance(cpus, (int, float)):
        raise TypeError(f"cpus: must be a number of processors (0.5 is half of one), not {type(cpus).__name__}")
    return round(cpus * 100)  # the server checks the range and names the field


def _drop_none(mapping: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in mapping.items() if v is not None}


def _decode_base64_text(data: str, *, final: bool = True) -> str:
    return codecs.getincrementaldecoder("utf-8")("replace").decode(base64.b64decode(data), final=final)


# -- framing -----------------------------------------------------------------------


def _frame(message: Mapping[str, Any]) -> bytes:
    # ensure_ascii: the body is ASCII (valid UTF-8) whatever it carries, and a
    # lone surrogate in a caller's string reaches the server as an escape it can
    # reject by field instead of breaking the encoding here.
    body = json.dumps(message, separators=(",", ":"), allow_nan=False).encode("ascii")
    return b"Content-Length: %d\r\n\r\n" % len(body) + body


async def _read_frame(reader: asyncio.StreamReader) -> Any | None:
    """The next message, or None at a clean end of the stream."""
    length: int | None = None
    while True:
        line = await reader.readline()
        if not line:
            if length is None:
                return None
            raise EOFError("the stream ended inside a header")
        line = line.rstrip(b"\r\n")
        if not line:
            if length is None:
                continue  # a blank line between messages
            break
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    return _loads(await reader.readexactly(length))


# -- the server child and its loop thread ------------------------------------------

#: What the loop thread hands a caller: ("output", stream, data), ("response", message)
#: or ("lost", text). The last two end the call.
Item = tuple[Any, ...]
Sink = Callable[[Item], None]


class _Connection:
    """One server child and the event-loop thread that owns its pipes.

    Nothing here refers to the public wrappers, so a ``SandboxServer`` can be
    garbage-collected while this thread runs; its finalizer calls ``shutdown``.
    The dictionaries are touched only on the loop thread.
    """

    def __init__(self, argv: Sequence[str], env: Mapping[str, str] | None, cwd: PathArg | None,
                 stderr: Any, shutdown_timeout: float) -> None:
        self.shutdown_timeout = shutdown_timeout
        self.process = subprocess.Popen(
            list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
            env=None if env is None else dict(env), cwd=cwd,
            # Its own session: a Ctrl-C meant for this program must not tear the
            # server (and every run) down behind the client's back; the client
            # ends it by closing stdin, and the kernel does that when we die.
            start_new_session=True,
        )
        self._ids = itertools.count(1)
        self._ids_lock = threading.Lock()
        self._calls: dict[int, tuple[Sink, str | None]] = {}
        self._streams: dict[str, Sink] = {}
        self._lost: str | None = None
        self._closing = False
        self._shutdown_lock = threading.Lock()
        self._shut_down = False
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._writer: asyncio.WriteTransport | None = None
        started: concurrent.futures.Future[None] = concurrent.futures.Future()
        # A daemon thread: a forgotten server must not hold up interpreter exit
        # (the atexit finalizer still closes it properly).
        self._thread = threading.Thread(target=self._serve, args=(started,), daemon=True,
                                        name=f"zsb-rpc-client-{self.process.pid}")
        self._thread.start()
        try:
            started.result()
        except BaseException:
            self.process.kill()
            self.process.wait()
            self._thread.join()
            raise

    @property
    def lost(self) -> str | None:
        return self._lost

    # Loop thread -----------------------------------------------------------

    def _serve(self, started: concurrent.futures.Future[None]) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._main(started))
        finally:
            self._loop.close()

    async def _main(self, started: concurrent.futures.Future[None]) -> None:
        loop = asyncio.get_running_loop()
        try:
            self._stop = asyncio.Event()
            assert self.process.stdin is not None and self.process.stdout is not None
            self._writer, _ = await loop.connect_write_pipe(asyncio.Protocol, self.process.stdin)
            reader = asyncio.StreamReader(limit=_MAX_HEADER_LINE)
            reading_transport, _ = await loop.connect_read_pipe(
                lambda: asyncio.StreamReaderProtocol(reader), self.process.stdout)
        except BaseException as error:
            started.set_exception(error)
            return
        started.set_result(None)
        reading = asyncio.ensure_future(self._read(reader))
        await self._stop.wait()
        # The child has exited by now; its stdout ends at once unless something
        # else still holds it open, which must not keep this thread alive.
        with contextlib.suppress(TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(reading, 1.0)
        self._lose("the SandboxServer was closed")
        self._writer.close()
        reading_transport.close()
        await asyncio.sleep(0)  # let the transports finish closing before the loop does

    async def _read(self, reader: asyncio.StreamReader) -> None:
        problem = None
        try:
            while (message := await _read_frame(reader)) is not None:
                self._dispatch(message)
        except asyncio.CancelledError:
            raise
        except asyncio.IncompleteReadError:
            pass  # the child died in the middle of a message: the connection is simply gone
        except Exception as error:
            # The stream is unusable from here on; say so, with the traceback, and
            # fail every call instead of leaving it waiting.
            logger.exception("reading from the sandbox server (pid %d) failed", self.process.pid)
            problem = f"reading from the sandbox server failed: {type(error).__name__}: {error}"
        finally:
            self._lose(problem)

    def _dispatch(self, message: Any) -> None:
        if not isinstance(message, dict):
            logger.warning("ignoring a message from the sandbox server that is not an object: %.200r", message)
            return
        if "method" in message:
            params = message.get("params") or {}
            if message["method"] == "run/output" and isinstance(params, dict):
                sink = self._streams.get(str(params.get("runId")))
                if sink is not None:
                    sink(("output", params.get("stream"), params.get("data", "")))
            else:
                logger.debug("ignoring notification %r", message["method"])
            return
        msg_id = message.get("id")
        entry = self._calls.pop(msg_id, None) if isinstance(msg_id, int) else None
        if entry is None:
            if msg_id is None and "error" in message:
                # The server could not read a message of ours at all: a bug here.
                logger.error("the sandbox server rejected a message: %s", message["error"])
            else:
                logger.warning("response to no request in flight (id %r)", msg_id)
            return
        sink, run_id = entry
        if run_id is not None:
            self._streams.pop(run_id, None)
        sink(("response", message))

    def _lose(self, problem: str | None) -> None:
        if self._lost is None:
            if problem is None:
                status = self.process.poll()
                problem = (f"the sandbox server (pid {self.process.pid}) closed the connection"
                           + (f" and exited with status {status}" if status is not None else "")
                           + "; its stderr may say why")
            self._lost = "the SandboxServer was closed" if self._closing else problem
        calls, self._calls = self._calls, {}
        self._streams.clear()
        for sink, _ in calls.values():
            sink(("lost", self._lost))

    def _begin(self, msg_id: int, frame: bytes, sink: Sink, run_id: str | None) -> None:
        if self._lost is not None or self._writer is None or self._writer.is_closing():
            sink(("lost", self._lost or "the SandboxServer was closed"))
            return
        self._calls[msg_id] = (sink, run_id)
        if run_id is not None:
            self._streams[run_id] = sink
        self._writer.write(frame)

    def _write(self, frame: bytes) -> None:
        if self._lost is None and self._writer is not None and not self._writer.is_closing():
            self._writer.write(frame)

    def _close_input(self) -> None:
        self._closing = True
        if self._writer is not None:
            self._writer.close()  # flushes what is buffered, then closes: the server sees EOF

    # Any thread ------------------------------------------------------------

    def start(self, method: str, params: Mapping[str, Any], sink: Sink, *, stream: bool = False) -> int:
        """Send a request; ``sink`` gets its items on the loop thread. Returns the request id."""
        with self._ids_lock:
            msg_id = next(self._ids)
        run_id = f"run-{msg_id}" if stream else None
        if run_id is not None:
            params = {**params, "runId": run_id}
        frame = _frame({"jsonrpc": "2.0", "id": msg_id, "method": method, "params": params})
        if self._lost is not None:
            raise SandboxConnectionError(self._lost)
        try:
            self._loop.call_soon_threadsafe(self._begin, msg_id, frame, sink, run_id)
        except RuntimeError:  # the loop is closed: the thread has ended
            raise SandboxConnectionError(self._lost or "the SandboxServer was closed") from None
        return msg_id

    def notify(self, method: str, params: Mapping[str, Any]) -> None:
        """Send a notification; nothing happens when the server is already gone (nothing left to tell)."""
        frame = _frame({"jsonrpc": "2.0", "method": method, "params": params})
        with contextlib.suppress(RuntimeError):  # the loop is closed: the server is gone
            self._loop.call_soon_threadsafe(self._write, frame)

    def cancel(self, msg_id: int) -> None:
        self.notify("$/cancelRequest", {"id": msg_id})

    def shutdown(self) -> None:
        """Close the server's stdin, wait for it to exit (kill it after ``shutdown_timeout``), stop the thread."""
        with self._shutdown_lock:
            if self._shut_down:
                return
            self._shut_down = True
        if threading.current_thread() is self._thread:
            # The garbage collector ran a finalizer on the loop thread; waiting
            # here for that loop would wait forever.
            threading.Thread(target=self._shutdown, daemon=True, name="zsb-rpc-client-shutdown").start()
        else:
            self._shutdown()

    def _shutdown(self) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: the thread is gone already
            self._loop.call_soon_threadsafe(self._close_input)
        try:
            self.process.wait(self.shutdown_timeout)
        except subprocess.TimeoutExpired:
            logger.warning("the sandbox server (pid %d) did not exit within %g s of its stdin closing; killing it",
                           self.process.pid, self.shutdown_timeout)
            self.process.kill()
            self.process.wait()
        if self._stop is not None:
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=5)


# -- waiting for a call, from a thread or from a coroutine ---------------------------


def _outcome(item: Item) -> Any:
    """The result a terminal item carries, or the error it stands for."""
    if item[0] == "lost":
        raise SandboxConnectionError(item[1])
    message = item[1]
    if "error" in message:
        raise _error_from_wire(message["error"])
    return message.get("result")


def _unconfirmed(method: str, msg_id: int) -> None:
    logger.warning("the sandbox server did not answer the cancelled %s request %d within %g s",
                   method, msg_id, CANCEL_GRACE_SECONDS)


def _call(conn: _Connection, method: str, params: Mapping[str, Any],
          on_output: Callable[[str, str], None] | None = None) -> Any:
    items: queue.SimpleQueue[Item] = queue.SimpleQueue()
    msg_id = conn.start(method, params, items.put, stream=on_output is not None)
    try:
        while (item := items.get())[0] == "output":
            assert on_output is not None
            on_output(item[1], item[2])
    except BaseException:
        # Ctrl-C, or a callback raised: the command must not go on unobserved.
        conn.cancel(msg_id)
        try:
            while items.get(timeout=CANCEL_GRACE_SECONDS)[0] == "output":
                pass
        except queue.Empty:
            _unconfirmed(method, msg_id)
        raise
    return _outcome(item)


async def _acall(conn: _Connection, method: str, params: Mapping[str, Any],
                 on_output: Callable[[str, str], None] | None = None) -> Any:
    loop = asyncio.get_running_loop()
    items: asyncio.Queue[Item] = asyncio.Queue()

    def sink(item: Item) -> None:
        try:
            loop.call_soon_threadsafe(items.put_nowait, item)
        except RuntimeError:
            pass  # the caller's loop is closed: nobody waits for this answer any more

    msg_id = conn.start(method, params, sink, stream=on_output is not None)
    try:
        while (item := await items.get())[0] == "output":
            assert on_output is not None
            on_output(item[1], item[2])
    except BaseException:
        # Cancelled (or a callback raised): have the server kill the tree, and
        # let the cancellation go on only once it says the tree is gone.
        conn.cancel(msg_id)
        try:
            async with asyncio.timeout(CANCEL_GRACE_SECONDS):
                while (await items.get())[0] == "output":
                    pass
        except TimeoutError:
            _unconfirmed(method, msg_id)
        raise
    return _outcome(item)


class _OutputRouter:
    """Streamed chunks to ``on_stdout``/``on_stderr``; base64 chunks are decoded without splitting characters."""

    def __init__(self, on_stdout: Callable[[str], Any] | None, on_stderr: Callable[[str], Any] | None,
                 binary: bool) -> None:
        self._callbacks = {"stdout": on_stdout, "stderr": on_stderr}
        self._decoders = ({name: codecs.getincrementaldecoder("utf-8")("replace") for name in self._callbacks}
                          if binary else None)

    def __call__(self, stream: str, data: str) -> None:
        if self._decoders is not None:
            data = self._decoders[stream].decode(base64.b64decode(data))
        callback = self._callbacks.get(stream)
        if callback is not None and data:
            callback(data)

    def finish(self) -> None:
        for stream, decoder in (self._decoders or {}).items():
            tail = decoder.decode(b"", final=True)
            callback = self._callbacks[stream]
            if callback is not None and tail:
                callback(tail)


# -- public API ------------------------------------------------------------------------


class SandboxServer:
    """One ``zsb-rpc`` server child. Share one between sessions with ``SandboxSession(..., server=srv)``.

    ``close()`` (also ``with``/``async with``, garbage collection and interpreter
    exit) closes the child's stdin: the server kills every run, closes every
    session (removing private workspaces) and exits.
    """

    def __init__(self, command: Sequence[str] | None = None, *, env: Mapping[str, str] | None = None,
                 cwd: PathArg | None = None, stderr: Any = None,
                 shutdown_timeout: float = SHUTDOWN_TIMEOUT_SECONDS) -> None:
        """``command`` defaults to ``[sys.executable, "-m", "zsb_rpc"]``; the server's stderr (its log) is
        inherited unless ``stderr`` says otherwise (a file, ``subprocess.DEVNULL``, ...). ``env`` is the
        server's environment, and so what commands may inherit from it (default: this process's)."""
        argv = list(command) if command is not None else [sys.executable, "-m", "zsb_rpc"]
        self._conn = _Connection(argv, env, cwd, stderr, shutdown_timeout)
        self._finalizer = weakref.finalize(self, self._conn.shutdown)

    @property
    def pid(self) -> int:
        return self._conn.process.pid

    @property
    def returncode(self) -> int | None:
        """The child's exit status once it has exited, else None."""
        return self._conn.process.poll()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive or self._conn.lost is not None

    def request(self, method: str, params: Mapping[str, Any] | None = None) -> Any:
        """Send any request and wait for its result (raises SandboxError)."""
        return _call(self._conn, method, params or {})

    async def arequest(self, method: str, params: Mapping[str, Any] | None = None) -> Any:
        return await _acall(self._conn, method, params or {})

    def capabilities(self, *, memory_strategy: str | None = None) -> Capabilities:
        """What this machine can enforce and how. Creates nothing."""
        return Capabilities._from_wire(self.request("capabilities", _drop_none({"memoryStrategy": memory_strategy})))

    async def acapabilities(self, *, memory_strategy: str | None = None) -> Capabilities:
        params = _drop_none({"memoryStrategy": memory_strategy})
        return Capabilities._from_wire(await self.arequest("capabilities", params))

    def close(self) -> None:
        """Stop the server and wait for it (at most ``shutdown_timeout``, then it is killed). Idempotent."""
        self._finalizer()

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)

    def __enter__(self) -> SandboxServer:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    async def __aenter__(self) -> SandboxServer:
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"<SandboxServer pid={self.pid} {'closed' if self.closed else 'running'}>"


def _close_abandoned(conn: _Connection, session_id: str) -> None:
    """Finalizer of a session on a shared server: close it without waiting for the answer."""
    def sink(item: Item) -> None:
        if item[0] == "response" and "error" in item[1]:
            logger.warning("closing abandoned session %s failed: %s", session_id, item[1]["error"].get("message"))

    with contextlib.suppress(SandboxConnectionError):  # the server is gone, and the session with it
        conn.start("session/close", {"sessionId": session_id}, sink)


class SandboxSession:
    """A sandbox session: a workspace, a policy and limits that every ``run`` gets.

    ``workspace`` is the directory commands may write (used, never deleted); without
    it the server makes a private one, removed when the session closes. The other
    options mirror ``session/open``: sizes are bytes or strings like ``"512MB"``
    (see ``parse_size``), ``cpus=0.5`` is half a core, ``network`` is True
    (``"full"``), False (``"none"``) or a mode string, ``timeout`` is the default
    wall-clock limit of a run in seconds (``None``: none). Bad option values raise
    TypeError/ValueError here; what the server rejects raises SandboxPolicyError
    on open, naming the wire field (e.g. ``params.limits.memoryBytes``).

    Each session starts a server child of its own unless ``server`` is given (one
    the caller owns and closes). Open it with ``with``/``async with`` or ``open()``.
    """

    def __init__(
        self,
        workspace: PathArg | None = None,
        *,
        memory: Size | None = None,
        max_file_size: Size | None = None,
        cpus: float | None = None,
        cpu_seconds: int | None = None,
        processes: int | None = None,
        open_files: int | None = None,
        core_dumps: bool | None = None,
        network: bool | str | None = None,
        writable: PathArg | Iterable[PathArg] | None = None,
        deny_write: PathArg | Iterable[PathArg] | None = None,
        deny_read: PathArg | Iterable[PathArg] | None = None,
        env: Mapping[str, str] | None = None,
        inherit_environment: str | Iterable[str] | None = None,
        timeout: float | None = DEFAULT,
        output_limit: Size | None = None,
        protect_defaults: bool | None = None,
        backend: str | None = None,
        require_isolation: bool | None = None,
        memory_strategy: str | None = None,
        server: SandboxServer | None = None,
    ) -> None:
        limits = _drop_none({
            "memoryBytes": _size_option(memory, "memory"),
            "cpuSeconds": _whole(cpu_seconds),
            "cpuPercent": _cpu_percent(cpus),
            "processes": _whole(processes),
            "fileSizeBytes": _size_option(max_file_size, "max_file_size"),
            "openFiles": _whole(open_files),
            "coreDumps": core_dumps,
        })
        params = _drop_none({
            "workspace": None if workspace is None else _absolute(workspace),
            "writable": _path_list(writable, "writable"),
            "denyWrite": _path_list(deny_write, "deny_write"),
            "denyRead": _path_list(deny_read, "deny_read"),
            "network": _network(network),
            "env": None if env is None else dict(env),
            "inheritEnvironment": _names(inherit_environment),
            "outputLimit": _size_option(output_limit, "output_limit"),
            "limits": limits or None,
            "protectDefaults": protect_defaults,
            "backend": backend,
            "requireIsolation": require_isolation,
            "memoryStrategy": memory_strategy,
        })
        if timeout is not DEFAULT:
            params["timeout"] = _whole(timeout)  # None goes as null: no timeout
        self._params = params
        self._given_server = server
        self._lock = threading.Lock()
        self._state = "new"  # -> opening -> open -> closing -> closed
        self._server: SandboxServer | None = None
        self._owns_server = False
        self._finalizer: weakref.finalize | None = None
        self._opened: dict[str, Any] = {}

    # -- lifecycle -------------------------------------------------------------

    @property
    def params(self) -> dict[str, Any]:
        """The ``session/open`` params this session sends (a copy)."""
        return json.loads(json.dumps(self._params))

    def _begin_open(self) -> None:
        with self._lock:
            if self._state != "new":
                raise RuntimeError(f"this SandboxSession is {self._state}; a session opens once")
            self._state = "opening"

    def _opened_on(self, server: SandboxServer, owned: bool, result: Mapping[str, Any]) -> None:
        self._server, self._owns_server, self._opened = server, owned, dict(result)
        if not owned:
            # Forgotten on a shared server: close it there. (An own server goes
            # with this object, and takes the session with it.)
            self._finalizer = weakref.finalize(self, _close_abandoned, server._conn, result["sessionId"])
        with self._lock:
            self._state = "open"

    def _open_failed(self) -> None:
        with self._lock:
            self._state = "closed"

    def open(self) -> SandboxSession:
        """Start the server (unless shared) and open the session. Returns self."""
        self._begin_open()
        server, owned = self._given_server, self._given_server is None
        try:
            if server is None:
                server = SandboxServer()
            result = _call(server._conn, "session/open", self._params)
        except BaseException:
            if owned and server is not None:
                server.close()
            self._open_failed()
            raise
        self._opened_on(server, owned, result)
        return self

    async def aopen(self) -> SandboxSession:
        self._begin_open()
        server, owned = self._given_server, self._given_server is None
        try:
            if server is None:
                server = await asyncio.to_thread(SandboxServer)
            result = await _acall(server._conn, "session/open", self._params)
        except BaseException:
            if owned and server is not None:
                await server.aclose()
            self._open_failed()
            raise
        self._opened_on(server, owned, result)
        return self

    def _begin_close(self) -> bool:
        with self._lock:
            if self._state in ("new", "opening", "closing", "closed"):
                if self._state == "new":
                    self._state = "closed"
                return False
            self._state = "closing"
        if self._finalizer is not None:
            self._finalizer.detach()
        return True

    def close(self) -> None:
        """Close the session: its runs are killed, a private workspace is removed. Idempotent."""
        if not self._begin_close():
            return
        assert self._server is not None
        try:
            with contextlib.suppress(SandboxConnectionError):  # server gone: it closed every session on exit
                _call(self._server._conn, "session/close", {"sessionId": self.session_id})
        finally:
            with self._lock:
                self._state = "closed"
            if self._owns_server:
                self._server.close()

    async def aclose(self) -> None:
        if not self._begin_close():
            return
        assert self._server is not None
        try:
            with contextlib.suppress(SandboxConnectionError):
                await _acall(self._server._conn, "session/close", {"sessionId": self.session_id})
        finally:
            with self._lock:
                self._state = "closed"
            if self._owns_server:
                await self._server.aclose()

    def __enter__(self) -> SandboxSession:
        return self.open()

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    async def __aenter__(self) -> SandboxSession:
        return await self.aopen()

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.aclose()

    # -- what the server said at open ------------------------------------------

    def _conn(self) -> _Connection:
        state = self._state
        if state != "open":
            hint = "; use `with SandboxSession(...)` or call open()" if state == "new" else ""
            raise RuntimeError(f"this SandboxSession is {state}{hint}")
        assert self._server is not None
        return self._server._conn

    @property
    def closed(self) -> bool:
        return self._state == "closed"

    @property
    def server(self) -> SandboxServer:
        if self._server is None:
            raise RuntimeError("this SandboxSession has not been opened")
        return self._server

    def _opened_field(self, name: str) -> Any:
        if not self._opened:
            raise RuntimeError("this SandboxSession has not been opened")
        return self._opened[name]

    @property
    def session_id(self) -> str:
        return self._opened_field("sessionId")

    @property
    def workspace(self) -> Path:
        """The workspace directory, resolved (a private one exists until the session closes)."""
        return Path(self._opened_field("workspace"))

    @property
    def backend(self) -> str:
        return self._opened_field("backend")

    @property
    def isolated(self) -> bool:
        return self._opened_field("isolated")

    @property
    def warnings(self) -> tuple[str, ...]:
        """What the session asked for and does not get (e.g. a limit this machine cannot enforce)."""
        return tuple(self._opened_field("warnings"))

    # -- commands --------------------------------------------------------------

    def _run_params(self, command: Command, cwd: PathArg | None, env: Mapping[str, str] | None,
                    input: str | bytes | None, timeout: Any, output_limit: Size | None) -> tuple[dict[str, Any], bool]:
        params: dict[str, Any] = {"sessionId": self.session_id, "command": _command(command)}
        if cwd is not None:
            params["cwd"] = os.fspath(cwd)  # relative to the workspace, as the server reads it
        if env:
            params["env"] = dict(env)
        binary = isinstance(input, (bytes, bytearray, memoryview))
        if binary:
            # Bytes go as base64, and the output then comes back as base64 too;
            # it is decoded to text with errors="replace".
            params["input"] = base64.b64encode(bytes(input)).decode("ascii")  # type: ignore[arg-type]
            params["encoding"] = "base64"
        elif input is not None:
            if not isinstance(input, str):
                raise TypeError(f"input must be str or bytes, not {type(input).__name__}")
            params["input"] = input
        if timeout is not DEFAULT:
            params["timeout"] = _whole(timeout)
        if output_limit is not None:
            params["outputLimit"] = _size_option(output_limit, "output_limit")
        return params, binary

    @staticmethod
    def _shown(command: Command) -> str | tuple[str, ...]:
        wire = _command(command)
        return wire if isinstance(wire, str) else tuple(wire)

    def run(self, command: Command, *, check: bool = False, cwd: PathArg | None = None,
            env: Mapping[str, str] | None = None, input: str | bytes | None = None, timeout: float | None = DEFAULT,
            output_limit: Size | None = None, on_stdout: Callable[[str], Any] | None = None,
            on_stderr: Callable[[str], Any] | None = None) -> RunResult:
        """Run a command in the sandbox and wait for it, like ``subprocess.run``.

        A string runs through ``/bin/sh -c``; a list runs directly. ``cwd`` is absolute
        or relative to the workspace; ``env`` adds to the session's variables; ``timeout``
        (seconds, ``None`` for none) defaults to the session's; ``output_limit`` caps
        the bytes kept per stream. ``on_stdout``/``on_stderr`` get the output as it
        comes, in text chunks, in this thread. ``check=True`` raises SandboxCommandError
        unless the command exited 0 in time. Bytes ``input`` is sent as base64; the
        output is then decoded from UTF-8 with ``errors="replace"``.
        """
        conn = self._conn()
        params, binary = self._run_params(command, cwd, env, input, timeout, output_limit)
        router = _OutputRouter(on_stdout, on_stderr, binary) if (on_stdout or on_stderr) else None
        wire = _call(conn, "run", params, router)
        if router is not None:
            router.finish()
        result = RunResult._from_wire(self._shown(command), wire, binary)
        if check:
            result.check_returncode()
        return result

    async def arun(self, command: Command, *, check: bool = False, cwd: PathArg | None = None,
                   env: Mapping[str, str] | None = None, input: str | bytes | None = None,
                   timeout: float | None = DEFAULT, output_limit: Size | None = None,
                   on_stdout: Callable[[str], Any] | None = None,
                   on_stderr: Callable[[str], Any] | None = None) -> RunResult:
        """``run`` for asyncio: runs of a session execute concurrently, and cancelling the
        awaiting task kills the command's process tree (before the cancellation propagates).
        The callbacks are called in this task."""
        conn = self._conn()
        params, binary = self._run_params(command, cwd, env, input, timeout, output_limit)
        router = _OutputRouter(on_stdout, on_stderr, binary) if (on_stdout or on_stderr) else None
        wire = await _acall(conn, "run", params, router)
        if router is not None:
            router.finish()
        result = RunResult._from_wire(self._shown(command), wire, binary)
        if check:
            result.check_returncode()
        return result

    def _wrap_params(self, command: Command, cwd: PathArg | None, env: Mapping[str, str] | None) -> dict[str, Any]:
        return _drop_none({"sessionId": self.session_id, "command": _command(command),
                           "cwd": None if cwd is None else os.fspath(cwd), "env": None if env is None else dict(env)})

    @staticmethod
    def _wrap_result(wire: Mapping[str, Any]) -> WrapResult:
        return WrapResult(argv=tuple(wire["argv"]), cwd=wire["cwd"], env=dict(wire["env"]),
                          warnings=tuple(wire.get("warnings", ())))

    def wrap(self, command: Command, cwd: PathArg | None = None, env: Mapping[str, str] | None = None) -> WrapResult:
        """The sandboxed command line of ``command`` under this session's policy, to spawn yourself."""
        conn = self._conn()
        return self._wrap_result(_call(conn, "wrap", self._wrap_params(command, cwd, env)))

    async def awrap(self, command: Command, cwd: PathArg | None = None,
                    env: Mapping[str, str] | None = None) -> WrapResult:
        conn = self._conn()
        return self._wrap_result(await _acall(conn, "wrap", self._wrap_params(command, cwd, env)))

    def _capabilities_params(self) -> dict[str, Any]:
        # Report on this session's limits and memory strategy.
        return _drop_none({"limits": self._params.get("limits"), "memoryStrategy": self._params.get("memoryStrategy")})

    def capabilities(self) -> Capabilities:
        """What the server's machine can enforce of this session's limits, and how."""
        return Capabilities._from_wire(_call(self._conn(), "capabilities", self._capabilities_params()))

    async def acapabilities(self) -> Capabilities:
        return Capabilities._from_wire(await _acall(self._conn(), "capabilities", self._capabilities_params()))

    def __repr__(self) -> str:
        where = f" {self._opened.get('workspace')}" if self._opened else ""
        return f"<SandboxSession {self._state}{where}>"
