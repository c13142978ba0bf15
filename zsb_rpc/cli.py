"""Entry point of ``zsb-rpc`` and ``python -m zsb_rpc``. Logs go to stderr: stdout is the protocol."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zsb-rpc", description="Sandbox server: JSON-RPC 2.0 on stdio.")
    parser.add_argument("--log-level", default="WARNING", help="stderr log level (default WARNING)")
    args = parser.parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=args.log_level.upper(),
                        format="zsb-rpc %(levelname)s %(name)s: %(message)s")
    # pygls logs every message it sends at INFO; that is the whole output stream.
    logging.getLogger("pygls").setLevel(max(logging.WARNING, logging.getLogger().level))

    from .server import ZsbServer

    server = ZsbServer()
    asyncio.run(server.serve_stdio())
    return 0


if __name__ == "__main__":
    sys.exit(main())
