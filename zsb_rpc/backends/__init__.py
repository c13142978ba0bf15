"""Backend selection: the only place that looks at the platform."""

from __future__ import annotations

import sys

from ..protocol.errors import InvalidParams, IsolationRequired, SandboxUnavailable
from .base import Availability, Backend, LaunchSpec
from .bubblewrap import BubblewrapBackend
from .passthrough import PassthroughBackend

__all__ = ["Availability", "Backend", "LaunchSpec", "all_backends", "default_backend_name", "select_backend"]

_BACKENDS: dict[str, Backend] = {"bubblewrap": BubblewrapBackend(), "passthrough": PassthroughBackend()}


def all_backends() -> dict[str, Backend]:
    return dict(_BACKENDS)


def default_backend_name() -> str:
    """The platform's own backend. Passthrough only where a platform has none."""
    if sys.platform.startswith("linux"):
        return "bubblewrap"
    return "passthrough"


def select_backend(name: str | None, require_isolation: bool) -> tuple[Backend, list[str]]:
    """The backend a session gets, or an error; never a silent run without a sandbox."""
    chosen = name or default_backend_name()
    backend = _BACKENDS.get(chosen)
    if backend is None:
        raise InvalidParams("params.backend", f"unknown backend {chosen!r}; known: {', '.join(_BACKENDS)}")
    availability = backend.probe()
    if not availability.available:
        raise SandboxUnavailable(f"backend {chosen} cannot run here: {availability.reason}")
    if require_isolation and not backend.isolated:
        raise IsolationRequired(
            f"requireIsolation is set and backend {chosen} isolates nothing"
            + ("" if name else " (this platform has no sandbox backend)")
        )
    return backend, list(availability.warnings)
