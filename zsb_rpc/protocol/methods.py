"""The one registry of the protocol: method name -> params type -> result type."""

from __future__ import annotations

from typing import Any

import attrs

from . import types as t


@attrs.frozen
class Method:
    params: type[Any]
    result: type[Any] | None  # None for notifications
    params_required: bool
    description: str


REQUESTS: dict[str, Method] = {
    "capabilities": Method(
        t.CapabilitiesParams, t.CapabilitiesResult, False,
        "What this machine can enforce and how. Creates nothing.",
    ),
    "session/open": Method(
        t.SessionOpenParams, t.SessionOpenResult, False,
        "Open a session: a workspace, a policy, limits.",
    ),
    "run": Method(t.RunParams, t.RunResult, True, "Run a command in a session and wait for it."),
    "wrap": Method(t.WrapParams, t.WrapResult, True, "The sandboxed argv of a command; nothing runs."),
    "session/close": Method(
        t.SessionCloseParams, t.SessionCloseResult, True,
        "Kill the session's process trees and remove what it created.",
    ),
}

# Notifications the client sends.
CLIENT_NOTIFICATIONS: dict[str, Method] = {
    "$/cancelRequest": Method(t.CancelParams, None, True, "Cancel an in-flight request; a run's tree is killed."),
}

# Notifications the server sends.
SERVER_NOTIFICATIONS: dict[str, Method] = {
    "run/output": Method(t.RunOutputNotification, None, True, "A chunk of a run's output, before its response."),
    "run/resources": Method(t.RunResourcesNotification, None, True, "A resource sample of a running command."),
}
