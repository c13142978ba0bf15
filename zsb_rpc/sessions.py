"""The session table: open, run, wrap, close, and teardown when the client goes away."""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import dataclasses
import logging
import os
import secrets
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from .backends import Backend, select_backend
from .limits import RunLimits, cleanup_server_cgroups, plan_limits
from .policy import (
    DEFAULT_TIMEOUT_SECONDS,
    ResolvedPolicy,
    as_path,
    build_environment,
    check_hidden_in_place,
    check_output_limit,
    check_text,
    check_timeout,
    command_arguments,
    resolve_policy,
)
from .protocol.errors import InvalidParams, SandboxUnavailable, SessionClosed, SessionNotFound, SpawnFailed
from .protocol.types import (
    UNSET,
    Resources,
    RunParams,
    RunResult,
    SessionCloseParams,
    SessionCloseResult,
    SessionOpenParams,
    SessionOpenResult,
    Truncated,
    WrapParams,
    WrapResult,
)
from .runner import Monitor, OutputSink, ResourceSink, RunningCommand, run_command
from .workspaces import record_placeholders, remove_stale_servers, remove_tree, server_directory, stale_server_pid

logger = logging.getLogger(__name__)


@dataclass
class Session:
    id: str
    policy: ResolvedPolicy
    backend: Backend
    private_workspace: Path | None
    warnings: list[str]
    runs: set[RunningCommand] = field(default_factory=set)
    closed: bool = False
    prepared: list[Path] = field(default_factory=list)


def existing_directory(path: Path, given: str, field_name: str) -> Path:
    """``path`` resolved through symbolic links; it must be an existing directory."""
    try:
        resolved = path.resolve(strict=True)
    except (OSError, RuntimeError):
        raise InvalidParams(field_name, f"must be an existing directory: {given!r}") from None
    if not resolved.is_dir():
        raise InvalidParams(field_name, f"must be a directory: {given!r}")
    return resolved


class SessionTable:
    def __init__(self, *, environ: Mapping[str, str] | None = None) -> None:
        self._sessions: dict[str, Session] = {}
        self._environ = dict(os.environ if environ is None else environ)
        self._home = Path(self._environ.get("HOME") or os.path.expanduser("~"))
        self._directory: Path | None = None
        self._releasing: set[asyncio.Future[None]] = set()
        self._directory_lock = threading.Lock()
        self._opening: set[asyncio.Future[SessionOpenResult]] = set()

    def _private_root(self) -> Path:
        # Opens run in executor threads: one directory per server, made once.
        with self._directory_lock:
            if self._directory is None:
                self._directory = server_directory()
            return self._directory

    def _get(self, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise SessionNotFound(session_id)
        return session

    def open(self, params: SessionOpenParams) -> SessionOpenResult:
        backend, warnings = select_backend(params.backend, params.require_isolation)
        timeout = DEFAULT_TIMEOUT_SECONDS if params.timeout is UNSET else params.timeout
        private: Path | None = None
        if params.workspace is None:
            session_id = "s-" + secrets.token_hex(8)
            private = self._private_root() / f"ws-{session_id}"
            private.mkdir(mode=0o700)
            workspace = private
        else:
            session_id = "s-" + secrets.token_hex(8)
            given = as_path(params.workspace, "params.workspace", self._home)
            workspace = existing_directory(given, params.workspace, "params.workspace")
        try:
            policy = resolve_policy(
                workspace=workspace,
                writable=params.writable,
                deny_write=params.deny_write,
                deny_read=params.deny_read,
                network=params.network,
                env=params.env,
                inherit_environment=params.inherit_environment,
                limits=params.limits,
                memory_strategy=params.memory_strategy,
                timeout=timeout,  # type: ignore[arg-type]
                output_limit=params.output_limit,
                protect_defaults=params.protect_defaults,
                home=self._home,
                source_environment=self._environ,
                private_workspace=private is not None,
                allow_unix_sockets=params.allow_unix_sockets,
            )
            plan = plan_limits(policy.limits, policy.memory_strategy, isolated=backend.isolated, requested_only=True)
            prepared = backend.prepare(policy)
            if backend.needs_private_tmp:
                tmp = self._private_root() / f"tmp-{session_id}"
                tmp.mkdir(mode=0o700)
                policy = dataclasses.replace(policy, private_tmp=tmp)
        except BaseException:
            if private is not None:
                remove_tree(private)
            raise
        warnings.extend(policy.warnings)
        warnings.extend(plan.warnings)
        warnings.extend(backend.differences(policy))
        if prepared:
            record_placeholders(self._private_root(), prepared)
            warnings.append(
                "created empty placeholders so that these protected paths stay unwritable (removed at close): "
                + ", ".join(str(p) for p in prepared)
            )
        session = Session(session_id, policy, backend, private, warnings, prepared=prepared)
        self._sessions[session_id] = session
        logger.info("opened %s on %s in %s", session_id, backend.name, workspace)
        return SessionOpenResult(
            session_id=session_id, workspace=str(workspace), backend=backend.name, isolated=backend.isolated,
            warnings=warnings,
        )

    def _cwd(self, session: Session, cwd: str | None) -> Path:
        if cwd is None:
            return session.policy.workspace
        check_text(cwd, "params.cwd")
        path = Path(cwd)
        if not path.is_absolute():
            path = session.policy.workspace / path
        resolved = existing_directory(path, cwd, "params.cwd")
        reason = session.backend.check_cwd(session.policy, resolved)
        if reason:
            raise InvalidParams("params.cwd", f"{resolved} {reason}")
        return resolved

    def _prepare(self, params: RunParams | WrapParams, *, allow_cgroups: bool):
        session = self._get(params.session_id)
        argv = command_arguments(params.command)
        cwd = self._cwd(session, params.cwd)
        env = build_environment((), {**session.policy.environment, **params.env}, {}, "params.env")
        check_hidden_in_place(session.policy)
        plan = plan_limits(session.policy.limits, session.policy.memory_strategy,
                           isolated=session.backend.isolated, requested_only=True, allow_cgroups=allow_cgroups)
        return session, argv, cwd, env, plan

    def _release_later(self, run_limits: RunLimits) -> None:
        """Remove a run's cgroup after its answer has gone; close_all waits for what is pending."""
        if run_limits.cgroup is None:
            return
        future = asyncio.get_running_loop().run_in_executor(None, run_limits.release)
        self._releasing.add(future)
        future.add_done_callback(self._releasing.discard)

    def wrap(self, params: WrapParams) -> WrapResult:
        session, argv, cwd, env, plan = self._prepare(params, allow_cgroups=False)
        if session.backend.launch_needs_server:
            raise SandboxUnavailable(
                f"backend {session.backend.name} cannot express its sandbox as a command line "
                "(it is applied between fork and exec); use run"
            )
        spec = session.backend.launch_spec(session.policy, argv, cwd, env, inline_environment=True)
        prefix = RunLimits(plan, session.policy.limits).start()
        warnings = [*spec.warnings, *plan.warnings]
        if plan.watchdog_memory is not None:
            warnings.append("memory: the watchdog needs the server to run the command; not applied to a wrapped command")
        return WrapResult(argv=[*prefix, *spec.argv], cwd=spec.cwd, env=spec.env, warnings=warnings)

    async def run(
        self, params: RunParams, notify_output: OutputSink | None, notify_resources: ResourceSink | None = None
    ) -> RunResult:
        session, argv, cwd, env, plan = self._prepare(params, allow_cgroups=True)
        timeout = session.policy.timeout if params.timeout is UNSET else params.timeout
        check_timeout(timeout, "params.timeout")  # type: ignore[arg-type]
        output_limit = session.policy.output_limit if params.output_limit is None else params.output_limit
        check_output_limit(output_limit, "params.outputLimit")
        stdin: bytes | None = None
        if params.input is not None:
            if params.encoding == "base64":
                try:
                    stdin = base64.b64decode(params.input, validate=True)
                except (binascii.Error, ValueError):
                    raise InvalidParams("params.input", "must be base64 when encoding is base64") from None
            else:
                try:
                    stdin = params.input.encode("utf-8")
                except UnicodeError:
                    raise InvalidParams("params.input", "must be valid Unicode (no lone surrogates)") from None
        limits = session.policy.limits
        run_limits = RunLimits(plan, limits)
        try:
            prefix = run_limits.start(trampoline=not session.backend.launch_needs_server)
        except OSError as error:
            raise SpawnFailed(f"cannot create the run's cgroup: {error}") from None
        try:
            spec = session.backend.launch_spec(session.policy, argv, cwd, env,
                                               writable_files=run_limits.procs_files())
        except BaseException:
            run_limits.release()
            raise
        spec.argv[:0] = prefix
        streaming = params.run_id is not None
        monitor = None
        if streaming or plan.watchdog_memory is not None or run_limits.cgroup is not None:
            monitor = Monitor(
                interval=limits.memory_sample_seconds,
                sampler=run_limits.sample,
                watchdog_memory=plan.watchdog_memory,
                sink=notify_resources if streaming else None,
            )
        handle = RunningCommand()
        session.runs.add(handle)
        limits_hit: list[str] = []
        outcome = None
        try:
            outcome = await run_command(
                spec, handle, stdin=stdin, timeout=timeout, output_limit=output_limit,  # type: ignore[arg-type]
                encoding=params.encoding, sink=notify_output if streaming else None,
                folds_signals=session.backend.folds_signals, monitor=monitor,
            )
        finally:
            session.runs.discard(handle)
            final = run_limits.sample()
            limits_hit = run_limits.finish(outcome.exit_code if outcome else 0,
                                           bytes(outcome.stderr.kept[-4096:]) if outcome else b"")
            self._release_later(run_limits)
        if outcome.killed and session.closed:
            raise SessionClosed(f"session {session.id} was closed while the command ran")
        if monitor is not None and monitor.watchdog_fired:
            limits_hit.insert(0, "memory")
        if outcome.timed_out:
            limits_hit = [hit for hit in limits_hit if hit != "cpu"]
        peak = (final or {}).get("peak") or (monitor.peak_memory if monitor else None)
        cpu = (final or {}).get("cpu")
        if cpu is None and monitor is not None:
            cpu = monitor.cpu_seconds
        return RunResult(
            exit_code=outcome.exit_code,
            stdout=outcome.stdout.text(),
            stderr=outcome.stderr.text(),
            timed_out=outcome.timed_out,
            truncated=Truncated(stdout=outcome.stdout.truncated, stderr=outcome.stderr.truncated),
            isolated=spec.isolated,
            duration_seconds=round(outcome.duration_seconds, 6),
            resources=Resources(mechanisms=plan.mechanisms, limits_hit=list(dict.fromkeys(limits_hit)),
                                peak_memory_bytes=int(peak) if peak is not None else None,
                                cpu_seconds=round(float(cpu), 6) if cpu is not None else None,
                                warnings=[*spec.warnings, *plan.warnings]),
        )

    async def open_async(self, params: SessionOpenParams) -> SessionOpenResult:
        """``open`` in a thread; close_all waits for opens under way, so none outlives it."""
        opening = asyncio.get_running_loop().run_in_executor(None, self.open, params)
        self._opening.add(opening)
        opening.add_done_callback(self._opening.discard)
        try:
            return await asyncio.shield(opening)
        except asyncio.CancelledError:
            # The thread goes on; a session nobody will learn the id of is closed again.
            with contextlib.suppress(Exception):
                opened = await opening
                await self.close(SessionCloseParams(session_id=opened.session_id))
            raise

    async def close(self, params: SessionCloseParams) -> SessionCloseResult:
        session = self._get(params.session_id)
        del self._sessions[session.id]
        # Shielded: a cancel that crosses a close must not leave half a teardown (placeholders).
        removed = await asyncio.shield(self._teardown(session))
        return SessionCloseResult(session_id=session.id, removed_workspace=removed)

    async def _teardown(self, session: Session) -> bool:
        session.closed = True
        for handle in list(session.runs):
            handle.kill()
        # Wait (briefly) for the killed runs to be reaped before removing files
        # they may still hold open.
        for _ in range(100):
            if not session.runs:
                break
            await asyncio.sleep(0.01)
        session.backend.release(session.prepared)
        if session.policy.private_tmp is not None:
            await asyncio.get_running_loop().run_in_executor(None, remove_tree, session.policy.private_tmp)
        if session.private_workspace is None:
            return False
        await asyncio.get_running_loop().run_in_executor(None, remove_tree, session.private_workspace)
        return True

    def remove_stale(self) -> None:
        """What servers killed without cleaning up left behind: workspaces, placeholders, cgroups."""
        from .backends.bubblewrap import kill_stale_sandboxes, remove_placeholders
        from .limits.cgroups import SERVER_PREFIX, remove_stale_cgroups

        for path in remove_stale_servers(remove_placeholders):
            logger.info("removed %s, left by a server that died", path)
        for path in remove_stale_cgroups(lambda name: stale_server_pid(name, SERVER_PREFIX) is not None):
            logger.info("removed cgroup %s, left by a server that died", path)
        for pid in kill_stale_sandboxes(lambda pid: stale_server_pid(f"{pid}-", "") is not None):
            logger.info("killed sandbox %d, left by a server that died", pid)

    async def close_all(self) -> None:
        if self._opening:
            await asyncio.wait(list(self._opening), timeout=5)
        sessions = list(self._sessions.values())
        self._sessions.clear()
        await asyncio.gather(*(self._teardown(s) for s in sessions), return_exceptions=True)
        if self._releasing:
            await asyncio.wait(list(self._releasing), timeout=2)
        if self._directory is not None:
            remove_tree(self._directory)
            self._directory = None
        cleanup_server_cgroups()
