"""Entry point of ``zsb-rpc`` and ``python -m zsb_rpc``.

With no arguments it serves JSON-RPC on stdio (stdout is the protocol; logs
go to stderr). ``capabilities`` and ``exec`` are for trying things by hand:
they start a real server through the bundled client, like any other host.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from typing import Any

from . import __version__

LIMIT_ROWS = (
    ("memory", "memory"), ("cpuSeconds", "cpu_seconds"), ("cpuPercent", "cpu_percent"),
    ("processes", "processes"), ("fileSizeBytes", "file_size_bytes"), ("openFiles", "open_files"),
    ("coreDumps", "core_dumps"),
)


def _serve(args: argparse.Namespace) -> int:
    logging.basicConfig(stream=sys.stderr, level=args.log_level.upper(),
                        format="zsb-rpc %(levelname)s %(name)s: %(message)s")
    # pygls logs every message it sends at INFO; that is the whole output stream.
    logging.getLogger("pygls").setLevel(max(logging.WARNING, logging.getLogger().level))

    from .server import ZsbServer

    asyncio.run(ZsbServer().serve_stdio())
    return 0


def _capabilities(args: argparse.Namespace) -> int:
    from .client import SandboxServer

    with SandboxServer() as server:
        params: dict[str, Any] = {}
        if args.memory_strategy:
            params["memoryStrategy"] = args.memory_strategy
        report = server.request("capabilities", params)
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
        return 0
    print(f"zsb-rpc {report['serverVersion']} (protocol {report['protocolVersion']}) on {report['platform']}")
    backend = report["backend"] or "none"
    print(f"backend: {backend}{'' if report['isolated'] else ' (no isolation)'}")
    print()
    print(f"{'limit':<16}mechanism")
    for wire, _ in LIMIT_ROWS:
        print(f"{wire:<16}{report[wire]}")
    print()
    print(f"{'backend':<14}{'available':<11}reason")
    for info in report["backends"]:
        print(f"{info['name']:<14}{'yes' if info['available'] else 'no':<11}{info['reason'] or ''}")
    for warning in report["warnings"]:
        print(f"warning: {warning}")
    return 0


def _exec(args: argparse.Namespace) -> int:
    from .client import SandboxError, SandboxSession

    command = args.command
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        print("zsb-rpc exec: give a command after --", file=sys.stderr)
        return 2
    env = {}
    for item in args.env:
        name, sep, value = item.partition("=")
        if not sep:
            print(f"zsb-rpc exec: --env takes NAME=VALUE, not {item!r}", file=sys.stderr)
            return 2
        env[name] = value
    options: dict[str, Any] = dict(
        memory=args.memory, max_file_size=args.max_file_size, cpus=args.cpus, cpu_seconds=args.cpu_seconds,
        processes=args.processes, open_files=args.open_files, network=args.network or None,
        writable=args.writable or None, deny_write=args.deny_write or None, deny_read=args.deny_read or None,
        env=env or None, backend=args.backend, require_isolation=args.require_isolation or None,
        memory_strategy=args.memory_strategy,
    )
    if args.timeout is not None:
        options["timeout"] = None if args.timeout <= 0 else args.timeout

    def out(chunk: str) -> None:
        sys.stdout.write(chunk)
        sys.stdout.flush()

    def err(chunk: str) -> None:
        sys.stderr.write(chunk)
        sys.stderr.flush()

    try:
        with SandboxSession(args.workspace, **options) as sb:
            for warning in sb.warnings if args.verbose else ():
                print(f"zsb-rpc: warning: {warning}", file=sys.stderr)
            result = sb.run(list(command), on_stdout=out, on_stderr=err, cwd=args.cwd)
    except SandboxError as error:
        print(f"zsb-rpc exec: {error}", file=sys.stderr)
        return 125
    if result.timed_out:
        print(f"zsb-rpc exec: timed out after {result.duration_seconds:.3g} s", file=sys.stderr)
        return 124
    # A signal ends us as a shell reports it: 128 + the signal number.
    return 128 - result.exit_code if result.exit_code < 0 else result.exit_code


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zsb-rpc", description=(
        "Sandbox server: JSON-RPC 2.0 on stdio. With no command, serve."))
    parser.add_argument("--version", action="version", version=f"zsb-rpc {__version__}")
    parser.add_argument("--log-level", default="WARNING", help="stderr log level when serving (default WARNING)")
    commands = parser.add_subparsers(dest="subcommand", metavar="COMMAND")

    serve = commands.add_parser("serve", help="serve JSON-RPC on stdio (the default)")
    serve.add_argument("--log-level", default="WARNING", help="stderr log level (default WARNING)")
    serve.set_defaults(handler=_serve)

    caps = commands.add_parser("capabilities", help="how this machine enforces each limit")
    caps.add_argument("--json", action="store_true", help="print the raw capabilities result")
    caps.add_argument("--memory-strategy", choices=("auto", "kernel", "watchdog", "none"))
    caps.set_defaults(handler=_capabilities)

    run = commands.add_parser("exec", help="run one command in a sandbox, streaming its output",
                              usage="zsb-rpc exec [options] -- CMD [ARGS...]")
    run.add_argument("--workspace", help="directory the command may write (default: a private one, deleted after)")
    run.add_argument("--cwd", help="working directory, absolute or relative to the workspace")
    run.add_argument("--network", action="store_true", help="allow the network (default: none)")
    run.add_argument("--memory", help="memory limit, bytes or 512MB (powers of 1024)")
    run.add_argument("--max-file-size", help="largest file the command may write, bytes or 10MB")
    run.add_argument("--cpus", type=float, help="share of processors, 0.5 is half a core")
    run.add_argument("--cpu-seconds", type=int, help="processor time limit")
    run.add_argument("--processes", type=int, help="processes the command may add")
    run.add_argument("--open-files", type=int, help="open file descriptors")
    run.add_argument("--timeout", type=float, help="wall-clock limit in seconds (0: none; default 60)")
    run.add_argument("--writable", action="append", default=[], metavar="PATH", help="another writable path")
    run.add_argument("--deny-write", action="append", default=[], metavar="PATH")
    run.add_argument("--deny-read", action="append", default=[], metavar="PATH")
    run.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help="a variable for the command")
    run.add_argument("--backend", help="force a backend (bubblewrap, landlock, passthrough)")
    run.add_argument("--require-isolation", action="store_true", help="refuse to run without isolation")
    run.add_argument("--memory-strategy", choices=("auto", "kernel", "watchdog", "none"))
    run.add_argument("-v", "--verbose", action="store_true", help="print the session's warnings")
    run.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    run.set_defaults(handler=_exec)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler = getattr(args, "handler", _serve)
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
