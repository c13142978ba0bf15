"""Seatbelt (macOS): the whole profile and the whole argv, exactly; real sandbox-exec on macOS only.

Also the Windows Job Object helpers: imported everywhere, exercised on Windows only.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.policies import make_policy
from zsb_rpc.backends import seatbelt
from zsb_rpc.backends.seatbelt import (
    SANDBOX_EXEC,
    SeatbeltBackend,
    anchors_for,
    build_seatbelt_argv,
    build_seatbelt_profile,
    classify_failure,
    user_temp_dir,
)
from zsb_rpc.policy import ResolvedPolicy

BASE_FILE = Path(seatbelt.__file__).with_name("seatbelt_base.sb")
BASE = BASE_FILE.read_text(encoding="utf-8")
TMPDIR = "/private/var/folders/zz/abc123/T"


_policy = make_policy


def _workspace_only(root: str = "/w") -> ResolvedPolicy:
    return _policy(workspace=Path(root), writable=(Path(root),), denied_write=(), protected_write=(), denied_read=())


def _whole(session: str) -> str:
    """The whole profile: the shipped base file, then the session's rules."""
    return BASE.rstrip("\n") + "\n\n" + session


SESSION_HEADER = ";; --- Session rules (zsb_rpc/backends/seatbelt.py) --------------------------\n"

WRITABLE_COMMENT = ";; Writable roots of the session, the workspace first.\n"
TMPDIR_RULES = (
    ";; The user's temporary directory ($TMPDIR), where macOS tools put temporary files.\n"
    '(allow file-write* (subpath (param "TMPDIR")))\n'
)
NETWORK_NONE = (
    ";; Network: none. No rule allows any network operation, so (deny default)\n"
    ";; refuses every connection and listener, Unix sockets included.\n"
)
DENY_WRITE_COMMENT = (
    ";; Unwritable, also inside the writable roots (denyWrite, protected files):\n"
    ";; the path itself and everything below it, existing or not, so that a\n"
    ";; missing one cannot be created either.\n"
)
ANCHOR_COMMENT = (
    ";; Writable directories on the way to an unwritable or unreadable path: they\n"
    ";; cannot be removed, renamed away, or made by renaming another directory into\n"
    ";; their place, which would move the path out from under its rule. What they\n"
    ";; contain stays writable.\n"
)
DENY_READ_COMMENT = (
    ";; Unreadable (denyRead, credentials, container sockets): not read, written,\n"
    ";; removed or created, and no connection to a socket there, whatever the\n"
    ";; network rules above allow.\n"
)

#: The session part of the profile of ``_policy()``; also of any policy of the same shape.
POLICY_SESSION = (
    SESSION_HEADER + "\n"
    + WRITABLE_COMMENT
    + '(allow file-write* (subpath (param "WRITABLE_0")))\n'
    '(allow file-write* (subpath (param "WRITABLE_1")))\n'
    "\n" + TMPDIR_RULES
    + "\n" + NETWORK_NONE
    + "\n" + DENY_WRITE_COMMENT
    + '(deny file-write* (literal (param "DENY_WRITE_0")) (subpath (param "DENY_WRITE_0")))\n'
    '(deny file-write* (literal (param "DENY_WRITE_1")) (subpath (param "DENY_WRITE_1")))\n'
    '(deny file-write* (literal (param "DENY_WRITE_2")) (subpath (param "DENY_WRITE_2")))\n'
    "\n" + ANCHOR_COMMENT
    + '(deny file-write-unlink file-write-create (literal (param "ANCHOR_0")))\n'
    '(deny file-write-unlink file-write-create (literal (param "ANCHOR_1")))\n'
    "\n" + DENY_READ_COMMENT
    + '(deny file-read* file-write* (literal (param "DENY_READ_0")) (subpath (param "DENY_READ_0")))\n'
    '(deny network-outbound (remote unix-socket (subpath (param "DENY_READ_0"))))\n'
    '(deny file-read* file-write* (literal (param "DENY_READ_1")) (subpath (param "DENY_READ_1")))\n'
    '(deny network-outbound (remote unix-socket (subpath (param "DENY_READ_1"))))\n'
)


# --- A small SBPL reader, to check that every generated profile is well formed ---------------------

_TOKEN = re.compile(r'\s+|;[^\n]*|#"(?:[^"\\]|\\.)*"|"(?:[^"\\]|\\.)*"|\(|\)|[^\s()";]+')


def _forms(text: str) -> list:
    """Top-level S-expressions (lists of atoms and lists); raises on anything unbalanced or unterminated."""
    stack: list[list] = [[]]
    position = 0
    while position < len(text):
        match = _TOKEN.match(text, position)
        assert match is not None, f"cannot read the profile at {text[position:position + 40]!r}"
        token = match.group()
        position = match.end()
        if token.isspace() or token.startswith(";"):
            continue
        if token == "(":
            stack.append([])
        elif token == ")":
            assert len(stack) > 1, "unbalanced ')'"
            closed = stack.pop()
            stack[-1].append(closed)
        else:
            stack[-1].append(token)
    assert len(stack) == 1, "unclosed '('"
    return stack[0]


def _referenced_params(form) -> list[str]:
    if not isinstance(form, list):
        return []
    if len(form) == 2 and form[0] == "param":
        return [form[1].strip('"')]
    return [name for item in form for name in _referenced_params(item)]


def _check_well_formed(profile: str, params: dict[str, str]) -> None:
    forms = _forms(profile)
    assert forms[0] == ["version", "1"] and forms[1] == ["deny", "default"]
    assert all(isinstance(form, list) and form[0] in ("version", "allow", "deny") for form in forms)
    referenced = [name for form in forms for name in _referenced_params(form)]
    # Every parameter the profile reads is passed, and every one passed is read.
    assert set(referenced) == set(params)
    assert all(re.fullmatch(r"[A-Z][A-Z0-9_]*", name) for name in params)


# --- Golden tests ----------------------------------------------------------------------------------


def test_base_profile_rules_are_exactly_these():
    """The rules of the shipped base file (comments aside), pinned: a change here is a decision."""
    rules = [line for line in BASE.splitlines() if line and not line.startswith(";")]
    assert rules == [
        "(version 1)",
        "(deny default)",
        "(allow process-exec)",
        "(allow process-fork)",
        "(allow signal (target same-sandbox))",
        "(allow process-info* (target same-sandbox))",
        "(allow file-read*)",
        "(allow file-map-executable)",
        '(allow file-write* (subpath "/private/tmp"))',
        '(allow file-write-data file-ioctl (literal "/dev/null") (literal "/dev/zero"))',
        '(allow file-write-data (regex #"^/dev/fd/[0-9]+$"))',
        '(allow file-write-data file-ioctl (literal "/dev/dtracehelper"))',
        "(allow sysctl-read)",
        "(allow mach-lookup",
        '  (global-name "com.apple.system.opendirectoryd.libinfo")',
        '  (global-name "com.apple.system.opendirectoryd.membership"))',
        '(allow mach-lookup (global-name "com.apple.system.notification_center"))',
        '(allow ipc-posix-shm-read* (ipc-posix-name "apple.shm.notification_center"))',
        "(allow ipc-posix-sem)",
    ]
    assert BASE.isascii()
    assert seatbelt.base_profile() == BASE


def test_profile_of_a_workspace_only():
    profile, params = build_seatbelt_profile(_workspace_only(), tmpdir=TMPDIR)
    assert profile == _whole(
        SESSION_HEADER + "\n"
        + WRITABLE_COMMENT
        + '(allow file-write* (subpath (param "WRITABLE_0")))\n'
        "\n" + TMPDIR_RULES
        + "\n" + NETWORK_NONE
    )
    assert params == {"WRITABLE_0": "/w", "TMPDIR": TMPDIR}
    _check_well_formed(profile, params)


def test_profile_without_a_temporary_directory_has_no_tmpdir_rule():
    profile, params = build_seatbelt_profile(_workspace_only(), tmpdir=None)
    assert profile == _whole(
        SESSION_HEADER + "\n"
        + WRITABLE_COMMENT
        + '(allow file-write* (subpath (param "WRITABLE_0")))\n'
        "\n" + NETWORK_NONE
    )
    assert params == {"WRITABLE_0": "/w"}
    # Inside a writable root (or /private/tmp) it is covered already.
    assert "TMPDIR" not in build_seatbelt_profile(_workspace_only(), tmpdir="/w/tmp")[1]
    assert "TMPDIR" not in build_seatbelt_profile(_workspace_only(), tmpdir="/private/tmp/t")[1]


def test_profile_of_writable_deny_write_and_deny_read():
    profile, params = build_seatbelt_profile(_policy(), tmpdir=TMPDIR)
    assert profile == _whole(POLICY_SESSION)
    assert params == {
        "WRITABLE_0": "/w", "WRITABLE_1": "/data", "TMPDIR": TMPDIR,
        "DENY_WRITE_0": "/w/locked", "DENY_WRITE_1": "/w/.bashrc", "DENY_WRITE_2": "/w/.git/hooks",
        # The directories a rename would carry the protected paths away with.
        "ANCHOR_0": "/w", "ANCHOR_1": "/w/.git",
        "DENY_READ_0": "/h/.ssh", "DENY_READ_1": "/h/.netrc",
    }
    _check_well_formed(profile, params)


def test_argv_is_exactly_sandbox_exec_profile_params_then_the_command():
    profile, _ = build_seatbelt_profile(_policy(), tmpdir=TMPDIR)
    argv = build_seatbelt_argv(_policy(), ["/bin/sh", "-c", "echo hi"], Path("/w/sub"), tmpdir=TMPDIR)
    assert argv == [
        "/usr/bin/sandbox-exec", "-p", profile,
        "-D", "WRITABLE_0=/w", "-D", "WRITABLE_1=/data", "-D", f"TMPDIR={TMPDIR}",
        "-D", "DENY_WRITE_0=/w/locked", "-D", "DENY_WRITE_1=/w/.bashrc", "-D", "DENY_WRITE_2=/w/.git/hooks",
        "-D", "ANCHOR_0=/w", "-D", "ANCHOR_1=/w/.git",
        "-D", "DENY_READ_0=/h/.ssh", "-D", "DENY_READ_1=/h/.netrc",
        "--", "/bin/sh", "-c", "echo hi",
    ]
    # A program that looks like an option is still the command: it comes after "--".
    assert build_seatbelt_argv(_workspace_only(), ["-n", "x"], Path("/w"))[-3:] == ["--", "-n", "x"]


def test_profile_with_full_network():
    policy = _workspace_only()
    policy = dataclasses.replace(policy, network="full", denied_read=(Path("/var/run/docker.sock"),),
                                 allow_unix_sockets=(Path("/private/tmp/ignored.sock"),))
    profile, params = build_seatbelt_profile(policy, tmpdir=TMPDIR)
    assert profile == _whole(
        SESSION_HEADER + "\n"
        + WRITABLE_COMMENT
        + '(allow file-write* (subpath (param "WRITABLE_0")))\n'
        "\n" + TMPDIR_RULES
        + "\n"
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
        '  (global-name "com.apple.ocspd"))\n'
        "\n" + DENY_READ_COMMENT
        + '(deny file-read* file-write* (literal (param "DENY_READ_0")) (subpath (param "DENY_READ_0")))\n'
        '(deny network-outbound (remote unix-socket (subpath (param "DENY_READ_0"))))\n'
    )
    # Full network opens every socket already: no per-socket rules, no parameter for them.
    assert params == {"WRITABLE_0": "/w", "TMPDIR": TMPDIR, "DENY_READ_0": "/var/run/docker.sock"}
    _check_well_formed(profile, params)


def test_profile_with_allowed_unix_sockets():
    policy = dataclasses.replace(
        _workspace_only(), allow_unix_sockets=(Path("/private/tmp/agent.sock"), Path("/Users/u/.colima/d.sock")),
    )
    profile, params = build_seatbelt_profile(policy, tmpdir=TMPDIR)
    assert profile == _whole(
        SESSION_HEADER + "\n"
        + WRITABLE_COMMENT
        + '(allow file-write* (subpath (param "WRITABLE_0")))\n'
        "\n" + TMPDIR_RULES
        + "\n"
        ";; Network: none, except the Unix sockets the session allows (allowUnixSockets),\n"
        ";; by exact path: the command may create a Unix socket and connect to those.\n"
        ";; No other connection, and no listener.\n"
        "(allow system-socket (socket-domain AF_UNIX))\n"
        '(allow network-outbound (remote unix-socket (path-literal (param "UNIX_SOCKET_0"))))\n'
        '(allow network-outbound (remote unix-socket (path-literal (param "UNIX_SOCKET_1"))))\n'
    )
    assert params == {"WRITABLE_0": "/w", "TMPDIR": TMPDIR, "UNIX_SOCKET_0": "/private/tmp/agent.sock",
                      "UNIX_SOCKET_1": "/Users/u/.colima/d.sock"}
    _check_well_formed(profile, params)


HOSTILE = [
    '/w "x" (allow default)',                    # a quote and a rule
    "/w ) (allow file-write* (subpath \"/\")) ;",  # closes the form, opens another, comments out the rest
    "/w\n(allow default)\n",                     # a newline, and a rule on a line of its own
    '/w\\" #"regex" \\\\ (param "TMPDIR")',       # backslashes, a regex literal, a param reference
    "/w spaces  and\ttabs",
]


@pytest.mark.parametrize("root", HOSTILE)
def test_paths_with_quotes_spaces_parentheses_and_newlines_change_only_the_parameters(root: str):
    """The profile is the plain-path profile, byte for byte; the paths travel as -D values only."""
    w = Path(root)
    data = Path(root + ' data (2)"')
    home = Path(root + "\nhome")
    tmpdir = TMPDIR + ' ("T")\n'
    hostile = _policy(
        workspace=w, writable=(w, data), denied_write=(w / "locked",),
        protected_write=(w / ".bashrc", w / ".git" / "hooks"), denied_read=(home / ".ssh", home / ".netrc"),
    )
    profile, params = build_seatbelt_profile(hostile, tmpdir=tmpdir)
    assert profile == build_seatbelt_profile(_policy(), tmpdir=TMPDIR)[0]
    assert params == {
        "WRITABLE_0": str(w), "WRITABLE_1": str(data), "TMPDIR": tmpdir,
        "DENY_WRITE_0": str(w / "locked"), "DENY_WRITE_1": str(w / ".bashrc"), "DENY_WRITE_2": str(w / ".git/hooks"),
        "ANCHOR_0": str(w), "ANCHOR_1": str(w / ".git"),
        "DENY_READ_0": str(home / ".ssh"), "DENY_READ_1": str(home / ".netrc"),
    }
    argv = build_seatbelt_argv(hostile, ["/bin/echo", root], w)
    assert argv[:3] == [SANDBOX_EXEC, "-p", build_seatbelt_profile(hostile)[0]]
    assert argv[-3:] == ["--", "/bin/echo", root]
    assert "-D" in argv and f"WRITABLE_0={w}" in argv
    for value in params.values():
        assert value not in profile
    _check_well_formed(profile, params)

    sockets = dataclasses.replace(_workspace_only(root), allow_unix_sockets=(Path(root + "/s (1).sock"),))
    plain = dataclasses.replace(_workspace_only(), allow_unix_sockets=(Path("/w/s.sock"),))
    assert build_seatbelt_profile(sockets)[0] == build_seatbelt_profile(plain)[0]


def test_anchors_are_the_writable_directories_above_protected_paths():
    areas = [Path("/w"), Path("/private/tmp")]
    assert anchors_for([Path("/w/a/b/.git/hooks"), Path("/w/.bashrc"), Path("/elsewhere/x")], areas) == [
        Path("/w"), Path("/w/a"), Path("/w/a/b"), Path("/w/a/b/.git")]
    # Above a root that sits in /private/tmp, the directories up to /private/tmp too; never /private or /.
    assert anchors_for([Path("/private/tmp/x/w/.git/config")], areas) == [
        Path("/private/tmp"), Path("/private/tmp/x"), Path("/private/tmp/x/w"), Path("/private/tmp/x/w/.git")]
    # A directory that is denied itself is covered by its own rule.
    assert anchors_for([Path("/w/.git"), Path("/w/.git/hooks")], areas) == [Path("/w")]


def test_the_probe_policies_cover_every_kind_of_rule():
    """The probe applies these on macOS, so a rule this macOS cannot compile fails the probe, not a run."""
    texts = [build_seatbelt_profile(policy, tmpdir=TMPDIR)[0] for policy in seatbelt._probe_policies()]
    joined = "\n".join(texts)
    for rule in ("WRITABLE_0", "TMPDIR", "DENY_WRITE_0", "ANCHOR_0", "DENY_READ_0", "UNIX_SOCKET_0",
                 "(allow network-outbound)", "(allow system-socket (socket-domain AF_UNIX))"):
        assert rule in joined
    for policy in seatbelt._probe_policies():
        _check_well_formed(*build_seatbelt_profile(policy, tmpdir=TMPDIR))


# --- Probe, temporary directory, launch spec ------------------------------------------------------


@pytest.mark.skipif(sys.platform == "darwin", reason="off macOS only")
def test_probe_off_macos_says_seatbelt_is_macos_only():
    availability = SeatbeltBackend().probe()
    assert not availability.available and availability.reason == "Seatbelt is macOS only"


def test_nesting_is_reported_with_what_to_change():
    reason = classify_failure(71, "sandbox-exec: sandbox_apply: Operation not permitted\n", False)
    assert "already runs inside a Seatbelt sandbox" in reason and "outside any sandbox" in reason
    assert "already runs inside" in classify_failure(1, "", True)
    other = classify_failure(65, "sandbox-exec: unbound variable\n", False)
    assert "already" not in other and "unbound variable" in other


def test_user_temp_dir_is_the_system_answer_and_only_under_private_var_folders(tmp_path: Path):
    assert user_temp_dir(lambda name: "/private/var/folders/ab/cd/T/", {}) == ("/private/var/folders/ab/cd/T", None)
    # The server's TMPDIR when the system has no answer.
    assert user_temp_dir(lambda name: None, {"TMPDIR": "/private/var/folders/x/y/T/"}) == (
        "/private/var/folders/x/y/T", None)
    # Under /private/tmp it is writable already.
    assert user_temp_dir(lambda name: None, {"TMPDIR": "/private/tmp/t"}) == (None, None)
    # Anywhere else it is not made writable, and the session is told.
    value, warning = user_temp_dir(lambda name: None, {"TMPDIR": str(tmp_path)})
    assert value is None and warning is not None and "not made writable" in warning
    assert user_temp_dir(lambda name: None, {}) == (None, None)


def test_backend_shape_and_launch_spec(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(seatbelt, "user_temp_dir", lambda: (TMPDIR, None))
    backend = SeatbeltBackend()
    assert (backend.name, backend.isolated, backend.needs_private_tmp, backend.launch_needs_server) == (
        "seatbelt", True, False, False)
    policy = _policy()
    assert backend.check_cwd(policy, Path("/w")) is None
    assert backend.prepare(policy) == [] and backend.release([]) is None
    assert any("setsid" in text for text in backend.differences(policy))
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/h"}
    spec = backend.launch_spec(policy, ["sh", "-c", "true"], Path("/w"), env)
    program = shutil.which("sh", path=env["PATH"])
    assert spec.argv == build_seatbelt_argv(policy, [program, "-c", "true"], Path("/w"), tmpdir=TMPDIR)
    assert spec.argv[0] == "/usr/bin/sandbox-exec"
    assert (spec.cwd, spec.env, spec.isolated, spec.own_pid_namespace, spec.warnings) == ("/w", env, True, False, [])


# --- Real sandbox-exec -----------------------------------------------------------------------------

macos = pytest.mark.skipif(
    sys.platform != "darwin" or not os.access(SANDBOX_EXEC, os.X_OK), reason="needs macOS and /usr/bin/sandbox-exec"
)


@macos
def test_real_sandbox_exec_enforces_the_policy(tmp_path: Path):
    availability = SeatbeltBackend().probe()
    if not availability.available and "already runs inside" in (availability.reason or ""):
        pytest.skip(availability.reason)
    assert availability.available, availability.reason
    root = tmp_path.resolve()  # /var/folders/... is /private/var/folders/... to the kernel
    workspace, outside = root / "ws", root / "outside"
    workspace.mkdir()
    outside.mkdir()
    (workspace / ".git").mkdir()
    (workspace / ".git" / "config").write_text("[core]\n")
    secret = root / "secret.txt"
    secret.write_text("s3cret")
    policy = _policy(
        workspace=workspace, writable=(workspace,), denied_write=(workspace / "locked",),
        protected_write=(workspace / ".git" / "hooks", workspace / ".git" / "config"), denied_read=(secret,),
    )

    def run(script: str) -> subprocess.CompletedProcess:
        # No TMPDIR rule: tmp_path itself lies in the user's temporary directory.
        argv = build_seatbelt_argv(policy, ["/bin/sh", "-c", script], workspace)
        return subprocess.run(argv, cwd=workspace, capture_output=True, text=True, timeout=30,
                              env={"PATH": "/usr/bin:/bin", "HOME": str(root)})

    done = run("echo inside > file && cat file && echo ok > /dev/null")
    assert (done.returncode, done.stdout) == (0, "inside\n"), done.stderr
    assert (workspace / "file").read_text() == "inside\n"

    done = run(f"echo escaped > '{outside}/file'")
    assert done.returncode != 0 and not (outside / "file").exists()

    done = run(f"cat '{secret}'")
    assert done.returncode != 0 and "s3cret" not in done.stdout

    # A protected path that does not exist cannot be created; an existing one cannot be changed.
    assert run("mkdir -p .git/hooks").returncode != 0 and not (workspace / ".git" / "hooks").exists()
    assert run("echo x >> .git/config").returncode != 0
    assert run("touch locked").returncode != 0 and not (workspace / "locked").exists()
    # Nor carried away by renaming its parent.
    assert run("mv .git .git.old").returncode != 0 and (workspace / ".git" / "config").exists()
    # The rest of .git stays writable.
    assert run("echo ref > .git/HEAD").returncode == 0


# --- Windows Job Object helpers --------------------------------------------------------------------


def test_windows_helpers_import_everywhere():
    from zsb_rpc.backends import windows

    if sys.platform == "win32":
        pytest.skip("off Windows only")
    assert windows.create_kill_on_close_job() is None
    with pytest.raises(OSError):
        windows.assign_process_to_job(windows.KillOnCloseJob(0), os.getpid())


@pytest.mark.skipif(sys.platform != "win32", reason="Windows only")
def test_windows_job_kills_the_tree_when_closed():
    import psutil

    from zsb_rpc.backends import windows

    job = windows.create_kill_on_close_job()
    assert job is not None
    # A child that starts a grandchild after it was put in the job, then waits.
    script = (
        "import subprocess, sys, time; sys.stdin.readline(); "
        "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
        "print(g.pid, flush=True); time.sleep(120)"
    )
    child = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        windows.assign_process_to_job(job, child.pid)
        assert child.stdin is not None and child.stdout is not None
        child.stdin.write("go\n")
        child.stdin.flush()
        grandchild = int(child.stdout.readline())
        job.close()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (child.poll() is None or psutil.pid_exists(grandchild)):
            time.sleep(0.05)
        assert child.poll() is not None
        assert not psutil.pid_exists(grandchild)
    finally:
        job.close()
        if child.poll() is None:
            child.kill()
