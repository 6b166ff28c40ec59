"""The Schema Registry wire format beside single-object encoding: round trips, a reader decoding a mixed topic, typed
errors, and the BACKWARD check of the .avsc files against schemas/history. No broker, no server: the registry here is
an in-memory table with the REST client's methods (the real one runs in tests/integration/test_schema_registry.py)."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
from fastavro import parse_schema, schemaless_writer

from clawbase.errors import CodecError, ConfigError, CorruptRecordError
from clawbase.settings import load_settings
from schemas import registry as wire
from schemas.codec import MARKER, SCHEMA_DIR, AvroCodec
from schemas.events import CallEvent
from schemas.registry_compat import IncompatibleSchemaError, backward_problems, check_history
from schemas.topics import CATALOG
from tests.support.factories import sample_events


class MemoryRegistry(wire.RegistryClient):
    """Subjects → versions and ids by content, as a Confluent-compatible registry keeps them."""

    def __init__(self) -> None:
        super().__init__("memory://")
        self.by_subject: dict[str, list[str]] = {}
        self.ids: dict[str, int] = {}

    def _canon(self, schema: str) -> str:
        return json.dumps(json.loads(schema), sort_keys=True)

    def subjects(self) -> list[str]:
        return sorted(self.by_subject)

    def schema_by_id(self, schema_id: int) -> str:
        return next(s for s, i in self.ids.items() if i == schema_id)

    def lookup(self, subject: str, schema: str) -> int | None:
        return self.ids[self._canon(schema)] if self._canon(schema) in self.by_subject.get(subject, []) else None

    def register(self, subject: str, schema: str) -> int:
        canon = self._canon(schema)
        self.by_subject.setdefault(subject, []).append(canon)
        return self.ids.setdefault(canon, len(self.ids) + 1)

    def set_compatibility(self, subject: str, level: str = wire.COMPATIBILITY) -> None:
        assert level == "BACKWARD"

    def compatibility_problems(self, subject: str, schema: str) -> list[str]:
        versions = self.by_subject.get(subject)
        return backward_problems(json.loads(schema), json.loads(versions[-1])) if versions else []


@pytest.fixture
def registry() -> MemoryRegistry:
    reg = MemoryRegistry()
    wire.register_catalog(reg, [(f"run1.{s.name}", s) for s in CATALOG], SCHEMA_DIR)
    return reg


def codecs(registry: MemoryRegistry) -> tuple[AvroCodec, AvroCodec]:
    resolver = wire.RegistryResolver(registry, topic_prefix="run1.")
    return AvroCodec(registry=resolver, write_registry=True), AvroCodec(registry=wire.RegistryResolver(registry))


@pytest.mark.parametrize("event", sample_events(), ids=lambda e: type(e).__name__)
def test_registry_format_round_trips(event, registry: MemoryRegistry) -> None:
    writer, reader = codecs(registry)
    data = event.to_bytes(writer)
    subject = next(f"run1.{s.name}-value" for s in CATALOG if s.value_schema == event.SCHEMA)
    assert data[:1] == b"\x00"
    assert int.from_bytes(data[1:5], "big") == registry.lookup(subject, registry.by_subject[subject][-1])
    assert data[5:] == event.to_bytes()[10:]  # same Avro body as single-object encoding, other header
    assert type(event).from_bytes(data, reader).to_bytes() == event.to_bytes()


def test_one_reader_decodes_a_mixed_topic(registry: MemoryRegistry) -> None:
    """During a migration a topic holds both formats; a reader takes each record by its first byte."""
    writer, reader = codecs(registry)
    calls = [e for e in sample_events() if isinstance(e, CallEvent)] * 2
    mixed = [c.to_bytes(writer) if i % 2 else c.to_bytes() for i, c in enumerate(calls)]
    assert [m[:1] for m in mixed] == [MARKER[:1], b"\x00"] * (len(calls) // 2)
    assert [reader.decode(m, expected="CallEvent")[1] for m in mixed] == [reader.decode(c.to_bytes())[1] for c in calls]


def test_old_writer_ids_resolve_to_the_current_reader(registry: MemoryRegistry) -> None:
    """History is registered first, so a record written with call_event.v0 under its id reads with today's schema."""
    old_text = (SCHEMA_DIR / "history" / "call_event.v0.avsc").read_text()
    old_id = registry.lookup("run1.clawstream.calls-value", json.dumps(json.loads(old_text)))
    assert old_id is not None and old_id < registry.lookup(
        "run1.clawstream.calls-value", (SCHEMA_DIR / "call_event.avsc").read_text()
    )
    current = CallEvent.from_bytes(next(e for e in sample_events() if isinstance(e, CallEvent)).to_bytes()).to_record()
    old_record = {f["name"]: current[f["name"]] for f in json.loads(old_text)["fields"]}
    buf = io.BytesIO()
    buf.write(b"\x00" + old_id.to_bytes(4, "big"))
    schemaless_writer(buf, parse_schema(json.loads(old_text)), old_record)
    _, record = codecs(registry)[1].decode(buf.getvalue(), expected="CallEvent")
    assert record["rollout_id"] == current["rollout_id"] and set(record) == set(current)


def test_registry_record_without_a_registry_says_what_to_set(registry: MemoryRegistry) -> None:
    data = sample_events()[0].to_bytes(codecs(registry)[0])
    with pytest.raises(CorruptRecordError, match="not Avro single-object.*CLAWSTREAM_SCHEMA_REGISTRY_URL"):
        AvroCodec().decode(data)


def test_registry_format_needs_a_url(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLAWSTREAM_WIRE_FORMAT", "registry")
    monkeypatch.delenv("CLAWSTREAM_SCHEMA_REGISTRY_URL", raising=False)
    with pytest.raises(ConfigError, match="CLAWSTREAM_SCHEMA_REGISTRY_URL"):
        load_settings(wire.WireSettings)


def test_a_writer_registers_its_topic_history_first_when_topics_create_did_not() -> None:
    reg = MemoryRegistry()
    writer = AvroCodec(registry=wire.RegistryResolver(reg, topic_prefix="x."), write_registry=True)
    call = next(e for e in sample_events() if isinstance(e, CallEvent))
    data = call.to_bytes(writer)
    assert len(reg.by_subject["x.clawstream.calls-value"]) == 8  # v0..v6, then the current schema
    assert int.from_bytes(data[1:5], "big") == reg.ids[reg.by_subject["x.clawstream.calls-value"][-1]]


# ---- compatibility -----------------------------------------------------------------------------------------------
def broken_copy(tmp_path: Path, edit) -> Path:  # noqa: ANN001
    shutil.copytree(SCHEMA_DIR, tmp_path / "schemas", ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    path = tmp_path / "schemas" / "call_event.avsc"
    raw = json.loads(path.read_text())
    edit(raw)
    path.write_text(json.dumps(raw))
    return tmp_path / "schemas"


def add_required(raw: dict) -> None:
    raw["fields"].append({"name": "harness_build", "type": "string", "doc": "added without a default"})


def narrow_type(raw: dict) -> None:
    next(f for f in raw["fields"] if f["name"] == "policy_version")["type"] = "int"


def test_shipped_schemas_are_backward_compatible_with_their_history() -> None:
    check_history(SCHEMA_DIR)


@pytest.mark.parametrize(
    ("edit", "field", "what"),
    [(add_required, "CallEvent.harness_build", "without a default"), (narrow_type, "CallEvent.policy_version", "long")],
)
def test_breaking_change_is_refused_naming_schema_field_and_fix(tmp_path: Path, edit, field: str, what: str) -> None:  # noqa: ANN001
    broken = broken_copy(tmp_path, edit)
    with pytest.raises(IncompatibleSchemaError) as err:
        check_history(broken)
    message = str(err.value)
    assert "call_event.avsc vs history/call_event.v0.avsc" in message and field in message and what in message
    assert "fix:" in message
    # Without the check nothing else stops it before data is lost: the broken copy loads as a codec, and only a
    # reader of an already-written record finds out.
    old = next(e for e in sample_events() if isinstance(e, CallEvent)).to_bytes()
    broken_codec = AvroCodec(broken)
    with pytest.raises(CodecError):
        broken_codec.decode(old)
    # The registry's own check (here the in-memory registry's, the same rules) refuses it at registration too.
    reg = MemoryRegistry()
    with pytest.raises(IncompatibleSchemaError, match="call_event.avsc"):
        wire.register_catalog(reg, [(f"r.{s.name}", s) for s in CATALOG if s.value_schema == "CallEvent"], broken)


def test_a_dead_letters_registry_framed_original_shows_decoded(registry: MemoryRegistry) -> None:
    """`tail`/`export` decode a dead letter's original value when it is a record of ours: in either wire format."""
    from consumers.analytics.records import decode_value
    from schemas.events import DeadLetter

    writer, reader = codecs(registry)
    call = next(e for e in sample_events() if isinstance(e, CallEvent))
    dead = next(e for e in sample_events() if isinstance(e, DeadLetter))
    dead.original_value = call.to_bytes(writer)
    assert dead.original_value[:1] == b"\x00"
    _, value = decode_value(dead.to_bytes(), codec=reader)
    assert value["original_value"]["call_id"] == call.call_id
