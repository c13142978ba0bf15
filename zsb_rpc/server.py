"""The pygls server: thin handlers from method name to session call to result."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

from pygls.server import JsonRPCServer

from .capabilities import report_capabilities
from .protocol import types as t
from .protocol.convert import make_converter
from .runner import become_subreaper
from .sessions import SessionTable
from .wire import ZsbProtocol, open_stdio, read_frames

logger = logging.getLogger(__name__)


class ZsbServer(JsonRPCServer):
    protocol: ZsbProtocol

    def __init__(self, sessions: SessionTable | None = None) -> None:
        super().__init__(ZsbProtocol, make_converter)
        self.sessions = sessions or SessionTable()
        self._register()

    def _register(self) -> None:
        sessions = self.sessions

        @self.feature("capabilities")
        async def capabilities(params: t.CapabilitiesParams) -> t.CapabilitiesResult:
            # The probe runs bubblewrap once; keep the loop serving meanwhile.
            return await asyncio.get_running_loop().run_in_executor(None, report_capabilities, params)

        @self.feature("session/open")
        async def session_open(params: t.SessionOpenParams) -> t.SessionOpenResult:
            opening = asyncio.get_running_loop().run_in_executor(None, sessions.open, params)
            try:
                return await asyncio.shield(opening)
            except asyncio.CancelledError:
                # The thread goes on; a session nobody will learn the id of is closed again.
                with contextlib.suppress(Exception):
                    opened = await opening
                    await sessions.close(t.SessionCloseParams(session_id=opened.session_id))
                raise

        @self.feature("run")
        async def run(params: t.RunParams) -> t.RunResult:
            async def notify_output(stream: str, data: str) -> None:
                # The hot path of streaming: the wire form of RunOutputNotification, built
                # directly rather than through the converter for every chunk.
                assert params.run_id is not None
                self.protocol.send_output(params.run_id, params.session_id, stream, data)
                # Back-pressure: a client that reads slowly slows the command, not our memory.
                await self.protocol.drain()

            async def notify_resources(sample: dict) -> None:
                assert params.run_id is not None
                self.protocol.notify("run/resources", t.RunResourcesNotification(
                    run_id=params.run_id, session_id=params.session_id,
                    memory_bytes=sample.get("memory"), peak_memory_bytes=sample.get("peak"),
                    cpu_seconds=sample.get("cpu"), processes=sample.get("processes")))
                await self.protocol.drain()

            return await sessions.run(params, notify_output, notify_resources)

        @self.feature("wrap")
        async def wrap(params: t.WrapParams) -> t.WrapResult:
            return sessions.wrap(params)

        @self.feature("session/close")
        async def session_close(params: t.SessionCloseParams) -> t.SessionCloseResult:
            return await sessions.close(params)

    async def serve_stdio(self) -> None:
        """Serve until stdin closes or a terminating signal arrives, then tear every session down."""
        loop = asyncio.get_running_loop()
        reader = await open_stdio(self.protocol)
        stop = asyncio.Event()
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.add_signal_handler(signum, stop.set)
        become_subreaper()
        # Off the start-up path: the first answer does not wait for it.
        loop.run_in_executor(None, self.sessions.remove_stale)
        frames = asyncio.ensure_future(read_frames(reader, self.protocol.handle_body, self.protocol.framing_error))
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait([frames, stopped], return_when=asyncio.FIRST_COMPLETED)
        logger.info("client gone; closing every session")
        frames.cancel()
        stopped.cancel()
        await self.sessions.close_all()
        # Requests in flight (their runs were just killed) still get their one
        # answer, within the 2 s a parent waits for us.
        pending = [f for f in self.protocol._request_futures.values() if isinstance(f, asyncio.Future)]
        if pending:
            await asyncio.wait(pending, timeout=1.0)  # type: ignore[type-var]
        await asyncio.sleep(0)
        await self.protocol.drain()


