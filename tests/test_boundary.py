"""Real attempts to cross the boundary, each checked on the host afterwards, as root and as a user."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
from pathlib import Path

import pytest

from tests.conftest import LINUX_BACKENDS, SECRET_VALUE, chown_tree, open_or_refused
from tests.rpc import RpcClient


@pytest.fixture(params=LINUX_BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """The whole isolation suite holds on bubblewrap and on landlock, differences asserted."""
    return request.param


async def test_writes_outside_the_workspace_fail_and_nothing_appears_on_the_host(
    server: RpcClient, session: dict, scratch: Path, marker: str
):
    targets = [scratch / f"outside-{marker}", Path(f"/etc/zsb-{marker}"), Path(f"/var/tmp/zsb-{marker}"),
               Path.home() / f"zsb-{marker}" if os.geteuid() == 0 else scratch / f"home-{marker}"]
    command = "; ".join(f"echo x > {t} 2>/dev/null && echo WROTE {t}" for t in targets)
    result = await server.run(session["sessionId"], command + "; true")
    assert "WROTE" not in result["stdout"]
    for target in targets:
        assert not target.exists()
    inside = await server.run(session["sessionId"], "echo ok > inside && cat inside")
    assert inside["stdout"] == "ok\n" and (Path(session["workspace"]) / "inside").exists()


async def test_extra_writable_path_is_writable_and_deny_write_inside_it_holds(
    server: RpcClient, scratch: Path, owner, backend: str
):
    extra = scratch / "extra"
    (extra / "locked").mkdir(parents=True)
    chown_tree(extra, owner)
    opened = await open_or_refused(server, backend, writable=[str(extra)], denyWrite=[str(extra / "locked")])
    if opened is None:
        # Without the protection, the plain writable path works on landlock too.
        opened = await server.open(writable=[str(extra)], protectDefaults=False)
        await server.run(opened["sessionId"], f"echo a > {extra}/a")
        assert (extra / "a").read_text() == "a\n"
        return
    result = await server.run(opened["sessionId"],
                              f"echo a > {extra}/a && echo b > {extra}/locked/b; echo rc=$?")
    assert (extra / "a").read_text() == "a\n"
    assert not (extra / "locked" / "b").exists() and "rc=0" not in result["stdout"]


async def test_tmp_is_private(server: RpcClient, session: dict, marker: str, backend: str):
    host_file = Path(f"/tmp/zsb-host-{marker}")
    host_file.write_text("host-content")
    try:
        result = await server.run(session["sessionId"], (
            f"cat /tmp/zsb-host-{marker} 2>&1; echo inner > /tmp/zsb-inner-{marker} && echo wrote; "
            "echo t > \"${TMPDIR:-/tmp}/mine\" && echo tmpdir-ok"))
        assert "host-content" not in result["stdout"] and "tmpdir-ok" in result["stdout"]
        assert not Path(f"/tmp/zsb-inner-{marker}").exists()
        if backend == "bubblewrap":
            assert "No such file" in result["stdout"] and "wrote" in result["stdout"]
        else:
            # The difference: the host's /tmp is hidden and unwritable rather than private.
            assert "wrote" not in result["stdout"] and "Permission denied" in result["stdout"]
            assert any("no private /tmp" in w for w in session["warnings"])
    finally:
        host_file.unlink()


def _listener() -> tuple[socket.socket, int]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    return listener, listener.getsockname()[1]


CONNECT = ("python3 -c \"import socket,sys; socket.create_connection(('127.0.0.1', int(sys.argv[1])), 3); "
           "print('CONNECTED')\" {port}")


async def test_network_none_cannot_reach_a_host_listener_on_loopback(server: RpcClient):
    listener, port = _listener()
    try:
        opened = await server.open()
        result = await server.run(opened["sessionId"], CONNECT.format(port=port) + " 2>&1")
        assert "CONNECTED" not in result["stdout"] and result["exitCode"] != 0
        try:
            listener.accept()
            raise AssertionError("the listener was reached")
        except BlockingIOError:
            pass
    finally:
        listener.close()


async def test_network_full_reaches_the_host_listener(server: RpcClient):
    listener, port = _listener()
    try:
        opened = await server.open(network="full")
        result = await server.run(opened["sessionId"], CONNECT.format(port=port) + " 2>&1")
        assert "CONNECTED" in result["stdout"]
        connection, _ = listener.accept()
        connection.close()
    finally:
        listener.close()


async def test_environment_is_an_allowlist(server: RpcClient):
    opened = await server.open(env={"SESSION_VAR": "s"})
    result = await server.run(opened["sessionId"], "env", env={"RUN_VAR": "r"})
    names = {line.split("=", 1)[0] for line in result["stdout"].splitlines()}
    assert "ZSB_TEST_SECRET" not in names and SECRET_VALUE not in result["stdout"]
    assert {"PATH", "HOME", "SESSION_VAR", "RUN_VAR"} <= names
    assert "PYTHONPATH" not in names
    narrowed = await server.open(inheritEnvironment=["PATH"])
    only = await server.run(narrowed["sessionId"], ["/usr/bin/env"])
    # bwrap sets PWD for --chdir, landlock a private TMPDIR; nothing else of the host comes through.
    assert {line.split("=", 1)[0] for line in only["stdout"].splitlines()} - {"PWD", "TMPDIR"} == {"PATH"}


async def test_default_credentials_are_hidden_under_the_home_directory(server: RpcClient, fake_home: Path):
    opened = await server.open()
    result = await server.run(
        opened["sessionId"],
        "echo HOME=$HOME; ls -A ~/.ssh ~/.aws; cat ~/.ssh/id_ed25519 ~/.aws/credentials ~/.netrc ~/.git-credentials; true",
    )
    assert f"HOME={fake_home}" in result["stdout"]
    assert SECRET_VALUE not in result["stdout"] + result["stderr"]
    assert "id_ed25519" not in result["stdout"] and "credentials" not in result["stdout"]
    # The host copy is untouched.
    assert SECRET_VALUE in (fake_home / ".ssh" / "id_ed25519").read_text()


async def test_deny_read_hides_a_named_path(server: RpcClient, scratch: Path, owner):
    secret_dir = scratch / "secrets"
    secret_dir.mkdir()
    (secret_dir / "token").write_text(SECRET_VALUE)
    (scratch / "file-secret").write_text(SECRET_VALUE)
    chown_tree(scratch, owner)
    opened = await server.open(denyRead=[str(secret_dir), str(scratch / "file-secret")])
    result = await server.run(opened["sessionId"],
                              f"cat {secret_dir}/token {scratch}/file-secret; ls {secret_dir}; touch {secret_dir}/x; true")
    assert SECRET_VALUE not in result["stdout"] and "token" not in result["stdout"]
    assert not (secret_dir / "x").exists()


async def test_existing_protected_files_stay_unwritable_in_the_workspace(
    server: RpcClient, scratch: Path, owner, backend: str
):
    workspace = scratch / "repo"
    subprocess.run(["git", "init", "-q", str(workspace)], check=True)
    (workspace / ".bashrc").write_text("original\n")
    (workspace / ".vscode").mkdir()
    (workspace / ".vscode" / "tasks.json").write_text("{}\n")
    nested = workspace / "pkg" / "sub"
    nested.mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(nested)], check=True)
    chown_tree(workspace, owner)
    config_before = (workspace / ".git" / "config").read_text()
    opened = await open_or_refused(server, backend, workspace=str(workspace))
    if opened is None:
        return
    attempts = [
        "echo evil >> .bashrc",
        "echo '#!/bin/sh' > .git/hooks/pre-commit",
        "echo '[core] fsmonitor=evil' >> .git/config",
        "echo evil > .vscode/tasks.json",
        "echo evil > pkg/sub/.git/hooks/post-checkout",
        "rm -f .bashrc",
    ]
    result = await server.run(opened["sessionId"], "; ".join(f"{a} && echo BROKE" for a in attempts) + "; true")
    assert "BROKE" not in result["stdout"]
    assert (workspace / ".bashrc").read_text() == "original\n"
    assert not (workspace / ".git" / "hooks" / "pre-commit").exists()
    assert (workspace / ".git" / "config").read_text() == config_before
    assert (workspace / ".vscode" / "tasks.json").read_text() == "{}\n"
    assert not (nested / ".git" / "hooks" / "post-checkout").exists()
    ordinary = await server.run(opened["sessionId"], "echo fine > notes.txt && cat notes.txt")
    assert ordinary["stdout"] == "fine\n"


async def test_commands_cannot_see_or_signal_the_server(server: RpcClient, session: dict, backend: str):
    result = await server.run(session["sessionId"],
                              f"ls /proc | grep -x {server.pid}; kill -0 {server.pid} 2>&1; echo rc=$?")
    assert "rc=0" not in result["stdout"]
    if backend == "bubblewrap":
        assert f"\n{server.pid}\n" not in "\n" + result["stdout"]
    else:
        # The difference: no PID namespace, so the server is visible, but it cannot be signalled.
        assert f"\n{server.pid}\n" in "\n" + result["stdout"]
        assert any("no PID namespace" in w for w in session["warnings"])
    await asyncio.sleep(0)
    assert server.process.returncode is None


async def test_deny_write_on_a_path_that_does_not_exist_yet_keeps_it_from_being_created(
    server: RpcClient, scratch: Path, owner, backend: str
):
    workspace = scratch / "deploy"
    workspace.mkdir()
    chown_tree(workspace, owner)
    params = dict(workspace=str(workspace), denyWrite=[str(workspace / "deploy.sh")])
    opened = await open_or_refused(server, backend, **params)
    if opened is None:
        return
    result = await server.run(opened["sessionId"], "echo 'rm -rf /' > deploy.sh && echo CREATED; echo ok > other && echo OTHER")
    await server.call("session/close", {"sessionId": opened["sessionId"]})
    assert "CREATED" not in result["stdout"] and "OTHER" in result["stdout"]
    assert not (workspace / "deploy.sh").exists() and (workspace / "other").exists()
