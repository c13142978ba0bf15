"""Windows helpers for the passthrough backend: a Job Object that ends a command's tree.

Windows has no process groups that a signal reaches, and a child whose parent
exited is not found by walking the process tree. A Job Object holds a process
and, by default, everything it starts afterwards; with
``JOB_OBJECT_LIMIT_KILL_ON_JOB_CLOSE`` the kernel terminates every process in
the job when the last handle to it closes: when the runner closes it after the
run, and also when the server dies, however it dies, because the kernel closes
a dead process's handles. The handle is not inheritable, so no command can
hold the job open.

Only ``ctypes`` against kernel32, no compiled extension. Every Windows-only
name is looked up inside the functions, so this module imports everywhere;
off Windows ``create_kill_on_close_job()`` returns None and
``assign_process_to_job()`` raises ``OSError``.

What remains when it is used:

- The command is assigned after it was created: whatever it starts before
  ``assign_process_to_job`` returns is not in the job. (Python's subprocess
  cannot create a process suspended, or inside a job, portably.)
- Without a job, or if assignment fails (on Windows 7 a process already in a
  job that forbids breakaway cannot be put into another one: access denied),
  the runner is back to what it does everywhere: kill the tree it can find
  through the parent links (psutil). A descendant whose parent already exited
  is then not found and keeps running.
- Nothing here isolates anything: passthrough stays ``isolated = False``.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import sys
from typing import Any

JOB_OBJECT_LIMIT_KILL_ON_JOB_CLOSE = 0x00002000
JOB_OBJECT_EXTENDED_LIMIT_INFORMATION_CLASS = 9  # JobObjectExtendedLimitInformation
PROCESS_TERMINATE = 0x0001
PROCESS_SET_QUOTA = 0x0100


class _BasicLimitInformation(ctypes.Structure):
    # JOBOBJECT_BASIC_LIMIT_INFORMATION, in fixed-size types so it is defined on every platform.
    _fields_ = [
        ("PerProcessUserTimeLimit", ctypes.c_int64),  # LARGE_INTEGER
        ("PerJobUserTimeLimit", ctypes.c_int64),  # LARGE_INTEGER
        ("LimitFlags", ctypes.c_uint32),  # DWORD
        ("MinimumWorkingSetSize", ctypes.c_size_t),  # SIZE_T
        ("MaximumWorkingSetSize", ctypes.c_size_t),  # SIZE_T
        ("ActiveProcessLimit", ctypes.c_uint32),  # DWORD
        ("Affinity", ctypes.c_size_t),  # ULONG_PTR
        ("PriorityClass", ctypes.c_uint32),  # DWORD
        ("SchedulingClass", ctypes.c_uint32),  # DWORD
    ]


class _IoCounters(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_uint64)
        for name in (
            "ReadOperationCount", "WriteOperationCount", "OtherOperationCount",
            "ReadTransferCount", "WriteTransferCount", "OtherTransferCount",
        )
    ]


class _ExtendedLimitInformation(ctypes.Structure):
    # JOBOBJECT_EXTENDED_LIMIT_INFORMATION
    _fields_ = [
        ("BasicLimitInformation", _BasicLimitInformation),
        ("IoInfo", _IoCounters),
        ("ProcessMemoryLimit", ctypes.c_size_t),
        ("JobMemoryLimit", ctypes.c_size_t),
        ("PeakProcessMemoryUsed", ctypes.c_size_t),
        ("PeakJobMemoryUsed", ctypes.c_size_t),
    ]


@functools.cache
def _kernel32() -> Any:
    """kernel32 with the prototypes used here; only ever called on Windows."""
    kernel32 = ctypes.WinDLL("kernel32", use_last_error=True)  # type: ignore[attr-defined]
    handle, bool_, dword = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32
    kernel32.CreateJobObjectW.argtypes = [ctypes.c_void_p, ctypes.c_wchar_p]
    kernel32.CreateJobObjectW.restype = handle
    kernel32.SetInformationJobObject.argtypes = [handle, ctypes.c_int, ctypes.c_void_p, dword]
    kernel32.SetInformationJobObject.restype = bool_
    kernel32.OpenProcess.argtypes = [dword, bool_, dword]
    kernel32.OpenProcess.restype = handle
    kernel32.AssignProcessToJobObject.argtypes = [handle, handle]
    kernel32.AssignProcessToJobObject.restype = bool_
    kernel32.TerminateJobObject.argtypes = [handle, ctypes.c_uint]
    kernel32.TerminateJobObject.restype = bool_
    kernel32.CloseHandle.argtypes = [handle]
    kernel32.CloseHandle.restype = bool_
    return kernel32


def _last_error(what: str) -> OSError:
    error = ctypes.WinError(ctypes.get_last_error())  # type: ignore[attr-defined]
    error.strerror = f"{what}: {error.strerror}"
    return error


class KillOnCloseJob:
    """An open Job Object handle; closing it terminates every process still in the job."""

    def __init__(self, handle: int) -> None:
        self.handle: int | None = handle

    def close(self) -> None:
        """Close the handle: the kernel then ends every process in the job. Idempotent."""
        handle, self.handle = self.handle, None
        if handle is not None:
            _kernel32().CloseHandle(handle)

    def terminate(self, exit_code: int = 1) -> None:
        """End every process in the job now, keeping the handle (for a timeout or a cancel)."""
        if self.handle is not None and not _kernel32().TerminateJobObject(self.handle, exit_code):
            raise _last_error("TerminateJobObject")

    def __enter__(self) -> KillOnCloseJob:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: the kernel closes it with the process anyway
            pass


def create_kill_on_close_job() -> KillOnCloseJob | None:
    """A new anonymous job that kills its processes when closed; None off Windows.

    Raises ``OSError`` when Windows refuses to create or configure it.
    """
    if sys.platform != "win32":
        return None
    kernel32 = _kernel32()
    handle = kernel32.CreateJobObjectW(None, None)  # no name, not inheritable
    if not handle:
        raise _last_error("CreateJobObjectW")
    info = _ExtendedLimitInformation()
    info.BasicLimitInformation.LimitFlags = JOB_OBJECT_LIMIT_KILL_ON_JOB_CLOSE
    if not kernel32.SetInformationJobObject(
        handle, JOB_OBJECT_EXTENDED_LIMIT_INFORMATION_CLASS, ctypes.byref(info), ctypes.sizeof(info)
    ):
        error = _last_error("SetInformationJobObject")
        kernel32.CloseHandle(handle)
        raise error
    return KillOnCloseJob(handle)


def assign_process_to_job(job: KillOnCloseJob, pid: int) -> None:
    """Put process ``pid`` (and what it starts from now on) into ``job``.

    Raises ``OSError``: off Windows always, on Windows when the process is gone
    or cannot be moved into the job.
    """
    if sys.platform != "win32":
        raise OSError(errno.ENOSYS, "Job Objects exist only on Windows")
    if job.handle is None:
        raise OSError(errno.EBADF, "the job is closed")
    kernel32 = _kernel32()
    process = kernel32.OpenProcess(PROCESS_SET_QUOTA | PROCESS_TERMINATE, False, pid)
    if not process:
        raise _last_error(f"OpenProcess({pid})")
    try:
        if not kernel32.AssignProcessToJobObject(job.handle, process):
            raise _last_error(f"AssignProcessToJobObject({pid})")
    finally:
        kernel32.CloseHandle(process)
