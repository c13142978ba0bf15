"""A JSON-RPC client for the tests, written against the wire, not against the server's code.

It frames bytes itself (so tests can also send broken frames), starts the real
server as a child over pipes, optionally as an unprivileged user, and keeps
every message it receives in order.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
from dataclasses import dataclass, field
from typing import Any

_MISSING = object()


class RpcError(Exception):
    def __init__(self, code: int, message: str, data: Any = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.data = data


def frame(message: Any) -> bytes:
    body = json.dumps(message).encode()
    return b"Content-Length: %d\r\n\r\n" % len(body) + body


@dataclass
class ServerCommand:
    """How to start the server: argv, environment, and as whom."""

    argv: list[str]
    env: dict[str, str]
    user: str | None = None
    uid: int = field(default_factory=os.getuid)


class RpcClient:
    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.messages: list[dict[str, Any]] = []
        self.stderr = bytearray()
        self._pending: dict[Any, asyncio.Future[dict[str, Any]]] = {}
        self._ids = itertools.count(1)
        self._reader = asyncio.ensure_future(self._read())
        self._err_reader = asyncio.ensure_future(self._read_stderr())
        self.eof = asyncio.get_running_loop().create_future()
        #: Merged into every ``open()``: how a suite runs against another backend.
        self.default_open: dict[str, Any] = {}

    @classmethod
    async def start(cls, command: ServerCommand, **spawn: Any) -> RpcClient:
        """Start the server; ``spawn`` overrides subprocess options (stderr, preexec_fn)."""
        options: dict[str, Any] = dict(stderr=asyncio.subprocess.PIPE)
        options.update(spawn)
        process = await asyncio.create_subprocess_exec(
            *command.argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env=command.env,
            limit=1 << 24,
            **options,
        )
        return cls(process)

    @property
    def pid(self) -> int:
        return self.process.pid

    async def _read(self) -> None:
        reader = self.process.stdout
        assert reader is not None
        try:
            while True:
                length = None
                while True:
                    line = await reader.readline()
                    if not line:
                        raise EOFError
                    line = line.strip()
                    if not line:
                        break
                    name, _, value = line.partition(b":")
                    if name.lower() == b"content-length":
                        length = int(value)
                assert length is not None, "server sent a frame without Content-Length"
                message = json.loads(await reader.readexactly(length))
                self.messages.append(message)
                if "id" in message and ("result" in message or "error" in message):
                    future = self._pending.get(message["id"])
                    if future is not None and not future.done():
                        future.set_result(message)
        except (EOFError, asyncio.IncompleteReadError):
            pass
        finally:
            if not self.eof.done():
                self.eof.set_result(None)

    async def _read_stderr(self) -> None:
        if self.process.stderr is None:
            return
        while chunk := await self.process.stderr.read(65536):
            self.stderr += chunk

    async def send_raw(self, data: bytes) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(data)
        await self.process.stdin.drain()

    async def notify(self, method: str, params: Any) -> None:
        await self.send_raw(frame({"jsonrpc": "2.0", "method": method, "params": params}))

    def send_request(self, method: str, params: Any = _MISSING, *, msg_id: Any = None) -> tuple[Any, asyncio.Future]:
        msg_id = next(self._ids) if msg_id is None else msg_id
        message: dict[str, Any] = {"jsonrpc": "2.0", "id": msg_id, "method": method}
        if params is not _MISSING:
            message["params"] = params
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[msg_id] = future
        assert self.process.stdin is not None
        self.process.stdin.write(frame(message))
        return msg_id, future

    async def request(self, method: str, params: Any = _MISSING, *, msg_id: Any = None, timeout: float = 30) -> dict:
        """The whole response message."""
        _, future = self.send_request(method, params, msg_id=msg_id)
        return await asyncio.wait_for(future, timeout)

    async def call(self, method: str, params: Any = _MISSING, *, timeout: float = 30) -> Any:
        """The result, or RpcError."""
        response = await self.request(method, params, timeout=timeout)
        if "error" in response:
            error = response["error"]
            raise RpcError(error["code"], error["message"], error.get("data"))
        return response["result"]

    def responses(self, msg_id: Any) -> list[dict[str, Any]]:
        return [m for m in self.messages if m.get("id") == msg_id and ("result" in m or "error" in m)]

    def notifications(self, method: str) -> list[dict[str, Any]]:
        return [m["params"] for m in self.messages if m.get("method") == method and "id" not in m]

    async def open(self, **params: Any) -> dict[str, Any]:
        return await self.call("session/open", {**self.default_open, **params})

    async def run(self, session_id: str, command: Any, **params: Any) -> dict[str, Any]:
        return await self.call("run", {"sessionId": session_id, "command": command, **params},
                               timeout=(params.get("timeout") or 60) + 15)

    async def close_stdin(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()

    async def wait_exit(self, timeout: float) -> int:
        return await asyncio.wait_for(self.process.wait(), timeout)

    async def aclose(self) -> None:
        if self.process.returncode is None:
            await self.close_stdin()
            try:
                await self.wait_exit(5)
            except TimeoutError:
                self.process.kill()
                await self.process.wait()
        self._reader.cancel()
        self._err_reader.cancel()
