"""The real server over pipes: each method, streaming, timeouts, cancellation, lifetime, bad input.

Every test here runs once as root and once as an unprivileged user (when the
suite runs as root), through the ``server`` fixture.
"""

from __future__ import annotations

import asyncio
import base64
import os
import signal
from pathlib import Path

import pytest

from tests.conftest import processes_with, wait_gone
from tests.rpc import RpcClient, RpcError, frame


async def test_capabilities_reports_backend_and_mechanisms_and_creates_nothing(server: RpcClient, server_command):
    state = Path("/tmp") / f"zsb-rpc-{server_command.uid}"
    caps = await server.call("capabilities")
    assert caps["backend"] == "bubblewrap" and caps["isolated"] is True
    assert caps["platform"] == "linux"
    for name in ("memory", "cpuSeconds", "cpuPercent", "processes", "fileSizeBytes", "openFiles", "coreDumps"):
        assert caps[name] in ("cgroup", "rlimit", "rlimit_as", "watchdog", "none")
    # Nothing is claimed that is not enforced: a processor share needs a cgroup.
    assert (caps["cpuPercent"] == "cgroup") == (server_command.uid == 0)
    assert (caps["cpuPercent"] == "none") == any(w.startswith("cpuPercent: not enforced") for w in caps["warnings"])
    assert {b["name"] for b in caps["backends"]} >= {"bubblewrap", "passthrough"}
    # Nothing of this server's exists: no directory of its own, no cgroup.
    assert not list(state.glob(f"server-{server.pid}-*"))
    from tests.test_limits import _server_cgroups

    assert not [p for p in _server_cgroups(True) if f"zsb-rpc-{server.pid}-" in p]


async def test_private_workspace_is_created_0700_and_removed_at_close_even_if_made_unreadable(server: RpcClient):
    opened = await server.open()
    workspace = Path(opened["workspace"])
    assert workspace.is_dir() and (workspace.stat().st_mode & 0o777) == 0o700
    result = await server.run(opened["sessionId"], "mkdir -p a/b && echo hi > a/b/f && chmod 000 a/b a")
    assert result["exitCode"] == 0
    closed = await server.call("session/close", {"sessionId": opened["sessionId"]})
    assert closed["removedWorkspace"] is True
    assert not workspace.exists()


async def test_given_workspace_is_used_and_never_deleted(server: RpcClient, scratch: Path):
    opened = await server.open(workspace=str(scratch))
    assert opened["workspace"] == str(scratch)
    result = await server.run(opened["sessionId"], "echo kept > out.txt && pwd")
    assert result["stdout"].strip() == str(scratch)
    closed = await server.call("session/close", {"sessionId": opened["sessionId"]})
    assert closed["removedWorkspace"] is False
    assert (scratch / "out.txt").read_text() == "kept\n"


async def test_string_runs_through_shell_and_list_runs_directly(server: RpcClient, session: dict):
    sid = session["sessionId"]
    shell = await server.run(sid, "echo one two | tr ' ' '\\n' | sort -r")
    assert shell["stdout"] == "two\none\n" and shell["isolated"] is True
    direct = await server.run(sid, ["echo", "$HOME", "a|b", ";", "*"])
    assert direct["stdout"] == "$HOME a|b ; *\n"


async def test_exit_codes_and_signals(server: RpcClient, session: dict):
    sid = session["sessionId"]
    assert (await server.run(sid, "exit 3"))["exitCode"] == 3
    killed = await server.run(sid, ["sh", "-c", "kill -9 $$"])
    assert killed["exitCode"] == -9
    missing = await server.run(sid, ["/nonexistent/program"])
    assert missing["exitCode"] != 0 and "nonexistent" in missing["stderr"]


async def test_cwd_env_and_input(server: RpcClient, session: dict):
    sid = session["sessionId"]
    await server.run(sid, "mkdir -p sub")
    result = await server.run(sid, "pwd; echo $A$B; cat", cwd="sub", env={"B": "b"}, input="from stdin")
    assert result["stdout"].splitlines() == [f"{session['workspace']}/sub", "b", "from stdin"]
    with pytest.raises(RpcError) as error:
        await server.run(sid, "true", cwd="/nonexistent-dir")
    assert error.value.code == -32602 and "cwd" in error.value.message


async def test_streaming_delivers_every_chunk_in_order_before_the_response(server: RpcClient, session: dict):
    sid = session["sessionId"]
    command = "for i in $(seq 1 200); do echo line$i; echo err$i >&2; done"
    msg_id, future = server.send_request("run", {"sessionId": sid, "command": command, "runId": "r1"})
    response = await asyncio.wait_for(future, 30)
    index = server.messages.index(response)
    chunks = [m for m in server.messages if m.get("method") == "run/output"]
    assert chunks and all(server.messages.index(m) < index for m in chunks)
    assert all(c["params"]["runId"] == "r1" and c["params"]["sessionId"] == sid for c in chunks)
    out = "".join(c["params"]["data"] for c in chunks if c["params"]["stream"] == "stdout")
    err = "".join(c["params"]["data"] for c in chunks if c["params"]["stream"] == "stderr")
    assert out == "".join(f"line{i}\n" for i in range(1, 201)) == response["result"]["stdout"]
    assert err == "".join(f"err{i}\n" for i in range(1, 201))


async def test_text_is_decoded_without_splitting_characters_and_base64_is_exact(server: RpcClient, session: dict):
    sid = session["sessionId"]
    # A three-byte character written one byte at a time, with pauses, arrives whole.
    split = await server.run(sid, "printf '\\342'; sleep 0.2; printf '\\202'; sleep 0.2; printf '\\254\\n'", runId="t")
    assert split["stdout"] == "\u20ac\n"
    chunks = [n["data"] for n in server.notifications("run/output") if n["runId"] == "t"]
    assert "".join(chunks) == "\u20ac\n" and "\ufffd" not in "".join(chunks)
    binary = await server.run(sid, "printf '\\000\\377\\200abc'", encoding="base64", runId="b")
    assert base64.b64decode(binary["stdout"]) == b"\x00\xff\x80abc"
    streamed = b"".join(base64.b64decode(n["data"]) for n in server.notifications("run/output") if n["runId"] == "b")
    assert streamed == b"\x00\xff\x80abc"
    echoed = await server.run(sid, "cat", encoding="base64", input=base64.b64encode(b"\x01\x02\xfe").decode())
    assert base64.b64decode(echoed["stdout"]) == b"\x01\x02\xfe"


async def test_flood_of_20_mb_keeps_1_mib_and_the_command_finishes(server: RpcClient, session: dict):
    result = await server.run(session["sessionId"], "head -c 20000000 /dev/zero | tr '\\0' x; echo done >&2")
    assert result["exitCode"] == 0
    assert len(result["stdout"]) == 1024 * 1024 and result["truncated"] == {"stdout": True, "stderr": False}
    assert result["stderr"] == "done\n"


async def test_timeout_kills_the_whole_tree(server: RpcClient, session: dict, marker: str):
    result = await server.run(session["sessionId"], f"sleep {marker} & sleep {marker}; echo never", timeout=1)
    assert result["timedOut"] is True and result["exitCode"] == -9 and "never" not in result["stdout"]
    assert wait_gone(marker) == []


async def test_setsid_children_die_with_their_run(server: RpcClient, session: dict, marker: str):
    result = await server.run(session["sessionId"], f"setsid sleep {marker} > /dev/null 2>&1 < /dev/null & echo started")
    assert result["stdout"] == "started\n"
    assert wait_gone(marker) == []


async def test_cancel_request_kills_the_tree_and_answers_32800(server: RpcClient, session: dict, marker: str):
    msg_id, future = server.send_request("run", {"sessionId": session["sessionId"],
                                                 "command": f"sleep {marker}; sleep {marker}", "timeout": None})
    for _ in range(100):
        if processes_with(marker):
            break
        await asyncio.sleep(0.05)
    assert processes_with(marker)
    await server.notify("$/cancelRequest", {"id": msg_id})
    response = await asyncio.wait_for(future, 10)
    assert response["error"]["code"] == -32800
    assert wait_gone(marker) == []
    # One answer only, and the server still serves.
    assert len(server.responses(msg_id)) == 1
    assert (await server.run(session["sessionId"], "echo ok"))["stdout"] == "ok\n"


async def test_runs_are_concurrent(server: RpcClient, session: dict):
    sid = session["sessionId"]
    # The first run can only finish if the second one runs while it waits.
    _, first = server.send_request("run", {"sessionId": sid, "command": "while [ ! -e flag ]; do sleep 0.05; done; echo saw",
                                           "timeout": 20})
    second = await server.run(sid, "sleep 0.3; touch flag")
    assert second["exitCode"] == 0
    assert (await asyncio.wait_for(first, 20))["result"]["stdout"] == "saw\n"


async def test_session_close_kills_running_commands(server: RpcClient, session: dict, marker: str):
    _, future = server.send_request("run", {"sessionId": session["sessionId"], "command": f"sleep {marker}"})
    for _ in range(100):
        if processes_with(marker):
            break
        await asyncio.sleep(0.05)
    await server.call("session/close", {"sessionId": session["sessionId"]})
    response = await asyncio.wait_for(future, 10)
    assert response["error"]["code"] == -32003
    assert wait_gone(marker) == []
    assert not Path(session["workspace"]).exists()


async def test_wrap_returns_a_sandboxed_argv_that_runs_nothing_itself(
    server: RpcClient, session: dict, scratch: Path, server_command
):
    command = "echo wrapped > out; touch " + str(scratch / "escape")
    wrapped = await server.call("wrap", {"sessionId": session["sessionId"], "command": command})
    assert "bwrap" in " ".join(wrapped["argv"]) and wrapped["cwd"] == session["workspace"]
    assert "ZSB_TEST_SECRET" not in wrapped["env"]
    assert not (Path(session["workspace"]) / "out").exists()
    # Spawned by the test as the server's user, the way a client with a pty would.
    as_user = server_command.argv[: server_command.argv.index("--") + 1] if server_command.user else []
    process = await asyncio.create_subprocess_exec(*as_user, *wrapped["argv"], cwd=wrapped["cwd"], env=wrapped["env"],
                                                   start_new_session=True, stderr=asyncio.subprocess.DEVNULL)
    await asyncio.wait_for(process.wait(), 20)
    assert (Path(session["workspace"]) / "out").read_text() == "wrapped\n"
    assert not (scratch / "escape").exists()


async def test_closing_stdin_kills_every_tree_removes_workspaces_and_exits_0(server: RpcClient, marker: str):
    opened = await server.open()
    server.send_request("run", {"sessionId": opened["sessionId"], "command": f"sleep {marker}", "timeout": None})
    for _ in range(100):
        if processes_with(marker):
            break
        await asyncio.sleep(0.05)
    assert processes_with(marker)
    await server.close_stdin()
    assert await server.wait_exit(2.0) == 0
    assert wait_gone(marker, 1.0) == []
    assert not Path(opened["workspace"]).exists()


async def test_sigkill_of_the_server_kills_every_sandboxed_process(server: RpcClient, marker: str):
    opened = await server.open()
    server.send_request("run", {"sessionId": opened["sessionId"], "command": f"setsid sleep {marker} & sleep {marker}"})
    for _ in range(100):
        if len(processes_with(marker)) >= 2:
            break
        await asyncio.sleep(0.05)
    assert processes_with(marker)
    # setpriv execs the server, so this pid is the server itself.
    os.kill(server.pid, signal.SIGKILL)
    await server.process.wait()
    assert wait_gone(marker) == []


async def test_bad_input_gets_errors_and_the_server_keeps_serving(server: RpcClient, session: dict):
    sid = session["sessionId"]
    unknown = await server.request("no/such/method", {})
    assert unknown["error"]["code"] == -32601
    missing = await server.request("run")
    assert missing["error"]["code"] == -32602 and "params" in missing["error"]["message"]
    wrong = await server.request("run", {"sessionId": sid, "command": "true", "timeout": "ten"})
    assert wrong["error"]["code"] == -32602 and "params.timeout" in wrong["error"]["message"]
    typo = await server.request("session/open", {"workspce": "/x"})
    assert typo["error"]["code"] == -32602 and "workspce" in typo["error"]["message"]
    empty = await server.request("run", {"sessionId": sid, "command": "  "})
    assert empty["error"]["code"] == -32602 and "params.command" in empty["error"]["message"]
    empty_list = await server.request("run", {"sessionId": sid, "command": []})
    assert empty_list["error"]["code"] == -32602
    no_session = await server.request("run", {"sessionId": "s-nope", "command": "true"})
    assert no_session["error"]["code"] == -32001
    relative = await server.request("session/open", {"writable": ["relative/path"]})
    assert relative["error"]["code"] == -32602 and "params.writable[0]" in relative["error"]["message"]
    floor = await server.request("session/open", {"limits": {"processes": 2}})
    assert floor["error"]["code"] == -32602 and "params.limits.processes" in floor["error"]["message"]
    root = await server.request("session/open", {"writable": ["/"]})
    assert root["error"]["code"] == -32602 and "root" in root["error"]["message"]
    count = len(server.messages)
    await server.send_raw(b"Content-Length: 9\r\n\r\n{not json")
    await server.send_raw(b"Content-Length: 3\r\n\r\n\xff\xfe\xfd")
    await server.send_raw(b"garbage header\r\n\r\n")
    await server.send_raw(frame([{"jsonrpc": "2.0", "id": 77, "method": "capabilities"}]))
    ok = await server.run(sid, "echo still here")
    assert ok["stdout"] == "still here\n"
    errors = [m for m in server.messages[count:] if "error" in m]
    assert [e["error"]["code"] for e in errors[:3]] == [-32700, -32700, -32700]
    assert any(e.get("id") == 77 and e["error"]["code"] == -32600 for e in errors)
    for message in server.messages:
        assert "Traceback" not in str(message.get("error", ""))


async def test_a_restarted_server_removes_what_a_killed_one_left_and_nothing_of_a_live_one(
    server_command, scratch: Path, marker: str
):
    from tests.test_limits import _server_cgroups

    live = await RpcClient.start(server_command)
    doomed = await RpcClient.start(server_command)
    try:
        live_ws = Path((await live.open())["workspace"])
        dead_ws = Path((await doomed.open(limits={"memoryBytes": 64 << 20, "processes": 64}))["workspace"])
        given = await doomed.open(workspace=str(scratch))
        assert (scratch / ".vscode").is_dir()  # a placeholder of the given workspace
        doomed.send_request("run", {"sessionId": given["sessionId"], "command": f"sleep {marker}"})
        sid = (await doomed.open(limits={"memoryBytes": 64 << 20, "processes": 64}))["sessionId"]
        doomed.send_request("run", {"sessionId": sid, "command": f"sleep {marker}"})
        for _ in range(100):
            if len(processes_with(marker)) >= 2:
                break
            await asyncio.sleep(0.05)
        os.kill(doomed.pid, signal.SIGKILL)
        await doomed.process.wait()
        assert dead_ws.exists()
        restarted = await RpcClient.start(server_command)
        try:
            await restarted.call("capabilities")
            def leftovers() -> list:
                cgroups = [p for p in _server_cgroups(True) if f"zsb-rpc-{doomed.pid}-" in p] if server_command.uid == 0 else []
                return [p for p in (dead_ws, scratch / ".vscode") if p.exists()] + cgroups

            for _ in range(100):
                if not leftovers():
                    break
                await asyncio.sleep(0.05)
            assert not dead_ws.exists() and not (scratch / ".vscode").exists()
            assert live_ws.exists()
            # A sandbox that escaped the killed server (still starting when it died) is gone too.
            assert wait_gone(marker, 5) == []
            assert leftovers() == []
        finally:
            await restarted.aclose()
    finally:
        await live.aclose()
        await doomed.aclose()
