"""The TypeScript client's own tests (``npm test`` in clients/typescript), against the real server.

``npm test`` checks that src/protocol.ts matches the schema, builds with tsc,
and runs Node's test runner; the server it starts is this interpreter's
``-m zsb_rpc``. .ci/setup has already run ``npm ci``; a checkout without
node_modules gets it here.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "clients" / "typescript"
NPM = shutil.which("npm")


def _npm(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "ZSB_RPC_PYTHON": sys.executable, "NO_COLOR": "1", "npm_config_update_notifier": "false"}
    assert NPM is not None
    # A group of its own, so that a timeout ends node and the servers it started too.
    process = subprocess.Popen([NPM, *args], cwd=PACKAGE, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"npm {' '.join(args)} did not finish in {timeout} s in {PACKAGE}:\n{output}")
    return subprocess.CompletedProcess(process.args, process.returncode, output)


@pytest.mark.skipif(NPM is None, reason="npm is not installed")
@pytest.mark.timeout(300)
def test_typescript_client_npm_test():
    if not (PACKAGE / "node_modules").is_dir():
        installed = _npm("ci", "--no-audit", "--no-fund", "--loglevel=error", timeout=150)
        assert installed.returncode == 0, f"npm ci failed in {PACKAGE}:\n{installed.stdout}"
    result = _npm("test", timeout=240)
    assert result.returncode == 0, f"npm test failed (exit {result.returncode}) in {PACKAGE}:\n{result.stdout}"
    # Node's runner closes with "# pass N" / "# fail N" (TAP) or "ℹ pass N" (spec): some ran, none failed.
    assert re.search(r"^\W*pass [1-9]", result.stdout, re.M), f"npm test ran no test:\n{result.stdout}"
    assert re.search(r"^\W*fail 0$", result.stdout, re.M), result.stdout
