"""Benchmarks against the physical floor: ``python -m zsb_rpc.bench``.

Every figure is measured beside its baseline in the same run, interleaved so
that machine drift hits both alike, and reported as medians and p99 (or as a
rate). The table goes to stdout, then one JSON line with every number.
Not part of the test suite: speed is measured here, never asserted in a test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .client import SandboxServer, SandboxSession

MB = 1000 * 1000
ALL_LIMITS = dict(memory="512MB", cpu_seconds=60, cpus=1, processes=256, max_file_size="1GB", open_files=1024)


def _quantiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]
    return {"median_ms": statistics.median(ordered) * 1000, "p99_ms": p99 * 1000, "n": len(ordered)}


def _spawn_direct(argv: list[str], cwd: str, env: dict[str, str]) -> float:
    started = time.perf_counter()
    subprocess.run(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                   start_new_session=True, check=False)
    return time.perf_counter() - started


def bench_round_trip(repetitions: int, limits: dict[str, Any]) -> dict[str, Any]:
    """A warm ``run ["true"]`` through the client, against the same bwrap argv spawned directly."""
    with SandboxSession(**limits) as sb:
        wrapped = sb.wrap(["true"])
        argv, cwd, env = list(wrapped.argv), wrapped.cwd, dict(wrapped.env)
        for _ in range(20):  # warm both paths
            sb.run(["true"])
            _spawn_direct(argv, cwd, env)
        ours, direct = [], []
        for _ in range(repetitions):
            started = time.perf_counter()
            sb.run(["true"])
            ours.append(time.perf_counter() - started)
            direct.append(_spawn_direct(argv, cwd, env))
    a, b = _quantiles(ours), _quantiles(direct)
    return {"run": a, "baseline": b, "ratio": a["median_ms"] / b["median_ms"]}


STREAM_COMMAND = "yes | head -c {size}"


def _raw_pipe(argv: list[str], cwd: str, env: dict[str, str]) -> tuple[float, int]:
    started = time.perf_counter()
    process = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, start_new_session=True)
    assert process.stdout is not None
    total = 0
    while chunk := process.stdout.read1(1 << 16):  # type: ignore[attr-defined]
        total += len(chunk)
    process.wait()
    return time.perf_counter() - started, total


def bench_stream_python(size: int, rounds: int) -> dict[str, Any]:
    with SandboxSession(timeout=None, output_limit=0) as sb:
        wrapped = sb.wrap(STREAM_COMMAND.format(size=size))
        ours, raw = [], []
        for _ in range(rounds):
            received = [0]

            def count(chunk: str, received: list[int] = received) -> None:
                received[0] += len(chunk)

            started = time.perf_counter()
            sb.run(STREAM_COMMAND.format(size=size), on_stdout=count)
            elapsed = time.perf_counter() - started
            assert received[0] == size, received[0]
            ours.append(size / elapsed / MB)
            seconds, total = _raw_pipe(list(wrapped.argv), wrapped.cwd, dict(wrapped.env))
            assert total == size
            raw.append(size / seconds / MB)
    rate, base = statistics.median(ours), statistics.median(raw)
    return {"MBps": rate, "baseline_MBps": base, "ratio": rate / base}


TS_STREAM = r"""
const { ZsbClient } = require(process.argv[1]);
(async () => {
  const client = await ZsbClient.start({ command: process.argv[2], args: ["-m", "zsb_rpc"] });
  const session = await client.openSession({ timeout: null, outputLimit: 0 });
  const size = Number(process.argv[3]);
  const rates = [];
  for (let i = 0; i < Number(process.argv[4]); i++) {
    let received = 0;
    const started = process.hrtime.bigint();
    await session.run(`yes | head -c ${size}`, { onStdout: (d) => { received += d.length; } });
    const seconds = Number(process.hrtime.bigint() - started) / 1e9;
    if (received !== size) throw new Error(`received ${received}`);
    rates.push(size / seconds / 1e6);
  }
  await session.close();
  await client.dispose();
  rates.sort((a, b) => a - b);
  console.log(JSON.stringify({ MBps: rates[Math.floor(rates.length / 2)] }));
})().catch((e) => { console.error(e); process.exit(1); });
"""


def bench_stream_typescript(size: int, rounds: int) -> dict[str, Any] | None:
    package = Path(__file__).resolve().parent.parent / "clients" / "typescript" / "dist" / "index.js"
    node = shutil.which("node")
    if node is None or not package.exists():
        return None
    done = subprocess.run([node, "-e", TS_STREAM, str(package), sys.executable, str(size), str(rounds)],
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        return {"error": done.stderr.strip()[-300:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


async def _concurrent(sessions: int, runs: int) -> tuple[float, float]:
    with SandboxServer() as server:
        opened = [SandboxSession(server=server) for _ in range(sessions)]
        for session in opened:
            await session.aopen()
        started = time.perf_counter()
        await opened[0].arun(["sleep", "1"])
        one = time.perf_counter() - started
        started = time.perf_counter()
        await asyncio.gather(*(opened[i % sessions].arun(["sleep", "1"]) for i in range(runs)))
        many = time.perf_counter() - started
        for session in opened:
            await session.aclose()
    return one, many


def bench_startup(repetitions: int) -> dict[str, Any]:
    """Server start to its first capabilities answer, against ``python3 -c pass``."""
    ours, base = [], []
    request = b'{"jsonrpc":"2.0","id":1,"method":"capabilities"}'
    frame = b"Content-Length: %d\r\n\r\n" % len(request) + request
    for _ in range(repetitions):
        started = time.perf_counter()
        process = subprocess.Popen([sys.executable, "-m", "zsb_rpc"], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        assert process.stdin is not None and process.stdout is not None
        process.stdin.write(frame)
        process.stdin.flush()
        header = process.stdout.readline()
        assert header.startswith(b"Content-Length")
        ours.append(time.perf_counter() - started)
        process.stdin.close()
        process.wait()
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        base.append(time.perf_counter() - started)
    a, b = _quantiles(ours), _quantiles(base)
    return {"start": a, "baseline": b, "ratio": a["median_ms"] / b["median_ms"]}


def bench_slow_reader_rss(size: int) -> dict[str, Any]:
    """Peak RSS of the server while a client reads 1 GB of streamed output slowly."""
    import psutil

    body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "session/open", "params": {"timeout": None,
                                                                                       "outputLimit": 0}})
    process = subprocess.Popen([sys.executable, "-m", "zsb_rpc"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, bufsize=0)
    assert process.stdin is not None and process.stdout is not None
    reader = process.stdout

    def send(text: str) -> None:
        data = text.encode()
        process.stdin.write(b"Content-Length: %d\r\n\r\n" % len(data) + data)  # type: ignore[union-attr]

    def read_message() -> dict[str, Any]:
        length = 0
        while (line := reader.readline().strip()):
            if line.lower().startswith(b"content-length"):
                length = int(line.split(b":")[1])
        data = b""
        while len(data) < length:
            data += reader.read(length - len(data))
        return json.loads(data)

    send(body)
    session = read_message()["result"]["sessionId"]
    send(json.dumps({"jsonrpc": "2.0", "id": 2, "method": "run", "params": {
        "sessionId": session, "command": f"yes | head -c {size}", "runId": "slow"}}))
    server = psutil.Process(process.pid)
    peak = 0
    received = 0
    started = time.perf_counter()
    while True:
        message = read_message()
        if message.get("id") == 2:
            break
        received += len(message["params"]["data"]) if message.get("method") == "run/output" else 0
        if received % (8 * 1024 * 1024) < 65536:
            peak = max(peak, server.memory_info().rss)
            time.sleep(0.001)  # a slow reader: the command must wait for it
    elapsed = time.perf_counter() - started
    peak = max(peak, server.memory_info().rss)
    process.stdin.close()
    process.wait()
    return {"peak_rss_MiB": peak / 2**20, "received_MB": received / MB, "MBps": received / elapsed / MB}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zsb_rpc.bench", description=__doc__)
    parser.add_argument("--repetitions", type=int, default=300)
    parser.add_argument("--stream-mb", type=int, default=200)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions, smaller streams")
    args = parser.parse_args(argv)
    reps = 40 if args.quick else args.repetitions
    stream = (20 if args.quick else args.stream_mb) * MB
    results: dict[str, Any] = {}
    results["run_true"] = bench_round_trip(reps, {})
    results["run_all_limits"] = bench_round_trip(reps, ALL_LIMITS)
    results["stream_python"] = bench_stream_python(stream, 3)
    results["stream_typescript"] = bench_stream_typescript(stream, 3)
    one, many = asyncio.run(_concurrent(8, 64))
    results["concurrent_64x1s"] = {"one_s": one, "wall_s": many}
    results["startup"] = bench_startup(10 if args.quick else 20)
    results["slow_reader"] = bench_slow_reader_rss((100 if args.quick else 1000) * MB)

    def row(figure: str, value: str, baseline: str, target: str) -> str:
        return f"| {figure} | {value} | {baseline} | {target} |"

    r = results
    lines = [
        "| figure | measured | baseline in the same run | target |",
        "|---|---|---|---|",
        row("warm run [\"true\"] (Python client)",
            f"{r['run_true']['run']['median_ms']:.2f} ms (p99 {r['run_true']['run']['p99_ms']:.2f})",
            f"bwrap directly {r['run_true']['baseline']['median_ms']:.2f} ms: {r['run_true']['ratio']:.2f}x", "<= 1.3x"),
        row("warm run with every limit",
            f"{r['run_all_limits']['run']['median_ms']:.2f} ms (p99 {r['run_all_limits']['run']['p99_ms']:.2f})",
            f"bwrap directly {r['run_all_limits']['baseline']['median_ms']:.2f} ms: "
            f"{r['run_all_limits']['ratio']:.2f}x", "<= 1.5x"),
        row(f"stream {stream // MB} MB, Python client", f"{r['stream_python']['MBps']:.0f} MB/s",
            f"raw pipe {r['stream_python']['baseline_MBps']:.0f} MB/s: {r['stream_python']['ratio']:.2f}x",
            ">= 150 MB/s"),
        row(f"stream {stream // MB} MB, TypeScript client",
            f"{r['stream_typescript']['MBps']:.0f} MB/s" if r["stream_typescript"] and "MBps" in r["stream_typescript"]
            else str(r["stream_typescript"]),
            f"raw pipe {r['stream_python']['baseline_MBps']:.0f} MB/s", ">= 150 MB/s"),
        row("64 concurrent 1 s runs, 8 sessions", f"{many:.2f} s wall", f"one run {one:.2f} s", "<= 1.5 s"),
        row("server start to first capabilities", f"{r['startup']['start']['median_ms']:.0f} ms",
            f"python3 -c pass {r['startup']['baseline']['median_ms']:.0f} ms: {r['startup']['ratio']:.2f}x",
            "<= 2x"),
        row(f"server peak RSS, {r['slow_reader']['received_MB']:.0f} MB to a slow reader",
            f"{r['slow_reader']['peak_rss_MiB']:.0f} MiB", "", "<= 100 MiB"),
    ]
    print("\n".join(lines))
    print(json.dumps(results, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
