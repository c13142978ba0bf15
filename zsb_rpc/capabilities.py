"""What this machine can enforce and how, without creating anything."""

from __future__ import annotations

import sys

from . import __version__
from .backends import all_backends, default_backend_name, platform_backends
from .limits import plan_limits
from .protocol import PROTOCOL_VERSION
from .protocol.types import BackendInfo, CapabilitiesParams, CapabilitiesResult


def report_capabilities(params: CapabilitiesParams) -> CapabilitiesResult:
    infos = []
    warnings: list[str] = []
    for name, backend in all_backends().items():
        availability = backend.probe()
        infos.append(BackendInfo(name=name, available=availability.available, isolated=backend.isolated,
                                 reason=availability.reason))
    default = default_backend_name()
    chosen = next((info for info in infos if info.name == default), None)
    if chosen is None:
        reasons = "; ".join(f"{info.name}: {info.reason}" for info in infos if not info.available)
        warnings.append(f"no session can open: no sandbox backend can run here ({reasons})")
        backend_name, isolated = None, False
    else:
        backend_name, isolated = chosen.name, chosen.isolated
        for info in infos:
            # The platform's preferred backend cannot run: say why, and what to change.
            if info.name in platform_backends() and info.name != chosen.name and not info.available:
                warnings.append(f"{info.name} cannot run here, so sessions get {chosen.name}: {info.reason}")
        warnings.extend(all_backends()[chosen.name].probe().warnings)
    plan = plan_limits(params.limits, params.memory_strategy, isolated=isolated, requested_only=False)
    warnings.extend(plan.warnings)
    m = plan.mechanisms
    return CapabilitiesResult(
        server_version=__version__,
        protocol_version=PROTOCOL_VERSION,
        platform=sys.platform,
        backend=backend_name,
        isolated=isolated,
        memory=m["memory"],  # type: ignore[arg-type]
        cpu_seconds=m["cpuSeconds"],  # type: ignore[arg-type]
        cpu_percent=m["cpuPercent"],  # type: ignore[arg-type]
        processes=m["processes"],  # type: ignore[arg-type]
        file_size_bytes=m["fileSizeBytes"],  # type: ignore[arg-type]
        open_files=m["openFiles"],  # type: ignore[arg-type]
        core_dumps=m["coreDumps"],  # type: ignore[arg-type]
        backends=infos,
        warnings=warnings,
    )
