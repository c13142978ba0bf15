"""Params, results and notifications of every method, as attrs classes.

Python names are snake_case; the converter in ``convert.py`` renames them to
the camelCase wire names. Every field carries its description in
``metadata["description"]`` so that the schema generator documents it.
"""

from __future__ import annotations

import enum
from typing import Any, Literal, Union

import attrs


class Unset(enum.Enum):
    """Marks a field that was absent, where absent and ``null`` mean different things."""

    UNSET = "unset"


UNSET = Unset.UNSET


def doc(description: str, **kwargs: Any) -> Any:
    """An attrs field with its wire description."""
    return attrs.field(metadata={"description": description}, **kwargs)


Mechanism = Literal["cgroup", "rlimit", "rlimit_as", "watchdog", "none"]
NetworkMode = Literal["none", "full"]
MemoryStrategy = Literal["auto", "kernel", "watchdog", "none"]
Encoding = Literal["utf-8", "base64"]
Stream = Literal["stdout", "stderr"]
Command = Union[str, list[str]]


@attrs.define(kw_only=True)
class Limits:
    """What each command of a session may use. Limits apply per run, not to the session as a whole."""

    memory_bytes: int | None = doc("Memory the command's whole tree may use, at least 16 MiB.", default=None)
    cpu_seconds: int | None = doc("Processor time each process may consume before SIGXCPU, at least 1.", default=None)
    cpu_percent: int | None = doc("Share of one processor the tree may use (100 is one core), at least 1.", default=None)
    processes: int | None = doc("Processes (and threads) the command may add, at least 8.", default=None)
    file_size_bytes: int | None = doc("Largest file the command may create or extend, at least 1.", default=None)
    open_files: int | None = doc("File descriptors each process may hold open, at least 16.", default=None)
    core_dumps: bool = doc("Whether a crash may write a core file. Off by default.", default=False)
    memory_sample_seconds: float = doc("How often memory is sampled, 0.01 to 60 seconds.", default=0.25)


@attrs.define(kw_only=True)
class CapabilitiesParams:
    limits: Limits | None = doc("Limits to report on; all of them when absent.", default=None)
    memory_strategy: MemoryStrategy = doc("Memory strategy to report on.", default="auto")


@attrs.define(kw_only=True)
class BackendInfo:
    name: str = doc("Backend name, as `session/open` takes it in `backend`.")
    available: bool = doc("Whether this backend can run on this machine now.")
    isolated: bool = doc("Whether this backend isolates the command at all.")
    reason: str | None = doc("Why it is unavailable, and what to change; null when available.", default=None)


@attrs.define(kw_only=True)
class CapabilitiesResult:
    server_version: str = doc("Version of the zsb-rpc server.")
    protocol_version: str = doc("Version of this protocol.")
    platform: str = doc("Operating system the server runs on (`linux`, `darwin`, `win32`).")
    backend: str | None = doc("Backend a session would get by default; null when none can run.")
    isolated: bool = doc("Whether that backend isolates commands.")
    memory: Mechanism = doc("How `memoryBytes` would be enforced.")
    cpu_seconds: Mechanism = doc("How `cpuSeconds` would be enforced.")
    cpu_percent: Mechanism = doc("How `cpuPercent` would be enforced.")
    processes: Mechanism = doc("How `processes` would be enforced.")
    file_size_bytes: Mechanism = doc("How `fileSizeBytes` would be enforced.")
    open_files: Mechanism = doc("How `openFiles` would be enforced.")
    core_dumps: Mechanism = doc("How `coreDumps` would be enforced.")
    backends: list[BackendInfo] = doc("Every backend this server knows, with its availability.")
    warnings: list[str] = doc("What this machine cannot enforce, and what to change.")


@attrs.define(kw_only=True)
class SessionOpenParams:
    workspace: str | None = doc(
        "Directory commands may write, used and never deleted. Absent: a private directory, deleted at close.",
        default=None,
    )
    writable: list[str] = doc("More directories or files the commands may write; they must exist.", factory=list)
    deny_write: list[str] = doc("Paths that stay unwritable even inside a writable path.", factory=list)
    deny_read: list[str] = doc("Paths hidden from reads, on top of the default credential paths.", factory=list)
    network: NetworkMode = doc("`none` (default): no network at all. `full`: the host's network.", default="none")
    allow_unix_sockets: list[str] = doc(
        "Host Unix sockets commands may connect to while network is `none`; every other host socket is unreachable.",
        factory=list,
    )
    env: dict[str, str] = doc("Variables every command of the session gets, on top of the allowlist.", factory=dict)
    inherit_environment: list[str] | None = doc(
        "Names of the server's variables commands receive; absent means the default allowlist.", default=None
    )
    timeout: float | None | Unset = doc(
        "Default wall-clock limit of a run in seconds (default 60); null means none.", default=UNSET
    )
    output_limit: int = doc("Default bytes kept per stream in a run's result (default 1 MiB).", default=1024 * 1024)
    limits: Limits = doc("Resource limits applied to every run.", factory=Limits)
    protect_defaults: bool = doc(
        "Hide the usual credential paths and keep shell, git and editor configuration unwritable.", default=True
    )
    backend: str | None = doc("Force a backend by name; absent picks the platform's own.", default=None)
    require_isolation: bool = doc("Refuse to open when the backend would isolate nothing.", default=False)
    memory_strategy: MemoryStrategy = doc("How memory is limited: auto, kernel, watchdog or none.", default="auto")


@attrs.define(kw_only=True)
class SessionOpenResult:
    session_id: str = doc("Identifier to pass to `run`, `wrap` and `session/close`.")
    workspace: str = doc("The workspace directory, resolved.")
    backend: str = doc("Backend the session's commands run on.")
    isolated: bool = doc("Whether that backend isolates commands.")
    warnings: list[str] = doc("What the session asked for and does not get.")


@attrs.define(kw_only=True)
class RunParams:
    session_id: str = doc("Session to run in.")
    command: Command = doc("A string runs through `/bin/sh -c`; a list runs directly with nothing parsed.")
    cwd: str | None = doc("Working directory, absolute or relative to the workspace; default the workspace.", default=None)
    env: dict[str, str] = doc("Variables for this run, on top of the session's.", factory=dict)
    input: str | None = doc("Standard input, in `encoding`; absent means an empty stdin.", default=None)
    timeout: float | None | Unset = doc(
        "Wall-clock limit in seconds; absent means the session's, null means none.", default=UNSET
    )
    output_limit: int | None = doc("Bytes kept per stream in the result; absent means the session's.", default=None)
    encoding: Encoding = doc("`utf-8` text (decoded incrementally) or `base64` bytes, for output and input.", default="utf-8")
    run_id: str | int | None = doc("Set to receive `run/output` and `run/resources` notifications for this run.", default=None)


@attrs.define(kw_only=True)
class Truncated:
    stdout: bool = doc("Whether stdout in the result was cut at the output limit.")
    stderr: bool = doc("Whether stderr in the result was cut at the output limit.")


@attrs.define(kw_only=True)
class Resources:
    mechanisms: dict[str, Mechanism] = doc("For each requested limit, how it was enforced.")
    peak_memory_bytes: int | None = doc("Peak memory of the tree where measured, else null.", default=None)
    cpu_seconds: float | None = doc("Processor time the tree used where measured, else null.", default=None)
    limits_hit: list[str] = doc(
        "Limits the evidence shows were hit: memory, cpu, file_size, processes, open_files.", factory=list
    )
    warnings: list[str] = doc("Requested limits that were not enforced, and why.", factory=list)


@attrs.define(kw_only=True)
class RunResult:
    exit_code: int = doc("Exit status; the negative signal number when a signal ended the command.")
    stdout: str = doc("Standard output, at most the output limit, in `encoding`.")
    stderr: str = doc("Standard error, at most the output limit, in `encoding`.")
    timed_out: bool = doc("Whether the timeout killed the command's tree.")
    truncated: Truncated = doc("Which streams were cut at the output limit.")
    isolated: bool = doc("Whether the command ran inside a sandbox.")
    duration_seconds: float = doc("Wall-clock time from start to the end of the tree.")
    resources: Resources = doc("Limits, how they were enforced, what was used and hit.")


@attrs.define(kw_only=True)
class WrapParams:
    session_id: str = doc("Session whose policy wraps the command.")
    command: Command = doc("A string runs through `/bin/sh -c`; a list runs directly.")
    cwd: str | None = doc("Working directory, absolute or relative to the workspace.", default=None)
    env: dict[str, str] = doc("Variables for the command, on top of the session's.", factory=dict)


@attrs.define(kw_only=True)
class WrapResult:
    argv: list[str] = doc("The sandboxed command line to spawn, in its own process group.")
    cwd: str = doc("Directory to spawn it in.")
    env: dict[str, str] = doc(
        "The environment to spawn it with: the launcher's own, fixed. The command's environment is carried in the "
        "argv (bubblewrap --setenv), so that nothing in it (LD_PRELOAD) acts outside the sandbox."
    )
    warnings: list[str] = doc("What the argv cannot carry (limits that need the server to place the process).")


@attrs.define(kw_only=True)
class SessionCloseParams:
    session_id: str = doc("Session to close.")


@attrs.define(kw_only=True)
class SessionCloseResult:
    session_id: str = doc("The closed session.")
    removed_workspace: bool = doc("Whether a private workspace was removed (never a caller's).")


@attrs.define(kw_only=True)
class CancelParams:
    id: str | int = doc("Id of the request to cancel.")


@attrs.define(kw_only=True)
class RunOutputNotification:
    run_id: str | int = doc("The `runId` of the run.")
    session_id: str = doc("The session of the run.")
    stream: Stream = doc("Which stream the data came from.")
    data: str = doc("A chunk of output, in the run's encoding; text chunks never split a character.")


@attrs.define(kw_only=True)
class RunResourcesNotification:
    run_id: str | int = doc("The `runId` of the run.")
    session_id: str = doc("The session of the run.")
    memory_bytes: int | None = doc("Memory the tree uses now.", default=None)
    peak_memory_bytes: int | None = doc("Peak memory so far.", default=None)
    cpu_seconds: float | None = doc("Processor time used so far.", default=None)
    processes: int | None = doc("Processes in the tree now.", default=None)
