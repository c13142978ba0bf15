"""The one place that spawns processes: pipes, output caps, streaming, timeout, kill.

Every command starts in a session and process group of its own, with only
stdin, stdout and stderr (``close_fds``), so it can never write to the
server's JSON-RPC pipes. Output is always read to the end: what exceeds the
output limit is discarded, so a flood neither fills memory nor blocks the
command, while streaming still delivers every byte. A cancelled run kills its
tree before the cancellation propagates.
"""

from __future__ import annotations

import asyncio
import base64
import codecs
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from .backends import LaunchSpec
from .protocol.errors import SpawnFailed

CHUNK_BYTES = 256 * 1024
#: Pipe capacity asked for the command's output: fewer, larger chunks per second.
PIPE_BYTES = 1024 * 1024
#: How long to wait for pipes to close after the command exited (a helper that
#: outlives it in the passthrough backend keeps them open; it is then killed).
PIPE_GRACE_SECONDS = 1.0

OutputSink = Callable[[str, str], Awaitable[None]]
Sample = dict[str, "int | float | None"]
ResourceSink = Callable[[Sample], Awaitable[None]]


@dataclass
class Monitor:
    """Periodic resource samples of a run: notifications, peak, and the memory watchdog."""

    interval: float
    sampler: Callable[[], Sample | None]
    watchdog_memory: int | None = None
    sink: ResourceSink | None = None
    peak_memory: int | None = None
    cpu_seconds: float | None = None
    watchdog_fired: bool = False


def sample_tree(pid: int) -> Sample:
    """Memory, processor time and process count of a tree, from /proc (psutil)."""
    import psutil

    memory, cpu, count = 0, 0.0, 0
    try:
        root = psutil.Process(pid)
        for process in [root, *root.children(recursive=True)]:
            try:
                with process.oneshot():
                    memory += process.memory_info().rss
                    times = process.cpu_times()
                    cpu += times.user + times.system
                    count += 1
            except psutil.Error:
                continue
    except psutil.Error:
        pass
    return {"memory": memory, "peak": None, "cpu": cpu, "processes": count}


async def _watch(process: asyncio.subprocess.Process, handle: RunningCommand, monitor: Monitor) -> None:
    while process.returncode is None:
        await asyncio.sleep(monitor.interval)
        if process.returncode is not None:
            break
        sample = monitor.sampler() or sample_tree(process.pid)
        memory = sample.get("memory")
        peak = max(v for v in (sample.get("peak"), memory, monitor.peak_memory) if v is not None) \
            if any(v is not None for v in (sample.get("peak"), memory, monitor.peak_memory)) else None
        monitor.peak_memory = int(peak) if peak is not None else None
        if sample.get("cpu") is not None:
            monitor.cpu_seconds = float(sample["cpu"])  # type: ignore[arg-type]
        sample["peak"] = monitor.peak_memory
        if monitor.watchdog_memory is not None and memory is not None and memory > monitor.watchdog_memory:
            monitor.watchdog_fired = True
            handle.kill()
            return
        if monitor.sink is not None:
            await monitor.sink(sample)


@dataclass
class StreamCapture:
    limit: int
    encoding: str
    kept: bytearray = field(default_factory=bytearray)
    truncated: bool = False

    def text(self) -> str:
        data = bytes(self.kept)
        if self.encoding == "base64":
            return base64.b64encode(data).decode("ascii")
        # Cut at a character boundary: a truncated stream must not end in U+FFFD
        # for half a character.
        return codecs.getincrementaldecoder("utf-8")("replace").decode(data, final=not self.truncated)


@dataclass
class RunOutcome:
    exit_code: int
    stdout: StreamCapture
    stderr: StreamCapture
    timed_out: bool
    killed: bool
    duration_seconds: float
    signal_number: int | None


def kill_process_tree(pid: int) -> None:
    """SIGKILL a command's process group, its descendants, and the process itself.

    For bubblewrap, killing the outer bwrap kills the sandbox's PID 1 (it has
    PDEATHSIG from --die-with-parent), and the kernel then kills everything in
    the PID namespace, setsid children included.
    """
    descendants = []
    try:
        import psutil  # imported here: start-up does not need it

        descendants = psutil.Process(pid).children(recursive=True)
    except Exception:  # the process is already gone, or psutil cannot see it
        pass
    if hasattr(os, "killpg"):  # not on Windows, where a Job Object ends the tree
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError, OSError):
        os.kill(pid, getattr(signal, "SIGKILL", signal.SIGTERM))
    for child in descendants:
        with contextlib.suppress(Exception):
            child.kill()


#: Root pids of runs in flight, and how many spawns are under way: the orphan
#: reaper must never take one of them for a leftover.
_ACTIVE_ROOTS: set[int] = set()
_SPAWNING = 0


def become_subreaper() -> None:
    """Orphans of runs without a PID namespace then come to the server, which can kill them."""
    if os.uname().sysname != "Linux":
        return
    import ctypes

    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER


def reap_orphans() -> None:
    """Kill and reap children of the server that belong to no run in flight.

    Each run's first process is itself a subreaper, so a detached descendant
    comes to the server only once that process has exited, that is once its
    run is over. Children in the server's own session (its probes) are left.
    """
    if _SPAWNING:
        return  # a child that is being spawned is not registered yet; next time
    own_session = os.getsid(0)
    for pid, state in _direct_children():
        if pid in _ACTIVE_ROOTS:
            continue
        if state == "Z":
            # A sandbox's PID 1 that outlived its bwrap comes here (we are a subreaper).
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(pid, os.WNOHANG)
            continue
        try:
            if os.getsid(pid) == own_session:
                continue
        except OSError:
            continue
        kill_process_tree(pid)
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)


def _direct_children() -> list[tuple[int, str]]:
    """(pid, state) of the server's children, from /proc/self/task/*/children: no full /proc scan."""
    pids: list[int] = []
    try:
        for task in os.scandir("/proc/self/task"):
            with open(f"{task.path}/children") as handle:
                pids.extend(int(pid) for pid in handle.read().split())
    except OSError:
        return []
    found = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as handle:
                found.append((pid, handle.read().rsplit(")", 1)[1].split()[0]))
        except (OSError, IndexError):
            continue
    return found


def _grow_pipes(transport: Any) -> None:
    """Ask for 1 MiB pipes where the kernel allows it (Linux F_SETPIPE_SZ); a failure changes nothing."""
    import fcntl

    for fd in (1, 2):
        pipe = transport.get_pipe_transport(fd)
        fileno = pipe.get_extra_info("pipe").fileno() if pipe is not None else None
        if fileno is not None:
            with contextlib.suppress(OSError, AttributeError):
                fcntl.fcntl(fileno, getattr(fcntl, "F_SETPIPE_SZ", 1031), PIPE_BYTES)


def _windows_job(pid: int) -> Any:
    """Put a Windows run in a kill-on-close Job Object; without one, the tree walk is all there is."""
    from .backends.windows import assign_process_to_job, create_kill_on_close_job

    try:
        job = create_kill_on_close_job()
        if job is not None:
            assign_process_to_job(job, pid)
        return job
    except OSError:
        return None


class _ExitProtocol(asyncio.subprocess.SubprocessStreamProtocol):
    """The stream protocol, plus a future that resolves when the process exits, pipes or not."""

    def __init__(self, exit_future: asyncio.Future[int], loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(limit=CHUNK_BYTES, loop=loop)
        self._exit_future = exit_future

    def process_exited(self) -> None:
        transport = getattr(self, "_transport", None)  # the base class drops it once the pipes close too
        super().process_exited()
        if not self._exit_future.done() and transport is not None:
            self._exit_future.set_result(transport.get_returncode())


class RunningCommand:
    """A spawned command; ``kill()`` ends its whole tree from anywhere (session close, shutdown)."""

    def __init__(self) -> None:
        self.process: asyncio.subprocess.Process | None = None
        self.killed = False
        self.job: Any = None  # Windows: a Job Object that kills the tree when closed

    def kill(self) -> None:
        self.killed = True
        if self.job is not None:
            with contextlib.suppress(OSError):
                self.job.terminate()
        if self.process is not None and self.process.returncode is None:
            kill_process_tree(self.process.pid)


async def _pump(
    reader: asyncio.StreamReader, name: str, capture: StreamCapture, sink: OutputSink | None
) -> None:
    decoder = codecs.getincrementaldecoder("utf-8")("replace") if capture.encoding != "base64" else None
    while True:
        chunk = await reader.read(CHUNK_BYTES)
        if not chunk:
            break
        room = capture.limit - len(capture.kept)
        if room > 0:
            capture.kept += chunk[:room]
        if len(chunk) > room:
            capture.truncated = True
        if sink is not None:
            data = decoder.decode(chunk) if decoder else base64.b64encode(chunk).decode("ascii")
            if data:
                await sink(name, data)
    if sink is not None and decoder is not None:
        tail = decoder.decode(b"", final=True)
        if tail:
            await sink(name, tail)


async def _feed(writer: asyncio.StreamWriter, data: bytes) -> None:
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        if data:
            writer.write(data)
            await writer.drain()
        writer.close()
        await writer.wait_closed()


def _exit_code(returncode: int, folds_signals: bool) -> tuple[int, int | None]:
    """(exitCode, signal) from a status; negative when a signal ended the command.

    bubblewrap reports a command killed by signal N as status 128+N, the same
    convention shells use, so for it 129..192 is read as a signal.
    """
    if returncode < 0:
        return returncode, -returncode
    if folds_signals and 128 < returncode <= 128 + 64:
        return -(returncode - 128), returncode - 128
    return returncode, None


async def run_command(
    spec: LaunchSpec,
    handle: RunningCommand,
    *,
    stdin: bytes | None,
    timeout: float | None,
    output_limit: int,
    encoding: str,
    sink: OutputSink | None,
    folds_signals: bool,
    monitor: Monitor | None = None,
) -> RunOutcome:
    global _SPAWNING
    started = time.monotonic()
    extra: dict = {}
    if spec.preexec is not None:
        extra["preexec_fn"] = spec.preexec
    _SPAWNING += 1
    loop = asyncio.get_running_loop()
    exit_future: asyncio.Future[int] = loop.create_future()
    spawning = asyncio.ensure_future(loop.subprocess_exec(
            lambda: _ExitProtocol(exit_future, loop),
            *spec.argv,
            cwd=spec.cwd,
            env=spec.env,
            stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
            close_fds=True,
            pass_fds=spec.pass_fds,
            **extra,
        ))
    try:
        try:
            transport, protocol = await asyncio.shield(spawning)
        except asyncio.CancelledError:
            # Cancelled while the sandbox starts: let it start, then end its tree, so that
            # nothing outlives a request that was answered -32800.
            with contextlib.suppress(BaseException):
                started_transport, _ = await spawning
                kill_process_tree(started_transport.get_pid())
                started_transport.close()
            # bwrap may have forked the sandbox's PID 1 a moment before it died, too early for
            # --die-with-parent: orphaned, it comes to us (a subreaper), and the reaper ends it.
            for delay in (0.05, 0.25, 1.0):
                loop.call_later(delay, reap_orphans)
            raise
        process = asyncio.subprocess.Process(transport, protocol, loop)
    except (OSError, subprocess.SubprocessError) as error:
        raise SpawnFailed(f"cannot start {spec.argv[0]}: {getattr(error, 'strerror', None) or error}") from None
    finally:
        _SPAWNING -= 1
        for fd in spec.close_after_spawn:
            with contextlib.suppress(OSError):
                os.close(fd)
    _ACTIVE_ROOTS.add(process.pid)
    handle.process = process
    if sys.platform == "win32":
        handle.job = _windows_job(process.pid)
    if handle.killed:  # closed while spawning
        handle.kill()
    assert process.stdout is not None and process.stderr is not None
    if sink is not None:
        _grow_pipes(transport)
    out = StreamCapture(output_limit, encoding)
    err = StreamCapture(output_limit, encoding)
    pumps = [
        asyncio.ensure_future(_pump(process.stdout, "stdout", out, sink)),
        asyncio.ensure_future(_pump(process.stderr, "stderr", err, sink)),
    ]
    feeder: asyncio.Future[None] | None = (
        asyncio.ensure_future(_feed(process.stdin, stdin)) if process.stdin is not None and stdin is not None else None
    )
    # Process.wait() also waits for the pipes to close, which a leftover helper
    # of a backend without a PID namespace can hold open: the exit itself is what counts.
    exited = exit_future
    watcher = asyncio.ensure_future(_watch(process, handle, monitor)) if monitor is not None else None
    timed_out = False
    try:
        try:
            await asyncio.wait_for(asyncio.shield(exited), timeout)
        except TimeoutError:
            timed_out = True
            handle.kill()
            await exited
        _ACTIVE_ROOTS.discard(process.pid)
        if not spec.own_pid_namespace:
            # The command is done: whatever it left in its group goes too. (With a
            # PID namespace the kernel already ended it, and the pid may be reused.)
            kill_process_tree(process.pid)
        # Leftovers that came to us, and the zombie of a sandbox's PID 1 (cheap: no /proc scan).
        reap_orphans()
        _, pending = await asyncio.wait(pumps, timeout=PIPE_GRACE_SECONDS)
        for task in pending:
            task.cancel()
        for task in pumps:
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
    except BaseException:
        # Cancelled (or failed): stop the tree first, then let it propagate.
        handle.kill()
        for pending_task in (*pumps, feeder):
            if pending_task is not None:
                pending_task.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(asyncio.shield(exited), 5)
        raise
    finally:
        _ACTIVE_ROOTS.discard(process.pid)
        if handle.job is not None:
            with contextlib.suppress(OSError):
                handle.job.close()  # kill-on-close: the rest of the tree ends here
        if feeder is not None:
            feeder.cancel()
        if watcher is not None:
            watcher.cancel()
    exit_code, signal_number = _exit_code(exited.result(), folds_signals)
    return RunOutcome(
        exit_code=exit_code,
        stdout=out,
        stderr=err,
        timed_out=timed_out,
        killed=handle.killed and not timed_out and not (monitor is not None and monitor.watchdog_fired),
        duration_seconds=time.monotonic() - started,
        signal_number=signal_number,
    )
