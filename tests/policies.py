"""One representative policy, shared by the golden tests of every backend."""

from __future__ import annotations

from pathlib import Path

from zsb_rpc.policy import ResolvedPolicy
from zsb_rpc.protocol import types as t


def make_policy(**overrides) -> ResolvedPolicy:
    values = dict(
        workspace=Path("/w"), writable=(Path("/w"), Path("/data")), denied_write=(Path("/w/locked"),),
        protected_write=(Path("/w/.bashrc"), Path("/w/.git/hooks")), denied_read=(Path("/h/.ssh"), Path("/h/.netrc")),
        network="none", environment={}, limits=t.Limits(), memory_strategy="auto", timeout=60.0, output_limit=1,
    )
    values.update(overrides)
    return ResolvedPolicy(**values)
