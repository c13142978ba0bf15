"""Fixtures that start the real server over pipes, as root and as an unprivileged user.

Nothing here mocks the sandbox, the kernel, processes or the protocol. The
unprivileged tier creates a user (removed at the end) and runs the server with
``/usr/bin/python3`` and a world-readable copy of the package and its
dependencies, because the test interpreter may live where that user cannot go.
"""

from __future__ import annotations

import importlib.util
import os
import pwd
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from tests.rpc import RpcClient, ServerCommand

IS_ROOT = os.geteuid() == 0
SECRET_VALUE = "zsb-secret-" + secrets.token_hex(8)
REPO = Path(__file__).resolve().parent.parent
RUNTIME_PACKAGES = ("zsb_rpc", "pygls", "lsprotocol", "cattrs", "attrs", "attr", "psutil", "typing_extensions",
                    "exceptiongroup")


def processes_with(marker: str) -> list[int]:
    """Pids whose command line contains ``marker`` (the tests' unique process marks)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as handle:
                if marker.encode() in handle.read():
                    found.append(int(entry))
        except OSError:
            pass
    return found


def wait_gone(marker: str, timeout: float = 5.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while (alive := processes_with(marker)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


@pytest.fixture
def marker() -> str:
    """A unique number that marks a test's processes: ``sleep <marker>`` is findable in /proc."""
    return f"{secrets.randbelow(10**6) + 10**6}.{secrets.randbelow(10**6):06d}"


@pytest.fixture(scope="session")
def test_base() -> Iterator[Path]:
    """A world-traversable directory outside /tmp (which is private inside the sandbox)."""
    base = Path(tempfile.mkdtemp(prefix="zsb-tests-", dir="/var/tmp"))
    base.chmod(0o755)
    yield base
    subprocess.run(["chmod", "-R", "u+rwX", str(base)], check=False)
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="session")
def runtime(test_base: Path) -> Path:
    """A copy of the package and its dependencies that any user can import."""
    target = test_base / "runtime"
    target.mkdir()
    for name in RUNTIME_PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            continue
        origin = Path(spec.origin)
        source = origin.parent if origin.name == "__init__.py" else origin
        if source.is_dir():
            shutil.copytree(source, target / source.name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, target / source.name)
    subprocess.run(["chmod", "-R", "a+rX", str(target)], check=True)
    return target


@pytest.fixture(scope="session")
def unprivileged_user() -> Iterator[pwd.struct_passwd]:
    if not IS_ROOT:
        pytest.skip("creating a user needs root")
    name = "zsbt" + secrets.token_hex(3)
    subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True)
    try:
        yield pwd.getpwnam(name)
    finally:
        subprocess.run(["pkill", "-KILL", "-u", name], check=False)
        subprocess.run(["userdel", name], check=False)


IDENTITIES = ["root", "user"] if IS_ROOT else ["self"]


@pytest.fixture(params=IDENTITIES)
def identity(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def owner(identity: str, request: pytest.FixtureRequest) -> tuple[int, int]:
    if identity == "user":
        user = request.getfixturevalue("unprivileged_user")
        return user.pw_uid, user.pw_gid
    return os.getuid(), os.getgid()


@pytest.fixture
def scratch(test_base: Path, owner: tuple[int, int]) -> Iterator[Path]:
    """A directory of the server's user, outside /tmp, removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="t-", dir=test_base))
    os.chown(path, *owner)
    path.chmod(0o755)
    yield path
    subprocess.run(["chmod", "-R", "u+rwX", str(path)], check=False)
    shutil.rmtree(path, ignore_errors=True)


def chown_tree(path: Path, owner: tuple[int, int]) -> None:
    for dirpath, _, filenames in os.walk(path):
        os.chown(dirpath, *owner)
        for name in filenames:
            os.chown(os.path.join(dirpath, name), *owner, follow_symlinks=False)


@pytest.fixture
def fake_home(scratch: Path, owner: tuple[int, int]) -> Path:
    """A HOME with credentials in the default places, owned by the server's user."""
    home = scratch / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id_ed25519").write_text("PRIVATE-KEY-" + SECRET_VALUE)
    (home / ".aws").mkdir()
    (home / ".aws" / "credentials").write_text("aws_secret=" + SECRET_VALUE)
    (home / ".netrc").write_text("machine x password " + SECRET_VALUE)
    (home / ".git-credentials").write_text("https://u:" + SECRET_VALUE + "@example.com")
    chown_tree(home, owner)
    return home


@pytest.fixture
def server_command(identity: str, fake_home: Path, runtime: Path, request: pytest.FixtureRequest) -> ServerCommand:
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
        "HOME": str(fake_home),
        "LANG": "C.UTF-8",
        "ZSB_TEST_SECRET": SECRET_VALUE,
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    if identity == "user":
        user = request.getfixturevalue("unprivileged_user")
        env.update(PYTHONPATH=str(runtime), USER=user.pw_name)
        argv = ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups", "--",
                "/usr/bin/python3", "-m", "zsb_rpc"]
        return ServerCommand(argv, env, user=user.pw_name, uid=user.pw_uid)
    env["PYTHONPATH"] = str(REPO)
    return ServerCommand([sys.executable, "-m", "zsb_rpc"], env)


@pytest.fixture
def backend() -> str:
    """The backend sessions ask for; suites that must hold on every Linux backend parametrize it."""
    return "bubblewrap"


@pytest.fixture
async def server(server_command: ServerCommand, backend: str) -> AsyncIterator[RpcClient]:
    client = await RpcClient.start(server_command)
    client.default_open = {"backend": backend}
    try:
        yield client
    finally:
        await client.aclose()


@pytest.fixture
async def session(server: RpcClient, scratch: Path) -> dict:
    """An open session on a private workspace."""
    return await server.open()


LINUX_BACKENDS = ["bubblewrap", "landlock"]


async def open_or_refused(server: RpcClient, backend: str, **params) -> dict | None:
    """Open a session on a caller's directory; on landlock, assert that it fails closed instead.

    Landlock cannot keep paths inside a writable directory unwritable, so a
    session that would need it is refused, naming the rule, rather than run
    unprotected. Returns None when refused.
    """
    from tests.rpc import RpcError

    if backend != "landlock":
        return await server.open(**params)
    with pytest.raises(RpcError) as refused:
        await server.open(**params)
    assert refused.value.code == -32602 and "params.protectDefaults" in refused.value.message
    return None
