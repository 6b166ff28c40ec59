"""The event-log decoding shared by tail, export and the dashboards (consumers/analytics/records.py, columns.py).

No broker: records are encoded with the project's codec and decoded back; expected values are computed here from the
events' own attributes (numpy arrays, dataclass fields), not by the code under test.
"""

from __future__ import annotations

import base64
import json
import math
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from consumers.analytics.columns import ArrowLayout
from consumers.analytics.records import (
    ALL_PARTITIONS,
    DecodeOptions,
    EventLogError,
    RolloutFilter,
    decode_parts,
    decode_value,
    iso_ms,
    json_line,
    load_tokenizer,
    parse_offsets,
    parse_time_ms,
    resolve_topic,
    rollout_ids,
    start_offsets,
)
from schemas.codec import default_codec
from schemas.events import BatchRecord, BatchRecordKind, CallEvent, DeadLetter
from schemas.topics import CATALOG
from tests.support.factories import T0, sample_events, sample_trajectory


def _event(kind: type) -> object:
    return next(e for e in sample_events("r-9") if isinstance(e, kind))


# ---- topics --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", CATALOG, ids=lambda s: s.name)
def test_every_catalog_topic_resolves_by_short_name_full_name_and_prefixed_name(spec) -> None:
    short = spec.name.removeprefix("clawstream.")
    assert resolve_topic(short).name == spec.name
    assert resolve_topic(short, "t-1.").name == "t-1." + spec.name
    assert resolve_topic(spec.name, "t-1.").spec is spec
    # An already prefixed name is used as given; the prefix it carries is recognised.
    ref = resolve_topic("run-7." + spec.name, "other.")
    assert (ref.name, ref.spec, ref.prefix) == ("run-7." + spec.name, spec, "run-7.")
    assert ref.keyed_by_rollout == (spec.key == "rollout_id")


def test_topics_outside_the_catalog_are_read_as_named_and_bad_names_are_refused() -> None:
    ref = resolve_topic("streams-app-by-group", "t-1.")
    assert (ref.name, ref.spec) == ("streams-app-by-group", None)
    with pytest.raises(EventLogError, match="not a Kafka topic name"):
        resolve_topic("calls; rm -rf /")
    with pytest.raises(EventLogError, match="not a Kafka topic name"):
        resolve_topic("x" * 250)


# ---- times and offsets ---------------------------------------------------------------------------------------------
def test_times_in_every_accepted_form() -> None:
    expected = int(datetime(2026, 9, 21, 10, 0, tzinfo=UTC).timestamp() * 1000)
    assert parse_time_ms(str(expected)) == expected
    assert parse_time_ms("2026-09-21T10:00:00Z") == expected
    assert parse_time_ms("2026-09-21T10:00") == expected  # no offset: UTC, like every timestamp in the log
    assert parse_time_ms("2026-09-21T12:00:00+02:00") == expected
    assert parse_time_ms("2026-09-21") == expected - 10 * 3_600_000
    now = expected
    assert parse_time_ms("15m", now_ms=now) == now - 15 * 60_000
    assert parse_time_ms("2h ago", now_ms=now) == now - 2 * 3_600_000
    assert parse_time_ms("-1d", now_ms=now) == now - 86_400_000
    assert parse_time_ms("0") == 0
    assert iso_ms(expected + 7) == "2026-09-21T10:00:00.007Z" and iso_ms(-1) is None


@pytest.mark.parametrize(
    "text,match", [("1790000000", "epoch seconds"), ("yesterday", "cannot read"), ("12x", "cannot read")]
)
def test_bad_times_get_a_clear_error(text: str, match: str) -> None:
    with pytest.raises(EventLogError, match=match):
        parse_time_ms(text)


def test_offsets_for_every_partition_or_some_and_from_the_end() -> None:
    marks = {0: (0, 10), 1: (5, 20), 2: (0, 0)}
    assert parse_offsets(["3"]) == {ALL_PARTITIONS: 3}
    assert start_offsets(parse_offsets(["3"]), marks) == {0: 3, 1: 5, 2: 0}  # below low: clamped (expired)
    assert start_offsets(parse_offsets(["1:7"]), marks) == {1: 7}  # only the partition named
    assert start_offsets(parse_offsets(["-4", "0:2"]), marks) == {0: 2, 1: 16, 2: 0}
    assert start_offsets(parse_offsets(["99"]), marks) == {0: 10, 1: 20, 2: 0}  # beyond the end: at the end
    with pytest.raises(EventLogError, match="no partition 5"):
        start_offsets(parse_offsets(["5:1"]), marks)
    for bad in ("a", "1:b", "-1:3"):
        with pytest.raises(EventLogError, match="--offset"):
            parse_offsets([bad])


# ---- decoding ------------------------------------------------------------------------------------------------------
def _plain(record: dict) -> dict:
    """An event's Avro record with bytes fields left for the caller to check."""
    return {k: v for k, v in record.items() if not isinstance(v, bytes | list)}


def test_every_event_type_decodes_to_its_fields(tmp_path: Path) -> None:
    for event in sample_events("r-9"):
        schema, value = decode_value(event.to_bytes())
        assert schema == event.SCHEMA
        record = event.to_record()
        for name, expected in _plain(record).items():
            if isinstance(expected, float) and not math.isfinite(expected):
                continue
            assert value[name] == expected, (event.SCHEMA, name)
        json.loads(json_line(value))  # strict JSON (no NaN literals)


def test_token_arrays_as_counts_or_lists_and_nested_trajectories() -> None:
    call = _event(CallEvent)
    _, counts = decode_value(call.to_bytes())
    assert (counts["new_tokens"], counts["generated_tokens"], counts["logprobs"]) == (
        len(call.new_tokens),
        len(call.generated_tokens),
        len(call.logprobs),
    )
    _, lists = decode_value(call.to_bytes(), DecodeOptions(tokens="list"))
    assert lists["new_tokens"] == [int(x) for x in call.new_tokens]
    assert lists["logprobs"] == [float(np.float32(x)) for x in call.logprobs]

    batch = _event(BatchRecord)
    trajectory = sample_trajectory("r-9")
    _, value = decode_value(batch.to_bytes(), DecodeOptions(tokens="list"))
    nested = value["trajectory"]
    assert nested["rollout_id"] == "r-9" and nested["reward"] == trajectory.reward
    assert [s["tokens"] for s in nested["segments"]] == [s.tokens.tolist() for s in trajectory.segments]
    assert [s["logprobs"] for s in nested["segments"]] == [
        s.logprobs.astype("<f4").tolist() for s in trajectory.segments
    ]
    _, value = decode_value(trajectory.to_bytes())
    assert [s["tokens"] for s in value["segments"]] == [len(s.tokens) for s in trajectory.segments]


def test_dead_letter_keys_as_text_and_undecodable_bytes_in_base64() -> None:
    dead = _event(DeadLetter)
    _, value = decode_value(dead.to_bytes())
    assert value["original_key"] == dead.original_key.decode()
    assert base64.b64decode(value["original_value"]["base64"]) == dead.original_value
    # A dead letter holding a record of ours shows it decoded.
    dead.original_value = _event(CallEvent).to_bytes()
    _, value = decode_value(dead.to_bytes())
    assert value["original_value"]["call_id"] == "c-1"


def test_undecodable_records_become_error_records_with_where() -> None:
    out = decode_parts("t.clawstream.calls", 3, 17, T0, b"r-1", b"\xc3\x01" + b"\x00" * 8 + b"zz")
    assert out["where"] == "t.clawstream.calls[3]@17" and "UnknownSchemaError" in out["error"]
    assert "value" not in out and out["key"] == "r-1" and out["bytes"] == 12
    raw = decode_parts("t", 0, 1, None, None, b"garbage", keep_raw=True)
    assert base64.b64decode(raw["raw"]) == b"garbage" and raw["timestamp"] is None
    tomb = decode_parts("t", 0, 2, T0, b"k", None)
    assert tomb["value"] is None and tomb["schema"] is None and "error" not in tomb
    # A packed field of the wrong length is flagged in place; the rest of the record still shows.
    record = _event(CallEvent).to_record() | {"new_tokens": b"\x01\x02\x03"}
    _, value = decode_value(default_codec().encode("CallEvent", record))
    assert "no whole number of int32" in value["new_tokens"]["error"] and value["call_id"] == "c-1"


def test_non_finite_floats_are_strings_so_the_line_stays_json() -> None:
    call = _event(CallEvent)
    call.logprobs = np.array([-np.inf, np.nan, -1.5], dtype="<f4")
    call.engine_ms = math.inf
    _, value = decode_value(call.to_bytes(), DecodeOptions(tokens="list"))
    assert value["logprobs"] == ["-Infinity", "NaN", -1.5] and value["engine_ms"] == "Infinity"
    json.loads(json_line(value))


def _word_level_model(tmp_path: Path) -> Path:
    """A real (tiny) Hugging Face tokenizer.json: word-level, three words."""
    from tokenizers import Tokenizer, decoders, models

    tok = Tokenizer(models.WordLevel({"hello": 0, "world": 1, "<unk>": 2}, unk_token="<unk>"))
    tok.decoder = decoders.WordPiece()  # joins words with spaces
    tok.save(str(tmp_path / "tokenizer.json"))
    return tmp_path


def test_text_with_a_models_tokenizer(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers", reason="the tokenizers package (extra ml) decodes token text")
    text = load_tokenizer(_word_level_model(tmp_path))
    call = _event(CallEvent)
    call.new_tokens = np.array([0, 1], dtype="<i4")
    call.generated_tokens = np.array([1, 99], dtype="<i4")  # 99: outside this vocabulary
    _, value = decode_value(call.to_bytes(), DecodeOptions(text=text))
    assert value["new_tokens_text"] == "hello world" and value["new_tokens"] == 2
    assert value["generated_tokens_text"] == "world<?99>" and "logprobs_text" not in value
    with pytest.raises(EventLogError, match="no tokenizer.json"):
        load_tokenizer(tmp_path / "nowhere")


# ---- filters -------------------------------------------------------------------------------------------------------
def test_rollout_filter_by_key_on_rollout_topics_and_by_value_elsewhere() -> None:
    calls = RolloutFilter(frozenset({"r-9"}), resolve_topic("calls"))
    assert calls.by_key(b"r-9") is True and calls.by_key(b"r-8") is False and calls.by_key(None) is False
    batches = RolloutFilter(frozenset({"r-9"}), resolve_topic("batches"))
    assert batches.by_key(b"b-5") is None
    record = decode_parts("clawstream.batches", 0, 0, T0, b"b-5", _event(BatchRecord).to_bytes())
    assert batches.matches(record) and rollout_ids(record, resolve_topic("batches")) == {"r-9"}
    seal = BatchRecord(batch_id="b-5", policy_version=3, timestamp_ms=T0, kind=BatchRecordKind.SEAL, step=5, index=1)
    assert not batches.matches(decode_parts("clawstream.batches", 0, 1, T0, b"b-5", seal.to_bytes()))
    assert not RolloutFilter(frozenset({"r-1"}), resolve_topic("batches")).matches(record)
    assert RolloutFilter(frozenset(), resolve_topic("batches")).by_key(b"x") is True


# ---- Arrow columns -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", CATALOG, ids=lambda s: s.name)
def test_every_catalog_schema_has_typed_columns(spec) -> None:
    layout = ArrowLayout(spec.value_schema)
    names = layout.schema.names
    assert names[:5] == ["topic", "partition", "offset", "timestamp", "key"] and names[-2:] == ["error", "raw_value"]
    assert len(names) == len(set(names))


def test_arrow_rows_equal_the_events() -> None:
    layout = ArrowLayout("CallEvent")
    call = _event(CallEvent)
    [row] = layout.table([layout.row("t", 1, 5, T0, b"r-9", call.to_bytes())]).to_pylist()
    assert row["generated_tokens"] == call.generated_tokens.tolist()
    assert row["logprobs"] == call.logprobs.astype("<f4").tolist()
    assert row["dialect"] == call.dialect.value and row["flags"] == call.flags and row["error"] is None
    assert row["timestamp"] == datetime.fromtimestamp(T0 / 1000, tz=UTC)
    types = layout.schema
    assert types.field("new_tokens").type == pa.list_(pa.int32())
    assert types.field("logprobs").type == pa.list_(pa.float32())

    layout = ArrowLayout("Trajectory")
    trajectory = sample_trajectory("r-9")
    [row] = layout.table([layout.row("t", 0, 0, T0, b"r-9", trajectory.to_bytes())]).to_pylist()
    assert [s["tokens"] for s in row["segments"]] == [s.tokens.tolist() for s in trajectory.segments]
    assert dict(row["excluded_calls"]) == trajectory.excluded_calls

    layout = ArrowLayout("BatchRecord")
    [row] = layout.table([layout.row("t", 0, 0, T0, b"b-5", _event(BatchRecord).to_bytes())]).to_pylist()
    assert row["trajectory"]["harness"] == trajectory.harness
    assert [s["logprobs"] for s in row["trajectory"]["segments"]] == [
        s.logprobs.astype("<f4").tolist() for s in trajectory.segments
    ]


def test_arrow_rows_keep_undecodable_and_foreign_records_with_their_bytes() -> None:
    layout = ArrowLayout("Trajectory")
    foreign = _event(CallEvent).to_bytes()
    rows = layout.table([layout.row("t", 0, 0, T0, b"k", b"junk"), layout.row("t", 0, 1, T0, b"k", foreign)])
    bad, other = rows.to_pylist()
    assert bad["raw_value"] == b"junk" and "CorruptRecordError" in bad["error"] and bad["rollout_id"] is None
    assert other["raw_value"] == foreign and "expected a io.clawstream.Trajectory" in other["error"]
