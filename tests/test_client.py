"""The bundled client, ``zsb_rpc.client``, against the real server it starts as a child.

Nothing is mocked: every test that talks to a server starts ``python -m
zsb_rpc`` through the client. Processes are found by a unique argument
(``sleep 30.<digits>``) in /proc; workspaces given to the server live under
/var/tmp, since /tmp is private inside the sandbox.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from zsb_rpc.client import (
    SandboxCommandError,
    SandboxConnectionError,
    SandboxError,
    SandboxPolicyError,
    SandboxServer,
    SandboxSession,
    SandboxSessionError,
    SandboxUnavailableError,
    parse_size,
)

pytestmark = pytest.mark.timeout(60)


# -- helpers --------------------------------------------------------------------


def _cmdlines() -> Iterator[tuple[int, bytes]]:
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as handle:
                    yield int(entry), handle.read()
            except OSError:
                pass  # it exited while we looked


def alive_with(marker: str) -> list[int]:
    """Pids whose command line contains ``marker``."""
    return [pid for pid, cmdline in _cmdlines() if marker.encode() in cmdline]


def sleeping(argument: str) -> list[int]:
    """Pids that are exactly ``sleep <argument>`` (not a shell whose script mentions it)."""
    exact = b"sleep\0" + argument.encode() + b"\0"
    return [pid for pid, cmdline in _cmdlines() if cmdline == exact]


def wait_gone(marker: str, timeout: float = 5.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while (alive := alive_with(marker)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


async def started(task: asyncio.Future, argument: str, timeout: float = 10.0) -> None:
    """Wait until ``sleep <argument>`` runs; a run that failed instead raises its error here."""
    deadline = time.monotonic() + timeout
    while not sleeping(argument):
        if task.done():
            await task
            raise AssertionError(f"the run ended before sleep {argument} was seen")
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.02)


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def server_children() -> set[int]:
    """This test process's own server children."""
    found = set()
    for child in psutil.Process().children():
        try:
            if "zsb_rpc" in child.cmdline():
                found.add(child.pid)
        except psutil.NoSuchProcess:
            pass
    return found


@pytest.fixture
def mark() -> str:
    """A unique sleep duration: ``sleep <mark>`` is findable in /proc and lasts 30 s."""
    return f"30.{secrets.randbelow(10**9):09d}"


@pytest.fixture
def project() -> Iterator[Path]:
    """A caller's workspace: a real directory outside /tmp, removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="zsb-client-", dir="/var/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def python_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Put this interpreter's directory first on PATH (the server, and so each command, inherits it)."""
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))


# -- the documented program ---------------------------------------------------------


def test_the_documented_program_works_unchanged(project: Path, python_on_path: None, capsys) -> None:
    (project / "build.py").write_text(
        "import os\nos.makedirs('dist', exist_ok=True)\n"
        "open('dist/app.tar', 'w').write('built')\nprint('built dist/app.tar')\n"
    )
    code = "import sys\nprint('job ran on', sys.platform)\n"

    with SandboxSession(str(project), memory="512MB", cpus=1, cpu_seconds=60) as sb:
        sb.run("python build.py", check=True)
        print(sb.run("ls dist").stdout)

    with SandboxSession(memory="256MB", timeout=30) as sb:      # private workspace, gone afterwards
        (sb.workspace / "job.py").write_text(code)
        result = sb.run(["python3", "job.py"], check=True)

    assert capsys.readouterr().out == "app.tar\n\n"
    assert (project / "dist" / "app.tar").read_text() == "built"  # the given workspace is kept
    assert result.stdout == "job ran on linux\n" and result.succeeded and result.isolated
    assert isinstance(sb.workspace, Path) and not sb.workspace.exists()


def test_the_private_workspace_is_gone_after_the_with_block() -> None:
    with SandboxSession() as sb:
        workspace = sb.workspace
        assert workspace.is_dir()
        sb.run("mkdir -p a/b && echo x > a/b/f && chmod 000 a/b a", check=True)
    assert not workspace.exists()


async def test_the_private_workspace_is_gone_after_the_async_with_block() -> None:
    async with SandboxSession() as sb:
        workspace = sb.workspace
        (await sb.arun("echo x > f", check=True))
        assert (workspace / "f").read_text() == "x\n"
    assert not workspace.exists()


# -- results and check=True -----------------------------------------------------------


def test_run_returns_a_result_like_subprocess_run(project: Path) -> None:
    (project / "sub").mkdir()
    with SandboxSession(str(project), env={"FROM_SESSION": "s"}) as sb:
        result = sb.run("echo out; echo err >&2; exit 3")
        assert (result.exit_code, result.returncode, result.stdout, result.stderr) == (3, 3, "out\n", "err\n")
        assert not result.succeeded and not result.timed_out and result.isolated
        assert result.duration_seconds > 0 and result.command == "echo out; echo err >&2; exit 3"
        with pytest.raises(dataclasses.FrozenInstanceError):
            result.exit_code = 0  # type: ignore[misc]

        listed = sb.run(["sh", "-c", 'pwd; echo "$FROM_SESSION $FROM_RUN"; cat'], cwd="sub",
                        env={"FROM_RUN": "r"}, input="from stdin")
        assert listed.stdout == f"{project / 'sub'}\ns r\nfrom stdin" and listed.succeeded
        assert listed.command == ("sh", "-c", 'pwd; echo "$FROM_SESSION $FROM_RUN"; cat')

        cut = sb.run("head -c 100000 /dev/zero | tr '\\0' a", output_limit="1K")
        assert cut.stdout == "a" * 1024 and cut.truncated.stdout and not cut.truncated.stderr

        assert sb.run("kill -9 $$").exit_code == -9


def test_check_true_raises_with_the_result() -> None:
    with SandboxSession(timeout=10) as sb:
        with pytest.raises(SandboxCommandError) as caught:
            sb.run("echo out; echo oops >&2; exit 3", check=True)
        error = caught.value
        assert isinstance(error, SandboxError) and error.code is None
        assert error.result.exit_code == error.returncode == 3
        assert (error.result.stdout, error.result.stderr) == ("out\n", "oops\n")
        assert "exited with status 3" in str(error) and "oops" in str(error)

        with pytest.raises(SandboxCommandError) as caught:
            sb.run(["sleep", "20"], timeout=0.5, check=True)
        assert caught.value.result.timed_out and "timed out" in str(caught.value)

        assert sb.run("true", check=True).succeeded


def test_bytes_input_goes_as_base64_and_output_is_decoded_with_replacement() -> None:
    with SandboxSession() as sb:
        result = sb.run("cat; printf 'caf\\303\\251\\377' >&2", input=b"\xff\xfehello \xe2\x82\xac")
        assert result.stdout == "\ufffd\ufffdhello \u20ac"
        assert result.stderr == "caf\u00e9\ufffd"


# -- streaming --------------------------------------------------------------------------


def test_streaming_callbacks_receive_every_chunk_in_this_thread() -> None:
    out: list[str] = []
    err: list[str] = []
    threads = set()

    def on_stdout(chunk: str) -> None:
        threads.add(threading.get_ident())
        out.append(chunk)

    script = "for i in 1 2 3 4 5; do echo line $i; echo warn $i >&2; sleep 0.1; done; head -c 300000 /dev/zero"
    with SandboxSession() as sb:
        result = sb.run(script, on_stdout=on_stdout, on_stderr=err.append)
    assert "".join(out) == result.stdout and len(result.stdout) == 5 * 7 + 300000
    assert "".join(err) == result.stderr == "".join(f"warn {i}\n" for i in range(1, 6))
    assert len(out) >= 2 and len(err) >= 2  # they came as the command ran, not as one piece at the end
    assert threads == {threading.get_ident()}


async def test_async_streaming_and_bytes_never_split_a_character() -> None:
    text = "\u20ac" * 100_000  # 3 bytes each: 64 KiB chunks end inside characters
    chunks: list[str] = []
    async with SandboxSession() as sb:
        result = await sb.arun("cat", input=text.encode(), on_stdout=chunks.append)
    assert "".join(chunks) == text == result.stdout
    assert len(chunks) >= 2


def test_a_callback_that_raises_stops_the_run(mark: str) -> None:
    def on_stdout(chunk: str) -> None:
        raise RuntimeError("enough")

    with SandboxSession() as sb:
        with pytest.raises(RuntimeError, match="enough"):
            sb.run(f"echo started; sleep {mark}", on_stdout=on_stdout)
        assert wait_gone(mark) == []
        assert sb.run("echo still serving").stdout == "still serving\n"


# -- asyncio: concurrency and cancellation ------------------------------------------------


async def test_async_runs_execute_concurrently() -> None:
    # Each run waits until all eight have started, then sleeps: run one at a
    # time, the first would wait until its timeout. While they sleep, count them.
    argument = f"1.{secrets.randbelow(10**9):09d}"
    script = ("touch ready.{i}; until [ $(ls ready.* | wc -l) -ge 8 ]; do sleep 0.01; done; "
              f"exec sleep {argument}")
    most = 0
    done = False

    async def count() -> None:
        nonlocal most
        while not done:
            most = max(most, len(sleeping(argument)))
            await asyncio.sleep(0.01)

    async with SandboxSession(timeout=20) as sb:
        counter = asyncio.ensure_future(count())
        try:
            results = await asyncio.gather(*(sb.arun(script.format(i=i)) for i in range(8)))
        finally:
            done = True
            await counter
    assert [(r.exit_code, r.timed_out) for r in results] == [(0, False)] * 8
    assert most == 8


async def test_cancelling_an_arun_task_kills_its_process(mark: str) -> None:
    async with SandboxSession() as sb:
        task = asyncio.ensure_future(sb.arun(["sleep", mark]))
        await started(task, mark)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert wait_gone(mark) == []
        assert (await sb.arun("echo still serving")).stdout == "still serving\n"


async def test_sync_and_async_calls_mix_on_one_session() -> None:
    async with SandboxSession(memory="256MB") as sb:
        caps = await sb.acapabilities()
        assert caps.platform == "linux" and caps.backend == sb.backend
        assert caps.memory in ("cgroup", "rlimit", "rlimit_as", "watchdog", "none")
        assert sb.capabilities() == caps
        wrapped = await sb.awrap(["echo", "hi"], env={"X": "1"})
        assert wrapped.argv[-2:] == ("echo", "hi") and wrapped.cwd == str(sb.workspace)
        # The command's environment travels in the argv (bwrap --setenv), not in the launcher's.
        triples = zip(wrapped.argv, wrapped.argv[1:], wrapped.argv[2:], strict=False)
        assert "X" not in wrapped.env and ("--setenv", "X", "1") in triples
        assert sb.wrap(["echo", "hi"], env={"X": "1"}) == wrapped
        assert sb.run("echo sync").stdout == "sync\n"


# -- lifetime of the server child -------------------------------------------------------------


def test_closing_the_session_stops_its_server() -> None:
    with SandboxSession() as sb:
        pid = sb.server.pid
        assert running(pid) and not sb.server.closed
    assert sb.closed and sb.server.closed and sb.server.returncode == 0
    assert not running(pid)
    with pytest.raises(RuntimeError, match="closed"):
        sb.run("true")
    sb.close()  # again: nothing to do


def test_garbage_collecting_a_session_stops_its_server_and_removes_its_workspace() -> None:
    sb = SandboxSession().open()
    pid, workspace = sb.server.pid, sb.workspace
    assert running(pid) and workspace.is_dir()
    del sb
    gc.collect()
    assert not running(pid)
    assert not workspace.exists()


def test_garbage_collecting_a_server_stops_it() -> None:
    server = SandboxServer()
    pid = server.pid
    assert server.capabilities().protocol_version == "1"
    del server
    gc.collect()
    assert not running(pid)


async def test_sessions_share_a_server_until_the_caller_closes_it(mark: str) -> None:
    server = SandboxServer()
    try:
        async with SandboxSession(server=server) as first:
            first_workspace = first.workspace
        assert not first_workspace.exists() and not server.closed  # the shared server keeps running

        second = await SandboxSession(server=server).aopen()
        task = asyncio.ensure_future(second.arun(["sleep", mark]))
        await started(task, mark)
        # The server's stdin closes: it kills every run, closes every session, exits.
        await server.aclose()
        with pytest.raises((SandboxSessionError, SandboxConnectionError)):
            await task
        assert wait_gone(mark) == []
        assert not second.workspace.exists()
        assert server.returncode == 0
        await second.aclose()  # the server is gone: nothing left to close
    finally:
        server.close()


def test_an_abandoned_session_on_a_shared_server_is_closed_there() -> None:
    with SandboxServer() as server:
        sb = SandboxSession(server=server).open()
        workspace = sb.workspace
        del sb
        gc.collect()
        wait_for(lambda: not workspace.exists())
        assert not server.closed


CLIENT_PROGRAM = """
import sys, time
from zsb_rpc.client import SandboxSession
sb = SandboxSession().open()
print(sb.server.pid, sb.workspace, flush=True)
if sys.argv[1] == "wait":
    time.sleep(60)
"""


@pytest.mark.parametrize("end", ["exit", "sigkill"])
def test_the_server_never_outlives_its_client(end: str) -> None:
    # "exit": the program ends without closing anything; "sigkill": it is killed.
    client = subprocess.Popen([sys.executable, "-c", CLIENT_PROGRAM, "exit" if end == "exit" else "wait"],
                              stdout=subprocess.PIPE, text=True)
    try:
        pid_text, workspace_text = client.stdout.readline().split(maxsplit=1)  # type: ignore[union-attr]
        pid, workspace = int(pid_text), Path(workspace_text.strip())
        if end == "sigkill":
            client.kill()
        assert client.wait(timeout=20) == (0 if end == "exit" else -signal.SIGKILL)
        wait_for(lambda: not running(pid))
        wait_for(lambda: not workspace.exists())  # the server removed it on its way out
    finally:
        client.kill()
        client.wait()
        client.stdout.close()  # type: ignore[union-attr]


async def test_a_server_that_dies_fails_calls_in_flight(mark: str) -> None:
    async with SandboxSession() as sb:
        task = asyncio.ensure_future(sb.arun(["sleep", mark]))
        await started(task, mark)
        pid = sb.server.pid
        try:
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(SandboxConnectionError, match="closed the connection"):
                await task
            assert wait_gone(mark) == []  # bubblewrap dies with its parent
            with pytest.raises(SandboxConnectionError):
                await sb.arun("true")
        finally:
            # A killed server cannot remove its directory (and the private workspace in it).
            for leftover in Path(tempfile.gettempdir(), f"zsb-rpc-{os.getuid()}").glob(f"server-{pid}-*"):
                shutil.rmtree(leftover)
    # Leaving the block did not raise: the session went with its server.


# -- errors -----------------------------------------------------------------------------------


def test_policy_errors_raise_sandbox_policy_error_naming_the_field() -> None:
    before = server_children()
    with pytest.raises(SandboxPolicyError) as caught:
        SandboxSession(processes=2).open()
    error = caught.value
    assert error.code == -32602 and "params.limits.processes" in error.message
    assert error.data == {"field": "params.limits.processes"}
    assert server_children() == before  # the failed open did not leave its server behind

    with pytest.raises(SandboxPolicyError, match=r"params\.limits\.memoryBytes"):
        with SandboxSession(memory="1MB"):
            pass
    with SandboxSession() as sb:
        with pytest.raises(SandboxPolicyError, match=r"params\.cwd"):
            sb.run("true", cwd="no/such/directory")
        with pytest.raises(SandboxPolicyError, match=r"params\.timeout"):
            sb.run("true", timeout=-1)


def test_other_server_errors_map_to_their_classes() -> None:
    with pytest.raises(SandboxUnavailableError) as caught:
        SandboxSession(backend="passthrough", require_isolation=True).open()
    assert caught.value.code == -32004 and "isolat" in caught.value.message
    with SandboxServer() as server:
        with pytest.raises(SandboxSessionError) as session_error:
            server.request("run", {"sessionId": "s-none", "command": "true"})
        assert session_error.value.code == -32001
        with pytest.raises(SandboxError) as unknown:
            server.request("no/such/method")
        assert type(unknown.value) is SandboxError and unknown.value.code == -32601


def test_bad_option_values_are_refused_before_anything_starts() -> None:
    with pytest.raises(ValueError, match="memory"):
        SandboxSession(memory="lots")
    with pytest.raises(TypeError, match="cpus"):
        SandboxSession(cpus="1")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="network"):
        SandboxSession(network=3)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="open"):
        SandboxSession().run("true")


# -- pure conversion ------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "expected"), [
    (4096, 4096),
    ("100", 100),
    ("100B", 100),
    ("1K", 1024),
    ("64kb", 64 * 1024),
    ("512MB", 512 * 1024**2),
    ("512MiB", 512 * 1024**2),
    ("512 M", 512 * 1024**2),
    ("1.5G", 3 * 1024**3 // 2),
    (" 2GiB ", 2 * 1024**3),
    ("1T", 1024**4),
    (".5k", 512),
    ("1.1K", 1126),  # fractions of a byte are dropped
    (1.0e6, 1_000_000),
])
def test_parse_size(text, expected) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "MB", "12X", "-1", "1.2.3", "1 KBB", "1iB", "0x10", "1e3", -5, float("nan")])
def test_parse_size_refuses_what_is_not_a_size(text) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


@pytest.mark.parametrize("value", [True, None, b"1K", [1]])
def test_parse_size_refuses_other_types(value) -> None:
    with pytest.raises(TypeError):
        parse_size(value)


def test_options_map_to_session_open_params() -> None:
    sb = SandboxSession(
        Path("/var/tmp"), memory="1.5G", max_file_size="1K", cpus=0.5, cpu_seconds=60.0, processes=64,
        open_files=256, core_dumps=True, network=True, writable="/var/tmp/out", deny_write=["/var/tmp/out/keep"],
        deny_read=[Path("/etc/secret")], env={"A": "1"}, inherit_environment="PATH", timeout=None,
        output_limit="2MB", protect_defaults=False, backend="bubblewrap", require_isolation=True,
        memory_strategy="kernel",
    )
    assert sb.params == {
        "workspace": "/var/tmp",
        "writable": ["/var/tmp/out"],
        "denyWrite": ["/var/tmp/out/keep"],
        "denyRead": ["/etc/secret"],
        "network": "full",
        "env": {"A": "1"},
        "inheritEnvironment": ["PATH"],
        "outputLimit": 2 * 1024**2,
        "limits": {"memoryBytes": 3 * 1024**3 // 2, "cpuSeconds": 60, "cpuPercent": 50, "processes": 64,
                   "fileSizeBytes": 1024, "openFiles": 256, "coreDumps": True},
        "protectDefaults": False,
        "backend": "bubblewrap",
        "requireIsolation": True,
        "memoryStrategy": "kernel",
        "timeout": None,
    }
    assert SandboxSession().params == {}  # the server's defaults
    assert SandboxSession(network=False, timeout=30).params == {"network": "none", "timeout": 30}
    assert SandboxSession("relative").params["workspace"] == os.path.join(os.getcwd(), "relative")
