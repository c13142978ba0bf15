"""Error codes of the protocol and the exceptions that carry them.

Handlers raise these; the server turns each into a JSON-RPC error response with
the code and message, and nothing else (no traceback ever reaches a client).
"""

from __future__ import annotations

from typing import Any

# Codes defined by JSON-RPC 2.0 and the LSP base protocol.
PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603
REQUEST_CANCELLED = -32800

# Codes of zsb-rpc itself, in the range JSON-RPC reserves for servers.
SESSION_NOT_FOUND = -32001
SANDBOX_UNAVAILABLE = -32002
SESSION_CLOSED = -32003
ISOLATION_REQUIRED = -32004
SPAWN_FAILED = -32005

ERROR_CODES: dict[int, str] = {
    PARSE_ERROR: "The body is not valid JSON, or the framing is broken.",
    INVALID_REQUEST: "The message is not a valid JSON-RPC 2.0 request.",
    METHOD_NOT_FOUND: "No method of that name.",
    INVALID_PARAMS: "A parameter breaks a rule; the message names the field and the rule.",
    INTERNAL_ERROR: "The server failed unexpectedly; it keeps serving.",
    REQUEST_CANCELLED: "The request was cancelled with $/cancelRequest; its process tree was killed.",
    SESSION_NOT_FOUND: "No open session has that sessionId.",
    SANDBOX_UNAVAILABLE: "The backend cannot run on this machine; the message says what to install or change.",
    SESSION_CLOSED: "The session was closed while the request was running.",
    ISOLATION_REQUIRED: "requireIsolation was set and the only backend available isolates nothing.",
    SPAWN_FAILED: "The sandbox process could not be started.",
}


class ZsbError(Exception):
    """An error a request answers with."""

    code: int = INTERNAL_ERROR

    def __init__(self, message: str, data: Any | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.data = data


class InvalidParams(ZsbError):
    code = INVALID_PARAMS

    def __init__(self, field: str, rule: str) -> None:
        super().__init__(f"{field}: {rule}", {"field": field})
        self.field = field


class SessionNotFound(ZsbError):
    code = SESSION_NOT_FOUND

    def __init__(self, session_id: str) -> None:
        super().__init__(f"params.sessionId: no open session {session_id!r}", {"field": "params.sessionId"})


class SandboxUnavailable(ZsbError):
    code = SANDBOX_UNAVAILABLE


class SessionClosed(ZsbError):
    code = SESSION_CLOSED


class IsolationRequired(ZsbError):
    code = ISOLATION_REQUIRED


class SpawnFailed(ZsbError):
    code = SPAWN_FAILED
