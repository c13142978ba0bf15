"""The committed JSON Schema is exactly what ``zsb_rpc.protocol`` generates, and it covers the whole contract."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import attrs

from zsb_rpc.protocol import errors, schema
from zsb_rpc.protocol import types as t
from zsb_rpc.protocol.convert import camel
from zsb_rpc.protocol.methods import CLIENT_NOTIFICATIONS, REQUESTS, SERVER_NOTIFICATIONS

REPO = Path(__file__).resolve().parent.parent
COMMITTED = REPO / "schema" / "zsb-rpc.schema.json"
FIX = "python -m zsb_rpc.protocol.schema"


def generated() -> dict[str, Any]:
    return json.loads(schema.render())


def test_committed_schema_is_current():
    assert COMMITTED.exists(), f"{COMMITTED.relative_to(REPO)} is missing; create it with: {FIX}"
    expected = schema.render()
    actual = COMMITTED.read_text(encoding="utf-8")
    assert actual == expected, (
        f"{COMMITTED.relative_to(REPO)} differs from what zsb_rpc/protocol generates; "
        f"regenerate it with: {FIX}"
    )


def test_output_is_deterministic_sorted_and_says_how_to_regenerate():
    text = schema.render()
    assert text == schema.render()
    assert text.endswith("}\n") and not text.endswith("\n\n")
    assert text == json.dumps(json.loads(text), indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    document = json.loads(text)
    assert next(iter(document)) == "$comment" and FIX in document["$comment"]
    assert document["$schema"] == "https://json-schema.org/draft/2020-12/schema"


def test_check_mode_fails_on_drift_and_names_the_fix(tmp_path: Path, capsys):
    stale = tmp_path / "schema.json"
    stale.write_text(schema.render().replace("Session to close.", "Session to shut."), encoding="utf-8")
    assert schema.main(["--check", "--output", str(stale)]) == 1
    captured = capsys.readouterr()
    assert FIX in captured.err and "Session to shut." in captured.out
    assert schema.main(["--output", str(stale)]) == 0
    assert schema.main(["--check", "--output", str(stale)]) == 0


def test_every_method_notification_and_error_code_has_a_section():
    document = generated()
    defs = document["$defs"]
    for section, registry in (("requests", REQUESTS), ("clientNotifications", CLIENT_NOTIFICATIONS),
                              ("serverNotifications", SERVER_NOTIFICATIONS)):
        assert set(document[section]) == set(registry)
        for name, spec in registry.items():
            entry = document[section][name]
            assert entry["description"] == spec.description
            assert entry["paramsRequired"] is spec.params_required
            assert entry["params"] == {"$ref": f"#/$defs/{spec.params.__name__}"}
            if spec.result is None:
                assert "result" not in entry
            else:
                assert entry["result"] == {"$ref": f"#/$defs/{spec.result.__name__}"}
    assert {int(code) for code in document["errors"]} == set(errors.ERROR_CODES)
    for code, description in errors.ERROR_CODES.items():
        entry = document["errors"][str(code)]
        assert entry["code"] == code and entry["description"] == description
        assert getattr(errors, entry["name"]) == code
    # Every $ref points into $defs.
    refs: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if "$ref" in node:
                refs.append(node["$ref"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(document)
    assert refs and all(ref.removeprefix("#/$defs/") in defs for ref in refs)


def test_every_field_is_documented_with_its_wire_name_and_requiredness():
    defs = generated()["$defs"]
    classes = [value for value in vars(t).values() if isinstance(value, type) and attrs.has(value)]
    for cls in classes:
        definition = defs[cls.__name__]
        assert definition["type"] == "object"
        fields = attrs.fields(cls)
        assert set(definition["properties"]) == {camel(f.name) for f in fields}
        for field in fields:
            prop = definition["properties"][camel(field.name)]
            assert prop["description"] == field.metadata["description"]
        assert definition["required"] == sorted(camel(f.name) for f in fields if f.default is attrs.NOTHING)


def test_type_mapping_rules():
    defs = generated()["$defs"]
    run = defs["RunParams"]
    # Absent means the session's; null means none: optional, number or null, no default.
    assert run["properties"]["timeout"] == {
        "type": ["number", "null"], "description": attrs.fields(t.RunParams).timeout.metadata["description"]}
    assert defs["SessionOpenParams"]["properties"]["timeout"]["type"] == ["number", "null"]
    assert "timeout" not in run["required"] and "default" not in run["properties"]["timeout"]
    assert run["properties"]["command"]["$ref"] == "#/$defs/Command"
    assert defs["Command"] == {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]}
    assert run["properties"]["env"]["additionalProperties"] == {"type": "string"}
    assert run["properties"]["runId"]["type"] == ["string", "integer", "null"]
    assert defs["Mechanism"] == {"type": "string", "enum": ["cgroup", "rlimit", "rlimit_as", "watchdog", "none"]}
    assert defs["Resources"]["properties"]["mechanisms"]["additionalProperties"] == {"$ref": "#/$defs/Mechanism"}
    # The server rejects unknown fields in what it structures; what it sends stays open.
    for name in ("CapabilitiesParams", "SessionOpenParams", "RunParams", "WrapParams", "SessionCloseParams",
                 "CancelParams", "Limits"):
        assert defs[name]["additionalProperties"] is False, name
    for name in ("CapabilitiesResult", "RunResult", "RunOutputNotification", "Resources"):
        assert "additionalProperties" not in defs[name], name


def test_generator_imports_nothing_of_zsb_rpc_but_the_protocol():
    code = (
        "import sys, zsb_rpc.protocol.schema\n"
        "print([m for m in sys.modules if m.startswith('zsb_rpc.') and not m.startswith('zsb_rpc.protocol')])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
