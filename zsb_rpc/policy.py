"""What a sandboxed command may touch, validated and resolved to concrete paths.

Pure functions from request parameters to a ``ResolvedPolicy``; backends turn
that into their own mechanism. The rules, names and defaults follow the
product's policy model: paths are absolute (``~`` expanded), writable paths
exist and are resolved through symbolic links, the filesystem root is never
writable, a denial beats a permission, and a denied-read path that would hide
a writable one is the caller's error when the caller asked for it and a
warning when it is a default.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .protocol.errors import InvalidParams, SpawnFailed
from .protocol.types import Limits

#: Host variables a command receives unless the session says otherwise. Where
#: API keys and tokens live (everything else) is withheld.
DEFAULT_INHERITED_ENVIRONMENT: tuple[str, ...] = (
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LC_ALL", "LC_CTYPE", "LC_MESSAGES",
    "TERM", "TZ", "TMPDIR", "COLORTERM", "NO_COLOR",
    "SYSTEMROOT", "SYSTEMDRIVE", "WINDIR", "COMSPEC", "PATHEXT", "TEMP", "TMP",
    "USERPROFILE", "APPDATA", "LOCALAPPDATA", "PROGRAMFILES", "PROGRAMDATA",
)

#: Files that run code in a later, unsandboxed context (a login shell, git, an
#: editor): a command that may write the workspace must not plant them.
PROTECTED_FILE_NAMES: tuple[str, ...] = (
    ".bashrc", ".bash_profile", ".zshrc", ".zprofile", ".profile",
    ".gitconfig", ".gitmodules", ".ripgreprc", ".mcp.json",
)
PROTECTED_DIRECTORY_NAMES: tuple[str, ...] = (".vscode", ".idea", ".claude", ".cursor", ".gemini", ".husky")
#: Inside a repository: what git executes (hooks) or trusts (config).
PROTECTED_GIT_NAMES: tuple[str, ...] = ("hooks", "config")
#: Read by a login shell or by git from a home directory only: where a writable
#: root is a home directory, these are protected even when they do not exist.
HOME_STARTUP_FILES: tuple[str, ...] = (
    ".bashrc", ".bash_profile", ".bash_login", ".bash_logout", ".zshrc", ".zprofile", ".zshenv", ".zlogin",
    ".profile", ".gitconfig", ".ripgreprc",
)
#: Directories with the same property in a home directory: ssh keys a remote login
#: trusts, git's XDG configuration.
HOME_STARTUP_DIRECTORIES: tuple[str, ...] = (".ssh", ".config/git")
#: Read by an editor or an agent from a project root: protected there even
#: when they do not exist.
PROJECT_ROOT_NAMES: tuple[tuple[str, str], ...] = ((".vscode", "dir"), (".idea", "dir"), (".mcp.json", "file"))

#: Credential locations under the home directory: a process that can read them
#: and reach the network can send them anywhere.
SENSITIVE_HOME_PATHS: tuple[str, ...] = (
    ".ssh", ".aws", ".gnupg", ".azure", ".kube", ".config/gcloud", ".config/gh",
    ".docker/config.json", ".docker/run/docker.sock", ".netrc", ".npmrc", ".pypirc",
    ".git-credentials", "Library/Keychains",
    ".cargo/credentials.toml", ".cargo/credentials", ".config/github-copilot", ".config/hub",
    ".codex/auth.json", ".claude/.credentials.json", ".vault-token", ".terraform.d/credentials.tfrc.json",
    ".config/op", ".password-store", ".local/share/keyrings",
)
#: Container-engine sockets: connecting to one is root on the host, and a
#: read-only mount does not stop a connection to a socket file.
SENSITIVE_SOCKET_PATHS: tuple[str, ...] = (
    "/var/run/docker.sock", "/run/docker.sock", "/var/run/podman/podman.sock", "/run/podman/podman.sock",
    "/run/containerd/containerd.sock", "/var/run/containerd/containerd.sock",
)

#: Large, generated trees where no repository hides; the search skips them.
_SKIPPED_DIRECTORIES = frozenset({
    "node_modules", ".venv", "venv", "__pycache__", ".tox", ".mypy_cache", ".pytest_cache",
    ".ruff_cache", "target", "dist", "build", ".git",
})
_PROTECTED_SEARCH_DEPTH = 3
_PROTECTED_SEARCH_ENTRIES = 10_000

MINIMUM_MEMORY_BYTES = 16 * 1024 * 1024
DEFAULT_TIMEOUT_SECONDS = 60.0
DEFAULT_OUTPUT_LIMIT = 1024 * 1024


@dataclass(frozen=True, slots=True)
class ResolvedPolicy:
    """A session's policy as concrete absolute paths a backend can enforce."""

    workspace: Path
    writable: tuple[Path, ...]
    denied_write: tuple[Path, ...]
    protected_write: tuple[Path, ...]
    denied_read: tuple[Path, ...]
    network: str
    environment: Mapping[str, str]
    limits: Limits
    memory_strategy: str
    timeout: float | None
    output_limit: int
    warnings: tuple[str, ...] = ()
    home: Path = field(default_factory=Path.home)
    placeholders: tuple[Placeholder, ...] = ()
    allow_unix_sockets: tuple[Path, ...] = ()
    #: A temporary directory of the session, for backends without a private /tmp.
    private_tmp: Path | None = None
    #: Hidden paths that existed at open: one that vanishes later was moved, and a run refuses.
    hidden_at_open: tuple[Path, ...] = ()

    @property
    def unwritable(self) -> tuple[Path, ...]:
        return _unique((*self.denied_write, *self.protected_write))


def _unique(paths: Iterable[Path]) -> tuple[Path, ...]:
    return tuple(dict.fromkeys(paths))


def check_text(value: str, field_name: str) -> str:
    """Refuse NUL and text the OS cannot hold (lone surrogates), before it reaches exec."""
    if "\0" in value:
        raise InvalidParams(field_name, "must not contain NUL")
    try:
        os.fsencode(value)
    except UnicodeError:
        raise InvalidParams(field_name, "must be valid Unicode (no lone surrogates)") from None
    return value


def as_path(value: str, field_name: str, home: Path) -> Path:
    """Expand ``~`` and require an absolute path, so a policy never depends on the server's cwd."""
    check_text(value, field_name)
    if value == "~" or value.startswith("~/"):
        value = str(home) + value[1:]
    path = Path(value)
    if not path.is_absolute():
        raise InvalidParams(field_name, f"must be an absolute path (or start with ~/), got {value!r}")
    return path


def check_limits(limits: Limits) -> None:
    """Floors are what the launcher itself needs: it is a process with descriptors of its own."""
    for name, wire, minimum, note in (
        ("cpu_seconds", "cpuSeconds", 1, ""),
        ("cpu_percent", "cpuPercent", 1, ""),
        ("processes", "processes", 8, " (the launcher is a process in the tree)"),
        ("file_size_bytes", "fileSizeBytes", 1, ""),
        ("open_files", "openFiles", 16, " (the launcher needs descriptors of its own)"),
        ("memory_bytes", "memoryBytes", MINIMUM_MEMORY_BYTES, " (16 MiB: the launcher must start)"),
    ):
        value = getattr(limits, name)
        if value is not None and value < minimum:
            raise InvalidParams(f"params.limits.{wire}", f"must be an integer of at least {minimum}{note}, or null")
        if value is not None and value > 2**62:
            raise InvalidParams(f"params.limits.{wire}", "is too large")
    if not 0.01 <= limits.memory_sample_seconds <= 60:
        raise InvalidParams("params.limits.memorySampleSeconds", "must be between 0.01 and 60")


def check_timeout(value: float | None, field_name: str) -> float | None:
    if value is not None and not 0 < value <= 7 * 24 * 3600:
        raise InvalidParams(field_name, "must be a number of seconds above 0 and at most a week, or null for none")
    return value


def check_output_limit(value: int, field_name: str) -> int:
    if not 0 <= value <= 1 << 40:
        raise InvalidParams(field_name, "must be a number of bytes from 0 to 2**40")
    return value


@dataclass(frozen=True, slots=True)
class Placeholder:
    """A protected path that does not exist yet: ``kind`` is ``file`` or ``dir``."""

    path: Path
    kind: str


def add_placeholder(placeholders: list[Placeholder], root: Path, path: Path, kind: str) -> None:
    """Add ``path`` after the parents below ``root`` that are missing too (made, not protected:
    ``.config`` for ``.config/git``)."""
    for relative in reversed(path.relative_to(root).parents[:-1]):
        parent = Placeholder(root / relative, "dir")
        if not os.path.lexists(parent.path) and parent not in placeholders:
            placeholders.append(parent)
    placeholders.append(Placeholder(path, kind))


def _gitdir_of(dotgit: Path) -> Path | None:
    """The repository a ``.git`` file (worktree, submodule) points at."""
    try:
        with open(dotgit, "rb") as handle:  # bounded: a command may have planted a huge file
            text = handle.read(4096).decode("utf-8", "replace")
    except OSError:
        return None
    if not text.startswith("gitdir:"):
        return None
    target = Path(text[len("gitdir:"):].strip())
    return (dotgit.parent / target).resolve(strict=False) if not target.is_absolute() else target


def _git_metadata(dotgit: Path, create: bool) -> tuple[list[Path], list[Placeholder]]:
    if dotgit.is_symlink():
        return [dotgit], []
    if dotgit.is_dir():
        paths = [dotgit / name for name in PROTECTED_GIT_NAMES]
        configured = hooks_path(dotgit)
        if configured:
            target = Path(configured).expanduser()
            paths.append(target if target.is_absolute() else dotgit.parent / target)
        missing = [Placeholder(dotgit / "hooks", "dir")] if create and not os.path.lexists(dotgit / "hooks") else []
        if create and not os.path.lexists(dotgit / "config"):
            missing.append(Placeholder(dotgit / "config", "file"))
        return paths, missing
    if dotgit.is_file():
        gitdir = _gitdir_of(dotgit)
        return [dotgit, *((gitdir / name) for name in PROTECTED_GIT_NAMES)] if gitdir else [dotgit], []
    if create:
        # No repository yet: an empty one-of-ours .git keeps a command from
        # creating one with hooks that the user's next git command would run.
        # git skips a .git without HEAD, so a parent repository still works.
        return [dotgit / name for name in PROTECTED_GIT_NAMES], [
            Placeholder(dotgit, "dir"), Placeholder(dotgit / "hooks", "dir"), Placeholder(dotgit / "config", "file"),
        ]
    return [], []


def protected_in(root: Path, *, create_missing: bool, home_like: bool) -> tuple[list[Path], list[Placeholder], bool]:
    """Paths under one writable root that must stay unwritable, and which of them to create first.

    At the root, the well-known names are protected whether they exist or not
    (``create_missing``: a backend that can only protect what exists gets
    empty placeholders for them); a shallow search then finds existing names,
    and git repositories, below it. Returns (paths, placeholders, truncated).
    """
    found: list[Path] = []
    missing: list[Placeholder] = []
    for name in (*PROTECTED_FILE_NAMES, *PROTECTED_DIRECTORY_NAMES):
        if os.path.lexists(root / name):
            found.append(root / name)
    if home_like:
        found.extend(root / name for name in (*HOME_STARTUP_FILES, *HOME_STARTUP_DIRECTORIES)
                     if os.path.lexists(root / name))
    if create_missing:
        wanted = [(name, "file") for name in HOME_STARTUP_FILES] if home_like else []
        wanted += [(name, "dir") for name in HOME_STARTUP_DIRECTORIES] if home_like else []
        for name, kind in (*wanted, *PROJECT_ROOT_NAMES):
            path = root / name
            if not os.path.lexists(path):
                found.append(path)
                add_placeholder(missing, root, path, kind)
    paths, placeholders = _git_metadata(root / ".git", create_missing)
    found.extend(paths)
    missing.extend(placeholders)
    visited = 0
    pending: deque[tuple[Path, int]] = deque([(root, 0)])
    while pending:
        directory, depth = pending.popleft()
        try:
            entries = list(os.scandir(directory))
        except OSError:
            continue
        for entry in entries:
            visited += 1
            if visited > _PROTECTED_SEARCH_ENTRIES:
                return found, missing, True
            try:
                is_directory = entry.is_dir(follow_symlinks=False)
            except OSError:
                continue
            path = directory / entry.name
            if directory == root:
                if is_directory and entry.name not in _SKIPPED_DIRECTORIES and depth + 1 < _PROTECTED_SEARCH_DEPTH:
                    pending.append((path, depth + 1))
                continue  # the root's own names were handled above
            if entry.name == ".git":
                found.extend(_git_metadata(path, False)[0])
                continue
            if entry.name in PROTECTED_FILE_NAMES or (is_directory and entry.name in PROTECTED_DIRECTORY_NAMES):
                found.append(path)
            if is_directory and entry.name not in _SKIPPED_DIRECTORIES and depth + 1 < _PROTECTED_SEARCH_DEPTH:
                pending.append((path, depth + 1))
    return found, missing, False


def check_hidden_in_place(policy: ResolvedPolicy) -> None:
    """Before each command: a hidden path that existed at open and is gone now was moved (a
    rename outside a run, or by a session with a weaker policy). Every backend hides by path,
    so the command is refused rather than run with it unmasked under its new name."""
    for path in policy.hidden_at_open:
        if not os.path.lexists(path):
            raise SpawnFailed(f"the hidden path {path} is gone since the session opened; refusing to run")


def symlinked(paths: Iterable[Path]) -> list[Path]:
    """Which of ``paths`` are symbolic links themselves (a mount would land on their target)."""
    return [path for path in paths if path.is_symlink()]


def hooks_path(dotgit: Path) -> str | None:
    """``core.hooksPath`` of a repository's config (husky and the like): hooks that live elsewhere."""
    try:
        with open(dotgit / "config", "rb") as handle:
            text = handle.read(1 << 16).decode("utf-8", "replace")
    except OSError:
        return None
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("["):
            section = line.strip("[]").strip().lower()
        elif section == "core" and "=" in line:
            key, _, value = line.partition("=")
            if key.strip().lower() == "hookspath":
                return value.strip().strip('"')
    return None


def home_directories(home: Path) -> set[Path]:
    """The server's home and every home in the user database: where shell startup files are read."""
    homes = {home.resolve(strict=False)}
    try:
        import pwd

        homes.update(Path(entry.pw_dir).resolve(strict=False) for entry in pwd.getpwall() if entry.pw_dir not in ("", "/"))
    except (ImportError, OSError):
        pass
    return homes


def build_environment(
    names: Iterable[str], extra: Mapping[str, str], source: Mapping[str, str], field_name: str
) -> dict[str, str]:
    """The allowlisted host variables, then ``extra``, which wins. Nothing else leaks through."""
    wanted = set(names)
    environment = {key: value for key, value in source.items() if key in wanted}
    for key, value in extra.items():
        if not key or "=" in key or "\0" in key:
            raise InvalidParams(f"{field_name}", f"invalid environment variable name {key!r}")
        check_text(key, field_name)
        check_text(value, f"{field_name}.{key}")
        environment[key] = value
    return environment


def command_arguments(command: str | Sequence[str], field_name: str = "params.command") -> list[str]:
    """A string runs through ``/bin/sh -c``; a list runs directly, with nothing parsed."""
    if isinstance(command, str):
        if not command.strip():
            raise InvalidParams(field_name, "cannot be blank")
        arguments = ["/bin/sh", "-c", command]
    else:
        arguments = list(command)
        if not arguments or not arguments[0]:
            raise InvalidParams(field_name, "must be a non-empty string or a non-empty array of strings")
    for argument in arguments:
        check_text(argument, field_name)
    return arguments


def resolve_policy(
    *,
    workspace: Path,
    writable: Sequence[str],
    deny_write: Sequence[str],
    deny_read: Sequence[str],
    network: str,
    env: Mapping[str, str],
    inherit_environment: Sequence[str] | None,
    limits: Limits,
    memory_strategy: str,
    timeout: float | None,
    output_limit: int,
    protect_defaults: bool,
    home: Path,
    source_environment: Mapping[str, str],
    private_workspace: bool = False,
    allow_unix_sockets: Sequence[str] = (),
) -> ResolvedPolicy:
    """Turn a session's parameters into the concrete paths a backend enforces."""
    check_limits(limits)
    check_timeout(timeout, "params.timeout")
    check_output_limit(output_limit, "params.outputLimit")
    warnings: list[str] = []

    roots: list[Path] = [workspace]
    for index, value in enumerate(writable):
        name = f"params.writable[{index}]"
        path = as_path(value, name, home)
        try:
            resolved = path.resolve(strict=True)
        except (OSError, RuntimeError):
            raise InvalidParams(name, f"must exist: {value!r} does not exist or cannot be resolved") from None
        roots.append(resolved)
    for index, root in enumerate(roots):
        if root == Path(root.anchor):
            name = "params.workspace" if index == 0 else f"params.writable[{index - 1}]"
            raise InvalidParams(name, "refusing to make the filesystem root writable")

    denied_write = _unique(
        as_path(v, f"params.denyWrite[{i}]", home).resolve(strict=False) for i, v in enumerate(deny_write)
    )
    explicit_denied_read = [
        as_path(v, f"params.denyRead[{i}]", home).resolve(strict=False) for i, v in enumerate(deny_read)
    ]
    denied_read: list[Path] = list(explicit_denied_read)
    protected: list[Path] = []
    placeholders: list[Placeholder] = []
    if protect_defaults:
        candidates = [home / relative for relative in SENSITIVE_HOME_PATHS]
        candidates.extend(Path(socket) for socket in SENSITIVE_SOCKET_PATHS)
        denied_read.extend(path.resolve(strict=False) for path in candidates if os.path.lexists(path))
        homes = home_directories(home)
        for index, root in enumerate(_unique(roots)):
            # A private workspace is deleted at close: nothing in it runs later.
            create = not (private_workspace and index == 0)
            paths, missing, truncated = protected_in(root, create_missing=create, home_like=root in homes)
            protected.extend(paths)
            placeholders.extend(missing)
            if truncated:
                warnings.append(f"{root}: too many entries to search for protected files; only part of the tree is covered")

    # Only what lies in a writable root needs protecting; a gitdir elsewhere is read-only anyway.
    protected = [path for path in protected if any(path.is_relative_to(root) for root in roots)]
    for path in denied_write:
        # A denied path that does not exist yet is made, so that it cannot be created instead.
        inside = [root for root in roots if path.is_relative_to(root) and path != root]
        if inside and not os.path.lexists(path):
            add_placeholder(placeholders, max(inside, key=lambda r: len(r.parts)), path, "dir")

    kept_denied_read: list[Path] = []
    for index, denied in enumerate(denied_read):
        inside = [root for root in roots if root == denied or root.is_relative_to(denied)]
        if not inside:
            kept_denied_read.append(denied)
        elif index < len(explicit_denied_read):
            raise InvalidParams(f"params.denyRead[{index}]", f"{denied} would hide the writable path {inside[0]}")
        else:
            warnings.append(f"default read protection of {denied} skipped: it contains the writable path {inside[0]}")

    names = DEFAULT_INHERITED_ENVIRONMENT if inherit_environment is None else tuple(inherit_environment)
    for index, name in enumerate(names):
        if not name or "=" in name or "\0" in name:
            raise InvalidParams(f"params.inheritEnvironment[{index}]", "must be a variable name (no '=' or NUL)")
    environment = build_environment(names, env, source_environment, "params.env")

    sockets = tuple(
        as_path(v, f"params.allowUnixSockets[{i}]", home).resolve(strict=False) for i, v in enumerate(allow_unix_sockets)
    )
    hidden_at_open = tuple(path for path in _unique(kept_denied_read) if os.path.lexists(path))
    return ResolvedPolicy(
        workspace=workspace,
        writable=outermost(roots),
        denied_write=denied_write,
        protected_write=_unique(protected),
        denied_read=_unique(kept_denied_read),
        network=network,
        environment=environment,
        limits=limits,
        memory_strategy=memory_strategy,
        timeout=timeout,
        output_limit=output_limit,
        warnings=tuple(warnings),
        home=home,
        placeholders=tuple(placeholders),
        allow_unix_sockets=sockets,
        hidden_at_open=hidden_at_open,
    )


def outermost(roots: Iterable[Path]) -> tuple[Path, ...]:
    """The writable roots, without those inside another one.

    A root inside another is writable already, and binding it again by path
    each run would follow whatever a command put there since: a symlink
    swapped in for ``a/b`` would carry the next run's writes outside.
    """
    unique = _unique(roots)
    return tuple(root for root in unique if not any(root != other and root.is_relative_to(other) for other in unique))
