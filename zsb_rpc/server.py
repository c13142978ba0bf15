"""The pygls server: thin handlers from method name to session call to result."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys

from pygls.server import JsonRPCServer

from .capabilities import report_capabilities
from .protocol import types as t
from .protocol.convert import make_converter
from .runner import become_subreaper, reap_orphans
from .sessions import SessionTable
from .wire import ZsbProtocol, open_stdio, read_frames

logger = logging.getLogger(__name__)


def use_pidfd_child_watcher(loop: asyncio.AbstractEventLoop) -> None:
    """Python 3.11 waits for each child in a thread of its own, started per spawn (about 1 ms of
    every run); a pidfd watched by the loop costs nothing. 3.12 does this by itself."""
    if sys.version_info >= (3, 12) or not hasattr(os, "pidfd_open"):
        return
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            watcher = asyncio.PidfdChildWatcher()
            watcher.attach_loop(loop)
            asyncio.set_child_watcher(watcher)
        except (OSError, AttributeError, NotImplementedError):
            pass  # the thread per child it is


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
            return await sessions.open_async(params)

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

    @staticmethod
    async def _reap_orphans_forever() -> None:
        """A sandbox that escaped its bwrap's death (killed while starting) is reparented to us."""
        while True:
            await asyncio.sleep(1.0)
            reap_orphans()

    async def serve_stdio(self) -> None:
        """Serve until stdin closes or a terminating signal arrives, then tear every session down."""
        loop = asyncio.get_running_loop()
        use_pidfd_child_watcher(loop)
        reader = await open_stdio(self.protocol)
        stop = asyncio.Event()
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.add_signal_handler(signum, stop.set)
        become_subreaper()
        # Off the start-up path: the first answer does not wait for it.
        loop.run_in_executor(None, self.sessions.remove_stale)
        reaper = asyncio.ensure_future(self._reap_orphans_forever())
        frames = asyncio.ensure_future(read_frames(reader, self.protocol.handle_body, self.protocol.framing_error))
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait([frames, stopped], return_when=asyncio.FIRST_COMPLETED)
        logger.info("client gone; closing every session")
        frames.cancel()
        stopped.cancel()
        reaper.cancel()
        await self.sessions.close_all()
        # Requests in flight (their runs were just killed) still get their one
        # answer, within the 2 s a parent waits for us.
        pending = [f for f in self.protocol._request_futures.values() if isinstance(f, asyncio.Future)]
        if pending:
            await asyncio.wait(pending, timeout=1.0)  # type: ignore[type-var]
        await asyncio.sleep(0)
        await self.protocol.drain()


