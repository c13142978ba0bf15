"""The command line, through the real server and client."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

CLI = [sys.executable, "-m", "zsb_rpc"]


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def test_version_and_help():
    assert _cli("--version").stdout.strip().startswith("zsb-rpc ")
    for command in ([], ["capabilities"], ["exec"]):
        shown = _cli(*command, "--help")
        assert shown.returncode == 0 and "usage" in shown.stdout


def test_capabilities_prints_a_table_and_json():
    table = _cli("capabilities")
    assert table.returncode == 0
    for name in ("memory", "cpuSeconds", "cpuPercent", "processes", "fileSizeBytes", "openFiles", "coreDumps"):
        assert name in table.stdout
    raw = json.loads(_cli("capabilities", "--json").stdout)
    assert raw["backend"] == "bubblewrap" and raw["isolated"] is True


def test_exec_exit_codes():
    assert _cli("exec", "--", "sh", "-c", "exit 7").returncode == 7
    assert _cli("exec", "--", "sh", "-c", "kill -TERM $$").returncode == 128 + 15
    timed = _cli("exec", "--timeout", "1", "--", "sleep", "30")
    assert timed.returncode == 124 and "timed out" in timed.stderr
    refused = _cli("exec", "--processes", "2", "--", "true")
    assert refused.returncode == 125 and "params.limits.processes" in refused.stderr


@pytest.mark.timeout(60)
def test_exec_streams_output_live_and_writes_nowhere_else(tmp_path: Path, test_base: Path):
    workspace = Path(subprocess.check_output(["mktemp", "-d", "-p", str(test_base)], text=True).strip())
    flag = workspace / "go"
    process = subprocess.Popen(
        [*CLI, "exec", "--workspace", str(workspace), "--", "sh", "-c",
         "echo first; while [ ! -e go ]; do sleep 0.05; done; echo second; echo x > /etc/zsb-cli-escape"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    assert process.stdout is not None
    # The first line arrives while the command still waits for us: output is streamed.
    assert process.stdout.readline() == "first\n"
    flag.touch()
    rest, errors = process.communicate(timeout=30)
    assert rest == "second\n" and process.returncode != 0
    assert not Path("/etc/zsb-cli-escape").exists()
