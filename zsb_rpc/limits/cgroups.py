"""cgroups, v2 and v1, as the kernel really has them: one cgroup per run, removed after.

Discovery reads /proc/self/mounts and /proc/self/cgroup and creates nothing.
A run's cgroup is created under the server's own cgroup (so that whatever
limits its container already has still apply), in a directory of this
server (``zsb-rpc-<pid>-<token>``, which a later server can recognise as
stale), and the launcher enters it before it execs anything, so no process
of the run ever runs outside it.

v1 (memory, pids, cpu, cpuacct mounted as separate hierarchies, as on this
machine) allows a cgroup with processes to have children. v2 does not: it
needs a delegated subtree where the server's own cgroup lists the
controllers in ``cgroup.subtree_control``, or a cgroup with no processes of
its own; where that is not the case, v2 is reported unusable with the reason.
"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

V1_CONTROLLERS = ("memory", "pids", "cpu", "cpuacct")
V2_CONTROLLERS = ("memory", "pids", "cpu")
SERVER_PREFIX = "zsb-rpc-"


@dataclass(frozen=True)
class CgroupSupport:
    """Which controllers this server can use, in which version, and why not the others."""

    version: int | None
    # controller -> the server's own cgroup directory in that controller's hierarchy
    directories: dict[str, Path] = field(default_factory=dict)
    reasons: tuple[str, ...] = ()

    def has(self, controller: str) -> bool:
        return controller in self.directories


def _mounts() -> list[tuple[str, str, set[str]]]:
    found = []
    with contextlib.suppress(OSError), open("/proc/self/mounts") as handle:
        for line in handle:
            parts = line.split()
            if len(parts) >= 4 and parts[2] in ("cgroup", "cgroup2"):
                found.append((parts[2], parts[1].replace("\\040", " "), set(parts[3].split(","))))
    return found


def _own_cgroups() -> dict[str, str]:
    """controller (or "" for v2) -> the server's cgroup path inside that hierarchy."""
    own: dict[str, str] = {}
    with contextlib.suppress(OSError), open("/proc/self/cgroup") as handle:
        for line in handle:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for controller in controllers.split(",") if controllers else [""]:
                own[controller] = path
    return own


def _writable_dir(path: Path) -> bool:
    return path.is_dir() and os.access(path, os.W_OK | os.X_OK)


def _probe_v2(mount: Path, own: str) -> tuple[dict[str, Path], str | None]:
    base = mount / own.lstrip("/")
    try:
        available = set((base / "cgroup.controllers").read_text().split())
    except OSError as error:
        return {}, f"cgroup v2 at {base} cannot be read: {error.strerror}"
    wanted = [c for c in V2_CONTROLLERS if c in available]
    if not wanted:
        return {}, f"cgroup v2 at {base} offers none of {', '.join(V2_CONTROLLERS)} (they may be bound to v1)"
    if not _writable_dir(base):
        return {}, f"cgroup v2 at {base} is not writable by this user (it needs a delegated subtree)"
    enabled = set((base / "cgroup.subtree_control").read_text().split())
    if not set(wanted) <= enabled:
        try:
            has_processes = bool((base / "cgroup.procs").read_text().strip())
        except OSError:
            has_processes = True
        if has_processes and own != "/":
            return {}, (
                f"cgroup v2 at {base} holds processes and does not delegate {', '.join(sorted(set(wanted) - enabled))} "
                "to its children; run the server in a delegated cgroup (systemd Delegate=yes)"
            )
    return {c: base for c in wanted}, None


@functools.cache
def probe_cgroups() -> CgroupSupport:
    """What this server could use, without creating anything. v2 first where it has controllers."""
    own = _own_cgroups()
    reasons: list[str] = []
    mounts = _mounts()
    for kind, mountpoint, _ in mounts:
        if kind == "cgroup2" and "" in own:
            found_v2, reason = _probe_v2(Path(mountpoint), own[""])
            if found_v2:
                return CgroupSupport(2, found_v2)
            if reason:
                reasons.append(reason)
    directories: dict[str, Path] = {}
    for kind, mountpoint, options in mounts:
        if kind != "cgroup":
            continue
        for controller in V1_CONTROLLERS:
            if controller in options and controller in own and controller not in directories:
                base = Path(mountpoint) / own[controller].lstrip("/")
                if _writable_dir(base):
                    directories[controller] = base
                else:
                    reasons.append(f"cgroup v1 {controller} at {base} is not writable by this user")
    if directories:
        return CgroupSupport(1, directories, tuple(reasons))
    if not mounts:
        reasons.append("no cgroup filesystem is mounted")
    return CgroupSupport(None, {}, tuple(reasons))


class CgroupRun:
    """The cgroups of one run: created, limited, entered by the launcher, read, removed."""

    def __init__(self, support: CgroupSupport, server_dir: str, controllers: list[str]) -> None:
        self.version = support.version
        name = f"run-{secrets.token_hex(6)}"
        self.paths: dict[str, Path] = {}
        for controller in controllers:
            self.paths[controller] = support.directories[controller] / server_dir / name

    def create(self, *, memory_bytes: int | None, processes: int | None, cpu_percent: int | None) -> None:
        try:
            for path in self.paths.values():
                if path.exists():
                    continue
                parent = path.parent
                if not parent.exists():
                    parent.mkdir()
                    if self.version == 2:
                        enable = " ".join(f"+{c}" for c in V2_CONTROLLERS if c in self.paths)
                        _write(parent / "cgroup.subtree_control", enable)
                path.mkdir()
            if memory_bytes is not None:
                if self.version == 2:
                    _write(self.paths["memory"] / "memory.max", str(memory_bytes))
                    # No swap beyond the limit either, where swap accounting exists.
                    with contextlib.suppress(OSError):
                        _write(self.paths["memory"] / "memory.swap.max", "0")
                else:
                    _write(self.paths["memory"] / "memory.limit_in_bytes", str(memory_bytes))
                    with contextlib.suppress(OSError):
                        _write(self.paths["memory"] / "memory.memsw.limit_in_bytes", str(memory_bytes))
            if processes is not None:
                _write(self.paths["pids"] / "pids.max", str(processes))
            if cpu_percent is not None:
                period = 100_000
                quota = max(1000, cpu_percent * period // 100)
                if self.version == 2:
                    _write(self.paths["cpu"] / "cpu.max", f"{quota} {period}")
                else:
                    _write(self.paths["cpu"] / "cpu.cfs_period_us", str(period))
                    _write(self.paths["cpu"] / "cpu.cfs_quota_us", str(quota))
        except OSError:
            self.remove()
            raise

    def procs_files(self) -> list[str]:
        # In v2 one cgroup holds every controller; in v1 each hierarchy needs the process.
        unique = dict.fromkeys(self.paths.values())
        return [str(path / "cgroup.procs") for path in unique]

    def sample(self) -> dict[str, int | float | None]:
        memory = peak = cpu = processes = None
        if "memory" in self.paths:
            base = self.paths["memory"]
            if self.version == 2:
                memory = _read_int(base / "memory.current")
                peak = _read_int(base / "memory.peak")
            else:
                memory = _read_int(base / "memory.usage_in_bytes")
                peak = _read_int(base / "memory.max_usage_in_bytes")
        if self.version == 2 and "cpu" in self.paths:
            usage = _read_keyed(self.paths["cpu"] / "cpu.stat").get("usage_usec")
            cpu = usage / 1e6 if usage is not None else None
        elif "cpuacct" in self.paths:
            usage = _read_int(self.paths["cpuacct"] / "cpuacct.usage")
            cpu = usage / 1e9 if usage is not None else None
        if "pids" in self.paths:
            processes = _read_int(self.paths["pids"] / "pids.current")
        return {"memory": memory, "peak": peak, "cpu": cpu, "processes": processes}

    def limits_hit(self) -> list[str]:
        hit = []
        if "memory" in self.paths:
            if self.version == 2:
                events = _read_keyed(self.paths["memory"] / "memory.events")
            else:
                events = _read_keyed(self.paths["memory"] / "memory.oom_control")
            if events.get("oom_kill", 0) > 0:
                hit.append("memory")
        if "pids" in self.paths and _read_keyed(self.paths["pids"] / "pids.events").get("max", 0) > 0:
            hit.append("processes")
        return hit

    def remove(self) -> None:
        for path in dict.fromkeys(self.paths.values()):
            remove_cgroup(path)


def remove_cgroup(path: Path) -> None:
    """rmdir a cgroup once its processes are gone (they may take a moment to be reaped)."""
    import time

    for _ in range(50):
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            # Processes that still exist are killed; an empty cgroup then goes.
            with contextlib.suppress(OSError):
                for pid in (path / "cgroup.procs").read_text().split():
                    # Never the server or its parent, whatever a command wrote into the file.
                    if int(pid) in (os.getpid(), os.getppid()):
                        continue
                    with contextlib.suppress(OSError):
                        os.kill(int(pid), 9)
            time.sleep(0.01)


def remove_server_cgroups(support: CgroupSupport, server_dir: str) -> None:
    for base in dict.fromkeys(support.directories.values()):
        directory = base / server_dir
        if directory.is_dir():
            for child in directory.iterdir():
                if child.is_dir():
                    remove_cgroup(child)
            remove_cgroup(directory)


def _write(path: Path, value: str) -> None:
    with open(path, "w") as handle:
        handle.write(value)


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
        return None if text == "max" else int(text)
    except (OSError, ValueError):
        return None


def _read_keyed(path: Path) -> dict[str, int]:
    values: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            key, _, value = line.partition(" ")
            with contextlib.suppress(ValueError):
                values[key] = int(value)
    return values


def server_cgroup_name() -> str:
    return f"{SERVER_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"


def remove_stale_cgroups(is_stale: Callable[[str], bool]) -> list[Path]:
    """Remove the cgroup directories of servers that died (their names carry their pid)."""
    removed = []
    support = probe_cgroups()
    for base in dict.fromkeys(support.directories.values()):
        with contextlib.suppress(OSError):
            for child in base.iterdir():
                if child.is_dir() and is_stale(child.name):
                    remove_server_cgroups(support, child.name)
                    removed.append(child)
    return removed
