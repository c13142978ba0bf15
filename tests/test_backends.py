"""Backend selection and reporting, against the real server."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.rpc import RpcClient, RpcError


async def test_automatic_selection_is_bubblewrap_when_it_works(server: RpcClient):
    caps = await server.call("capabilities")
    infos = {b["name"]: b for b in caps["backends"]}
    assert infos["bubblewrap"]["available"] and infos["landlock"]["available"]
    opened = await server.call("session/open", {})
    assert opened["backend"] == "bubblewrap" and opened["isolated"] is True


async def test_landlock_is_selected_when_forced_and_reports_its_differences(server: RpcClient):
    opened = await server.call("session/open", {"backend": "landlock"})
    assert opened["backend"] == "landlock" and opened["isolated"] is True
    assert any("no private /tmp" in w for w in opened["warnings"])
    result = await server.run(opened["sessionId"], "echo hi > f && cat f")
    assert result["stdout"] == "hi\n" and result["isolated"] is True


async def test_landlock_cannot_be_wrapped_and_says_why(server: RpcClient):
    opened = await server.call("session/open", {"backend": "landlock"})
    with pytest.raises(RpcError) as refused:
        await server.call("wrap", {"sessionId": opened["sessionId"], "command": "true"})
    assert refused.value.code == -32002 and "use run" in refused.value.message


async def test_unknown_backend_is_invalid_params(server: RpcClient):
    with pytest.raises(RpcError) as refused:
        await server.call("session/open", {"backend": "chroot"})
    assert refused.value.code == -32602 and "params.backend" in refused.value.message


async def test_unavailable_backend_answers_with_its_reason(server: RpcClient):
    with pytest.raises(RpcError) as refused:
        await server.call("session/open", {"backend": "seatbelt"})
    assert refused.value.code in (-32002, -32602)
    caps = await server.call("capabilities")
    seatbelt = [b for b in caps["backends"] if b["name"] == "seatbelt"]
    if seatbelt:
        assert seatbelt[0]["available"] is False and "macOS" in seatbelt[0]["reason"]
        assert refused.value.code == -32002 and "macOS" in refused.value.message


async def test_passthrough_isolates_nothing_and_says_so(server: RpcClient, scratch: Path, marker: str):
    with pytest.raises(RpcError) as refused:
        await server.call("session/open", {"backend": "passthrough", "requireIsolation": True})
    assert refused.value.code == -32004
    opened = await server.call("session/open", {"backend": "passthrough", "limits": {"memoryBytes": 64 << 20}})
    assert opened["isolated"] is False and any("without any isolation" in w for w in opened["warnings"])
    assert any(w.startswith("memory: not enforced") for w in opened["warnings"])
    result = await server.run(opened["sessionId"], f"echo visible > {scratch}/passthrough-{marker}; sleep {marker} &")
    assert result["isolated"] is False
    assert result["resources"]["mechanisms"]["memory"] == "none"
    # No isolation: the write lands on the host. The tree still dies with its run.
    assert (scratch / f"passthrough-{marker}").exists()
    from tests.conftest import wait_gone

    assert wait_gone(marker) == []


async def test_landlock_applies_cgroup_limits_entering_the_cgroup_before_its_domain(server: RpcClient, identity: str):
    opened = await server.call("session/open", {"backend": "landlock", "limits": {"memoryBytes": 64 << 20}})
    result = await server.run(opened["sessionId"], ["python3", "-c", "x = bytearray(512 * 1024 * 1024)"])
    assert result["exitCode"] != 0 and "memory" in result["resources"]["limitsHit"]
    assert result["resources"]["mechanisms"]["memory"] == ("cgroup" if identity == "root" else "rlimit_as")
    assert (await server.run(opened["sessionId"], "echo fine"))["stdout"] == "fine\n"
