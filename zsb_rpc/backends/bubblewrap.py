"""Linux backend on bubblewrap: namespaces, bind mounts, no capabilities.

``build_bwrap_argv`` is a pure function from policy to argv, tested by
comparing the whole argv. The order of bwrap options is the order bwrap
applies them, so every later mount lands on top of the earlier ones: the
read-only root first, then the writable roots, then what stays unwritable
inside them, then what stays unreadable (a denial beats a permission).
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from ..policy import ResolvedPolicy
from .base import Availability, LaunchSpec

#: Distribution security profiles (AppArmor on Ubuntu 24.04) cover this path,
#: not a copy found elsewhere on PATH.
PREFERRED_BWRAP = "/usr/bin/bwrap"

_INSTALL_HINT = "install bubblewrap (apt-get install bubblewrap, dnf install bubblewrap)"


def find_bwrap() -> tuple[str | None, list[str]]:
    if os.access(PREFERRED_BWRAP, os.X_OK):
        return PREFERRED_BWRAP, []
    found = shutil.which("bwrap")
    if found:
        return os.path.realpath(found), [
            f"using {found}: {PREFERRED_BWRAP} is missing, and security profiles usually cover only that path"
        ]
    return None, []


def _version(bwrap: str) -> tuple[int, ...]:
    try:
        out = subprocess.run([bwrap, "--version"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    match = re.search(r"(\d+)\.(\d+)\.(\d+)", out)
    return tuple(int(part) for part in match.groups()) if match else ()


def classify_failure(stderr: str) -> str:
    """Turn what bwrap printed into what to change."""
    text = stderr.strip()
    if "setting up uid map" in text or "Failed RTM_NEWADDR" in text or "loopback: Failed" in text:
        return (
            f"bubblewrap cannot create user namespaces ({text}); on Ubuntu 24.04 AppArmor blocks them for "
            "unprofiled programs: set kernel.apparmor_restrict_unprivileged_userns=0 or add an AppArmor "
            "profile for /usr/bin/bwrap"
        )
    if "No permissions to creating new namespace" in text or "Operation not permitted" in text and "namespace" in text:
        return (
            f"bubblewrap cannot create namespaces ({text}): enable unprivileged user namespaces "
            "(sysctl kernel.unprivileged_userns_clone=1, user.max_user_namespaces > 0) or, in a container, "
            "run it with a seccomp profile that allows them"
        )
    if "Can't mount proc" in text:
        return f"bubblewrap cannot mount /proc ({text}): in a container, /proc is masked; run with a less restricted /proc"
    if "No space left on device" in text:
        return f"bubblewrap cannot create a namespace ({text}): raise user.max_user_namespaces"
    return f"bubblewrap failed to start a sandbox: {text or 'no message'}"


@functools.cache
def probe_bwrap() -> tuple[Availability, str | None, bool]:
    """Probe once per server: (availability, bwrap path, whether --disable-userns works)."""
    bwrap, warnings = find_bwrap()
    if bwrap is None:
        return Availability(False, f"bubblewrap is not installed: {_INSTALL_HINT}"), None, False
    disable_userns = _version(bwrap) >= (0, 8, 0)
    argv = [bwrap, *_BASE_MOUNTS, *_BASE_ISOLATION, *(["--disable-userns"] if disable_userns else []), "--", "/bin/true"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=10, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError) as error:
        return Availability(False, f"bubblewrap could not be run: {error}"), bwrap, disable_userns
    if done.returncode != 0:
        return Availability(False, classify_failure(done.stderr)), bwrap, disable_userns
    if not disable_userns:
        warnings.append("bubblewrap is older than 0.8.0: nested user namespaces are not blocked (--disable-userns)")
    return Availability(True, None, tuple(warnings)), bwrap, disable_userns


# Mounts every sandbox starts from, in the order bwrap applies them.
_BASE_MOUNTS: tuple[str, ...] = (
    # Read the machine, write nothing.
    "--ro-bind", "/", "/",
    # A fresh /dev (null, zero, random, tty, pts, shm) and no host devices.
    "--dev", "/dev",
    # /proc of the new PID namespace: the command sees only its own processes.
    "--proc", "/proc",
    # Private temporary space, gone with the sandbox.
    "--tmpfs", "/tmp",
)

# Namespaces and privileges every sandbox gets.
_BASE_ISOLATION: tuple[str, ...] = (
    # New user, PID, IPC, UTS, network and cgroup namespaces.
    "--unshare-all",
    # Explicit, so that root too gets a user namespace of its own: capabilities
    # held there do not reach the host, and --disable-userns needs it.
    "--unshare-user",
    # No capabilities inside, even for root (bwrap keeps them for root otherwise).
    "--cap-drop", "ALL",
    # The sandbox dies with the server, even when the server is SIGKILLed.
    "--die-with-parent",
    # A new session: no controlling terminal, so TIOCSTI cannot reach the parent's.
    "--new-session",
)


def build_bwrap_argv(
    bwrap: str,
    policy: ResolvedPolicy,
    argv: Sequence[str],
    cwd: Path,
    *,
    disable_userns: bool = True,
    exists: Callable[[Path], bool] = os.path.lexists,
    is_dir: Callable[[Path], bool] = os.path.isdir,
) -> list[str]:
    """The whole bwrap command line for one command. Pure apart from ``exists``/``is_dir``."""
    args = [bwrap, *_BASE_MOUNTS]
    for root in policy.writable:
        args += ["--bind", str(root), str(root)]
    for path in policy.unwritable:
        # A missing path has nothing to bind; creating a placeholder would
        # leave debris in the caller's directory.
        if exists(path):
            args += ["--ro-bind", str(path), str(path)]
    for path in policy.denied_read:
        if not exists(path):
            continue
        if is_dir(path):
            # An empty, read-only directory in its place.
            args += ["--tmpfs", str(path), "--remount-ro", str(path)]
        else:
            # Files and sockets alike: /dev/null cannot be read from or connected to.
            args += ["--ro-bind", "/dev/null", str(path)]
    args += _BASE_ISOLATION
    if disable_userns:
        # No nested user namespace: it would hand the command fresh capabilities
        # over mounts it creates.
        args.append("--disable-userns")
    if policy.network == "full":
        args.append("--share-net")
    args += ["--chdir", str(cwd), "--", *argv]
    return args


def _visible(policy: ResolvedPolicy, path: Path) -> bool:
    """Whether ``path`` exists inside the sandbox the same as on the host."""
    if any(path == denied or path.is_relative_to(denied) for denied in policy.denied_read):
        return False
    if path == Path("/tmp") or path.is_relative_to("/tmp"):
        return any(path == root or path.is_relative_to(root) for root in policy.writable)
    return True


class BubblewrapBackend:
    name = "bubblewrap"
    isolated = True

    def probe(self) -> Availability:
        return probe_bwrap()[0]

    def check_cwd(self, policy: ResolvedPolicy, cwd: Path) -> str | None:
        if not _visible(policy, cwd):
            return "is not visible inside the sandbox (/tmp is private there, and denied paths are hidden)"
        return None

    def launch_spec(
        self, policy: ResolvedPolicy, argv: Sequence[str], cwd: Path, env: Mapping[str, str]
    ) -> LaunchSpec:
        availability, bwrap, disable_userns = probe_bwrap()
        assert bwrap is not None and availability.available
        environment = dict(env)
        # The host's TMPDIR may point into the host /tmp, which is private here.
        if "TMPDIR" in environment and not _visible(policy, Path(environment["TMPDIR"])):
            environment["TMPDIR"] = "/tmp"
        return LaunchSpec(
            argv=build_bwrap_argv(bwrap, policy, argv, cwd, disable_userns=disable_userns),
            cwd=str(cwd),
            env=environment,
            isolated=True,
        )
