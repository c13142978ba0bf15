"""Private workspaces: created under a directory of this server, removed whatever the command did."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path


def state_root() -> Path:
    """A per-user directory for every server's private workspaces, created 0700 and checked."""
    root = Path(tempfile.gettempdir()) / f"zsb-rpc-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        root.mkdir(mode=0o700)
    info = root.lstat()
    # Another user could have planted it (or a symlink) in a shared /tmp.
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise RuntimeError(f"{root} is not a private directory of this user; remove it")
    return root


def server_directory() -> Path:
    """This server's own directory; its name carries the pid so a later server can tell it is stale."""
    path = state_root() / f"server-{os.getpid()}-{secrets.token_hex(4)}"
    path.mkdir(mode=0o700)
    return path


def make_unreadable_removable(root: Path) -> None:
    """Give every real directory below ``root`` rwx for its owner, so that rmtree can enter it.

    A command may leave ``chmod 000`` directories behind. Symbolic links are
    never followed: the tree is only the workspace's own.
    """
    pending = [root]
    while pending:
        directory = pending.pop()
        with contextlib.suppress(OSError):
            os.chmod(directory, 0o700)
        try:
            entries = list(os.scandir(directory))
        except OSError:
            continue
        for entry in entries:
            with contextlib.suppress(OSError):
                if entry.is_dir(follow_symlinks=False):
                    pending.append(Path(entry.path))


def remove_tree(path: Path) -> None:
    if not path.exists() and not path.is_symlink():
        return
    make_unreadable_removable(path)
    shutil.rmtree(path, ignore_errors=True)
    if path.exists():
        # Second pass for what the first could not enter.
        make_unreadable_removable(path)
        shutil.rmtree(path)


PLACEHOLDER_MANIFEST = "placeholders"


def _server_alive(pid: int) -> bool:
    """Whether ``pid`` is a running zsb-rpc server (a reused pid of another program is not)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            cmdline = handle.read()
    except OSError:
        return False
    return b"zsb_rpc" in cmdline or b"zsb-rpc" in cmdline


def stale_server_pid(name: str, prefix: str) -> int | None:
    """The pid in a ``<prefix><pid>-<token>`` name whose server is gone, else None."""
    if not name.startswith(prefix):
        return None
    pid_text = name[len(prefix):].split("-", 1)[0]
    if not pid_text.isdigit() or int(pid_text) == os.getpid():
        return None
    pid = int(pid_text)
    return None if _server_alive(pid) else pid


def record_placeholders(server_dir: Path, paths: list[Path]) -> None:
    """Note placeholders where a later server finds them if this one is killed."""
    with open(server_dir / PLACEHOLDER_MANIFEST, "a", encoding="utf-8", errors="surrogateescape") as handle:
        handle.writelines(f"{path}\n" for path in paths)


def remove_stale_servers(remove_placeholders: Callable[[list[Path]], None]) -> list[Path]:
    """Remove what servers that died without cleaning up left: workspaces and placeholders."""
    removed: list[Path] = []
    try:
        root = state_root()
    except (OSError, RuntimeError):
        return removed
    for entry in root.iterdir():
        if stale_server_pid(entry.name, "server-") is None:
            continue
        manifest = entry / PLACEHOLDER_MANIFEST
        with contextlib.suppress(OSError):
            paths = [Path(line) for line in manifest.read_text(errors="surrogateescape").splitlines() if line]
            remove_placeholders(paths)
        remove_tree(entry)
        removed.append(entry)
    return removed
