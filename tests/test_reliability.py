"""Reliability of the real server over pipes: a wire fuzzer, a soak, many sessions, cancellation races.

Every test here runs one server, as the user the suite runs as (root when the
suite runs as root), never as the unprivileged user too: these tests are about
the server's own bookkeeping, not about the sandbox, and they are long.

Invariants throughout: the server never dies; every request with a valid id
(a string or an integer) gets exactly one response; no error a client sees
carries a traceback; and nothing a session made (processes, workspaces,
cgroups, descriptors, memory) outlives it. Server bugs these tests found are
strict xfail tests at the end, each with its reason; the other tests steer
clear of them (and say where) so that they still guard everything else.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import glob
import itertools
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import types as pytypes
import typing
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir

from tests.conftest import REPO, processes_with, wait_gone
from tests.rpc import RpcClient, ServerCommand, frame
from zsb_rpc.protocol import types as wire_types
from zsb_rpc.protocol.methods import REQUESTS

UID = os.getuid()
MIB = 1024 * 1024
LIMITS = {"memoryBytes": 64 * MIB, "processes": 64}


# -- one server, as the suite's own user ---------------------------------------------


def server_command(home: Path) -> ServerCommand:
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "PYTHONPATH": str(REPO),
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    return ServerCommand([sys.executable, "-m", "zsb_rpc"], env)


@pytest.fixture
def home() -> Iterator[Path]:
    """A fake HOME outside /tmp (private inside the sandbox), removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="zsb-rel-", dir="/var/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def server(home: Path) -> AsyncIterator[RpcClient]:
    client = await RpcClient.start(server_command(home))
    client.default_open = {"backend": "bubblewrap"}
    try:
        yield client
    finally:
        await client.aclose()


@pytest.fixture(autouse=True)
def kill_leftovers(marker: str) -> Iterator[None]:
    """After each test (whatever its outcome), end the processes it marked that are still alive, by pid.

    Only a failing (or xfail) test leaves any: passing tests assert that none are left.
    """
    yield
    for pid in processes_with(marker):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


# -- what a server holds, read from /proc, /tmp and /sys -----------------------------


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def children(pid: int) -> list[tuple[int, str, str]]:
    """(pid, name, state) of the processes whose parent is ``pid``.

    The server is a child subreaper: orphans of its runs come back to it.
    """
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                stat = handle.read()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1: stat.rindex(")")]
        state, ppid = stat[stat.rindex(")") + 2:].split()[:2]
        if int(ppid) == pid:
            found.append((int(entry), comm, state))
    return found


def live_children(pid: int) -> list[tuple[int, str, str]]:
    return [child for child in children(pid) if child[2] != "Z"]


def zombies(pid: int) -> list[tuple[int, str, str]]:
    return [child for child in children(pid) if child[2] == "Z"]


def wait_no_children(pid: int, timeout: float = 5.0) -> list[tuple[int, str, str]]:
    """Wait until ``pid`` has no live children; zombies are counted apart (see the xfail test below)."""
    deadline = time.monotonic() + timeout
    while (alive := live_children(pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


def server_dirs(pid: int) -> list[Path]:
    return [Path(p) for p in glob.glob(f"/tmp/zsb-rpc-{UID}/server-{pid}-*")]


def private_entries(pid: int) -> list[str]:
    """What is inside this server's own directory: ``ws-<session>``, ``tmp-<session>``, manifests."""
    return sorted(f"{d.name}/{e}" for d in server_dirs(pid) for e in os.listdir(d))


def server_cgroups(pid: int) -> list[str]:
    return glob.glob(f"/sys/fs/cgroup/**/zsb-rpc-{pid}-*", recursive=True)


def run_cgroups(pid: int) -> list[str]:
    return sorted(p for d in server_cgroups(pid) for p in glob.glob(os.path.join(d, "run-*")) if os.path.isdir(p))


def tree(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def no_traceback(messages: list[dict[str, Any]]) -> None:
    for message in messages:
        if "error" in message:
            text = json.dumps(message["error"])
            assert "Traceback" not in text, message


def sleeping(mark: str) -> list[int]:
    """Pids of ``sleep <mark>`` itself: the command has started (bwrap's own argv names it much earlier)."""
    found = []
    for pid in processes_with(mark):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as handle:
            if handle.read() == b"sleep\0" + mark.encode() + b"\0":
                found.append(pid)
    return found


async def wait_for_marker(mark: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not sleeping(mark):
        assert time.monotonic() < deadline, f"sleep {mark} never started"
        await asyncio.sleep(0.02)


async def answered(client: RpcClient, msg_id: Any, timeout: float = 30) -> dict[str, Any]:
    """The response to a request sent with ``send_raw`` (so not awaited through the client)."""
    deadline = time.monotonic() + timeout
    while not (found := client.responses(msg_id)):
        assert time.monotonic() < deadline, f"no response to {msg_id!r}"
        await asyncio.sleep(0.01)
    return found[0]


async def still_serves(client: RpcClient) -> None:
    caps = await client.call("capabilities")
    assert caps["backend"] == "bubblewrap"
    opened = await client.open()
    result = await client.run(opened["sessionId"], "echo ok")
    assert result["stdout"] == "ok\n" and result["exitCode"] == 0
    closed = await client.call("session/close", {"sessionId": opened["sessionId"]})
    assert closed["removedWorkspace"] is True


# -- the fuzzer's strategies, generated from the protocol's registry ------------------

KINDS = ("null", "boolean", "integer", "number", "string", "array", "object")
HUGE_INTS = [2**31, 2**53 + 1, 2**63, 2**64, -(2**63) - 1, 10**30, -(10**30), 10**300]
ODD_NUMBERS = [-1, 0, -0.0, 1e308, -1e308, 5e-324, 2**63, -(2**63), 10**30, -(10**30), 10**300, 1e-300, 0.001]

json_scalars = (st.none() | st.booleans() | st.integers() | st.sampled_from(HUGE_INTS)
                | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12))
json_values = st.recursive(
    json_scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


def of_kind(kind: str) -> st.SearchStrategy[Any]:
    return {
        "null": st.none(),
        "boolean": st.booleans(),
        "integer": st.integers() | st.sampled_from(HUGE_INTS),
        # A Python float always serializes as a JSON number that reads back as a float, never an integer.
        "number": st.floats(allow_nan=False, allow_infinity=False),
        "string": st.text(max_size=20),
        "array": st.lists(json_values, max_size=3),
        "object": st.dictionaries(st.text(max_size=6), json_values, max_size=3),
    }[kind]


def _members(kind: Any) -> list[Any]:
    if typing.get_origin(kind) in (typing.Union, pytypes.UnionType):
        return [m for m in typing.get_args(kind) if m is not wire_types.Unset]
    return [kind]


def accepted_kinds(kind: Any) -> set[str]:
    """The JSON types a field's annotation accepts at all (a value of another type is always refused)."""
    accepted: set[str] = set()
    for member in _members(kind):
        origin = typing.get_origin(member)
        if member is type(None):
            accepted.add("null")
        elif member is bool:
            accepted.add("boolean")
        elif member is int:
            accepted.add("integer")
        elif member is float:
            accepted |= {"integer", "number"}
        elif member is str or origin is typing.Literal:
            accepted.add("string")
        elif origin is list:
            accepted.add("array")
        elif origin is dict or attrs.has(member):
            accepted.add("object")
        else:
            raise AssertionError(f"the fuzzer does not know the type {member!r}; teach accepted_kinds")
    return accepted


def camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


def hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def wrong_value(kind: Any) -> st.SearchStrategy[Any]:
    """A value that this annotation refuses: a wrong JSON type, or a container holding one."""
    options = [st.sampled_from(sorted(set(KINDS) - accepted_kinds(kind))).flatmap(of_kind)]
    for member in _members(kind):
        origin = typing.get_origin(member)
        if origin is typing.Literal:
            allowed = typing.get_args(member)
            options.append(st.text(max_size=10).filter(lambda s, allowed=allowed: s not in allowed))
        elif origin is list:
            (item,) = typing.get_args(member)
            options.append(st.lists(wrong_value(item), min_size=1, max_size=2))
        elif origin is dict:
            _, item = typing.get_args(member)
            options.append(st.dictionaries(st.text(max_size=6), wrong_value(item), min_size=1, max_size=2))
        elif attrs.has(member):
            options.append(wrong_params(member))
    return st.one_of(options)


def wrong_params(cls: type) -> st.SearchStrategy[dict[str, Any]]:
    """An object for ``cls`` with one field of a wrong type (so never a valid params object)."""
    fields = hints(cls)
    return st.sampled_from(sorted(fields)).flatmap(
        lambda name: wrong_value(fields[name]).map(lambda value: {camel(name): value}))


def numeric_fields(cls: type, prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    found = []
    for name, kind in hints(cls).items():
        for member in _members(kind):
            if member in (int, float):
                found.append(((*prefix, camel(name)), member))
            elif attrs.has(member):
                found.extend(numeric_fields(member, (*prefix, camel(name))))
    return found


def odd_number_params(method: str) -> st.SearchStrategy[dict[str, Any]]:
    """Huge, negative and tiny numbers in the numeric fields of a method's params.

    These can be valid (a session/open with a huge outputLimit opens a session:
    the test closes what it opened), but never run anything: ``run`` and
    ``wrap`` get no command and a session id that does not exist.
    """
    fields = numeric_fields(REQUESTS[method].params)

    def build(choice: tuple[tuple[str, ...], Any], number: Any) -> dict[str, Any]:
        path, _ = choice
        params: dict[str, Any] = {}
        target = params
        for part in path[:-1]:
            target = target.setdefault(part, {})
        target[path[-1]] = number
        if method in ("run", "wrap", "session/close"):
            params["sessionId"] = "s-does-not-exist"
            params.pop("command", None)
        return params

    return st.builds(build, st.sampled_from(fields), st.sampled_from(ODD_NUMBERS))


def params_for(method: Any) -> st.SearchStrategy[Any]:
    """Params that are missing (``MISSING``), null, of the wrong type, or of wrong field types.

    Mostly one field of a wrong type, the case with the most code behind it.
    """
    absent = st.just(MISSING) | st.none()
    common = st.one_of(st.lists(json_values, max_size=3), st.text(max_size=5), st.integers(), st.booleans())
    if not isinstance(method, str) or method not in REQUESTS:
        return absent | common | json_values
    spec = REQUESTS[method]
    unknown = st.dictionaries(st.sampled_from(["bogus", "session_id", "SessionId", "params", ""]), json_values,
                              min_size=1, max_size=2)
    odd = odd_number_params(method) if numeric_fields(spec.params) else wrong_params(spec.params)
    # Absent params make a valid capabilities or session/open (answered later, from a thread).
    return st.integers(0, 9).flatmap(lambda n: (absent, common, unknown, odd)[n] if n < 4 else wrong_params(spec.params))


MISSING = object()


@dataclass(frozen=True)
class Id:
    """An id to be made unique when the message is sent: ``kind`` says which JSON type it has."""

    kind: str
    text: str = ""


# Valid ids (which must each get one answer) weigh more than the others.
ID_KINDS = ["int", "negint", "bigint", "str"] * 3 + ["float", "bool", "null", "object", "array", "missing", "missing"]
METHODS = [*REQUESTS, "$/cancelRequest", "", "zz/unknown", "run/output", "initialize", "shutdown", "exit", "RUN"]


@st.composite
def message(draw: Any) -> dict[str, Any]:
    method = draw(st.integers(0, 9).flatmap(lambda n: st.sampled_from(list(REQUESTS)) if n < 6 else (
        st.sampled_from(METHODS), st.text(max_size=8), st.integers() | st.none() | st.lists(st.integers(), max_size=2),
        st.sampled_from(METHODS))[n - 6]))
    envelope: dict[str, Any] = {}
    jsonrpc = draw(st.sampled_from(["2.0"] * 8 + ["missing", "1.0", 2.0, None]))
    if jsonrpc != "missing":
        envelope["jsonrpc"] = jsonrpc
    id_kind = draw(st.sampled_from(ID_KINDS))
    if id_kind != "missing":
        envelope["id"] = Id(id_kind, draw(st.text(max_size=6)))
    if draw(st.integers(0, 19)) > 0:
        envelope["method"] = method
    if method == "$/cancelRequest" and id_kind == "missing":
        # A cancel notification: only ever of ids this test never sends, or of the wrong type.
        params = draw(st.none() | st.just(MISSING) | st.fixed_dictionaries({"id": st.one_of(
            st.integers(-(10**8), -1), st.text(max_size=6).map(lambda s: "nx-" + s), wrong_value(str | int))}))
    else:
        params = draw(params_for(method))
    if params is not MISSING:
        envelope["params"] = params
    if draw(st.integers(0, 9)) == 0:
        envelope.update(draw(st.dictionaries(st.sampled_from(["result", "error", "extra", "Id"]), json_values,
                                             min_size=1, max_size=2)))
    return envelope


BAD_LENGTHS = [b"-5", b"abc", b"", b" ", b"5x", b"0x10", b"+5", b"1e3", b"1.0", b"99999999999999999999",
               b"10" + b"0" * 30, "\uff11\uff12".encode(), b"\xff\xfe", b"12 34", b"NaN"]
INVALID_UTF8 = [b"\xff", b"\xc3\x28", b"\x80", b"\xc0\xaf", b"\xf8\x88\x80\x80\x80", b"\xe2\x82"]

# A frame: ("frame", message-or-list, framing, extra), or ("raw", body-bytes, framing, expect-nothing-of-this-id).
FRAMINGS = ["ok"] * 6 + ["headers", "bare-lf", "short", "long-space", "long-junk", "no-length", "bad-length",
                         "dup-length", "no-colon"]


@st.composite
def item(draw: Any) -> tuple[str, Any, str, Any]:
    choice = draw(st.integers(0, 9))
    framing = draw(st.sampled_from(FRAMINGS))
    if choice <= 5:
        return ("frame", draw(message()), framing, draw(st.integers(1, 40)))
    if choice == 6:
        batch = draw(st.lists(message() | json_values, max_size=4))
        return ("frame", batch, framing, draw(st.integers(1, 40)))
    raw = draw(st.sampled_from(["binary", "utf8", "cesu", "deep", "deep-valid", "nan", "digits", "bom", "utf16",
                                "empty", "spaces", "long-header"]))
    return ("raw", raw, framing, draw(st.binary(max_size=64)))


@dataclass
class FuzzState:
    """Ids already used, what each must get, and what was sent."""

    counter: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    # key -> (least, most) responses, and a description for the failure message
    expected: dict[tuple[str, Any], tuple[int, int, str]] = field(default_factory=dict)
    sent: set[tuple[str, Any]] = field(default_factory=set)
    frames: int = 0
    bytes_sent: int = 0


def id_key(value: Any) -> tuple[str, Any]:
    return (type(value).__name__, value)


def valid_id(value: Any) -> bool:
    return isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))


def materialize(value: Any, state: FuzzState) -> Any:
    """Replace every ``Id`` by a unique id of its kind."""
    if isinstance(value, Id):
        n = next(state.counter)
        return {
            "int": 10**9 + n, "negint": -(10**9) - n, "bigint": 10**30 + n, "str": f"fz{n}:{value.text}",
            "float": n + 0.5, "bool": n % 2 == 0, "null": None, "object": {"n": n}, "array": [n],
        }[value.kind]
    if isinstance(value, dict):
        return {k: materialize(v, state) for k, v in value.items()}
    if isinstance(value, list):
        return [materialize(v, state) for v in value]
    return value


def expect(message_: Any, state: FuzzState, delivered: bool, description: str) -> None:
    """Record how many responses a message's id must get: one for a request, none if it never arrived whole."""
    if not isinstance(message_, dict) or not valid_id(message_.get("id")):
        return
    key = id_key(message_["id"])
    state.sent.add(key)
    if not delivered:
        state.expected[key] = (0, 0, description)
    elif "method" in message_:
        state.expected[key] = (1, 1, description)
    else:
        # Not a request (a response of the client's, as far as the server can tell): at most one error.
        state.expected[key] = (0, 1, description)


def tracked_request(state: FuzzState, method: str, params: Any) -> tuple[dict[str, Any], Any]:
    msg_id = 10**9 + next(state.counter)
    return {"jsonrpc": "2.0", "id": msg_id, "method": method, "params": params}, msg_id


def raw_body(kind: str, junk: bytes, state: FuzzState) -> tuple[bytes, Any, tuple[int, int]]:
    """A body built byte by byte, with the id it carries (or None) and how many answers that id may get."""
    if kind == "binary":
        return junk, None, (0, 0)
    if kind == "empty":
        return b"", None, (0, 0)
    if kind == "spaces":
        return b" \t\r\n ", None, (0, 0)
    if kind == "deep":
        depth = 100_000 if len(junk) % 2 else 1_000
        return (b"[" * depth if len(junk) % 3 else b'{"a":' * depth), None, (0, 0)
    if kind == "long-header":
        return b"", None, (0, 0)  # see encode(): the header itself is the problem
    message_, msg_id = tracked_request(state, "run", {"sessionId": "x", "command": ["true"]})
    body = json.dumps(message_).encode()
    if kind == "utf8":
        bad = INVALID_UTF8[len(junk) % len(INVALID_UTF8)]
        return body.replace(b'"x"', b'"x' + bad + b'"'), msg_id, (0, 0)
    if kind == "cesu":
        # A surrogate encoded in UTF-8: refused, or read as a lone surrogate and answered. Once at most.
        return body.replace(b'"x"', b'"x\xed\xa0\x80"'), msg_id, (0, 1)
    if kind == "deep-valid":
        depth = 300
        return body.replace(b'"x"', b"[" * depth + b"]" * depth), msg_id, (1, 1)
    if kind == "nan":
        literal = [b"NaN", b"Infinity", b"-Infinity", b"1e400"][len(junk) % 4]
        message_, msg_id = tracked_request(state, "capabilities", {"limits": {"memorySampleSeconds": 0}})
        body = json.dumps(message_).encode().replace(b'"memorySampleSeconds": 0', b'"memorySampleSeconds": ' + literal)
        # Not JSON: refused as a parse error, or read (as Python does) and refused as a non-finite number.
        return body, msg_id, (0, 1)
    if kind == "digits":
        message_, msg_id = tracked_request(state, "capabilities", {"limits": {"memoryBytes": 0}})
        body = json.dumps(message_).encode().replace(b'"memoryBytes": 0', b'"memoryBytes": ' + b"9" * 5000)
        return body, msg_id, (0, 1)
    if kind == "bom":
        return b"\xef\xbb\xbf" + body, msg_id, (0, 1)
    if kind == "utf16":
        return json.dumps(message_).encode("utf-16"), msg_id, (0, 1)
    raise AssertionError(kind)


def encode(body: bytes, framing: str, extra: int) -> tuple[bytes, bool]:
    """Frame ``body`` as ``framing`` says; whether the body arrives whole. Always ends where headers start."""
    n = len(body)
    delivered = True
    if framing == "ok":
        data = b"Content-Length: %d\r\n\r\n" % n + body
    elif framing == "headers":
        data = (b"content-type: application/vscode-jsonrpc; charset=utf-8\r\nX-Junk: :::\r\n"
                b"  CONTENT-LENGTH :  %d  \r\n\r\n" % n + body)
    elif framing == "bare-lf":
        data = b"Content-Length: %d\n\n" % n + body
    elif framing == "dup-length":
        data = b"Content-Length: %d\r\nContent-Length: %d\r\n\r\n" % (n, n) + body
    elif framing == "short" and n > 1:
        data = b"Content-Length: %d\r\n\r\n" % (n - 1 - extra % (n - 1)) + body
        delivered = False
    elif framing == "long-space":
        data = b"Content-Length: %d\r\n\r\n" % (n + extra) + body + b" " * extra
    elif framing == "long-junk":
        data = b"Content-Length: %d\r\n\r\n" % (n + extra) + body + b"}" * extra
        delivered = False
    elif framing == "no-length":
        data = b"Content-Type: x\r\n\r\n" + body
        delivered = False
    elif framing == "bad-length":
        data = b"Content-Length: " + BAD_LENGTHS[extra % len(BAD_LENGTHS)] + b"\r\n\r\n" + body
        delivered = False
    elif framing == "no-colon":
        data = b"Content-Length %d\r\n\r\n" % n + body
        delivered = False
    else:
        data = b"Content-Length: %d\r\n\r\n" % n + body
    # Whatever did not arrive as a body is read as header lines: end that block.
    return data + b"\r\n\r\n", delivered


class LoopThread:
    """An event loop in a thread of its own, so that a (synchronous) hypothesis test can drive the client."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fuzz-loop", daemon=True)
        self.thread.start()

    def run(self, coroutine: Any, timeout: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


def count_responses(client: RpcClient) -> collections.Counter:
    counts: collections.Counter = collections.Counter()
    for m in list(client.messages):
        if "id" in m and ("result" in m or "error" in m):
            counts[id_key(m["id"])] += 1
    return counts


@pytest.mark.timeout(180)
def test_wire_fuzz_never_kills_the_server_and_answers_each_request_once(home: Path):
    state = FuzzState()
    loop = LoopThread()
    client: RpcClient = loop.run(RpcClient.start(server_command(home)))
    client.default_open = {"backend": "bubblewrap"}
    sentinels = itertools.count(1)

    async def send(data: bytes) -> None:
        await client.send_raw(data)

    async def sentinel() -> dict[str, Any]:
        # Unknown method: answered at once, after everything sent before it was read.
        return await client.request("zz/sentinel", {}, msg_id=f"sentinel-{next(sentinels)}", timeout=20)

    def check_so_far() -> None:
        counts = count_responses(client)
        for key, (least, most, description) in state.expected.items():
            got = counts.get(key, 0)
            assert got <= most, f"{got} responses (at most {most}) to {description}"
            if got < least:
                # Only a valid capabilities or session/open is answered later (it runs in a thread).
                assert description.startswith(("capabilities", "session/open")), f"no response to {description}"

    @settings(max_examples=300, deadline=None, derandomize=True, database=None, print_blob=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                     HealthCheck.data_too_large, HealthCheck.filter_too_much,
                                     HealthCheck.large_base_example])
    @given(items=st.lists(item(), min_size=1, max_size=6))
    def fuzz(items: list[tuple[str, Any, str, Any]]) -> None:
        data = bytearray()
        for kind, payload, framing, extra in items:
            if kind == "frame":
                payload = materialize(payload, state)
                body = json.dumps(payload).encode()
                if b"content-length" in body.lower():
                    framing = "ok"  # a body read as headers must never announce a length of its own
                chunk, delivered = encode(body, framing, extra)
                description = f"{body[:300]!r} framed {framing}"
                for entry in payload if isinstance(payload, list) else [payload]:
                    method = entry.get("method") if isinstance(entry, dict) else None
                    batched = isinstance(payload, list)
                    # In a batch, every entry with a valid id is answered (refused) once.
                    if batched and isinstance(entry, dict):
                        entry = {**entry, "method": "batched"}
                    expect(entry, state, delivered,
                           (f"{method} " if isinstance(method, str) and not batched else "") + description)
            else:
                body, msg_id, (least, most) = raw_body(payload, extra, state)
                if payload == "long-header":
                    chunk, delivered = b"X-Long: " + b"a" * (70 * 1024) + b"\r\n\r\n", False
                else:
                    chunk, delivered = encode(body, framing, len(extra) + 1)
                if msg_id is not None:
                    key = id_key(msg_id)
                    state.sent.add(key)
                    state.expected[key] = (least, most, f"raw {payload} {body[:200]!r}") if delivered else (
                        0, 0, f"raw {payload} framed {framing}")
            data += chunk
        state.frames += len(items)
        state.bytes_sent += len(data)
        loop.run(send(bytes(data)))
        answer = loop.run(sentinel(), timeout=30)
        assert answer["error"]["code"] == -32601, answer
        assert client.process.returncode is None, client.stderr.decode(errors="replace")[-3000:]
        check_so_far()

    # Hypothesis caches what it learns (unicode tables, constants) under ./.hypothesis: not in the repo.
    hypothesis_home = tempfile.mkdtemp(prefix="zsb-rel-hypothesis-", dir="/var/tmp")
    set_hypothesis_home_dir(hypothesis_home)
    try:
        fuzz()
        # Deterministic ones once each: a length over the limit followed by that many bytes, huge digits.
        over = 65 * MIB
        loop.run(send(b"Content-Length: %d\r\n\r\n" % over + b" " * over), timeout=60)
        loop.run(send(b"Content-Length: %d\r\n\r\n" % 10**20 + b"{}\r\n\r\n"))
        loop.run(send(b"Content-Length: 100000\r\n\r\n" + b"[" * 100_000))
        answer = loop.run(sentinel(), timeout=60)
        assert answer["error"]["code"] == -32601
        framing_errors = [m["error"]["message"] for m in client.messages if m.get("id") is None and "error" in m]
        assert any("exceeds the limit" in text for text in framing_errors)

        # What runs in a thread (valid capabilities and session/open) is answered too, in the end.
        deadline = time.monotonic() + 30
        while True:
            counts = count_responses(client)
            missing = [d for k, (least, _, d) in state.expected.items() if counts.get(k, 0) < least]
            if not missing or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        time.sleep(0.5)  # room for a second answer, which must not come
        counts = count_responses(client)
        for key, (least, most, description) in state.expected.items():
            assert least <= counts.get(key, 0) <= most, f"{counts.get(key, 0)} responses to {description}"
        last_sentinel = next(sentinels)
        assert [counts[("str", f"sentinel-{i}")] for i in range(1, last_sentinel)] == [1] * (last_sentinel - 1)
        invented = [k for k in counts if k not in state.sent and k[1] is not None
                    and not str(k[1]).startswith("sentinel-")
                    and not (k[0] == "int" and 0 < k[1] < 10**6)]
        assert invented == [], f"responses to ids never sent: {invented[:5]}"
        no_traceback(client.messages)
        internal = [m for m in client.messages if m.get("error", {}).get("code") == -32603]
        assert internal == [], f"internal errors on bad input: {internal[:3]}"

        # Sessions that a valid (default) session/open made are closed again.
        opened = [m["result"]["sessionId"] for m in client.messages
                  if isinstance(m.get("result"), dict) and "sessionId" in m["result"]]

        async def close_all() -> None:
            for session_id in opened:
                await client.call("session/close", {"sessionId": session_id})

        loop.run(close_all(), timeout=60)
        loop.run(still_serves(client), timeout=60)
        assert private_entries(client.pid) == []
        print(f"\nfuzz: {state.frames} frames, {state.bytes_sent} bytes (+{over} once), {len(state.expected)} ids "
              f"tracked, {len(client.messages)} messages back, {len(opened)} default sessions opened and closed")
        assert client.process.returncode is None
        assert "Traceback" not in client.stderr.decode(errors="replace"), client.stderr.decode(errors="replace")[-4000:]
    finally:
        set_hypothesis_home_dir(None)
        shutil.rmtree(hypothesis_home, ignore_errors=True)
        loop.run(client.aclose(), timeout=15)
        loop.close()


# -- soak ---------------------------------------------------------------------------


@dataclass
class Figures:
    fds: int
    rss: int
    children: int
    zombies: int
    entries: int
    cgroups: int

    def __str__(self) -> str:
        return (f"fds={self.fds} rss={self.rss / MIB:.1f}MiB live-children={self.children} zombies={self.zombies} "
                f"private-entries={self.entries} run-cgroups={self.cgroups}")


def figures(pid: int) -> Figures:
    return Figures(open_fds(pid), rss_bytes(pid), len(live_children(pid)), len(zombies(pid)),
                   len(private_entries(pid)), len(run_cgroups(pid)))


async def cycle(client: RpcClient, n: int, marker: str, seen: collections.Counter) -> Any:
    """One open, run, close; what runs depends on ``n``."""
    limited = n % 10 == 3 or n % 100 in (10, 45, 74)
    opened = await client.open(**({"limits": LIMITS} if limited else {}))
    sid = opened["sessionId"]
    try:
        if n % 25 == 24:
            seen["flood"] += 1
            result = await client.run(sid, "head -c 5000000 /dev/zero")
            assert result["exitCode"] == 0 and result["truncated"]["stdout"] is True, result["resources"]
            assert len(result["stdout"]) == MIB
        elif n % 10 == 0:
            seen["timeout"] += 1
            result = await client.run(sid, f"sleep {marker}", timeout=0.2)
            assert result["timedOut"] is True and result["exitCode"] == -9
        elif n % 10 == 5:
            seen["cancel"] += 1
            # Cancelled once the command sleeps: a cancel that lands while bwrap is still being
            # spawned hangs (test_cancel_while_the_sandbox_is_spawning..., xfail: a server bug).
            mark = f"{marker}{n:03d}"
            msg_id, future = client.send_request("run", {"sessionId": sid, "command": f"sleep {mark}",
                                                         "timeout": None})
            await wait_for_marker(mark)
            await client.notify("$/cancelRequest", {"id": msg_id})
            response = await asyncio.wait_for(future, 15)
            assert response.get("error", {}).get("code") == -32800, response
            result = None
        else:
            seen["true"] += 1
            result = await client.run(sid, "true")
            assert result["exitCode"] == 0, result
        if limited:
            seen["limited"] += 1
            if result is not None and UID == 0:
                assert result["resources"]["mechanisms"]["memory"] == "cgroup", result["resources"]
                seen["cgroup"] += 1
    finally:
        closed = await client.call("session/close", {"sessionId": sid})
        assert closed["removedWorkspace"] is True


async def cycles(client: RpcClient, numbers: range, marker: str, seen: collections.Counter, width: int = 4) -> None:
    queue = iter(numbers)

    async def worker() -> None:
        for n in queue:
            await cycle(client, n, marker, seen)

    await asyncio.gather(*(worker() for _ in range(width)))


async def quiesce(client: RpcClient, marker: str) -> None:
    """Wait until nothing of a run is left: processes, then let the server's loop settle."""
    assert wait_gone(marker, 10) == []
    assert wait_no_children(client.pid, 10) == []
    await asyncio.sleep(0.3)


@pytest.mark.timeout(240)
async def test_soak_1000_cycles_leaks_nothing(server: RpcClient, marker: str, home: Path):
    pid = server.pid
    await server.call("capabilities")
    start = figures(pid)
    seen: collections.Counter = collections.Counter()
    began = time.monotonic()

    # The first session is opened alone: concurrent first opens each create a server directory
    # (test_concurrent_first_opens_share_one_server_directory, xfail: a server bug).
    await cycle(server, 0, marker, seen)
    await cycles(server, range(1, 100), marker, seen)
    await quiesce(server, marker)
    baseline = figures(pid)
    after_100 = time.monotonic() - began
    responses = count_responses(server)
    assert all(count == 1 for count in responses.values()), [k for k, c in responses.items() if c != 1]
    server.messages.clear()  # 1 MiB floods add up in the test process otherwise

    await cycles(server, range(100, 1000), marker, seen)
    await quiesce(server, marker)
    end = figures(pid)
    elapsed = time.monotonic() - began
    responses = count_responses(server)
    assert all(count == 1 for count in responses.values()), [k for k, c in responses.items() if c != 1]
    no_traceback(server.messages)

    print(f"\nsoak: {dict(seen)} in {elapsed:.1f}s (first 100 in {after_100:.1f}s)\n"
          f"  start     {start}\n  after 100 {baseline}\n  after 1000 {end}\n"
          f"  rss growth {(end.rss - baseline.rss) / MIB:+.2f}MiB ({(end.rss / baseline.rss - 1) * 100:+.1f}%)")
    assert seen["flood"] == 40 and seen["timeout"] == 100 and seen["cancel"] == 100
    if UID == 0:
        assert seen["cgroup"] >= 90 and server_cgroups(pid), "limited runs did not use cgroups: the check is vacuous"

    assert end.fds <= baseline.fds and end.fds <= start.fds + 2, (start, baseline, end)
    assert live_children(pid) == [] and processes_with(marker) == []
    # Zombies are not asserted here but in test_runs_leave_no_zombie_children (xfail: a server bug).
    assert private_entries(pid) == []
    assert run_cgroups(pid) == []
    assert tree(home) == []  # placeholders made for protected paths in HOME are gone
    # Within 10 % of what it was after 100 cycles (both measured right after a flood, cycles
    # 99 and 999), with no absolute slack: runs here moved it by +0.3 to +2.3 MiB (at most 5 %),
    # allocator noise from the 1 MiB results of floods; 4,000 cycles showed no trend.
    assert end.rss <= baseline.rss * 1.10, (baseline, end)

    await server.close_stdin()
    assert await server.wait_exit(5) == 0
    left = {str(d): tree(d) for d in server_dirs(pid)}
    assert left == {} and server_cgroups(pid) == [], (left, server_cgroups(pid), server.stderr.decode()[-3000:])


# -- many sessions at once ---------------------------------------------------------


@pytest.mark.timeout(150)
async def test_200_sessions_open_at_once_each_run_then_all_closed(server: RpcClient):
    pid = server.pid
    await server.call("capabilities")
    fds = open_fds(pid)
    opened = await asyncio.gather(*(server.open() for _ in range(200)))
    ids = [o["sessionId"] for o in opened]
    assert len(set(ids)) == 200
    workspaces = [Path(o["workspace"]) for o in opened]
    assert all(w.is_dir() for w in workspaces) and len(set(workspaces)) == 200

    results = await asyncio.gather(*(server.run(sid, f"echo {n}; pwd") for n, sid in enumerate(ids)))
    for n, (result, workspace) in enumerate(zip(results, workspaces, strict=True)):
        assert result["exitCode"] == 0 and result["stdout"] == f"{n}\n{workspace}\n", result

    closed = await asyncio.gather(*(server.call("session/close", {"sessionId": sid}) for sid in ids))
    assert [c["sessionId"] for c in closed] == ids and all(c["removedWorkspace"] for c in closed)
    assert not any(w.exists() for w in workspaces)
    assert private_entries(pid) == []
    assert wait_no_children(pid) == []
    await asyncio.sleep(0.2)
    assert open_fds(pid) <= fds + 2, (fds, open_fds(pid))
    counts = count_responses(server)
    assert all(count == 1 for count in counts.values())
    no_traceback(server.messages)
    await still_serves(server)


# -- cancellation races --------------------------------------------------------------


@pytest.mark.timeout(90)
async def test_cancels_of_answered_unknown_and_twice_cancelled_requests_are_ignored(server: RpcClient, marker: str):
    pid = server.pid
    sid = (await server.open())["sessionId"]
    ids: list[Any] = []

    # Cancel a request that has been answered, twice.
    msg_id, future = server.send_request("run", {"sessionId": sid, "command": "echo answered"})
    ids.append(msg_id)
    assert (await asyncio.wait_for(future, 30))["result"]["stdout"] == "answered\n"
    await server.notify("$/cancelRequest", {"id": msg_id})
    await server.notify("$/cancelRequest", {"id": msg_id})

    # Cancel ids that never existed, and cancels that are not cancels at all.
    for bogus in (987_654_321, -1, 0, "no-such-request", "", 10**30):
        await server.notify("$/cancelRequest", {"id": bogus})
    for params in ({"id": None}, {"id": 1.5}, {"id": True}, {"id": [msg_id]}, {}, [], None, "x", {"id": 1, "x": 2}):
        await server.notify("$/cancelRequest", params)
    await server.send_raw(frame({"jsonrpc": "2.0", "method": "$/cancelRequest"}))
    # A cancel sent as a request is a request like any other: one answer (method not found).
    msg_id, future = server.send_request("$/cancelRequest", {"id": msg_id})
    ids.append(msg_id)
    assert (await asyncio.wait_for(future, 10))["error"]["code"] == -32601

    # Cancel a running command twice in a row, then once more after its answer.
    msg_id, future = server.send_request("run", {"sessionId": sid, "command": f"sleep {marker}", "timeout": None})
    ids.append(msg_id)
    await wait_for_marker(marker)
    await server.notify("$/cancelRequest", {"id": msg_id})
    await server.notify("$/cancelRequest", {"id": msg_id})
    assert (await asyncio.wait_for(future, 15))["error"]["code"] == -32800
    await server.notify("$/cancelRequest", {"id": msg_id})
    assert wait_gone(marker) == []

    outcomes: collections.Counter = collections.Counter()
    # A cancel right behind its request, in the same write: the request is cancelled before it
    # starts, so nothing is spawned. (A cancel that lands while bwrap is being spawned hangs:
    # test_cancel_while_the_sandbox_is_spawning..., xfail, a server bug.)
    for n in range(20):
        msg_id = f"race-{n}"
        ids.append(msg_id)
        request = {"jsonrpc": "2.0", "id": msg_id, "method": "run",
                   "params": {"sessionId": sid, "command": ["sleep", f"{marker}{n:03d}"], "timeout": None}}
        cancel = {"jsonrpc": "2.0", "method": "$/cancelRequest", "params": {"id": msg_id}}
        await server.send_raw(frame(request) + frame(cancel) + (frame(cancel) if n % 2 else b""))
        response = await answered(server, msg_id)
        assert response["error"]["code"] == -32800, response
        outcomes["cancelled before start"] += 1
    # A cancel right behind its answer: ignored.
    for n in range(20):
        msg_id, future = server.send_request("run", {"sessionId": sid, "command": ["echo", str(n)]})
        ids.append(msg_id)
        assert (await asyncio.wait_for(future, 30))["result"]["stdout"] == f"{n}\n"
        await server.notify("$/cancelRequest", {"id": msg_id})
        outcomes["answered, then cancelled"] += 1
    assert wait_gone(marker) == []

    # Cancelled capabilities and session/open (which runs in a thread): a cancelled open
    # closes the session it made, so no workspace is left over.
    opens = []
    for n in range(12):
        msg_id, future = server.send_request("session/open", {"backend": "bubblewrap"})
        ids.append(msg_id)
        if n % 4:
            await asyncio.sleep(0.001 * n)
        await server.notify("$/cancelRequest", {"id": msg_id})
        if n % 2:
            await server.notify("$/cancelRequest", {"id": msg_id})
        opens.append(future)
        msg_id, future = server.send_request("capabilities")
        ids.append(msg_id)
        await server.notify("$/cancelRequest", {"id": msg_id})
        opens.append(future)
    still_open = [sid]
    for future in opens:
        response = await asyncio.wait_for(future, 30)
        if "result" in response:
            outcomes["open/caps answered"] += 1
            if "sessionId" in response["result"]:
                still_open.append(response["result"]["sessionId"])
        else:
            assert response["error"]["code"] == -32800, response
            outcomes["open/caps cancelled"] += 1
    await asyncio.sleep(0.3)
    leftovers = [e for e in private_entries(pid) if not any(s in e for s in still_open)]
    assert leftovers == [], f"workspaces of cancelled opens: {leftovers}"
    for other in still_open[1:]:
        await server.call("session/close", {"sessionId": other})

    # Still serving, and every request had exactly one answer.
    assert (await server.run(sid, "echo ok"))["stdout"] == "ok\n"
    await server.call("session/close", {"sessionId": sid})
    await asyncio.sleep(0.5)
    assert {i: len(server.responses(i)) for i in ids} == {i: 1 for i in ids}
    counts = count_responses(server)
    assert all(count == 1 for count in counts.values())
    no_traceback(server.messages)
    print(f"\ncancellation races: {dict(outcomes)}")
    assert server.process.returncode is None
    await still_serves(server)
    assert private_entries(pid) == []


# -- server bugs this suite found, fixed: each stays as a regression test ----------------


@pytest.mark.timeout(60)
async def test_runs_leave_no_zombie_children(server: RpcClient):
    await server.call("capabilities")
    sid = (await server.open())["sessionId"]
    for _ in range(10):
        assert (await server.run(sid, "true"))["exitCode"] == 0
    await server.call("session/close", {"sessionId": sid})
    await asyncio.sleep(0.5)
    assert live_children(server.pid) == []
    assert zombies(server.pid) == []


@pytest.mark.timeout(90)
async def test_cancel_while_the_sandbox_is_spawning_is_answered_and_kills_the_command(server: RpcClient,
                                                                                       marker: str):
    sid = (await server.open())["sessionId"]
    for n in range(200):
        mark = f"{marker}{n:03d}"
        msg_id, future = server.send_request("run", {"sessionId": sid, "command": f"sleep {mark}", "timeout": None})
        await server.send_raw(b"")  # flush the request first
        await asyncio.sleep((0.0, 0.002, 0.005, 0.01)[n % 4])
        await server.notify("$/cancelRequest", {"id": msg_id})
        try:
            response = await asyncio.wait_for(future, 10)
        except TimeoutError:
            raise AssertionError(f"cancel #{n} of a spawning run never answered; still running: "
                                 f"{processes_with(mark)}") from None
        assert response["error"]["code"] == -32800, response
        assert wait_gone(mark, 5) == [], f"cancel #{n}: the command outlived its cancelled run"
    await server.call("session/close", {"sessionId": sid})


@pytest.mark.timeout(60)
async def test_concurrent_first_opens_share_one_server_directory(home: Path):
    # A race: tried on up to 20 fresh servers, stopping at the first that shows it.
    for _ in range(20):
        client = await RpcClient.start(server_command(home))
        try:
            await client.call("capabilities")  # threads of the executor warmed up: the race is then likely
            opened = await asyncio.gather(*(client.open(backend="bubblewrap") for _ in range(16)))
            parents = sorted({str(Path(o["workspace"]).parent) for o in opened})
            for o in opened:
                await client.call("session/close", {"sessionId": o["sessionId"]})
            await client.close_stdin()
            assert await client.wait_exit(5) == 0
            left = server_dirs(client.pid)
            for directory in left:
                shutil.rmtree(directory)  # what this test's server left behind
        finally:
            await client.aclose()
        if len(parents) > 1 or left:
            break
    assert len(parents) == 1, f"one server, {len(parents)} server directories: {parents}"
    assert left == [], f"left after exit: {left}"


@pytest.mark.timeout(60)
async def test_an_id_reused_right_after_its_cancel_is_refused_or_still_cancellable(server: RpcClient, marker: str):
    sid = (await server.open())["sessionId"]
    first, second = f"{marker}001", f"{marker}002"

    def run(mark: str) -> dict[str, Any]:
        return {"jsonrpc": "2.0", "id": "reused", "method": "run",
                "params": {"sessionId": sid, "command": ["sleep", mark], "timeout": None}}

    cancel = frame({"jsonrpc": "2.0", "method": "$/cancelRequest", "params": {"id": "reused"}})
    await server.send_raw(frame(run(first)))
    await wait_for_marker(first)
    # The cancel, and at once a request with the same id: its first answer has not been sent yet.
    await server.send_raw(cancel + frame(run(second)))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        answers = server.responses("reused")
        if answers and (len(answers) >= 2 or sleeping(second)):
            break  # the first is answered, and the second refused or running
        await asyncio.sleep(0.02)
    answers = server.responses("reused")
    assert answers, "the cancelled request was never answered"
    assert len(answers) == 2 or answers[0]["error"]["code"] == -32800
    if len(answers) == 1:  # accepted: then a cancel must still reach it
        await server.send_raw(cancel)
        deadline = time.monotonic() + 10
        while len(server.responses("reused")) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        answers = server.responses("reused")
        assert len(answers) == 2, f"the second request with a reused id could not be cancelled: {answers}"
        assert answers[1]["error"]["code"] == -32800, answers
    else:  # refused as still in flight; the two answers share the id, so their order says nothing
        assert sorted(a["error"]["code"] for a in answers) == [-32800, -32600], answers
    assert wait_gone(marker) == []
    await server.call("session/close", {"sessionId": sid})
