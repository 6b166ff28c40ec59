"""Local BACKWARD-compatibility check of the value schemas against their history (Avro schema resolution rules).

BACKWARD: the current schema (reader) must read every record written with an older version (writer) in
``schemas/history``. Checked at ``clawstream topics create`` for every deployment, with or without a registry (a
registry checks the same with its own rules). Each problem names the schema, the field and the fix.
Pure: no Kafka import, no I/O beyond reading the ``.avsc`` files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from clawbase.errors import CodecError

PROMOTIONS = {
    "int": {"int", "long", "float", "double"},
    "long": {"long", "float", "double"},
    "float": {"float", "double"},
    "string": {"string", "bytes"},
    "bytes": {"bytes", "string"},
}
PRIMITIVES = {"null", "boolean", "int", "long", "float", "double", "bytes", "string"}


class IncompatibleSchemaError(CodecError):
    """A schema change would leave records written with an older version unreadable."""


def _named(schema: Any, names: dict[str, Any], namespace: str) -> Any:
    """Resolve a reference to a named type; register named definitions (full names) as they appear."""
    if isinstance(schema, str):
        if schema in PRIMITIVES:
            return schema
        full = schema if "." in schema else f"{namespace}.{schema}" if namespace else schema
        return names.get(full, names.get(schema, schema))
    if isinstance(schema, dict) and schema.get("type") in ("record", "enum", "fixed") and "name" in schema:
        ns = schema.get("namespace", namespace)
        full = schema["name"] if "." in schema["name"] else f"{ns}.{schema['name']}" if ns else schema["name"]
        names.setdefault(full, schema)
    return schema


def _kind(schema: Any) -> str:
    if isinstance(schema, list):
        return "union"
    if isinstance(schema, dict):
        kind = schema["type"]
        return kind if isinstance(kind, str) else _kind(kind)
    return str(schema)


class _Checker:
    def __init__(self) -> None:
        self.rnames: dict[str, Any] = {}
        self.wnames: dict[str, Any] = {}
        self.problems: list[str] = []

    def check(self, reader: Any, writer: Any, path: str, ns: str = "") -> bool:
        """Whether data of ``writer`` resolves to ``reader``; records every problem under ``path``."""
        reader, writer = _named(reader, self.rnames, ns), _named(writer, self.wnames, ns)
        if isinstance(reader, dict) and isinstance(reader.get("type"), (dict, list)):
            reader = reader["type"]
        if isinstance(writer, dict) and isinstance(writer.get("type"), (dict, list)):
            writer = writer["type"]
        rk, wk = _kind(reader), _kind(writer)
        if wk == "union":  # every writer branch must resolve
            return all([self._resolves(reader, branch, f"{path} (writer branch {_kind(branch)})") for branch in writer])
        if rk == "union":  # the first reader branch that matches the writer's type
            if any(self._quiet(branch, writer, path) for branch in reader):
                return True
            return self._fail(path, f"the union {_show(reader)} has no branch for the old type {_show(writer)}")
        if wk in PRIMITIVES or rk in PRIMITIVES:
            if rk in PROMOTIONS.get(wk, {wk}):
                return True
            return self._fail(path, f"type changed from {_show(writer)} to {_show(reader)}")
        if rk != wk:
            return self._fail(path, f"type changed from {wk} to {rk}")
        return getattr(self, f"_{rk}")(reader, writer, path, ns)

    def _resolves(self, reader: Any, writer: Any, path: str) -> bool:
        return self.check(reader, writer, path)

    def _quiet(self, reader: Any, writer: Any, path: str) -> bool:
        saved = list(self.problems)
        ok = self.check(reader, writer, path)
        self.problems = saved
        return ok

    def _fail(self, path: str, what: str) -> bool:
        self.problems.append(f"{path}: {what}")
        return False

    def _record(self, reader: dict, writer: dict, path: str, ns: str) -> bool:
        if reader["name"].rpartition(".")[2] != writer["name"].rpartition(".")[2]:
            return self._fail(path, f"record renamed from {writer['name']} to {reader['name']} (add an alias)")
        ns = reader.get("namespace", ns)
        wfields = {f["name"]: f for f in writer["fields"]}
        ok = True
        for field in reader["fields"]:
            names = [field["name"], *field.get("aliases", [])]
            old = next((wfields[n] for n in names if n in wfields), None)
            where = f"{path}.{field['name']}"
            if old is None:
                if "default" not in field:
                    ok = self._fail(
                        where,
                        "added without a default, so records written before it cannot be read; "
                        'give it a "default" (e.g. null with type ["null", ...])',
                    )
                continue
            ok = self.check(field["type"], old["type"], where, ns) and ok
        return ok

    def _enum(self, reader: dict, writer: dict, path: str, ns: str) -> bool:
        missing = [s for s in writer["symbols"] if s not in reader["symbols"]]
        if missing and "default" not in reader:
            return self._fail(path, f"enum symbols {missing} removed; keep them or give the enum a default")
        return True

    def _fixed(self, reader: dict, writer: dict, path: str, ns: str) -> bool:
        if reader["size"] != writer["size"]:
            return self._fail(path, f"fixed size changed from {writer['size']} to {reader['size']}")
        return True

    def _array(self, reader: dict, writer: dict, path: str, ns: str) -> bool:
        return self.check(reader["items"], writer["items"], f"{path}[]", ns)

    def _map(self, reader: dict, writer: dict, path: str, ns: str) -> bool:
        return self.check(reader["values"], writer["values"], f"{path}{{}}", ns)


def _show(schema: Any) -> str:
    return json.dumps(schema if not isinstance(schema, dict) else schema.get("name", schema["type"]))


def backward_problems(reader: dict[str, Any], writer: dict[str, Any]) -> list[str]:
    """Why records written with ``writer`` cannot be read with ``reader`` (empty: BACKWARD-compatible)."""
    checker = _Checker()
    checker.check(reader, writer, reader.get("name", "record"), reader.get("namespace", ""))
    return checker.problems


def history_of(schema_dir: Path) -> dict[str, list[Path]]:
    """``{current .avsc path: its history files, oldest first}`` (``<stem>.v<N>.avsc``, by N)."""
    out: dict[str, list[Path]] = {}
    for current in sorted(schema_dir.glob("*.avsc")):
        olds = list((schema_dir / "history").glob(f"{current.stem}.v*.avsc"))
        out[str(current)] = sorted(olds, key=lambda p: int(p.name.rsplit(".v", 1)[1].split(".")[0]))
    return out


def check_history(schema_dir: Path) -> None:
    """Raise :class:`IncompatibleSchemaError` naming each schema, field and fix where a current ``.avsc`` cannot read
    records written with one of its versions in ``schemas/history`` (every version, not only the latest)."""
    problems: list[str] = []
    for current, olds in history_of(schema_dir).items():
        reader = json.loads(Path(current).read_text())
        for old in olds:
            for problem in backward_problems(reader, json.loads(old.read_text())):
                problems.append(f"{Path(current).name} vs history/{old.name}: {problem}")
    if problems:
        raise IncompatibleSchemaError(
            "schema change breaks BACKWARD compatibility (records already written could not be read):\n  "
            + "\n  ".join(problems)
            + "\nfix: make the change compatible (add fields with a default, only widen types), or write a new "
            "schema under a new name and topic"
        )
