"""How each requested limit is enforced on this machine, and what a run needs to apply it.

The strongest mechanism the machine offers for the server's user wins:
cgroups (v2 or v1) for memory, processes and processor share; POSIX rlimits
for processor time, file size, open files and core dumps, and for memory
(address space) and processes where no cgroup is usable; a sampling watchdog
where the kernel has nothing. rlimits are applied by util-linux ``prlimit``
in front of bubblewrap, and a run's cgroup is entered by a three-line
``/bin/sh`` trampoline before it execs ``prlimit``: small C programs, never a
Python interpreter per run. A limit that cannot be enforced is reported as
``none`` with its reason, never as enforced.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass, field

from ..protocol.types import Limits
from .cgroups import CgroupRun, CgroupSupport, probe_cgroups, remove_server_cgroups, server_cgroup_name

#: Enters every cgroup.procs file given before ``--`` ("0" is the writer
#: itself), then execs the rest. No caller text is ever part of the script.
CGROUP_TRAMPOLINE = 'while [ "$1" != -- ]; do echo 0 > "$1" || exit 125; shift; done; shift; exec "$@"'

_SERVER_CGROUP: str | None = None


def server_cgroup() -> str:
    global _SERVER_CGROUP
    if _SERVER_CGROUP is None:
        _SERVER_CGROUP = server_cgroup_name()
    return _SERVER_CGROUP


def cleanup_server_cgroups() -> None:
    if _SERVER_CGROUP is not None:
        remove_server_cgroups(probe_cgroups(), _SERVER_CGROUP)


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


@dataclass
class LimitPlan:
    """Mechanism per limit, and what a run must do to apply them."""

    mechanisms: dict[str, str]
    warnings: list[str] = field(default_factory=list)
    rlimit_options: list[str] = field(default_factory=list)
    cgroup_controllers: list[str] = field(default_factory=list)
    watchdog_memory: int | None = None


def plan_limits(
    limits: Limits | None,
    strategy: str,
    *,
    isolated: bool,
    requested_only: bool,
    allow_cgroups: bool = True,
    support: CgroupSupport | None = None,
) -> LimitPlan:
    """Decide every mechanism. Creates nothing.

    ``requested_only`` reports only what ``limits`` asks for (a run's
    ``resources.mechanisms``; ``coreDumps`` is always applied); otherwise every
    limit is reported as it would be enforced if asked (``capabilities``).
    ``allow_cgroups`` is false for ``wrap``: a cgroup needs the server to place
    the process, so the argv falls back to what it can carry.
    """
    limits = limits or Limits()
    support = support or probe_cgroups()
    prlimit = _prlimit() if isolated else None
    can_rlimit = prlimit is not None
    no_rlimit = "this backend applies no limits" if not isolated else "prlimit (util-linux) is not installed"
    cgroup_ok = isolated and allow_cgroups
    if isolated and not allow_cgroups:
        no_cgroup = "it needs a cgroup, which the server places and a wrapped command does not get"
    elif not isolated:
        no_cgroup = no_rlimit
    else:
        no_cgroup = "it needs a cgroup and none is usable (" + ("; ".join(support.reasons) or "none found") + ")"
    plan = LimitPlan(mechanisms={})

    def report(name: str, asked: object, mechanism: str, reason: str | None = None) -> None:
        wanted = asked not in (None, False)
        if requested_only and not wanted and name != "coreDumps":
            return
        plan.mechanisms[name] = mechanism
        if mechanism == "none" and reason and (wanted or not requested_only):
            plan.warnings.append(f"{name}: not enforced: {reason}")

    def rlimit(option: str) -> None:
        plan.rlimit_options.append(option)

    # Memory: the strategy chooses among the mechanisms, strongest first.
    memory = limits.memory_bytes
    kernel_memory = "cgroup" if cgroup_ok and support.has("memory") else ("rlimit_as" if can_rlimit else None)
    if not isolated:
        report("memory", memory, "none", no_rlimit)
    elif strategy == "none":
        report("memory", memory, "none", "memoryStrategy is none")
    elif strategy == "watchdog" or (strategy == "auto" and kernel_memory is None):
        report("memory", memory, "watchdog")
        plan.watchdog_memory = memory
    elif kernel_memory is None:
        report("memory", memory, "none", f"memoryStrategy is kernel and no kernel mechanism is usable: {no_cgroup}")
    else:
        report("memory", memory, kernel_memory)
        if memory is not None:
            if kernel_memory == "cgroup":
                plan.cgroup_controllers.append("memory")
            else:
                rlimit(f"--as={memory}")

    if can_rlimit:
        report("cpuSeconds", limits.cpu_seconds, "rlimit")
        if limits.cpu_seconds is not None:
            # The hard limit a second later stops a process that handles SIGXCPU.
            rlimit(f"--cpu={limits.cpu_seconds}:{limits.cpu_seconds + 1}")
    else:
        report("cpuSeconds", limits.cpu_seconds, "none", no_rlimit)

    if cgroup_ok and support.has("cpu"):
        report("cpuPercent", limits.cpu_percent, "cgroup")
        if limits.cpu_percent is not None:
            plan.cgroup_controllers.append("cpu")
    else:
        report("cpuPercent", limits.cpu_percent, "none", no_cgroup)

    if cgroup_ok and support.has("pids"):
        report("processes", limits.processes, "cgroup")
        if limits.processes is not None:
            plan.cgroup_controllers.append("pids")
    elif can_rlimit and os.geteuid() != 0:
        report("processes", limits.processes, "rlimit")
        if limits.processes is not None:
            # RLIMIT_NPROC counts every process the user owns, so the allowance
            # is what already runs plus what the command may add.
            rlimit(f"--nproc={_user_process_count(os.getuid()) + limits.processes}")
    elif can_rlimit:
        report("processes", limits.processes, "none", f"the kernel does not apply RLIMIT_NPROC to root, and {no_cgroup}")
    else:
        report("processes", limits.processes, "none", no_rlimit)

    for name, value, option in (
        ("fileSizeBytes", limits.file_size_bytes, "--fsize"),
        ("openFiles", limits.open_files, "--nofile"),
    ):
        if can_rlimit:
            report(name, value, "rlimit")
            if value is not None:
                rlimit(f"{option}={value}")
        else:
            report(name, value, "none", no_rlimit)

    if can_rlimit:
        report("coreDumps", limits.core_dumps, "rlimit")
        rlimit("--core=unlimited" if limits.core_dumps else "--core=0")
    else:
        report("coreDumps", limits.core_dumps, "none", no_rlimit)

    if cgroup_ok and plan.cgroup_controllers:
        # Processor time is measured where the kernel accounts it.
        if support.version == 1 and support.has("cpuacct"):
            plan.cgroup_controllers.append("cpuacct")
        if "memory" not in plan.cgroup_controllers and support.has("memory"):
            plan.cgroup_controllers.append("memory")  # for the peak, with no limit set
    return plan


class RunLimits:
    """What one run does to apply a plan: argv prefix, cgroup, sampling, evidence."""

    def __init__(self, plan: LimitPlan, limits: Limits) -> None:
        self.plan = plan
        self.limits = limits
        self.cgroup: CgroupRun | None = None
        if plan.cgroup_controllers:
            self.cgroup = CgroupRun(probe_cgroups(), server_cgroup(), plan.cgroup_controllers)

    def start(self, *, trampoline: bool = True) -> list[str]:
        """Create the run's cgroup; the argv prefix that enters it and applies the rlimits.

        ``trampoline`` false: the backend enters the cgroup itself between fork and exec.
        """
        prefix: list[str] = []
        if self.cgroup is not None:
            self.cgroup.create(
                memory_bytes=self.limits.memory_bytes if "memory" in self.plan.mechanisms
                and self.plan.mechanisms["memory"] == "cgroup" else None,
                processes=self.limits.processes if self.plan.mechanisms.get("processes") == "cgroup" else None,
                cpu_percent=self.limits.cpu_percent if self.plan.mechanisms.get("cpuPercent") == "cgroup" else None,
            )
            if trampoline:
                prefix += ["/bin/sh", "-c", CGROUP_TRAMPOLINE, "zsb-enter-cgroup", *self.cgroup.procs_files(), "--"]
        prlimit = _prlimit()
        if self.plan.rlimit_options and prlimit:
            prefix += [prlimit, *self.plan.rlimit_options, "--"]
        return prefix

    def release(self) -> None:
        """Remove the run's cgroup (it may take the kernel a moment to let go of it)."""
        if self.cgroup is not None:
            self.cgroup.remove()

    def procs_files(self) -> list[str]:
        return self.cgroup.procs_files() if self.cgroup is not None else []

    def sample(self) -> dict[str, int | float | None] | None:
        return self.cgroup.sample() if self.cgroup is not None else None

    def finish(self, exit_code: int, stderr_tail: bytes) -> list[str]:
        """Evidence of limits hit. The cgroup is removed by ``release``, off the answer's path."""
        hit: list[str] = []
        if self.cgroup is not None:
            hit = self.cgroup.limits_hit()
        mechanisms = self.plan.mechanisms
        signal_number = -exit_code if exit_code < 0 else None
        if signal_number == 24 and "cpuSeconds" in mechanisms:  # SIGXCPU
            hit.append("cpu")
        if signal_number == 25:  # SIGXFSZ
            hit.append("file_size")
        if "cpuSeconds" in mechanisms and self.limits.cpu_seconds and b"CPU time limit exceeded" in stderr_tail:
            hit.append("cpu")
        # Without a kernel event, the words of the command (or of the shell that
        # ran it: "File size limit exceeded") are the evidence, exit status or not.
        text = stderr_tail.decode("utf-8", "replace")
        if text:
            if mechanisms.get("memory") == "rlimit_as" and self.limits.memory_bytes and _MEMORY_WORDS.search(text):
                hit.append("memory")
            if mechanisms.get("fileSizeBytes") == "rlimit" and self.limits.file_size_bytes and _FSIZE_WORDS.search(text):
                hit.append("file_size")
            if mechanisms.get("openFiles") == "rlimit" and self.limits.open_files and _NOFILE_WORDS.search(text):
                hit.append("open_files")
            if mechanisms.get("processes") == "rlimit" and self.limits.processes and _NPROC_WORDS.search(text):
                hit.append("processes")
        return list(dict.fromkeys(hit))


_MEMORY_WORDS = re.compile(r"MemoryError|Cannot allocate memory|memory exhausted|out of memory|bad_alloc", re.I)
_FSIZE_WORDS = re.compile(r"File too large|File size limit exceeded|EFBIG", re.I)
_NOFILE_WORDS = re.compile(r"Too many open files|EMFILE", re.I)
_NPROC_WORDS = re.compile(r"Resource temporarily unavailable|Cannot fork|can't fork|EAGAIN", re.I)
