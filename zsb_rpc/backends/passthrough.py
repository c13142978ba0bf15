"""No isolation at all, for platforms without a backend. It says so everywhere."""

from __future__ import annotations

import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path

from ..policy import ResolvedPolicy
from .base import Availability, LaunchSpec

WARNING = "passthrough backend: the command runs without any isolation or resource limits"


class PassthroughBackend:
    name = "passthrough"
    isolated = False
    #: Whether the sandbox is applied by the server between fork and exec, so no argv can carry it.
    #: Whether a signal that ended the command arrives as exit status 128+N (bubblewrap).
    folds_signals = False
    launch_needs_server = False
    needs_private_tmp = False

    def probe(self) -> Availability:
        return Availability(True, None, (WARNING,))

    def check_cwd(self, policy: ResolvedPolicy, cwd: Path) -> str | None:
        return None

    def prepare(self, policy: ResolvedPolicy) -> list[Path]:
        return []

    def release(self, created: list[Path]) -> None:
        return None

    def differences(self, policy: ResolvedPolicy) -> list[str]:
        return []

    def launch_spec(
        self, policy: ResolvedPolicy, argv: Sequence[str], cwd: Path, env: Mapping[str, str],
        *, writable_files: Sequence[str] = (),
    ) -> LaunchSpec:
        program = argv[0]
        if "/" not in program:
            # exec does not search PATH for us with an explicit environment.
            program = shutil.which(program, path=env.get("PATH")) or program
        return LaunchSpec(argv=[program, *argv[1:]], cwd=str(cwd), env=dict(env), isolated=False, warnings=[WARNING],
                          own_pid_namespace=False)
