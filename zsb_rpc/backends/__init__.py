"""Backend selection: the only place that looks at the platform."""

from __future__ import annotations

import sys

from ..protocol.errors import InvalidParams, IsolationRequired, SandboxUnavailable
from .base import Availability, Backend, LaunchSpec
from .bubblewrap import BubblewrapBackend
from .landlock import LandlockBackend
from .passthrough import PassthroughBackend
from .seatbelt import SeatbeltBackend

__all__ = ["Availability", "Backend", "LaunchSpec", "all_backends", "default_backend_name", "select_backend"]

_BACKENDS: dict[str, Backend] = {  # the order capabilities lists them in
    "bubblewrap": BubblewrapBackend(),
    "landlock": LandlockBackend(),
    "seatbelt": SeatbeltBackend(),
    "passthrough": PassthroughBackend(),
}


def all_backends() -> dict[str, Backend]:
    return dict(_BACKENDS)


def platform_backends() -> list[str]:
    """The platform's own backends, in order of preference. Passthrough only where a platform has none."""
    if sys.platform.startswith("linux"):
        return ["bubblewrap", "landlock"]
    if sys.platform == "darwin":
        return ["seatbelt"]
    return ["passthrough"]


def default_backend_name() -> str | None:
    """The first of the platform's backends that can run here, or None."""
    for name in platform_backends():
        if _BACKENDS[name].probe().available:
            return name
    return None


def select_backend(name: str | None, require_isolation: bool) -> tuple[Backend, list[str]]:
    """The backend a session gets, or an error; never a silent run without a sandbox."""
    if name is None:
        chosen = default_backend_name()
        if chosen is None:
            reasons = "; ".join(f"{n}: {_BACKENDS[n].probe().reason}" for n in platform_backends())
            raise SandboxUnavailable(f"no sandbox backend can run here ({reasons})")
    else:
        chosen = name
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
    if name is None and chosen != platform_backends()[0]:
        first = platform_backends()[0]
        availability_warnings = [f"{first} cannot run here ({_BACKENDS[first].probe().reason}); using {chosen}"]
        return backend, availability_warnings + list(availability.warnings)
    return backend, list(availability.warnings)
