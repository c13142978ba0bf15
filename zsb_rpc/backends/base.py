"""The one small interface every backend implements.

A backend probes whether it can run here (with a reason when it cannot) and
turns a resolved policy plus a command into a launch spec. It never spawns:
``runner.py`` is the one place that does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

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


class Backend(Protocol):
    name: str
    isolated: bool

    def probe(self) -> Availability: ...

    def check_cwd(self, policy: ResolvedPolicy, cwd: Path) -> str | None:
        """Why ``cwd`` cannot be the working directory inside the sandbox, or None."""
        ...

    def prepare(self, policy: ResolvedPolicy) -> list[Path]:
        """Set up what the session needs on the host (placeholders); returns what was created."""
        ...

    def release(self, created: list[Path]) -> None:
        """Undo ``prepare``: remove what it created, if it is still as it was made."""
        ...

    def launch_spec(
        self, policy: ResolvedPolicy, argv: Sequence[str], cwd: Path, env: Mapping[str, str]
    ) -> LaunchSpec: ...
