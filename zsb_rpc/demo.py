"""A short demonstration through the real server: ``python -m zsb_rpc.demo``.

It asks what this machine enforces, streams a command's output as it runs,
and makes an escape attempt that must fail, checking the host afterwards.
Exits 0 only if the sandbox behaved as promised.
"""

from __future__ import annotations

import secrets
import sys
from pathlib import Path

from .client import SandboxSession


def main() -> int:
    failures: list[str] = []
    with SandboxSession(memory="256MB", timeout=30, cpu_seconds=10) as sb:
        caps = sb.capabilities()
        print(f"backend: {caps.backend} (isolated: {caps.isolated}) on {caps.platform}")
        for name in ("memory", "cpu_seconds", "cpu_percent", "processes", "file_size_bytes", "open_files",
                     "core_dumps"):
            print(f"  {name:<16} {getattr(caps, name)}")
        for warning in caps.warnings:
            print(f"  warning: {warning}")
        if not caps.isolated:
            failures.append("this machine has no isolating backend")

        print("\nstreaming a command's output as it runs:")
        result = sb.run("for i in 1 2 3; do echo \"  step $i\"; sleep 0.3; done",
                        on_stdout=lambda chunk: print(chunk, end="", flush=True))
        if result.stdout.split() != ["step", "1", "step", "2", "step", "3"]:
            failures.append(f"unexpected output: {result.stdout!r}")

        target = Path.home() / f"zsb-demo-escape-{secrets.token_hex(4)}"
        print(f"\nescape attempt: writing {target} and /etc/zsb-demo, reading ~/.ssh:")
        attempt = sb.run(f"echo pwned > {target}; echo pwned > /etc/zsb-demo; ls ~/.ssh; cat ~/.ssh/* 2>&1 | head -1")
        for line in attempt.stderr.splitlines()[:3]:
            print(f"  {line}")
        if target.exists() or Path("/etc/zsb-demo").exists():
            failures.append("a write outside the workspace reached the host")
            for path in (target, Path("/etc/zsb-demo")):
                if path.exists():
                    path.unlink()
        else:
            print("  blocked: nothing was written on the host")
        workspace = sb.workspace
    if workspace.exists():
        failures.append(f"the private workspace {workspace} was not removed")
    else:
        print(f"\nthe private workspace {workspace} is gone")
    for failure in failures:
        print(f"FAILED: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
