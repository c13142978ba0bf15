"""The JSON Schema (draft 2020-12) of the protocol, generated from this package.

``python -m zsb_rpc.protocol.schema`` writes ``schema/zsb-rpc.schema.json``;
``--check`` only compares, and exits 1 (naming the command that fixes it)
when the committed file differs. The output is deterministic: keys sorted,
two-space indent, a trailing newline.

The document has:

* ``$defs``: every params, result and notification type, and every named
  alias of ``types.py`` (enums like ``Mechanism``, ``Command``), with the
  field descriptions of ``types.py`` and camelCase wire names;
* ``requests``: for each request, its description, whether params are
  required, and ``$ref`` s to its params and result;
* ``clientNotifications`` and ``serverNotifications``: the same for
  notifications (no result);
* ``errors``: every error code, with its constant's name and description.

The mapping of Python types to schema: ``X | None`` is "X or null";
``| Unset`` (default ``UNSET``) adds nothing but optionality (absent means
the default, ``null`` means none); ``Literal`` is an ``enum``; other unions
are ``oneOf``; ``dict[str, X]`` is an object whose values are X. Fields with
defaults are optional, the others required. Objects the server structures
(params and what they contain) are closed with ``additionalProperties:
false``, as the server rejects unknown fields; results and server
notifications are left open so that clients tolerate fields added later.

Only ``zsb_rpc.protocol`` is imported here: the contract does not depend on
the server.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
import types as pytypes
import typing
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import attrs

from . import PROTOCOL_VERSION, errors
from . import types as t
from .convert import camel
from .methods import CLIENT_NOTIFICATIONS, REQUESTS, SERVER_NOTIFICATIONS, Method

DRAFT = "https://json-schema.org/draft/2020-12/schema"
COMMAND = "python -m zsb_rpc.protocol.schema"
#: Where the committed schema lives, relative to the repository root.
RELATIVE_PATH = Path("schema") / "zsb-rpc.schema.json"
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_PATH = REPO_ROOT / RELATIVE_PATH

_PRIMITIVES: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean", type(None): "null"}


def _aliases() -> dict[str, Any]:
    """Module-level names of ``types.py`` bound to a Literal or a Union: they become named ``$defs``."""
    found = {}
    for name, value in vars(t).items():
        if name.startswith("_") or isinstance(value, type):
            continue
        if get_origin(value) is Literal or get_origin(value) in (Union, pytypes.UnionType):
            found[name] = value
    return found


class _Builder:
    def __init__(self) -> None:
        self.defs: dict[str, Any] = {}
        self.aliases = _aliases()
        self.closed: set[type] = set()  # classes the server structures

    # -- types ----------------------------------------------------------

    def ref(self, name: str) -> dict[str, Any]:
        return {"$ref": f"#/$defs/{name}"}

    def alias_name(self, kind: Any) -> str | None:
        for name, value in self.aliases.items():
            if value == kind:
                return name
        return None

    def type_schema(self, kind: Any) -> dict[str, Any]:
        if kind in _PRIMITIVES:
            return {"type": _PRIMITIVES[kind]}
        alias = self.alias_name(kind)
        if alias is not None:
            if alias not in self.defs:
                self.defs[alias] = {}  # placeholder against recursion
                self.defs[alias] = self.inline_schema(kind)
            return self.ref(alias)
        if isinstance(kind, type) and attrs.has(kind):
            self.add_class(kind)
            return self.ref(kind.__name__)
        return self.inline_schema(kind)

    def inline_schema(self, kind: Any) -> dict[str, Any]:
        origin = get_origin(kind)
        if origin is Literal:
            values = list(get_args(kind))
            schema: dict[str, Any] = {"enum": values}
            kinds = {type(v) for v in values}
            if len(kinds) == 1 and (only := kinds.pop()) in _PRIMITIVES:
                schema["type"] = _PRIMITIVES[only]
            return schema
        if origin in (Union, pytypes.UnionType):
            members = [m for m in get_args(kind) if m is not t.Unset]
            if len(members) == 1:
                return self.type_schema(members[0])
            if all(m in _PRIMITIVES for m in members):
                return {"type": [_PRIMITIVES[m] for m in members]}
            return {"oneOf": [self.type_schema(m) for m in members]}
        if origin is list:
            (item,) = get_args(kind)
            return {"type": "array", "items": self.type_schema(item)}
        if origin is dict:
            key, value = get_args(kind)
            if key is not str:
                raise TypeError(f"object keys must be strings, not {key!r}")
            return {"type": "object", "additionalProperties": self.type_schema(value)}
        raise TypeError(f"no JSON Schema for {kind!r}")

    def add_class(self, cls: type) -> None:
        name = cls.__name__
        if name in self.defs:
            return
        self.defs[name] = {}  # placeholder against recursion
        hints = typing.get_type_hints(cls, vars(sys.modules[cls.__module__]))
        properties: dict[str, Any] = {}
        required: list[str] = []
        for field in attrs.fields(cls):
            wire = camel(field.name)
            description = field.metadata.get("description")
            if not description:
                raise ValueError(f"{name}.{field.name} has no metadata['description']")
            schema = dict(self.type_schema(hints[field.name]))
            schema["description"] = description
            default = _default(field)
            if default is _REQUIRED:
                required.append(wire)
            elif default is not _NO_DEFAULT:
                schema["default"] = default
            properties[wire] = schema
        schema = {"type": "object", "properties": properties, "required": sorted(required)}
        if cls.__doc__:
            schema["description"] = " ".join(cls.__doc__.split())
        self.defs[name] = schema

    def close(self, cls: type) -> None:
        """Mark ``cls`` and every class its fields contain as structured by the server."""
        if cls in self.closed:
            return
        self.closed.add(cls)
        hints = typing.get_type_hints(cls, vars(sys.modules[cls.__module__]))
        for field in attrs.fields(cls):
            for inner in _classes_in(hints[field.name]):
                self.close(inner)

    # -- methods --------------------------------------------------------

    def method(self, name: str, spec: Method, direction: str) -> dict[str, Any]:
        self.add_class(spec.params)
        if direction == "in":
            self.close(spec.params)
        kind = "notification" if spec.result is None else "request"
        self.describe(spec.params, f"Params of the `{name}` {kind}.")
        entry: dict[str, Any] = {
            "description": spec.description,
            "params": self.ref(spec.params.__name__),
            "paramsRequired": spec.params_required,
        }
        if spec.result is not None:
            self.add_class(spec.result)
            self.describe(spec.result, f"Result of the `{name}` request.")
            entry["result"] = self.ref(spec.result.__name__)
        return entry

    def describe(self, cls: type, description: str) -> None:
        schema = self.defs[cls.__name__]
        schema["description"] = description + (" " + schema["description"] if "description" in schema else "")

    def finish(self) -> None:
        for cls in self.closed:
            self.defs[cls.__name__]["additionalProperties"] = False
        for name, schema in self.defs.items():
            if not schema:
                raise ValueError(f"$defs/{name} was never completed")


_REQUIRED = object()
_NO_DEFAULT = object()


def _default(field: attrs.Attribute) -> Any:
    """The JSON default of a field, ``_REQUIRED``, or ``_NO_DEFAULT`` (optional; see its description)."""
    default = field.default
    if default is attrs.NOTHING:
        return _REQUIRED
    if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
        factory = default.factory  # type: ignore[union-attr]
        if factory is list:
            return []
        if factory is dict:
            return {}
        if isinstance(factory, type) and attrs.has(factory):
            return {}  # every field of the object at its default
        return _NO_DEFAULT
    if default is t.UNSET:
        return _NO_DEFAULT  # absent means the default its description names; null means none
    if default is None or isinstance(default, (bool, int, float, str)):
        return default
    return _NO_DEFAULT


def _classes_in(kind: Any) -> list[type]:
    if isinstance(kind, type):
        return [kind] if attrs.has(kind) else []
    return [inner for arg in get_args(kind) for inner in _classes_in(arg)]


def _error_names() -> dict[int, str]:
    names: dict[int, str] = {}
    for name, value in vars(errors).items():
        if name.isupper() and isinstance(value, int) and value in errors.ERROR_CODES:
            names.setdefault(value, name)
    return names


def build_schema() -> dict[str, Any]:
    """The whole schema document, as plain data."""
    builder = _Builder()
    requests = {name: builder.method(name, spec, "in") for name, spec in REQUESTS.items()}
    client_notifications = {name: builder.method(name, spec, "in") for name, spec in CLIENT_NOTIFICATIONS.items()}
    server_notifications = {name: builder.method(name, spec, "out") for name, spec in SERVER_NOTIFICATIONS.items()}
    # Every type of types.py, even one no method names (yet).
    for value in vars(t).values():
        if isinstance(value, type) and attrs.has(value):
            builder.add_class(value)
    for alias in builder.aliases.values():
        builder.type_schema(alias)
    builder.finish()
    names = _error_names()
    error_codes = {
        str(code): {"code": code, "name": names.get(code, ""), "description": description}
        for code, description in errors.ERROR_CODES.items()
    }
    return {
        "$schema": DRAFT,
        "$comment": (
            f"Generated from zsb_rpc/protocol by `{COMMAND}`; do not edit by hand. "
            f"Regenerate with `{COMMAND}`; `{COMMAND} --check` tells whether this file is current."
        ),
        "title": "zsb-rpc protocol",
        "description": (
            "JSON-RPC 2.0 over stdio with LSP base-protocol framing (Content-Length headers, UTF-8 JSON bodies). "
            "$defs holds every type with camelCase wire names; requests, clientNotifications and "
            "serverNotifications name each method's params and result; errors lists every error code."
        ),
        "protocolVersion": PROTOCOL_VERSION,
        "$defs": builder.defs,
        "requests": requests,
        "clientNotifications": client_notifications,
        "serverNotifications": server_notifications,
        "errors": error_codes,
    }


def render() -> str:
    """The schema as the committed file holds it."""
    return json.dumps(build_schema(), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description="Write (or check) the protocol's JSON Schema.")
    parser.add_argument("--check", action="store_true", help="exit 1 if the file differs from the generated schema")
    parser.add_argument("--output", type=Path, default=DEFAULT_PATH, help=f"file to write (default {RELATIVE_PATH})")
    args = parser.parse_args(argv)
    text = render()
    path: Path = args.output
    if args.check:
        current = path.read_text(encoding="utf-8") if path.exists() else ""
        if current == text:
            return 0
        diff = difflib.unified_diff(current.splitlines(keepends=True), text.splitlines(keepends=True),
                                    f"{path} (committed)", f"{path} (generated)", n=1)
        lines = list(diff)
        sys.stdout.writelines(lines[:60])
        if len(lines) > 60:
            print(f"... ({len(lines) - 60} more diff lines)")
        print(f"{path} is out of date with zsb_rpc/protocol; fix it with: {COMMAND}", file=sys.stderr)
        return 1
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
