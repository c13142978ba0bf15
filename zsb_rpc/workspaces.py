"""Private workspaces: created under a directory of this server, removed whatever the command did."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import stat
import tempfile
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
