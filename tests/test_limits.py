"""Resource limits on the real kernel: cgroup v1 as root here, rlimits as an unprivileged user."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from tests.rpc import RpcClient

MiB = 1024 * 1024
GROW = "python3 -c 'import time\nx=[]\nwhile True:\n    x.append(bytearray(8*1024*1024)); time.sleep(0.05)'"


def _server_cgroups(uid_is_root: bool) -> list[str]:
    """Every zsb-rpc cgroup directory on this machine's v1 memory/pids/cpu hierarchies."""
    found = []
    for controller in ("memory", "pids", "cpu", "cpuacct"):
        base = Path("/sys/fs/cgroup") / controller
        if base.is_dir():
            for dirpath, dirnames, _ in os.walk(base):
                found += [os.path.join(dirpath, d) for d in dirnames if d.startswith("zsb-rpc-")]
                if dirpath.count("/") > 8:
                    dirnames.clear()
    return found


async def test_capabilities_match_what_a_run_reports(server: RpcClient, identity: str):
    limits = {"memoryBytes": 64 * MiB, "cpuSeconds": 5, "cpuPercent": 50, "processes": 32,
              "fileSizeBytes": 10 * MiB, "openFiles": 64}
    caps = await server.call("capabilities", {"limits": limits})
    opened = await server.open(limits=limits)
    result = await server.run(opened["sessionId"], "true")
    for name, value in result["resources"]["mechanisms"].items():
        assert caps[name] == value, name
    if identity == "root":
        assert (caps["memory"], caps["processes"], caps["cpuPercent"]) == ("cgroup", "cgroup", "cgroup")
    else:
        assert (caps["memory"], caps["processes"], caps["cpuPercent"]) == ("rlimit_as", "rlimit", "none")
        assert any(w.startswith("cpuPercent: not enforced") for w in caps["warnings"])
        assert any(w.startswith("cpuPercent: not enforced") for w in result["resources"]["warnings"])
    assert caps["cpuSeconds"] == caps["fileSizeBytes"] == caps["openFiles"] == caps["coreDumps"] == "rlimit"


async def test_512_mb_allocation_under_64_mb_dies_and_reports_memory(server: RpcClient):
    opened = await server.open(limits={"memoryBytes": 64 * MiB})
    result = await server.run(opened["sessionId"], ["python3", "-c", "x = bytearray(512 * 1024 * 1024); print('ALLOCATED')"])
    assert "ALLOCATED" not in result["stdout"] and result["exitCode"] != 0
    assert "memory" in result["resources"]["limitsHit"]


async def test_50_mb_write_under_10_mb_file_limit_stops_at_10_mib(server: RpcClient):
    opened = await server.open(limits={"fileSizeBytes": 10 * MiB})
    result = await server.run(opened["sessionId"], "head -c 50000000 /dev/zero > big.bin")
    assert result["exitCode"] != 0
    assert (Path(opened["workspace"]) / "big.bin").stat().st_size <= 10 * MiB
    assert "file_size" in result["resources"]["limitsHit"]


async def test_200_background_sleeps_under_32_processes_never_exceed_32(server: RpcClient, marker: str):
    opened = await server.open(limits={"processes": 32})
    # dash gives up at the first failed fork, so a Python parent starts the 200 and counts.
    program = (
        "import os, subprocess\nstarted = []\nfor _ in range(200):\n    try:\n"
        f"        started.append(subprocess.Popen(['sleep', '{marker}']))\n"
        "    except OSError:\n        pass\n"
        "print(len([p for p in os.listdir('/proc') if p.isdigit()]), len(started))\n"
        "[p.kill() for p in started]\n"
    )
    result = await server.run(opened["sessionId"], ["python3", "-c", program], runId="pids")
    alive, started = map(int, result["stdout"].split())
    assert started < 200 and alive <= 32, result
    samples = [n["processes"] for n in server.notifications("run/resources") if n["runId"] == "pids"]
    assert all(count is None or count <= 32 + 3 for count in samples)  # host view adds the launcher


async def test_busy_loop_under_cpu_seconds_1_ends_and_reports_cpu(server: RpcClient):
    opened = await server.open(limits={"cpuSeconds": 1})
    result = await server.run(opened["sessionId"], ["sh", "-c", "while :; do :; done"], timeout=30)
    assert result["timedOut"] is False and result["exitCode"] in (-24, -9)
    assert "cpu" in result["resources"]["limitsHit"]


async def test_cpu_percent_50_holds_a_busy_loop_near_half_a_core(server: RpcClient, identity: str):
    opened = await server.open(limits={"cpuPercent": 50})
    result = await server.run(opened["sessionId"], ["sh", "-c", "while :; do :; done"], timeout=2)
    assert result["timedOut"] is True
    if identity == "root":
        assert result["resources"]["mechanisms"]["cpuPercent"] == "cgroup"
        assert 0.6 <= result["resources"]["cpuSeconds"] <= 1.4, result["resources"]
    else:
        assert result["resources"]["mechanisms"]["cpuPercent"] == "none"
        assert any("cpuPercent" in w for w in result["resources"]["warnings"])


async def test_open_files_16_stops_the_17th_open(server: RpcClient):
    opened = await server.open(limits={"openFiles": 16})
    program = ("import os\nn = 3\ntry:\n    while True:\n        os.open('/dev/null', os.O_RDONLY); n += 1\n"
               "except OSError as e:\n    print(n, e.errno)")
    result = await server.run(opened["sessionId"], ["python3", "-c", program])
    assert result["stdout"].split() == ["16", "24"]  # 16 descriptors open, then EMFILE


async def test_watchdog_strategy_kills_a_slow_grower(server: RpcClient):
    opened = await server.open(limits={"memoryBytes": 64 * MiB, "memorySampleSeconds": 0.05},
                               memoryStrategy="watchdog")
    result = await server.run(opened["sessionId"], GROW, timeout=30, runId="w")
    assert result["resources"]["mechanisms"]["memory"] == "watchdog"
    assert result["exitCode"] == -9 and "memory" in result["resources"]["limitsHit"]
    samples = server.notifications("run/resources")
    assert samples and all({"memoryBytes", "peakMemoryBytes", "cpuSeconds", "processes"} <= set(s) for s in samples)


async def test_memory_strategy_none_is_reported_as_not_enforced(server: RpcClient):
    opened = await server.open(limits={"memoryBytes": 64 * MiB}, memoryStrategy="none")
    assert any(w.startswith("memory: not enforced") for w in opened["warnings"])
    result = await server.run(opened["sessionId"], "true")
    assert result["resources"]["mechanisms"]["memory"] == "none"


async def test_wrap_carries_rlimits_and_says_what_it_cannot(server: RpcClient, identity: str):
    opened = await server.open(limits={"memoryBytes": 64 * MiB, "cpuPercent": 50, "openFiles": 32})
    wrapped = await server.call("wrap", {"sessionId": opened["sessionId"], "command": "true"})
    assert wrapped["argv"][0].endswith("prlimit") and "--nofile=32" in wrapped["argv"]
    assert f"--as={64 * MiB}" in wrapped["argv"]  # the argv's own memory mechanism
    assert any(w.startswith("cpuPercent: not enforced") for w in wrapped["warnings"])


@pytest.mark.skipif(os.geteuid() != 0, reason="cgroups here are root's")
async def test_no_cgroup_directories_are_left_behind(server: RpcClient, identity: str, marker: str):
    if identity != "root":
        pytest.skip("the unprivileged server uses no cgroups")
    opened = await server.open(limits={"memoryBytes": 64 * MiB, "processes": 32, "cpuPercent": 50})
    await server.run(opened["sessionId"], "true")
    await server.run(opened["sessionId"], f"sleep {marker}", timeout=0.5)
    _, running = server.send_request("run", {"sessionId": opened["sessionId"], "command": f"sleep {marker}"})
    await server.call("session/close", {"sessionId": opened["sessionId"]})
    await running

    def runs_left() -> list[Path]:
        mine = [Path(p) for p in _server_cgroups(True) if f"zsb-rpc-{server.pid}-" in p]
        return [run for directory in mine for run in directory.glob("run-*")]

    # A run's cgroup goes right after its answer, off the answer's path.
    for _ in range(100):
        if not runs_left():
            break
        await asyncio.sleep(0.02)
    assert runs_left() == []
    await server.close_stdin()
    await server.wait_exit(5)
    assert [p for p in _server_cgroups(True) if f"zsb-rpc-{server.pid}-" in p] == []
