"""macOS backend on Seatbelt, through ``/usr/bin/sandbox-exec``.

The profile is the closed-by-default base in ``seatbelt_base.sb`` (a data
file next to this module, every rule there commented with why it exists)
followed by the session's rules, which ``build_seatbelt_profile`` generates:
writable roots, the user's temporary directory, network, then the denials.
When several rules match an operation the last one decides, so every denial
comes after every allowance: a denial beats a permission, as on Linux.

Paths never enter the profile text. Each one is a ``-D NAME=value``
parameter (``WRITABLE_0``, ``DENY_WRITE_1``, ``DENY_READ_0``...) that the
profile reads with ``(param "NAME")``, so quotes, spaces, parentheses or a
newline in a path can only change the value of a parameter, never what a rule
says; for a given shape of policy the profile text is the same whatever the
paths are. ``sandbox-exec`` splits each ``-D`` argument at its first ``=``,
and names never contain one.

Command line: ``sandbox-exec [-f file] [-n name] [-p profile] [-D key=value
...] command [arguments ...]``. Its options are parsed with getopt(3), which
ends them at ``--`` and consumes it, so ``build_seatbelt_argv`` always puts
``--`` before the command: a program whose name starts with ``-`` is never
taken for an option. The probe runs its first check through ``--`` too. The
program is always ``/usr/bin/sandbox-exec``, never one found on PATH: a copy
elsewhere could be anything, and one in /usr/bin can only be replaced by root.

Seatbelt rules match paths as the kernel names them (``/private/tmp``, not
``/tmp``; ``/private/var/folders``, not ``/var/folders``). The policy
resolves writable roots through symbolic links and denied paths as far as
they exist, which is what this needs; the temporary directory is resolved
here.

Protected paths that do not exist yet need no placeholder here: a rule can
name a missing path, so each unwritable path is denied as a ``literal`` (the
path itself, whatever it will be) and as a ``subpath`` (everything below
it), and a command cannot create it. So ``prepare`` creates nothing.
Moving a protected path's parent away would carry the path out from under
its rule (``mv .git .git.old``, write the hooks, move it back), so every
writable directory that leads to an unwritable or unreadable path is an
anchor: it cannot be removed, renamed, or created by renaming another
directory into its place (``file-write-unlink``, ``file-write-create``);
what it contains stays writable, and so do its times and modes.

Nesting: a process that already runs inside a Seatbelt sandbox cannot apply
another one (``sandbox-exec: sandbox_apply: Operation not permitted``, the
kernel logs ``forbidden-sandbox-reinit``). The probe detects that, and says
that the server has to start outside any sandbox.

What is not covered:

- Detached processes. There is no PID namespace and no subreaper on macOS.
  The runner starts every command in a process group of its own and kills
  that group and the descendants it can still find when the run ends; a
  process that started a session of its own (``setsid``) and whose parent
  has already exited is no longer connected to the run in any way, and keeps
  running after the run and after the session closes.
- Hard links. A hard link made inside a writable root to an existing
  protected file is a second name for the same file, and Seatbelt judges a
  write by the name it is made through. Whether it checks the source of
  link(2) against the denials has not been verified.
- Other processes of the user are visible (``ps``: the process table is a
  kernel parameter, read through sysctl), though they cannot be signalled.
- /tmp is the host's /tmp, shared and writable, not a private one.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
import platform
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from importlib import resources
from pathlib import Path

from ..policy import ResolvedPolicy
from ..protocol.types import Limits
from .base import Availability, Backend, LaunchSpec, resolve_program

#: Only this one: a copy found on PATH could be anything.
SANDBOX_EXEC = "/usr/bin/sandbox-exec"
BASE_PROFILE_FILE = "seatbelt_base.sb"
#: A profile that allows everything: if even this cannot be applied, nothing can.
TRIVIAL_PROFILE = "(version 1)(allow default)"
_TRUE = "/usr/bin/true"

#: The shared temporary directory, writable in the base profile.
SYSTEM_TEMP = Path("/private/tmp")
#: Where macOS keeps each user's temporary directory ($TMPDIR).
USER_TEMP_ROOT = Path("/private/var/folders")
#: confstr(3) name of the user's temporary directory (_CS_DARWIN_USER_TEMP_DIR).
_CS_DARWIN_USER_TEMP_DIR = 65537


@functools.cache
def base_profile() -> str:
    """The closed-by-default base profile, as shipped next to this module."""
    package = __name__.rpartition(".")[0]
    return resources.files(package).joinpath(BASE_PROFILE_FILE).read_text(encoding="utf-8")


# The session's rules. Each template names its parameter as {p}; nothing else
# is ever substituted into the profile.

_SESSION_HEADER = ";; --- Session rules (zsb_rpc/backends/seatbelt.py) --------------------------"

_WRITABLE_COMMENT = ";; Writable roots of the session, the workspace first."
_WRITABLE_RULE = "(allow file-write* (subpath {p}))"

_WRITABLE_FILE_COMMENT = ";; Files the launcher writes before it starts the command."
_WRITABLE_FILE_RULE = "(allow file-write-data (literal {p}))"

_TMPDIR_COMMENT = ";; The user's temporary directory ($TMPDIR), where macOS tools put temporary files."
_TMPDIR_RULE = "(allow file-write* (subpath {p}))"

_NETWORK_NONE = (
    ";; Network: none. No rule allows any network operation, so (deny default)\n"
    ";; refuses every connection and listener, Unix sockets included."
)
_NETWORK_SOCKETS_COMMENT = (
    ";; Network: none, except the Unix sockets the session allows (allowUnixSockets),\n"
    ";; by exact path: the command may create a Unix socket and connect to those.\n"
    ";; No other connection, and no listener."
)
_NETWORK_SOCKETS_CREATE = "(allow system-socket (socket-domain AF_UNIX))"
_NETWORK_SOCKET_RULE = "(allow network-outbound (remote unix-socket (path-literal {p})))"
_NETWORK_FULL = (
    ";; Network: full. Every connection and listener, local services and the Unix\n"
    ";; sockets of host daemons included (except the unreadable paths, below).\n"
    "(allow network-outbound)\n"
    "(allow network-inbound)\n"
    "(allow network-bind)\n"
    "(allow system-socket)\n"
    ";; Name resolution, proxy settings and certificate trust, which the system's\n"
    ";; network and TLS libraries ask these daemons for. Not the keychain.\n"
    "(allow mach-lookup\n"
    '  (global-name "com.apple.SystemConfiguration.configd")\n'
    '  (global-name "com.apple.SystemConfiguration.DNSConfiguration")\n'
    '  (global-name "com.apple.networkd")\n'
    '  (global-name "com.apple.trustd")\n'
    '  (global-name "com.apple.trustd.agent")\n'
    '  (global-name "com.apple.ocspd"))'
)

_DENY_WRITE_COMMENT = (
    ";; Unwritable, also inside the writable roots (denyWrite, protected files):\n"
    ";; the path itself and everything below it, existing or not, so that a\n"
    ";; missing one cannot be created either."
)
_DENY_WRITE_RULE = "(deny file-write* (literal {p}) (subpath {p}))"

_ANCHOR_COMMENT = (
    ";; Writable directories on the way to an unwritable or unreadable path: they\n"
    ";; cannot be removed, renamed away, or made by renaming another directory into\n"
    ";; their place, which would move the path out from under its rule. What they\n"
    ";; contain stays writable."
)
_ANCHOR_RULE = "(deny file-write-unlink file-write-create (literal {p}))"

_DENY_READ_COMMENT = (
    ";; Unreadable (denyRead, credentials, container sockets): not read, written,\n"
    ";; removed or created, and no connection to a socket there, whatever the\n"
    ";; network rules above allow."
)
_DENY_READ_RULES = (
    "(deny file-read* file-write* (literal {p}) (subpath {p}))",
    "(deny network-outbound (remote unix-socket (subpath {p})))",
)


def _depth(path: Path) -> int:
    return len(path.parts)


def _within(path: Path, roots: Iterable[Path]) -> bool:
    return any(path == root or path.is_relative_to(root) for root in roots)


def anchors_for(paths: Sequence[Path], writable_areas: Sequence[Path]) -> list[Path]:
    """The writable directories above ``paths``: renaming one would carry a path away from its rule."""
    found: set[Path] = set()
    for path in paths:
        for parent in path.parents:
            if parent != Path(parent.anchor) and _within(parent, writable_areas):
                found.add(parent)
    # A directory that is itself denied, or lies below a denied path, is covered already.
    kept = [anchor for anchor in found if not _within(anchor, paths)]
    return sorted(kept, key=lambda p: (_depth(p), str(p)))


def build_seatbelt_profile(
    policy: ResolvedPolicy, *, tmpdir: str | None = None, writable_files: Sequence[str] = ()
) -> tuple[str, dict[str, str]]:
    """The whole profile text and its ``-D`` parameters. Pure apart from reading the shipped base file.

    ``tmpdir`` is the user's temporary directory as the kernel names it
    (``user_temp_dir()``), made writable; None for none. ``writable_files``
    are single files the launcher writes (a cgroup's procs file).
    """
    params: dict[str, str] = {}

    def param(name: str, value: Path | str) -> str:
        params[name] = str(value)
        return f'(param "{name}")'

    lines = [base_profile().rstrip("\n"), "", _SESSION_HEADER, ""]

    lines.append(_WRITABLE_COMMENT)
    for index, root in enumerate(policy.writable):
        lines.append(_WRITABLE_RULE.format(p=param(f"WRITABLE_{index}", root)))
    if writable_files:
        lines += ["", _WRITABLE_FILE_COMMENT]
        for index, name in enumerate(writable_files):
            lines.append(_WRITABLE_FILE_RULE.format(p=param(f"WRITABLE_FILE_{index}", name)))

    areas = [*policy.writable, SYSTEM_TEMP]
    if tmpdir is not None and not _within(Path(tmpdir), areas):
        lines += ["", _TMPDIR_COMMENT, _TMPDIR_RULE.format(p=param("TMPDIR", tmpdir))]
        areas.append(Path(tmpdir))

    lines.append("")
    if policy.network == "full":
        lines.append(_NETWORK_FULL)
    elif policy.allow_unix_sockets:
        lines += [_NETWORK_SOCKETS_COMMENT, _NETWORK_SOCKETS_CREATE]
        for index, socket in enumerate(policy.allow_unix_sockets):
            lines.append(_NETWORK_SOCKET_RULE.format(p=param(f"UNIX_SOCKET_{index}", socket)))
    else:
        lines.append(_NETWORK_NONE)

    unwritable = list(policy.unwritable)
    if unwritable:
        lines += ["", _DENY_WRITE_COMMENT]
        for index, path in enumerate(unwritable):
            lines.append(_DENY_WRITE_RULE.format(p=param(f"DENY_WRITE_{index}", path)))

    anchors = anchors_for([*unwritable, *policy.denied_read], areas)
    if anchors:
        lines += ["", _ANCHOR_COMMENT]
        for index, anchor in enumerate(anchors):
            lines.append(_ANCHOR_RULE.format(p=param(f"ANCHOR_{index}", anchor)))

    if policy.denied_read:
        lines += ["", _DENY_READ_COMMENT]
        for index, path in enumerate(policy.denied_read):
            reference = param(f"DENY_READ_{index}", path)
            lines += [rule.format(p=reference) for rule in _DENY_READ_RULES]

    return "\n".join(lines) + "\n", params


def build_seatbelt_argv(
    policy: ResolvedPolicy,
    argv: Sequence[str],
    cwd: Path,
    *,
    tmpdir: str | None = None,
    writable_files: Sequence[str] = (),
) -> list[str]:
    """The whole sandbox-exec command line. ``cwd`` is not part of it: sandbox-exec has no such
    option, and the runner starts it there (the argument keeps the shape of ``build_bwrap_argv``)."""
    profile, params = build_seatbelt_profile(policy, tmpdir=tmpdir, writable_files=writable_files)
    args = [SANDBOX_EXEC, "-p", profile]
    for name, value in params.items():
        args += ["-D", f"{name}={value}"]
    return [*args, "--", *argv]


def user_temp_dir(
    confstr: Callable[[int], str | None] | None = None, environ: Mapping[str, str] | None = None
) -> tuple[str | None, str | None]:
    """The user's temporary directory as the kernel names it, and a warning when there is none.

    Asked of the system (confstr), then of the server's own ``TMPDIR``; never
    of the command's environment, which the client sets. Only a directory
    under /private/var/folders qualifies: a TMPDIR pointing at, say, the home
    directory must not make it writable.
    """
    candidates: list[str] = []
    lookup: Callable[[int], str | None] | None = getattr(os, "confstr", None) if confstr is None else confstr
    try:
        value = lookup(_CS_DARWIN_USER_TEMP_DIR) if lookup is not None else None
        if value:
            candidates.append(value)
    except (OSError, ValueError, TypeError):
        pass
    value = (os.environ if environ is None else environ).get("TMPDIR")
    if value:
        candidates.append(value)
    for candidate in candidates:
        if not os.path.isabs(candidate):
            continue
        real = Path(os.path.realpath(candidate))
        if real == SYSTEM_TEMP or real.is_relative_to(SYSTEM_TEMP):
            return None, None  # writable already
        if real.is_relative_to(USER_TEMP_ROOT) and real != USER_TEMP_ROOT:
            return str(real), None
    if candidates:
        return None, (
            f"seatbelt backend: the temporary directory {candidates[-1]!r} is not under /private/var/folders, "
            "so it is not made writable; commands can use /tmp"
        )
    return None, None


def already_sandboxed() -> bool:
    """Whether this process already runs inside a Seatbelt sandbox (libsystem's sandbox_check)."""
    if sys.platform != "darwin":
        return False
    try:
        check = ctypes.CDLL("/usr/lib/libSystem.B.dylib").sandbox_check
        check.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        check.restype = ctypes.c_int
        # No operation and no filter: "is this process sandboxed at all".
        return bool(check(os.getpid(), None, 0) > 0)
    except (OSError, AttributeError, ctypes.ArgumentError):
        return False


def classify_failure(returncode: int, stderr: str, nested: bool) -> str:
    """Turn a failed trivial sandbox-exec into what to change."""
    text = stderr.strip()
    if nested or ("sandbox_apply" in text and "Operation not permitted" in text):
        return (
            f"the server already runs inside a Seatbelt sandbox ({text or 'sandbox_check says so'}), and macOS "
            "cannot start a sandbox inside another one: start the server outside any sandbox (not from a "
            "sandboxed agent, app or terminal)"
        )
    return f"{SANDBOX_EXEC} cannot apply even a profile that allows everything: {text or f'exit status {returncode}'}"


def _probe_policies() -> list[ResolvedPolicy]:
    """Policies with every kind of session rule, on paths that are never created."""
    base = Path("/private/tmp/zsb-rpc-seatbelt-probe")
    policy = ResolvedPolicy(
        workspace=base / "w", writable=(base / "w",), denied_write=(base / "w" / "locked",),
        protected_write=(base / "w" / ".git" / "hooks",), denied_read=(base / "w" / "secret",), network="none",
        environment={}, limits=Limits(), memory_strategy="auto", timeout=None, output_limit=0, home=base,
    )
    return [
        dataclasses.replace(policy, allow_unix_sockets=(base / "s.sock",)),
        policy,
        dataclasses.replace(policy, network="full"),
    ]


def _run(argv: list[str]) -> tuple[int, str]:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=10, stdin=subprocess.DEVNULL)
    return done.returncode, done.stderr


@functools.cache
def probe_seatbelt() -> Availability:
    """Probe once per server: sandbox-exec exists, applies a sandbox here, and takes our profile."""
    if sys.platform != "darwin":
        return Availability(False, "Seatbelt is macOS only")
    if not os.access(SANDBOX_EXEC, os.X_OK):
        return Availability(
            False, f"{SANDBOX_EXEC} is missing or not executable (it ships with macOS; it is deprecated, not removed)"
        )
    try:
        base_profile()
    except OSError as error:
        return Availability(False, f"{BASE_PROFILE_FILE} is missing from the installed package: {error}")
    try:
        code, stderr = _run([SANDBOX_EXEC, "-p", TRIVIAL_PROFILE, "--", _TRUE])
        if code != 0:
            return Availability(False, classify_failure(code, stderr, already_sandboxed()))
        tmpdir, _ = user_temp_dir()
        for policy in _probe_policies():
            code, stderr = _run(build_seatbelt_argv(policy, [_TRUE], Path("/"), tmpdir=tmpdir))
            if code != 0:
                if "sandbox_apply" in stderr and "Operation not permitted" in stderr:
                    return Availability(False, classify_failure(code, stderr, True))
                return Availability(
                    False,
                    f"the zsb-rpc Seatbelt profile does not apply on macOS {platform.mac_ver()[0] or '?'}: "
                    f"{stderr.strip() or f'exit status {code}'}",
                )
    except (OSError, subprocess.SubprocessError) as error:
        return Availability(False, f"{SANDBOX_EXEC} could not be run: {error}")
    return Availability(True)


DIFFERENCES = (
    "seatbelt backend: no private /tmp (/tmp and the user's temporary directory are the host's, shared and writable)",
    "seatbelt backend: no PID namespace (the user's other processes are visible, though they cannot be signalled; "
    "a process that detaches with setsid and outlives its parent keeps running after the run)",
)


class SeatbeltBackend(Backend):
    name = "seatbelt"
    isolated = True
    # /tmp is shared (see DIFFERENCES); the whole sandbox is in the sandbox-exec argv, so
    # ``wrap`` can hand it out: the defaults of Backend hold.

    def probe(self) -> Availability:
        return probe_seatbelt()

    # prepare: a rule can name a missing path, so no placeholders (the default).

    def differences(self, policy: ResolvedPolicy) -> list[str]:
        return list(DIFFERENCES)

    def launch_spec(
        self, policy: ResolvedPolicy, argv: Sequence[str], cwd: Path, env: Mapping[str, str],
        *, writable_files: Sequence[str] = (), inline_environment: bool = False,
    ) -> LaunchSpec:
        command = resolve_program(argv, env)
        tmpdir, warning = user_temp_dir()
        return LaunchSpec(
            argv=build_seatbelt_argv(policy, command, cwd, tmpdir=tmpdir, writable_files=writable_files),
            cwd=str(cwd),
            env=dict(env),
            isolated=True,
            warnings=[warning] if warning else [],
            own_pid_namespace=False,
        )
