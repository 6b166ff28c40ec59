"""The Avro single-object codec: round trips, interop with the reference Apache `avro` package, schema evolution,
typed errors. No broker."""

from __future__ import annotations

import io
import json
import struct
from pathlib import Path

import avro.io
import avro.schema
import numpy as np
import pytest
from fastavro import parse_schema, schemaless_writer

from clawbase.errors import CodecError, CorruptRecordError, UnknownSchemaError
from schemas.codec import MARKER, SCHEMA_DIR, AvroCodec, default_codec, schema_fingerprint
from schemas.events import ALL_EVENTS, CallEvent, Trajectory
from tests.support.factories import sample_events


@pytest.mark.parametrize("event", sample_events(), ids=lambda e: type(e).__name__)
def test_every_event_round_trips(event) -> None:
    data = event.to_bytes()
    assert data[:2] == MARKER
    back = type(event).from_bytes(data)
    assert back.to_bytes() == data
    assert back.rollout_id == event.rollout_id and back.timestamp_ms == event.timestamp_ms


def test_typed_events_mirror_the_avsc_files() -> None:
    for cls in ALL_EVENTS:
        path = default_codec().entry(cls.SCHEMA).path
        avsc_fields = [f["name"] for f in json.loads(path.read_text())["fields"]]
        py_fields = [f for f in cls.__dataclass_fields__ if not f.isupper()]
        assert sorted(py_fields) == sorted(avsc_fields), cls.__name__
        assert {"rollout_id", "policy_version", "timestamp_ms"} <= set(avsc_fields), cls.__name__


def test_every_field_is_documented() -> None:
    def walk(schema: dict) -> None:
        for f in schema.get("fields", []):
            assert f.get("doc"), f"{schema['name']}.{f['name']} has no doc"
            t = f["type"]
            if isinstance(t, dict) and t.get("type") == "array" and isinstance(t["items"], dict):
                walk(t["items"])

    for path in SCHEMA_DIR.glob("*.avsc"):
        walk(json.loads(path.read_text()))


def test_packed_arrays_keep_values_and_dtypes() -> None:
    call = next(e for e in sample_events() if isinstance(e, CallEvent))
    back = CallEvent.from_bytes(call.to_bytes())
    assert back.new_tokens.dtype == np.dtype("<i4") and back.logprobs.dtype == np.dtype("<f4")
    assert back.new_tokens.tolist() == [200, 201, 7]
    assert back.generated_tokens.tolist() == [102, 103, 2]
    assert back.logprobs.tolist() == [-0.125, -2.5, -0.0078125]
    traj = Trajectory.from_bytes(next(e for e in sample_events() if isinstance(e, Trajectory)).to_bytes())
    assert [s.parent for s in traj.segments] == [-1, 0, 1]
    assert traj.segments[1].logprobs.tolist() == [-0.5, -0.25] and traj.segments[1].trainable


@pytest.mark.parametrize("event", sample_events(), ids=lambda e: type(e).__name__)
def test_reference_avro_package_decodes_from_the_avsc_alone(event) -> None:
    """Apache's own Python `avro` reads our bytes given only the .avsc: marker, fingerprint and body."""
    path = default_codec().entry(event.SCHEMA).path
    schema = avro.schema.parse(path.read_text())
    data = event.to_bytes()
    assert data[:2] == b"\xc3\x01"
    assert data[2:10] == schema.fingerprint("CRC-64-AVRO")  # Apache's CRC-64-AVRO, little-endian
    record = avro.io.DatumReader(schema).read(avro.io.BinaryDecoder(io.BytesIO(data[10:])))
    ours = default_codec().decode(data)[1]
    assert record == ours


def test_record_written_with_older_schema_is_read_with_the_new_one() -> None:
    old_raw = json.loads((SCHEMA_DIR / "history" / "call_event.v0.avsc").read_text())
    old = parse_schema(old_raw)
    record = {
        "rollout_id": "r-old",
        "policy_version": 1,
        "timestamp_ms": 5,
        "call_id": "c",
        "seq": 0,
        "dialect": "OPENAI_CHAT",
        "requested_model": "policy",
        "call_kind": "MAIN",
        "parent_call_id": None,
        "shared_prefix_len": 0,
        "new_tokens": struct.pack("<3i", 1, 2, 3),
        "prompt_len": 3,
        "generated_tokens": struct.pack("<1i", 9),
        "logprobs": struct.pack("<1f", -1.0),
        "finish_reason": "stop",
    }
    buf = io.BytesIO()
    buf.write(MARKER + schema_fingerprint(old_raw))
    schemaless_writer(buf, old, record)
    event = CallEvent.from_bytes(buf.getvalue())
    assert event.rollout_id == "r-old" and event.new_tokens.tolist() == [1, 2, 3]
    assert event.flags == [] and event.total_ms == 0.0 and event.system_fingerprint == ""  # defaults filled in
    assert schema_fingerprint(old_raw) != default_codec().entry("CallEvent").fingerprint


def test_call_event_v1_without_cache_and_gpu_fields_reads_them_as_null() -> None:
    """Records written before cached_prompt_tokens / gpu_utilization / gpu_memory_used_bytes decode with nulls."""
    v1_raw = json.loads((SCHEMA_DIR / "history" / "call_event.v1.avsc").read_text())
    assert {f["name"] for f in v1_raw["fields"]}.isdisjoint(
        {"cached_prompt_tokens", "gpu_utilization", "gpu_memory_used_bytes"}
    )
    record = {
        "rollout_id": "r-v1",
        "policy_version": 2,
        "timestamp_ms": 5,
        "call_id": "c",
        "seq": 0,
        "dialect": "ANTHROPIC_MESSAGES",
        "requested_model": "policy",
        "call_kind": "MAIN",
        "system_fingerprint": "f",
        "parent_call_id": None,
        "shared_prefix_len": 0,
        "new_tokens": struct.pack("<2i", 4, 5),
        "prompt_len": 2,
        "generated_tokens": struct.pack("<1i", 9),
        "logprobs": struct.pack("<1f", -1.0),
        "finish_reason": "stop",
        "flags": [],
        "received_ms": 1.0,
        "render_ms": 2.0,
        "engine_ms": 3.0,
        "total_ms": 7.0,
    }
    buf = io.BytesIO()
    buf.write(MARKER + schema_fingerprint(v1_raw))
    schemaless_writer(buf, parse_schema(v1_raw), record)
    event = CallEvent.from_bytes(buf.getvalue())
    assert event.rollout_id == "r-v1" and event.total_ms == 7.0
    assert (event.cached_prompt_tokens, event.gpu_utilization, event.gpu_memory_used_bytes) == (None, None, None)
    assert schema_fingerprint(v1_raw) != default_codec().entry("CallEvent").fingerprint


def test_call_event_cache_and_gpu_fields_round_trip() -> None:
    call = next(e for e in sample_events() if isinstance(e, CallEvent))
    back = CallEvent.from_bytes(call.to_bytes())
    assert (back.cached_prompt_tokens, back.gpu_utilization, back.gpu_memory_used_bytes) == (7, 42.5, 3_000_000_000)
    bare = CallEvent.from_bytes(
        CallEvent(
            **{**vars(call), "cached_prompt_tokens": None, "gpu_utilization": None, "gpu_memory_used_bytes": None}
        ).to_bytes()
    )
    assert (bare.cached_prompt_tokens, bare.gpu_utilization, bare.gpu_memory_used_bytes) == (None, None, None)


def test_new_reader_fields_need_defaults(tmp_path: Path) -> None:
    """A schema change that adds a field without a default cannot read old records: the codec says so."""
    (tmp_path / "history").mkdir()
    v1 = {"type": "record", "name": "X", "namespace": "io.clawstream", "fields": [{"name": "a", "type": "int"}]}
    v2 = dict(v1, fields=[{"name": "a", "type": "int"}, {"name": "b", "type": "int"}])
    (tmp_path / "history" / "x.v1.avsc").write_text(json.dumps(v1))
    (tmp_path / "x.avsc").write_text(json.dumps(v2))
    codec = AvroCodec(tmp_path)
    buf = io.BytesIO(MARKER + schema_fingerprint(v1))
    buf.seek(0, 2)
    schemaless_writer(buf, parse_schema(v1), {"a": 1})
    with pytest.raises(CodecError, match="cannot read io.clawstream.X written with x.v1.avsc"):
        codec.decode(buf.getvalue())


@pytest.mark.parametrize(
    "data",
    [b"", b"\xc3", b"\x00\x01\x00", b'{"json": true}', b"\xc3\x02" + b"\x00" * 12],  # 00: registry header
    ids=["empty", "short", "zero-marker", "json", "wrong-version"],
)
def test_bad_marker_raises_corrupt(data: bytes) -> None:
    with pytest.raises(CorruptRecordError):
        default_codec().decode(data)


def test_unknown_fingerprint_raises_unknown_schema() -> None:
    data = MARKER + b"\x01\x02\x03\x04\x05\x06\x07\x08" + b"\x02"
    with pytest.raises(UnknownSchemaError, match="0102030405060708"):
        default_codec().decode(data)
    assert issubclass(UnknownSchemaError, CodecError)


def test_truncated_and_trailing_bytes_raise_corrupt() -> None:
    data = sample_events()[2].to_bytes()
    with pytest.raises(CorruptRecordError, match="CallEvent"):
        default_codec().decode(data[:-7])
    with pytest.raises(CorruptRecordError, match="trailing"):
        default_codec().decode(data + b"\x00\x00")


def test_garbled_body_raises_corrupt() -> None:
    data = bytearray(sample_events()[0].to_bytes())
    data[10] = 0x7F  # string length varint → far past the end of the record
    with pytest.raises(CorruptRecordError):
        default_codec().decode(bytes(data))


def test_wrong_expected_type_raises() -> None:
    with pytest.raises(CorruptRecordError, match="expected a io.clawstream.CallEvent"):
        CallEvent.from_bytes(sample_events()[0].to_bytes())


def test_encode_error_names_the_field() -> None:
    with pytest.raises(CodecError, match="seq"):
        default_codec().encode("CallEvent", {**default_codec().decode(sample_events()[2].to_bytes())[1], "seq": "x"})
    with pytest.raises(UnknownSchemaError, match="known:"):
        default_codec().encode("Nope", {})


def test_call_event_v2_without_attempt_id_reads_it_as_null() -> None:
    """Calls written before attempt_id decode with None (the assembler counts them for the assembled attempt)."""
    v2_raw = json.loads((SCHEMA_DIR / "history" / "call_event.v2.avsc").read_text())
    assert "attempt_id" not in {f["name"] for f in v2_raw["fields"]}
    call = next(e for e in sample_events() if isinstance(e, CallEvent))
    record = {k: v for k, v in call.to_record().items() if k != "attempt_id"}
    buf = io.BytesIO()
    buf.write(MARKER + schema_fingerprint(v2_raw))
    schemaless_writer(buf, parse_schema(v2_raw), record)
    assert CallEvent.from_bytes(buf.getvalue()).attempt_id is None
    tagged = CallEvent(**{**vars(call), "attempt_id": "r.a0.x"})
    assert CallEvent.from_bytes(tagged.to_bytes()).attempt_id == "r.a0.x"
