"""The one small interface every backend implements.

A backend probes whether it can run here (with a reason when it cannot) and
turns a resolved policy plus a command into a launch spec. It never spawns:
``runner.py`` is the one place that does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..policy import ResolvedPolicy


@dataclass(frozen=True, slots=True)
class Availability:
    available: bool
    reason: str | None = None
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class LaunchSpec:
    """What to exec, where, with which environment. ``argv[0]`` is an absolute path."""

    argv: list[str]
    cwd: str
    env: dict[str, str]
    isolated: bool
    warnings: list[str] = field(default_factory=list)
    #: Run in the child between fork and exec (Landlock and seccomp): system calls, no interpreter.
    preexec: Callable[[], None] | None = None
    #: Descriptors the child inherits besides stdin, stdout and stderr.
    pass_fds: tuple[int, ...] = ()
    #: Descriptors the server closes once the child has them.
    close_after_spawn: tuple[int, ...] = ()
    #: Whether the kernel ends every process of the run with it (a PID namespace). Without one,
    #: the runner kills what is left of the tree and reaps the orphans itself.
    own_pid_namespace: bool = True


def resolve_program(argv: Sequence[str], env: Mapping[str, str]) -> list[str]:
    """argv with its program found on the command's own PATH: exec with an explicit environment
    does not search it, and backends that exec directly must agree on what runs."""
    program = argv[0]
    if "/" not in program:
        import shutil

        program = shutil.which(program, path=env.get("PATH")) or program
    return [program, *argv[1:]]


class Backend:
    """What every backend is. The defaults are those of a backend with nothing to set up."""

    name: str
    #: Whether commands are isolated at all.
    isolated: bool
    #: Whether the session needs a private temporary directory of its own (no private /tmp).
    needs_private_tmp = False
    #: Whether the sandbox is applied by the server between fork and exec, so ``wrap`` cannot carry it.
    launch_needs_server = False
    #: Whether a signal that ended the command arrives as exit status 128+N (bubblewrap's own convention).
    folds_signals = False

    def probe(self) -> Availability:
        raise NotImplementedError

    def check_cwd(self, policy: ResolvedPolicy, cwd: Path) -> str | None:
        """Why ``cwd`` cannot be the working directory inside the sandbox, or None."""
        return None

    def prepare(self, policy: ResolvedPolicy) -> list[Path]:
        """Set up what the session needs on the host (placeholders); returns what was created."""
        return []

    def release(self, created: list[Path]) -> None:
        """Undo ``prepare``: remove what it created, if it is still as it was made."""
        return None

    def differences(self, policy: ResolvedPolicy) -> list[str]:
        """Guarantees of the bubblewrap backend that this one cannot give, for the session's warnings."""
        return []

    def launch_spec(
        self, policy: ResolvedPolicy, argv: Sequence[str], cwd: Path, env: Mapping[str, str],
        *, writable_files: Sequence[str] = (), inline_environment: bool = False,
    ) -> LaunchSpec:
        """``writable_files``: files the launcher must write inside the sandbox (a cgroup.procs).
        ``inline_environment``: for ``wrap``, carry the command's environment in the argv."""
        raise NotImplementedError
