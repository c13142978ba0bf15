"""The cattrs converter of the wire: camelCase names, strict types, no unknown fields.

JSON has no integers distinct from booleans and cattrs' default hooks coerce
(``int("5")``, ``int(5.7)``, ``int(True)``); a sandbox must not guess what a
caller meant, so every primitive is checked, not converted.
"""

from __future__ import annotations

import math
import re
import types
from typing import Any, Union, get_args, get_origin

import attrs
import cattrs
from cattrs.gen import make_dict_structure_fn, make_dict_unstructure_fn, override

from .errors import InvalidParams
from .types import Unset


def camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


def _strict(kind: type, label: str) -> Any:
    def structure(value: Any, _: Any) -> Any:
        if isinstance(value, bool) and kind is not bool:
            raise TypeError(f"must be {label}, not a boolean")
        if not isinstance(value, kind):
            raise TypeError(f"must be {label}, not {_json_type(value)}")
        return value

    return structure


def _structure_float(value: Any, _: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"must be a number, not {_json_type(value)}")
    if not math.isfinite(value):
        raise TypeError("must be a finite number")
    return float(value)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object"}.get(type(value), type(value).__name__)


def _is_union(kind: Any) -> bool:
    return get_origin(kind) in (Union, types.UnionType)


def make_converter() -> cattrs.Converter:
    converter = cattrs.Converter(forbid_extra_keys=True)
    converter.register_structure_hook(str, _strict(str, "a string"))
    converter.register_structure_hook(int, _strict(int, "an integer"))
    converter.register_structure_hook(bool, _strict(bool, "a boolean"))
    converter.register_structure_hook(float, _structure_float)

    def structure_list(value: Any, kind: Any) -> list[Any]:
        if not isinstance(value, list):
            raise TypeError(f"must be an array, not {_json_type(value)}")
        (item,) = get_args(kind) or (Any,)
        return [converter.structure(entry, item) for entry in value]

    def structure_dict(value: Any, kind: Any) -> dict[Any, Any]:
        if not isinstance(value, dict):
            raise TypeError(f"must be an object, not {_json_type(value)}")
        key_type, value_type = get_args(kind) or (Any, Any)
        return {converter.structure(k, key_type): converter.structure(v, value_type) for k, v in value.items()}

    converter.register_structure_hook_func(lambda kind: get_origin(kind) is list, structure_list)
    converter.register_structure_hook_func(lambda kind: get_origin(kind) is dict, structure_dict)

    def structure_union(value: Any, kind: Any) -> Any:
        # Unions on the wire are of distinct JSON types (string or array, number
        # or null), so the first member that accepts the value is the answer.
        members = [m for m in get_args(kind) if m is not Unset]
        if value is None and type(None) in members:
            return None
        errors = []
        for member in members:
            if member is type(None):
                continue
            try:
                return converter.structure(value, member)
            except (TypeError, ValueError, cattrs.BaseValidationError) as error:
                errors.append(error)
        raise TypeError(f"must be {_describe(members)}, not {_json_type(value)}")

    converter.register_structure_hook_func(_is_union, structure_union)

    def structure_literal(value: Any, kind: Any) -> Any:
        allowed = get_args(kind)
        if value not in allowed or isinstance(value, bool):
            raise ValueError("must be one of " + ", ".join(repr(a) for a in allowed))
        return value

    converter.register_structure_hook_func(lambda kind: str(get_origin(kind)) == "typing.Literal", structure_literal)

    def structure_factory(cls: type) -> Any:
        renames = {a.name: override(rename=camel(a.name)) for a in attrs.fields(cls)}
        inner: Any = make_dict_structure_fn(cls, converter, _cattrs_forbid_extra_keys=True, **renames)  # type: ignore[arg-type]

        def structure(value: Any, kind: Any) -> Any:
            if not isinstance(value, dict):
                raise TypeError(f"must be an object, not {_json_type(value)}")
            return inner(value, kind)

        return structure

    def unstructure_factory(cls: type) -> Any:
        renames = {a.name: override(rename=camel(a.name)) for a in attrs.fields(cls)}
        return make_dict_unstructure_fn(cls, converter, **renames)  # type: ignore[arg-type]

    converter.register_structure_hook_factory(attrs.has, structure_factory)
    converter.register_unstructure_hook_factory(attrs.has, unstructure_factory)
    return converter


def _describe(members: list[Any]) -> str:
    names = []
    for member in members:
        if member is type(None):
            names.append("null")
        elif get_origin(member) is list:
            names.append("an array of strings" if get_args(member) == (str,) else "an array")
        else:
            plain = {str: "a string", int: "an integer", float: "a number", bool: "a boolean"}
            names.append(plain.get(member, getattr(member, "__name__", str(member))))
    return " or ".join(names)


_SNAKE = re.compile(r"_([a-z])")


def _wire_path(path: str) -> str:
    # cattrs names attributes in Python's snake_case; the caller wrote camelCase.
    return _SNAKE.sub(lambda m: m.group(1).upper(), path)


def structure_params(converter: cattrs.Converter, value: Any, kind: type) -> Any:
    """Structure ``params``; any failure becomes InvalidParams naming the first bad field and its rule."""
    try:
        return converter.structure(value, kind)
    except cattrs.BaseValidationError as error:
        extra = _first_extra_key(error)
        messages = cattrs.transform_error(error, path="params", format_exception=_format_exception)
        field, _, rule = messages[0].rpartition(" @ ")[::-1] if " @ " in messages[0] else ("params", "", messages[0])
        if extra is not None and rule.startswith("unknown field"):
            field, rule = f"{field}.{extra}", "unknown field (wire names are camelCase)"
            raise InvalidParams(field, rule) from None
        raise InvalidParams(_wire_path(field), rule) from None
    except (TypeError, ValueError) as error:
        raise InvalidParams("params", str(error)) from None


def _first_extra_key(error: BaseException) -> str | None:
    """The first unknown key of the first object that had one, as the caller spelled it."""
    if isinstance(error, cattrs.ForbiddenExtraKeysError):
        return sorted(error.extra_fields)[0]
    for inner in getattr(error, "exceptions", ()):
        found = _first_extra_key(inner)
        if found is not None:
            return found
    return None


def _format_exception(exc: BaseException, type_: Any) -> str:
    if isinstance(exc, KeyError):
        return "is required"
    if isinstance(exc, cattrs.ForbiddenExtraKeysError):
        return "unknown field(s): " + ", ".join(sorted(exc.extra_fields)) + " (names are camelCase)"
    if isinstance(exc, (TypeError, ValueError)) and str(exc):
        return str(exc)
    return cattrs.v.format_exception(exc, type_)
