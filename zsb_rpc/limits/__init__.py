"""How each requested limit is enforced on this machine, and the argv prefix that applies it.

Today's mechanisms are POSIX rlimits, applied by util-linux ``prlimit`` in
front of bubblewrap (an exec of a small C program, not a Python interpreter per
run) and inherited by everything the command starts. Limits that need a cgroup
or a watchdog are reported as ``none`` with the reason, never as enforced.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field

from ..protocol.types import Limits

#: Wire name of each limit in ``capabilities`` and ``resources.mechanisms``.
LIMIT_NAMES = ("memory", "cpuSeconds", "cpuPercent", "processes", "fileSizeBytes", "openFiles", "coreDumps")


@dataclass
class LimitPlan:
    mechanisms: dict[str, str]
    prefix: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def _prlimit() -> str | None:
    for candidate in ("/usr/bin/prlimit", "/bin/prlimit"):
        if os.access(candidate, os.X_OK):
            return candidate
    return shutil.which("prlimit")


def _user_process_count(uid: int) -> int:
    count = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    count += 1
            except OSError:
                pass
    return count


def plan_limits(limits: Limits | None, strategy: str, *, isolated: bool, requested_only: bool) -> LimitPlan:
    """Mechanism per limit, the prlimit prefix and warnings. Creates nothing.

    ``requested_only`` reports only what ``limits`` asks for (a run's
    ``resources.mechanisms``); otherwise every limit is reported as it would be
    enforced if asked (``capabilities``).
    """
    limits = limits or Limits()
    prlimit = _prlimit()
    root = os.geteuid() == 0
    mechanisms: dict[str, str] = {}
    warnings: list[str] = []
    options: list[str] = []

    def report(name: str, asked: object, mechanism: str, reason: str | None = None) -> None:
        if requested_only and asked in (None, False) and name != "coreDumps":
            return
        mechanisms[name] = mechanism
        if mechanism == "none" and reason and (asked not in (None, False) or not requested_only):
            warnings.append(f"{name}: not enforced: {reason}")

    can_rlimit = isolated and prlimit is not None
    no_rlimit = "this backend applies no limits" if not isolated else "prlimit (util-linux) is not installed"

    # Memory: an address-space rlimit is the strongest mechanism today (no cgroup yet).
    if strategy == "none":
        report("memory", limits.memory_bytes, "none", "memoryStrategy is none")
    elif strategy == "watchdog":
        report("memory", limits.memory_bytes, "none", "the memory watchdog is not implemented yet")
    elif can_rlimit:
        report("memory", limits.memory_bytes, "rlimit_as")
        if limits.memory_bytes is not None:
            options.append(f"--as={limits.memory_bytes}")
    else:
        report("memory", limits.memory_bytes, "none", no_rlimit)

    if can_rlimit:
        report("cpuSeconds", limits.cpu_seconds, "rlimit")
        if limits.cpu_seconds is not None:
            # The hard limit a second later stops a process that handles SIGXCPU.
            options.append(f"--cpu={limits.cpu_seconds}:{limits.cpu_seconds + 1}")
    else:
        report("cpuSeconds", limits.cpu_seconds, "none", no_rlimit)

    report("cpuPercent", limits.cpu_percent, "none", "a processor share needs a cgroup, not supported yet")

    if can_rlimit and not root:
        report("processes", limits.processes, "rlimit")
        if limits.processes is not None:
            # RLIMIT_NPROC counts every process the user owns, so the allowance
            # is what already runs plus what the command may add.
            options.append(f"--nproc={_user_process_count(os.getuid()) + limits.processes}")
    elif can_rlimit:
        report("processes", limits.processes, "none", "the kernel does not apply RLIMIT_NPROC to root; needs a cgroup")
    else:
        report("processes", limits.processes, "none", no_rlimit)

    for name, value, flag in (
        ("fileSizeBytes", limits.file_size_bytes, "--fsize"),
        ("openFiles", limits.open_files, "--nofile"),
    ):
        if can_rlimit:
            report(name, value, "rlimit")
            if value is not None:
                options.append(f"{flag}={value}")
        else:
            report(name, value, "none", no_rlimit)

    if can_rlimit:
        report("coreDumps", limits.core_dumps, "rlimit")
        if not limits.core_dumps:
            options.append("--core=0")
    else:
        report("coreDumps", limits.core_dumps, "none", no_rlimit if limits.core_dumps is False else no_rlimit)

    prefix = [prlimit, *options, "--"] if options and prlimit else []
    return LimitPlan(mechanisms=mechanisms, prefix=prefix, warnings=warnings)
