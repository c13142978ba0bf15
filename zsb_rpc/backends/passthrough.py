"""No isolation at all, for platforms without a backend. It says so everywhere."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from ..policy import ResolvedPolicy
from .base import Availability, Backend, LaunchSpec, resolve_program

WARNING = "passthrough backend: the command runs without any isolation or resource limits"


class PassthroughBackend(Backend):
    name = "passthrough"
    isolated = False

    def probe(self) -> Availability:
        return Availability(True, None, (WARNING,))

    def launch_spec(
        self, policy: ResolvedPolicy, argv: Sequence[str], cwd: Path, env: Mapping[str, str],
        *, writable_files: Sequence[str] = (), inline_environment: bool = False,
    ) -> LaunchSpec:
        command = resolve_program(argv, env)
        return LaunchSpec(argv=command, cwd=str(cwd), env=dict(env), isolated=False, warnings=[WARNING],
                          own_pid_namespace=False)
