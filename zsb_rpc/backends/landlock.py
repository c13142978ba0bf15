"""Linux fallback on Landlock (kernel >= 5.13) plus seccomp, for machines where bubblewrap cannot
create namespaces (Docker's default seccomp profile, Ubuntu 24.04's AppArmor policy).

Landlock only allows: a rule grants rights on a directory and everything
below it. So reads are granted on every entry of the filesystem except the
hidden ones, by walking from ``/`` down each hidden path and granting its
siblings; writes are granted on the writable roots and a private temporary
directory. The ruleset is built in the server (so a failing rule is an error
before anything runs) and handed to the child, which applies it between fork
and exec with ``no_new_privs``, a seccomp filter, and ``PR_SET_CHILD_SUBREAPER``.
That is a few system calls through ctypes in the forked child, not a Python
interpreter per run.

What this backend cannot give, each reported in the session's warnings and
asserted by the tests:

- no private /tmp: the host's /tmp is hidden and unwritable instead, and
  ``TMPDIR`` points to a private directory of the session;
- no PID namespace: the command sees other processes in /proc, but Landlock
  scopes signals and ptrace (ABI >= 6), so it cannot signal, trace or read
  ``/proc/<pid>/environ`` of anything outside its run;
- protected paths inside a writable root cannot be kept unwritable (a rule on
  the root covers them), so a session whose writable roots hold any fails
  closed unless ``protectDefaults`` is false;
- listing a directory on the way to a hidden path (``ls /``) is refused;
- with network ``none``, ``socket()`` is refused altogether: Landlock cannot
  tell a host daemon's socket file from one the command made, so only
  ``socketpair`` keeps working, and ``allowUnixSockets`` cannot be honoured;
- process trees: every run's first process is a child subreaper, so detached
  (``setsid``) descendants stay in its tree while it lives and are reparented
  to the server (also a subreaper) when it exits, where they are killed.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import struct
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from ..policy import ResolvedPolicy
from ..protocol.errors import InvalidParams
from .base import Availability, Backend, LaunchSpec, resolve_program

_SYS_CREATE_RULESET, _SYS_ADD_RULE, _SYS_RESTRICT_SELF = 444, 445, 446
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1

# Filesystem rights, by the ABI that introduced them.
EXECUTE, WRITE_FILE, READ_FILE, READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
REMOVE_DIR, REMOVE_FILE, MAKE_CHAR, MAKE_DIR, MAKE_REG = 1 << 4, 1 << 5, 1 << 6, 1 << 7, 1 << 8
MAKE_SOCK, MAKE_FIFO, MAKE_BLOCK, MAKE_SYM = 1 << 9, 1 << 10, 1 << 11, 1 << 12
REFER, TRUNCATE, IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
_FS_BY_ABI = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 5: (1 << 16) - 1}
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1

READ = EXECUTE | READ_FILE | READ_DIR
WRITE = WRITE_FILE | REMOVE_DIR | REMOVE_FILE | MAKE_DIR | MAKE_REG | MAKE_SOCK | MAKE_FIFO | MAKE_SYM | REFER | TRUNCATE

_PR_SET_NO_NEW_PRIVS, _PR_SET_CHILD_SUBREAPER, _PR_SET_SECCOMP = 38, 36, 22
_SECCOMP_MODE_FILTER = 2

#: Devices a command may read and write (ioctl included only where harmless).
_DEVICES_RW = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.prctl.restype = ctypes.c_int


def landlock_abi() -> int:
    version = _libc.syscall(_SYS_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(_CREATE_RULESET_VERSION))
    return int(version) if version > 0 else 0


def _fs_rights(abi: int) -> int:
    return _FS_BY_ABI[max(level for level in _FS_BY_ABI if level <= abi)]


# -- seccomp -------------------------------------------------------------

_ARCH = {
    "x86_64": (0xC000003E, {"socket": 41, "ioctl": 16, "unshare": 272, "clone": 56, "clone3": 435}),
    "aarch64": (0xC00000B7, {"socket": 198, "ioctl": 29, "unshare": 97, "clone": 220, "clone3": 435}),
}
_CLONE_NEWUSER = 0x10000000
_RET_ALLOW = 0x7FFF0000
_TIOCSTI, _TIOCLINUX = 0x5412, 0x541C


def _ret_errno(errno: int) -> int:
    return 0x00050000 | errno


def build_seccomp_filter(machine: str, *, deny_sockets: bool) -> bytes:
    """A classic BPF program: refuse TIOCSTI/TIOCLINUX and new user namespaces always, socket()
    when the network is off.

    Any other architecture (32-bit system calls on a 64-bit kernel, say) is
    refused outright, so the numbers checked here cannot be sidestepped.
    clone3 passes its flags in memory a filter cannot read, so it answers
    ENOSYS and the C library falls back to clone, whose flags it can.
    """
    arch, numbers = _ARCH[machine]
    LD_W_ABS, JEQ_K, JGE_K, JSET_K, RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
    program: list[tuple[int, int, int, int]] = []

    def emit(code: int, k: int, jt: int = 0, jf: int = 0) -> None:
        program.append((code, jt, jf, k))

    emit(LD_W_ABS, 4)                                 # seccomp_data.arch
    emit(JEQ_K, arch, 1, 0)
    emit(RET_K, _ret_errno(1))                        # another architecture: EPERM
    emit(LD_W_ABS, 0)                                 # seccomp_data.nr
    emit(JGE_K, 0x40000000, 0, 1)                     # x32 numbers share the architecture: refuse them
    emit(RET_K, _ret_errno(1))
    if deny_sockets:
        emit(JEQ_K, numbers["socket"], 0, 1)
        emit(RET_K, _ret_errno(13))                   # socket(): EACCES
    emit(JEQ_K, numbers["clone3"], 0, 1)
    emit(RET_K, _ret_errno(38))                       # clone3: ENOSYS, use clone
    emit(JEQ_K, numbers["unshare"], 1, 0)
    emit(JEQ_K, numbers["clone"], 0, 4)
    emit(LD_W_ABS, 16)                                # low word of args[0], the flags
    emit(JSET_K, _CLONE_NEWUSER, 0, 1)
    emit(RET_K, _ret_errno(1))                        # a new user namespace: EPERM
    emit(RET_K, _RET_ALLOW)
    emit(JEQ_K, numbers["ioctl"], 1, 0)
    emit(RET_K, _RET_ALLOW)
    emit(LD_W_ABS, 24)                                # low word of args[1], the request
    emit(JEQ_K, _TIOCSTI, 1, 0)
    emit(JEQ_K, _TIOCLINUX, 0, 1)
    emit(RET_K, _ret_errno(1))                        # terminal injection: EPERM
    emit(RET_K, _RET_ALLOW)
    return b"".join(struct.pack("=HBBI", *instruction) for instruction in program)


# -- rules -----------------------------------------------------------------


def readable_rules(hidden: Sequence[Path]) -> list[Path]:
    """Paths to grant reads on so that everything but ``hidden`` (and what lies below) is readable.

    Each ancestor of a hidden path gets no rule of its own (it would cover the
    hidden path); its other entries each get one.
    """
    hidden_set = {Path(p) for p in hidden}
    ancestors: set[Path] = set()
    for path in hidden_set:
        ancestors.update(path.parents)
    grants: list[Path] = []
    if not ancestors:
        return [Path("/")]
    for ancestor in sorted(ancestors, key=lambda p: (len(p.parts), str(p))):
        if any(ancestor == h or ancestor.is_relative_to(h) for h in hidden_set):
            continue
        try:
            names = sorted(os.listdir(ancestor))
        except OSError:
            continue
        for name in names:
            child = ancestor / name
            if child in ancestors or child in hidden_set:
                continue
            grants.append(child)
    return grants


@functools.cache
def _probe() -> Availability:
    if not sys.platform.startswith("linux"):
        return Availability(False, "Landlock is Linux only")
    machine = platform.machine()
    if machine not in _ARCH:
        return Availability(False, f"the landlock backend does not know the system calls of {machine}")
    abi = landlock_abi()
    if abi < 1:
        return Availability(False, "the kernel has no Landlock (it needs Linux >= 5.13 with landlock in the LSM list)")
    warnings = [f"landlock ABI {abi}"]
    if abi < 4:
        warnings.append("Landlock ABI < 4: TCP is refused by seccomp alone")
    if abi < 6:
        warnings.append("Landlock ABI < 6: signals and abstract Unix sockets are not scoped to the run")
    return Availability(True, None, tuple(warnings))


DIFFERENCES = (
    "landlock backend: no private /tmp (the host's /tmp is hidden and read-only; TMPDIR is private to the session)",
    "landlock backend: no PID namespace (other processes are visible in /proc, but cannot be signalled or traced)",
    "landlock backend: listing a directory on the way to a hidden path (ls /) is refused",
)
NETWORK_FULL_DIFFERENCE = (
    "landlock backend: with network full, host Unix sockets are reachable (Landlock cannot mask a socket file)"
)
NETWORK_NONE_DIFFERENCE = (
    "landlock backend: with network none, socket() is refused altogether (socketpair works; a Unix socket server "
    "in the workspace does not)"
)


class LandlockBackend(Backend):
    name = "landlock"
    isolated = True
    launch_needs_server = True
    needs_private_tmp = True

    def probe(self) -> Availability:
        return _probe()

    def check_cwd(self, policy: ResolvedPolicy, cwd: Path) -> str | None:
        for hidden in self._hidden(policy):
            if cwd == hidden or cwd.is_relative_to(hidden):
                return f"is hidden inside the sandbox (under {hidden})"
        return None

    def differences(self, policy: ResolvedPolicy) -> list[str]:
        found = list(DIFFERENCES)
        found.append(NETWORK_NONE_DIFFERENCE if policy.network == "none" else NETWORK_FULL_DIFFERENCE)
        return found

    def prepare(self, policy: ResolvedPolicy) -> list[Path]:
        protected = [path for path in policy.unwritable if any(path.is_relative_to(root) for root in policy.writable)]
        if protected or policy.placeholders:
            names = ", ".join(str(p) for p in (protected or [p.path for p in policy.placeholders])[:4])
            raise InvalidParams(
                "params.protectDefaults",
                f"the landlock backend cannot keep paths inside a writable directory unwritable ({names}); "
                "set protectDefaults to false (and drop denyWrite) to accept that, or use bubblewrap",
            )
        if policy.allow_unix_sockets and policy.network == "none":
            raise InvalidParams(
                "params.allowUnixSockets",
                "the landlock backend cannot open single host sockets: it refuses socket() altogether "
                "while network is none",
            )
        return []

    @staticmethod
    def _hidden(policy: ResolvedPolicy) -> list[Path]:
        hidden = list(policy.denied_read)
        tmp = Path("/tmp")
        if not any(root == tmp or tmp.is_relative_to(root) for root in policy.writable):
            hidden.append(tmp)  # not private here: hidden instead
        # What lies inside a hidden path but must stay reachable (a private
        # workspace under /tmp) gets its own rules; the walk keeps its parents
        # unlistable, not unreachable.
        return hidden

    def launch_spec(
        self, policy: ResolvedPolicy, argv: Sequence[str], cwd: Path, env: Mapping[str, str],
        *, writable_files: Sequence[str] = (), inline_environment: bool = False,
    ) -> LaunchSpec:
        private_tmp = policy.private_tmp
        abi = landlock_abi()
        handled_fs = _fs_rights(abi)
        handled_net = (NET_BIND_TCP | NET_CONNECT_TCP) if abi >= 4 and policy.network == "none" else 0
        scoped = SCOPE_SIGNAL if abi >= 6 else 0
        if abi >= 6 and policy.network == "none":
            scoped |= SCOPE_ABSTRACT_UNIX_SOCKET
        read_rights = READ & handled_fs
        write_rights = WRITE & handled_fs
        rules: list[tuple[Path, int]] = [(path, read_rights) for path in readable_rules(self._hidden(policy))]
        for root in policy.writable:
            rules.append((root, read_rights | write_rights))
        if private_tmp is not None:
            rules.append((private_tmp, read_rights | write_rights))
        for device in _DEVICES_RW:
            rules.append((Path(device), (READ_FILE | WRITE_FILE | (IOCTL_DEV if abi >= 5 else 0)) & handled_fs))
        ruleset = _make_ruleset(handled_fs, handled_net, scoped, abi, rules)
        seccomp = build_seccomp_filter(platform.machine(), deny_sockets=policy.network == "none")
        environment = dict(env)
        if private_tmp is not None:
            environment["TMPDIR"] = str(private_tmp)
        command = resolve_program(argv, environment)
        return LaunchSpec(
            argv=command, cwd=str(cwd), env=environment, isolated=True,
            preexec=functools.partial(_enter_sandbox, ruleset, seccomp, tuple(writable_files)), pass_fds=(ruleset,),
            close_after_spawn=(ruleset,), own_pid_namespace=False,
        )


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _make_ruleset(handled_fs: int, handled_net: int, scoped: int, abi: int, rules: list[tuple[Path, int]]) -> int:
    attr = _RulesetAttr(handled_fs, handled_net, scoped)
    size = 8 if abi < 4 else (16 if abi < 6 else 24)
    fd = _libc.syscall(_SYS_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if fd < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset failed")
    try:
        for path, rights in rules:
            try:
                target = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue  # gone since it was listed
            try:
                is_dir = os.path.isdir(f"/proc/self/fd/{target}")
                # Directory-only rights cannot be granted on a file.
                allowed = rights if is_dir else rights & (EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE | IOCTL_DEV)
                beneath = _PathBeneath(allowed, target)
                if _libc.syscall(_SYS_ADD_RULE, ctypes.c_int(fd), ctypes.c_int(_RULE_PATH_BENEATH),
                                 ctypes.byref(beneath), ctypes.c_uint32(0)) < 0:
                    error = ctypes.get_errno()
                    raise OSError(error, f"landlock_add_rule failed for {path}: {os.strerror(error)}")
            finally:
                os.close(target)
    except BaseException:
        os.close(fd)
        raise
    return fd


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


_PR_CAPBSET_DROP, _PR_SET_SECUREBITS, _PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 24, 28, 47, 4
#: NOROOT, NO_SETUID_FIXUP and KEEP_CAPS off, all locked: uid 0 gets no capabilities from execve.
_SECUREBITS = 0b101111
_CAPABILITY_VERSION_3 = 0x20080522


def _drop_capabilities() -> None:  # pragma: no cover - runs in the forked child
    """Root keeps every capability under Landlock unless told otherwise: give them all up, for good."""
    if os.geteuid() == 0:
        if _libc.prctl(_PR_SET_SECUREBITS, _SECUREBITS, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "PR_SET_SECUREBITS failed")
        for capability in range(64):
            if _libc.prctl(_PR_CAPBSET_DROP, capability, 0, 0, 0) != 0 and ctypes.get_errno() != 22:
                raise OSError(ctypes.get_errno(), "PR_CAPBSET_DROP failed")
    _libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    header = _CapHeader(_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    if _libc.capset(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capset failed")


def _enter_sandbox(ruleset: int, seccomp: bytes, cgroup_procs: tuple[str, ...]) -> None:  # pragma: no cover
    """Between fork and exec: the run's cgroups, no capabilities, no new privileges, subreaper,
    seccomp, then Landlock. The cgroups come first so the sandbox needs no right on cgroupfs."""
    for procs in cgroup_procs:
        fd = os.open(procs, os.O_WRONLY)
        try:
            os.write(fd, b"0")
        finally:
            os.close(fd)
    _drop_capabilities()
    if _libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS failed")
    if _libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "PR_SET_CHILD_SUBREAPER failed")
    buffer = ctypes.create_string_buffer(seccomp, len(seccomp))

    class _Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    program = _Program(len(seccomp) // 8, ctypes.cast(buffer, ctypes.c_void_p))
    if _libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(program), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "seccomp filter failed")
    if _libc.syscall(_SYS_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0)) != 0:
        raise OSError(ctypes.get_errno(), "landlock_restrict_self failed")
    os.close(ruleset)
