"""Pure functions: the whole bwrap argv, policy rules, the strict converter, exit codes."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.policies import make_policy
from zsb_rpc.backends.bubblewrap import SANDBOX_TAG, build_bwrap_argv, classify_failure
from zsb_rpc.policy import command_arguments, resolve_policy
from zsb_rpc.protocol import types as t
from zsb_rpc.protocol.convert import make_converter, structure_params
from zsb_rpc.protocol.errors import InvalidParams
from zsb_rpc.runner import _exit_code

_policy = make_policy


def test_bwrap_argv_is_exactly_mounts_in_order_then_isolation_then_command():
    present = {Path("/w/locked"), Path("/w/.bashrc"), Path("/w/.git"), Path("/w/.git/hooks"), Path("/h/.ssh"),
               Path("/h/.netrc")}
    argv = build_bwrap_argv("/usr/bin/bwrap", _policy(), ["/bin/sh", "-c", "echo hi"], Path("/w/sub"),
                            masked_sockets=[Path("/run/daemon.sock")],
                            exists=lambda p: p in present, is_dir=lambda p: p == Path("/h/.ssh"))
    assert argv == [
        "/usr/bin/bwrap",
        "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp",
        "--bind", "/w", "/w", "--bind", "/data", "/data",
        # .git is bound onto itself so that it cannot be renamed away from its hooks.
        "--bind", "/w/.git", "/w/.git",
        "--ro-bind", "/w/locked", "/w/locked", "--ro-bind", "/w/.bashrc", "/w/.bashrc",
        "--ro-bind", "/w/.git/hooks", "/w/.git/hooks",
        "--tmpfs", "/h/.ssh", "--remount-ro", "/h/.ssh", "--ro-bind", "/dev/null", "/h/.netrc",
        "--ro-bind", "/dev/null", "/run/daemon.sock",
        "--unshare-all", "--unshare-user", "--cap-drop", "ALL", "--die-with-parent", "--new-session",
        "--hostname", SANDBOX_TAG, "--disable-userns",
        "--chdir", "/w/sub", "--", "/bin/sh", "-c", "echo hi",
    ]


def test_bwrap_argv_shares_the_network_only_when_full():
    argv = build_bwrap_argv("/usr/bin/bwrap", _policy(network="full"), ["true"], Path("/w"),
                            exists=lambda p: False)
    assert "--share-net" in argv and argv.index("--share-net") > argv.index("--unshare-all")
    assert "--share-net" not in build_bwrap_argv("/usr/bin/bwrap", _policy(), ["true"], Path("/w"),
                                                 exists=lambda p: False)


def test_bwrap_failures_are_classified_with_what_to_change():
    assert "AppArmor" in classify_failure("bwrap: setting up uid map: Permission denied")
    assert "AppArmor" in classify_failure("bwrap: loopback: Failed RTM_NEWADDR: Operation not permitted")
    assert "/proc" in classify_failure("bwrap: Can't mount proc on /newroot/proc: Operation not permitted")


def _resolve(tmp_path: Path, **overrides):
    values = dict(workspace=tmp_path, writable=[], deny_write=[], deny_read=[], network="none", env={},
                  inherit_environment=None, limits=t.Limits(), memory_strategy="auto", timeout=60.0,
                  output_limit=1024, protect_defaults=True, home=tmp_path / "home",
                  source_environment={"PATH": "/bin", "API_TOKEN": "secret", "HOME": "/h"})
    values.update(overrides)
    return resolve_policy(**values)


def test_policy_rules_name_the_field(tmp_path: Path):
    with pytest.raises(InvalidParams, match=r"params.writable\[0\].*absolute"):
        _resolve(tmp_path, writable=["rel"])
    with pytest.raises(InvalidParams, match=r"params.writable\[0\].*must exist"):
        _resolve(tmp_path, writable=[str(tmp_path / "missing")])
    with pytest.raises(InvalidParams, match=r"params.writable\[0\].*root"):
        _resolve(tmp_path, writable=["/"])
    with pytest.raises(InvalidParams, match=r"params.denyRead\[0\].*would hide"):
        _resolve(tmp_path, deny_read=[str(tmp_path.parent)])
    with pytest.raises(InvalidParams, match=r"params.limits.openFiles.*16"):
        _resolve(tmp_path, limits=t.Limits(open_files=3))
    with pytest.raises(InvalidParams, match=r"params.limits.memoryBytes"):
        _resolve(tmp_path, limits=t.Limits(memory_bytes=1024))


def test_policy_environment_is_the_allowlist_then_env(tmp_path: Path):
    policy = _resolve(tmp_path, env={"EXTRA": "1"})
    assert policy.environment == {"PATH": "/bin", "HOME": "/h", "EXTRA": "1"}


def test_policy_default_read_denial_over_a_writable_path_is_dropped_with_a_warning(tmp_path: Path):
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    policy = _resolve(tmp_path, workspace=home / ".ssh", home=home)
    assert home / ".ssh" not in policy.denied_read
    assert any("skipped" in w for w in policy.warnings)


def test_policy_protects_git_metadata_found_below_the_workspace(tmp_path: Path):
    (tmp_path / "a" / "b" / ".git").mkdir(parents=True)
    policy = _resolve(tmp_path)
    assert tmp_path / "a" / "b" / ".git" / "hooks" in policy.protected_write
    # Missing at the root: placeholders, parents first; shell files only in a home directory.
    kinds = {p.path.relative_to(tmp_path).as_posix(): p.kind for p in policy.placeholders}
    assert kinds == {".git": "dir", ".git/hooks": "dir", ".git/config": "file", ".vscode": "dir", ".idea": "dir",
                     ".mcp.json": "file"}
    as_home = _resolve(tmp_path, home=tmp_path)
    assert tmp_path / ".bashrc" in as_home.protected_write
    assert any(p.path == tmp_path / ".bashrc" for p in as_home.placeholders)


def test_anchors_are_the_directories_between_a_protected_path_and_its_root():
    from zsb_rpc.backends.bubblewrap import anchors_for

    policy = _policy(writable=(Path("/w"),))
    assert anchors_for(policy, [Path("/w/a/b/.git/hooks"), Path("/w/.bashrc"), Path("/elsewhere/x")]) == [
        Path("/w/a"), Path("/w/a/b"), Path("/w/a/b/.git")]


def test_command_arguments():
    assert command_arguments("ls | wc") == ["/bin/sh", "-c", "ls | wc"]
    assert command_arguments(["ls", "-l"]) == ["ls", "-l"]
    for bad in ("", "  ", [], [""], ["a\0b"], "\ud800"):
        with pytest.raises(InvalidParams):
            command_arguments(bad)


def test_converter_is_strict_and_speaks_camel_case():
    converter = make_converter()
    params = structure_params(converter, {"sessionId": "s", "command": ["a"], "runId": 3, "timeout": None},
                              t.RunParams)
    assert params.session_id == "s" and params.run_id == 3 and params.timeout is None
    assert structure_params(converter, {"sessionId": "s", "command": "x"}, t.RunParams).timeout is t.UNSET
    for bad, field in (
        ({"sessionId": 1, "command": "x"}, "params.sessionId"),
        ({"sessionId": "s", "command": "x", "timeout": True}, "params.timeout"),
        ({"sessionId": "s", "command": "x", "outputLimit": 1.5}, "params.outputLimit"),
        ({"sessionId": "s", "command": "x", "bogus": 1}, "bogus"),
        ({"sessionId": "s"}, "params.command"),
    ):
        with pytest.raises(InvalidParams, match=field.replace(".", r"\.")):
            structure_params(converter, bad, t.RunParams)
    assert converter.unstructure(t.Truncated(stdout=True, stderr=False)) == {"stdout": True, "stderr": False}


def test_exit_codes_fold_signals_only_for_bubblewrap():
    assert _exit_code(137, True) == (-9, 9)
    assert _exit_code(137, False) == (137, None)
    assert _exit_code(-15, False) == (-15, 15)
    assert _exit_code(3, True) == (3, None)


def test_cgroup_v2_files_on_a_fake_tree(tmp_path: Path):
    """The v2 layout cannot be exercised on this machine's kernel (v1 controllers); its files can."""
    from zsb_rpc.limits.cgroups import CgroupRun, CgroupSupport, _probe_v2

    own = tmp_path / "user.slice" / "svc"
    own.mkdir(parents=True)
    (own / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (own / "cgroup.subtree_control").write_text("cpu memory pids\n")
    (own / "cgroup.procs").write_text("")
    directories, reason = _probe_v2(tmp_path, "/user.slice/svc")
    assert reason is None and set(directories) == {"memory", "pids", "cpu"}
    run = CgroupRun(CgroupSupport(2, directories), "zsb-rpc-1-ab", ["memory", "pids", "cpu"])
    run.create(memory_bytes=64 << 20, processes=32, cpu_percent=50)
    path = run.paths["memory"]
    assert path.parent.name == "zsb-rpc-1-ab" and run.procs_files() == [str(path / "cgroup.procs")]
    assert (path.parent / "cgroup.subtree_control").read_text() == "+memory +pids +cpu"
    assert (path / "memory.max").read_text() == str(64 << 20)
    assert (path / "memory.swap.max").read_text() == "0"
    assert (path / "pids.max").read_text() == "32"
    assert (path / "cpu.max").read_text() == "50000 100000"
    (path / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    (path / "pids.events").write_text("max 7\n")
    (path / "memory.current").write_text("1048576\n")
    (path / "memory.peak").write_text("2097152\n")
    (path / "cpu.stat").write_text("usage_usec 1500000\nuser_usec 1000000\n")
    (path / "pids.current").write_text("3\n")
    assert run.limits_hit() == ["memory", "processes"]
    assert run.sample() == {"memory": 1048576, "peak": 2097152, "cpu": 1.5, "processes": 3}


def test_cgroup_v2_without_delegation_is_refused_with_the_reason(tmp_path: Path):
    from zsb_rpc.limits.cgroups import _probe_v2

    own = tmp_path / "session"
    own.mkdir()
    (own / "cgroup.controllers").write_text("memory pids\n")
    (own / "cgroup.subtree_control").write_text("\n")
    (own / "cgroup.procs").write_text("1234\n")
    directories, reason = _probe_v2(tmp_path, "/session")
    assert directories == {} and "Delegate=yes" in reason
