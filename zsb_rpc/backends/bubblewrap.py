"""Linux backend on bubblewrap: namespaces, bind mounts, no capabilities.

Protected paths hold because every one of them is a mount point: a mount
point cannot be renamed, removed or replaced (EBUSY), and neither can the
directories between it and its writable root, which are bound onto
themselves ("anchors") so that ``mv .git .git.old; mkdir -p .git/hooks``
fails at the first step. A protected path that does not exist yet has
nothing to mount on, so the session creates an empty placeholder for it
(removed at close if still empty); a placeholder that cannot be created
fails the session, rather than leaving the path unprotected.

Host Unix sockets: with ``network: "none"`` the sandbox has its own network
namespace, which already separates abstract sockets. A socket *file* is
reachable across namespaces, and a read-only mount does not stop connect(),
so every listening socket the host has (``/proc/net/unix`` of the server's
namespace, read afresh for each run) is covered with /dev/null, except those
the session allows. Why not seccomp: a filter sees connect()'s arguments but
cannot read the path behind the sockaddr pointer, so it could only forbid
AF_UNIX sockets outright, which breaks socketpair users and servers a command
starts in its own workspace; masking keeps both working. What it cannot
cover: a socket a host process creates after the run started.

``build_bwrap_argv`` is a pure function from policy to argv, tested by
comparing the whole argv. The order of bwrap options is the order bwrap
applies them, so every later mount lands on top of the earlier ones: the
read-only root first, then the writable roots, then what stays unwritable
inside them, then what stays unreadable (a denial beats a permission).
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import stat
import subprocess
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from ..policy import Placeholder, ResolvedPolicy, symlinked
from ..protocol.errors import InvalidParams
from .base import Availability, Backend, LaunchSpec

#: What every sandbox of this server carries in its argv (as its hostname).
SANDBOX_TAG_PREFIX = "zsb-"
SANDBOX_TAG = f"{SANDBOX_TAG_PREFIX}{os.getpid()}"


def kill_stale_sandboxes(is_stale: Callable[[int], bool]) -> list[int]:
    """Kill the bwrap processes whose server (the pid in their tag) is gone, with their trees."""
    from ..runner import kill_process_tree

    killed = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/cmdline", "rb") as handle:
                argv = handle.read().split(b"\0")
        except OSError:
            continue
        if not argv or not argv[0].endswith(b"bwrap") or b"--hostname" not in argv:
            continue
        tag = argv[argv.index(b"--hostname") + 1] if argv.index(b"--hostname") + 1 < len(argv) else b""
        pid_text = tag[len(SANDBOX_TAG_PREFIX):].decode(errors="replace")
        if tag.startswith(SANDBOX_TAG_PREFIX.encode()) and pid_text.isdigit() and is_stale(int(pid_text)):
            kill_process_tree(int(entry.name))
            killed.append(int(entry.name))
    return killed


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


def _depth(path: Path) -> int:
    return len(path.parts)


def anchors_for(policy: ResolvedPolicy, protected: Sequence[Path]) -> list[Path]:
    """Directories between each protected path and its writable root, to bind onto themselves."""
    found: set[Path] = set()
    for path in protected:
        roots = [root for root in policy.writable if path.is_relative_to(root) and path != root]
        if not roots:
            continue
        root = max(roots, key=_depth)
        parent = path.parent
        while parent != root and parent.is_relative_to(root):
            found.add(parent)
            parent = parent.parent
    return sorted(found, key=lambda p: (_depth(p), str(p)))


def host_unix_sockets(table: str = "/proc/net/unix") -> list[Path]:
    """Paths of the Unix sockets bound in the server's network namespace."""
    paths: list[Path] = []
    try:
        with open(table, encoding="utf-8", errors="surrogateescape") as handle:
            next(handle, None)
            for line in handle:
                fields = line.split(None, 7)
                # Abstract sockets show as "@name": the network namespace separates them.
                if len(fields) == 8 and fields[7].startswith("/"):
                    paths.append(Path(fields[7].rstrip("\n")))
    except OSError:
        pass
    return paths


def build_bwrap_argv(
    bwrap: str,
    policy: ResolvedPolicy,
    argv: Sequence[str],
    cwd: Path,
    *,
    disable_userns: bool = True,
    masked_sockets: Sequence[Path] = (),
    environment: Mapping[str, str] | None = None,
    environment_fd: int | None = None,
    exists: Callable[[Path], bool] = os.path.lexists,
    is_dir: Callable[[Path], bool] = os.path.isdir,
) -> list[str]:
    """The whole bwrap command line for one command. Pure apart from ``exists``/``is_dir``.

    Mount groups go in this order, each group parents first, because a later
    mount lands on top of an earlier one and a denial must beat a permission.
    """
    args = [bwrap, *_BASE_MOUNTS]
    for root in sorted(policy.writable, key=_depth):
        args += ["--bind", str(root), str(root)]
    unwritable = [path for path in policy.unwritable if exists(path)]
    hidden = [path for path in policy.denied_read if exists(path)]
    # Hidden paths are anchored as well: renaming a parent between runs would carry them
    # out from under their mask.
    for anchor in anchors_for(policy, [*unwritable, *hidden]):
        if exists(anchor):
            args += ["--bind", str(anchor), str(anchor)]
    for path in sorted(unwritable, key=_depth):
        args += ["--ro-bind", str(path), str(path)]
    for path in sorted((p for p in policy.denied_read if exists(p)), key=_depth):
        if is_dir(path):
            # An empty, read-only directory in its place.
            args += ["--tmpfs", str(path), "--remount-ro", str(path)]
        else:
            # Files and sockets alike: /dev/null cannot be read from or connected to.
            args += ["--ro-bind", "/dev/null", str(path)]
    for path in masked_sockets:
        args += ["--ro-bind", "/dev/null", str(path)]
    args += _BASE_ISOLATION
    # The sandbox's hostname names its server: a sandbox that outlives a server SIGKILLed while
    # it was starting (before bwrap armed --die-with-parent) is found by the next one.
    args += ["--hostname", SANDBOX_TAG]
    if disable_userns:
        # No nested user namespace: it would hand the command fresh capabilities
        # over mounts it creates.
        args.append("--disable-userns")
    if policy.network == "full":
        args.append("--share-net")
    if environment_fd is not None:
        # The command's environment, read by bwrap from a descriptor: never in the launcher's
        # own environment (where LD_PRELOAD would run code outside the sandbox), never in an
        # argv that every user can read in /proc.
        args += ["--args", str(environment_fd)]
    elif environment is not None:
        args += environment_arguments(environment)
    args += ["--chdir", str(cwd), "--", *argv]
    return args


def environment_arguments(environment: Mapping[str, str]) -> list[str]:
    """bwrap options that give the command exactly ``environment`` and nothing of the launcher's."""
    args = ["--clearenv"]
    for name, value in environment.items():
        args += ["--setenv", name, value]
    return args


#: The environment bubblewrap itself (and the launcher in front of it) runs with: fixed, so
#: that nothing a caller sets (LD_PRELOAD, LD_LIBRARY_PATH, GCONV_PATH) acts outside the sandbox.
LAUNCHER_ENVIRONMENT = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"}


def environment_descriptor(environment: Mapping[str, str]) -> int:
    """A sealed-off memfd holding ``--clearenv --setenv ...`` for ``bwrap --args``."""
    data = b"".join(os.fsencode(arg) + b"\0" for arg in environment_arguments(environment))
    fd = os.memfd_create("zsb-environment", os.MFD_CLOEXEC)
    try:
        os.write(fd, data) if len(data) < 1 << 20 else _write_all(fd, data)
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


#: Where daemons keep their sockets. Walked as well as /proc/net/unix, which lists only the
#: sockets bound in the server's own network namespace (rootless Docker binds its socket in
#: rootlesskit's).
SOCKET_DIRECTORIES = ("/run", "/var/run")
_SOCKET_WALK_ENTRIES = 20_000


#: directory -> (mtime, sockets in it, subdirectories): a directory whose mtime has not moved
#: has the same entries, so each run stats the tree instead of listing it.
_SOCKET_DIRECTORY_CACHE: dict[str, tuple[int, list[str], list[str]]] = {}


def socket_files(directories: Sequence[str]) -> list[Path]:
    """Socket files under ``directories`` (bounded, symlinks not followed)."""
    found: list[str] = []
    seen: set[tuple[int, int]] = set()
    visited = 0
    pending = list(directories)
    while pending and visited < _SOCKET_WALK_ENTRIES:
        directory = pending.pop()
        try:
            info = os.lstat(directory)
        except OSError:
            _SOCKET_DIRECTORY_CACHE.pop(directory, None)
            continue
        if not stat.S_ISDIR(info.st_mode) or (info.st_dev, info.st_ino) in seen:
            continue
        seen.add((info.st_dev, info.st_ino))
        cached = _SOCKET_DIRECTORY_CACHE.get(directory)
        if cached is None or cached[0] != info.st_mtime_ns:
            sockets, subdirectories = [], []
            try:
                with os.scandir(directory) as entries:
                    for entry in entries:
                        try:
                            mode = entry.stat(follow_symlinks=False).st_mode
                        except OSError:
                            continue
                        if stat.S_ISSOCK(mode):
                            sockets.append(entry.path)
                        elif stat.S_ISDIR(mode):
                            subdirectories.append(entry.path)
            except OSError:
                continue
            cached = (info.st_mtime_ns, sockets, subdirectories)
            _SOCKET_DIRECTORY_CACHE[directory] = cached
        visited += len(cached[1]) + len(cached[2])
        found.extend(cached[1])
        pending.extend(cached[2])
    return [Path(path) for path in found]


def sockets_to_mask(policy: ResolvedPolicy, candidates: Sequence[Path]) -> list[Path]:
    """Host sockets visible inside the sandbox that the session did not allow.

    With ``network: "full"`` the host's IP network is open, but a Unix socket is
    local IPC, not network (the D-Bus session bus alone runs host commands through
    systemd-run): those outside the writable roots stay masked there too.
    """
    masked = []
    for path in dict.fromkeys(candidates):
        if path in policy.allow_unix_sockets or not _visible(policy, path):
            continue
        if policy.network == "full" and any(path.is_relative_to(root) for root in policy.writable):
            continue
        try:
            if not stat.S_ISSOCK(path.lstat().st_mode):
                continue
        except OSError:
            continue  # stale entry: the file is gone
        masked.append(path)
    return masked


#: Placeholders this server made, and how many sessions rely on each: one session's close
#: must not remove what another still protects with.
_PLACEHOLDER_USERS: dict[Path, int] = {}


def claim_placeholders(policy: ResolvedPolicy) -> list[Path]:
    """Create the session's placeholders and count it among the users of every one it relies on."""
    create_placeholders([p for p in policy.placeholders if p.path not in _PLACEHOLDER_USERS])
    claimed = [p.path for p in policy.placeholders if os.path.lexists(p.path)]
    # Placeholders another session made show up here as existing paths: claim every one in
    # these roots (parents like .git included), so none goes while this session relies on it.
    claimed += [path for path in _PLACEHOLDER_USERS
                if path not in claimed and any(path.is_relative_to(root) for root in policy.writable)]
    for path in claimed:
        _PLACEHOLDER_USERS[path] = _PLACEHOLDER_USERS.get(path, 0) + 1
    return claimed


def release_placeholders(claimed: Sequence[Path]) -> None:
    unused = []
    for path in claimed:
        users = _PLACEHOLDER_USERS.get(path, 0) - 1
        if users <= 0:
            _PLACEHOLDER_USERS.pop(path, None)
            unused.append(path)
        else:
            _PLACEHOLDER_USERS[path] = users
    remove_placeholders(sorted(unused, key=_depth))


def ensure_placeholders(placeholders: Sequence[Placeholder]) -> None:
    """Before each run: a placeholder a host process removed since is made again."""
    missing = [p for p in placeholders if not os.path.lexists(p.path)]
    if missing:
        create_placeholders(missing)


def create_placeholders(placeholders: Sequence[Placeholder]) -> list[Path]:
    """Create each missing protected path empty; on failure undo and fail the session, naming it."""
    created: list[Path] = []
    for placeholder in placeholders:
        path = placeholder.path
        try:
            if placeholder.kind == "dir":
                path.mkdir(mode=0o755)
            else:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
                os.close(fd)
        except FileExistsError:
            continue
        except OSError as error:
            if isinstance(error, PermissionError) and os.geteuid() != 0:
                # We cannot create it, and the command runs as us without
                # capabilities: it cannot create it either.
                continue
            remove_placeholders(created)
            raise InvalidParams(
                "params.workspace",
                f"cannot protect {path}, which does not exist: {error.strerror}; create it, or set protectDefaults to false",
            ) from None
        created.append(path)
    return created


def remove_placeholders(created: Sequence[Path]) -> None:
    """Remove placeholders that are still empty; anything a host process filled in stays."""
    for path in reversed(created):
        with contextlib.suppress(OSError):
            info = path.lstat()
            if stat.S_ISDIR(info.st_mode):
                path.rmdir()
            elif stat.S_ISREG(info.st_mode) and info.st_size == 0:
                path.unlink()


def _visible(policy: ResolvedPolicy, path: Path) -> bool:
    """Whether ``path`` exists inside the sandbox the same as on the host."""
    if any(path == denied or path.is_relative_to(denied) for denied in policy.denied_read):
        return False
    if path == Path("/tmp") or path.is_relative_to("/tmp"):
        return any(path == root or path.is_relative_to(root) for root in policy.writable)
    return True


class BubblewrapBackend(Backend):
    name = "bubblewrap"
    isolated = True
    folds_signals = True

    def probe(self) -> Availability:
        return probe_bwrap()[0]

    def check_cwd(self, policy: ResolvedPolicy, cwd: Path) -> str | None:
        if not _visible(policy, cwd):
            return "is not visible inside the sandbox (/tmp is private there, and denied paths are hidden)"
        return None

    def prepare(self, policy: ResolvedPolicy) -> list[Path]:
        links = symlinked(p for p in policy.unwritable if any(p.is_relative_to(r) for r in policy.writable))
        if links:
            # A mount over a symbolic link lands on its target: the link itself could be
            # removed and replaced. Fail closed rather than protect the wrong file.
            raise InvalidParams(
                "params.protectDefaults",
                f"cannot keep {links[0]} unwritable: it is a symbolic link (to {os.readlink(links[0])}); "
                "replace it with what it points to, or set protectDefaults to false",
            )
        return claim_placeholders(policy)

    def release(self, created: list[Path]) -> None:
        release_placeholders(created)

    def launch_spec(
        self, policy: ResolvedPolicy, argv: Sequence[str], cwd: Path, env: Mapping[str, str],
        *, writable_files: Sequence[str] = (), inline_environment: bool = False,
    ) -> LaunchSpec:
        availability, bwrap, disable_userns = probe_bwrap()
        assert bwrap is not None and availability.available
        environment = dict(env)
        # The host's TMPDIR may point into the host /tmp, which is private here.
        if "TMPDIR" in environment and not _visible(policy, Path(environment["TMPDIR"])):
            environment["TMPDIR"] = "/tmp"
        ensure_placeholders(policy.placeholders)
        masked = sockets_to_mask(policy, [*host_unix_sockets(), *socket_files(SOCKET_DIRECTORIES)])
        if inline_environment:
            # wrap: the caller spawns it, with the environment it chooses for bwrap.
            return LaunchSpec(
                argv=build_bwrap_argv(bwrap, policy, argv, cwd, disable_userns=disable_userns,
                                      masked_sockets=masked, environment=environment),
                cwd=str(cwd), env=dict(LAUNCHER_ENVIRONMENT), isolated=True,
            )
        fd = environment_descriptor(environment)
        try:
            spec_argv = build_bwrap_argv(bwrap, policy, argv, cwd, disable_userns=disable_userns,
                                         masked_sockets=masked, environment_fd=fd)
        except BaseException:
            os.close(fd)
            raise
        return LaunchSpec(argv=spec_argv, cwd=str(cwd), env=dict(LAUNCHER_ENVIRONMENT), isolated=True,
                          pass_fds=(fd,), close_after_spawn=(fd,))
