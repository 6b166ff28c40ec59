"""Poison records under the analytics tools, on the real broker (issue #29): none crashes or stalls.

The same poison goes on each tool's input topic between good records: undecodable bytes, an unknown writer
fingerprint, a valid record of another schema, a truncated record, a tombstone, and (for the tools that build typed
events) a valid Avro record whose packed token array is no whole number of int32. The one-shot tools (tail, export,
audit, health, replay, the example harness report) must report each bad record as ``topic[partition]@offset`` with
the reason and go on to the good record after it; the dashboard's live feed counts them and stays alive.
"""

from __future__ import annotations

import io
import json
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from clawbase.kafka.clients import make_producer
from clawbase.settings import KafkaSettings
from consumers.analytics.audit import main as audit_main
from consumers.analytics.dashboard import health_report
from consumers.analytics.dashboard.feed import LiveFeed
from consumers.analytics.dashboard.state import DashboardState
from consumers.analytics.examples import harness_report
from consumers.analytics.export import main as export_main
from consumers.analytics.replay import replay
from consumers.analytics.settings import ReplaySettings
from consumers.analytics.tail import TailRequest, tail
from schemas.codec import default_codec
from schemas.events import (
    BatchRecord,
    BatchRecordKind,
    CallEvent,
    CallKind,
    Dialect,
    RewardEvent,
    RewardStatus,
    WeightVersion,
)
from schemas.topics import BATCHES, CALLS, REWARDS, ROLLOUT_REQUESTS, TRAJECTORIES
from tests.support import sandbox_helpers as S
from tests.support.factories import T0, sample_trajectory

pytestmark = pytest.mark.integration

OTHER = WeightVersion(policy_version=1, timestamp_ms=T0, model_name="m", step=1, uri="file:///x", sha256="0" * 64)


def _call(rollout_id: str, seq: int, new_tokens: bytes | None = None) -> bytes:
    event = CallEvent(
        rollout_id=rollout_id,
        policy_version=0,
        timestamp_ms=T0 + seq,
        call_id=f"{rollout_id}-c{seq}",
        seq=seq,
        dialect=Dialect.OPENAI_CHAT,
        requested_model="policy",
        call_kind=CallKind.MAIN,
        new_tokens=np.arange(5, dtype=np.int32),
        prompt_len=5,
        generated_tokens=np.arange(3, dtype=np.int32),
        logprobs=np.zeros(3, dtype=np.float32),
        finish_reason="stop",
        attempt_id=f"{rollout_id}.a0",
    )
    record = event.to_record()
    if new_tokens is not None:
        record["new_tokens"] = new_tokens
    return default_codec().encode("CallEvent", record)


def _poison(good: bytes, packed: bytes | None = None) -> list[tuple[str, bytes | None]]:
    """(what, value) of each poison record; ``packed``: a valid record with a broken packed array."""
    out: list[tuple[str, bytes | None]] = [
        ("garbage", b"\x00not avro at all"),
        ("fingerprint", good[:2] + b"\xee" * 8 + good[10:]),
        ("other schema", OTHER.to_bytes()),
        ("truncated", good[:-7]),
        ("tombstone", None),
    ]
    return out + ([("packed", packed)] if packed is not None else [])


def _produce(kafka: KafkaSettings, topic: str, values: list[bytes | None]) -> list[int]:
    """Produce ``values`` in order to partition 0 of ``topic``; their offsets."""
    producer = make_producer(kafka)
    offsets: list[int] = []
    for value in values:
        producer.produce(
            kafka.topic(topic), key=b"k", value=value, partition=0, on_delivery=lambda _e, m: offsets.append(m.offset())
        )
        producer.flush(30)
    assert len(offsets) == len(values)
    return offsets


def _where(kafka: KafkaSettings, topic: str, offset: int) -> str:
    return f"{kafka.topic(topic)}[0]@{offset}"


def _kafka_args(kafka: KafkaSettings) -> list[str]:
    return ["--bootstrap", kafka.bootstrap_servers or "", "--topic-prefix", kafka.topic_prefix]


def test_tail_and_export_report_each_poison_record_and_go_on(
    kafka_settings: KafkaSettings, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = _call("r-1", 0)
    poison = _poison(good)
    offsets = _produce(kafka_settings, CALLS, [good, *(v for _, v in poison), _call("r-1", 1)])
    at = {what: offsets[i + 1] for i, (what, _) in enumerate(poison)}
    # tail and JSON lines show any schema's record as it is (a tombstone too); Parquet columns need the topic's schema
    bad = {at[w]: w for w in ("garbage", "fingerprint", "truncated")}

    out = io.StringIO()
    summary = tail(kafka_settings, TailRequest(topic="calls", from_beginning=True), out)
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [line["offset"] for line in lines] == offsets and summary.undecodable == len(bad)
    for line in lines:
        if line["offset"] in bad:
            assert line["where"] == _where(kafka_settings, CALLS, line["offset"]) and line["error"], line
        else:
            assert "error" not in line, line
    assert lines[-1]["schema"] == "CallEvent" and lines[-1]["value"]["seq"] == 1  # went on past the poison

    for fmt, wrong in (("jsonl", {}), ("parquet", {at["other schema"]: "other schema"})):
        path = tmp_path / f"calls.{fmt}"
        capsys.readouterr()
        assert export_main(["calls", "--format", fmt, "--out", str(path), *_kafka_args(kafka_settings)]) == 0
        err = capsys.readouterr().err
        assert err.count("export: undecodable ") == len(bad) + len(wrong), err
        for offset, what in {**bad, **wrong}.items():
            assert f"export: undecodable {_where(kafka_settings, CALLS, offset)}: " in err, (fmt, what, err)
        rows = pq.read_table(path).to_pylist() if fmt == "parquet" else [json.loads(x) for x in path.open()]
        assert [r["offset"] for r in rows] == offsets and rows[-1]["seq" if fmt == "parquet" else "value"], fmt


def test_audit_lists_each_poison_record_of_every_topic(kafka_settings: KafkaSettings) -> None:
    reward = RewardEvent(
        rollout_id="r-1",
        policy_version=0,
        timestamp_ms=T0,
        attempt_id="r-1.a0",
        status=RewardStatus.OK,
        grader="g",
        reward=1.0,
    )
    wheres = []
    for topic, good in (
        (CALLS, _call("r-1", 0)),  # calls and requests were only counted, never decoded, before #29
        (ROLLOUT_REQUESTS, S.request("hello", "agentloop", rollout_id="r-1").to_bytes()),
        (REWARDS, reward.to_bytes()),
    ):
        offsets = _produce(kafka_settings, topic, [v for _, v in _poison(good)])
        wheres += [_where(kafka_settings, topic, o) for o in offsets]
    out = io.StringIO()
    assert audit_main(_kafka_args(kafka_settings), out=out) == 1
    report = out.getvalue()
    listed = report.split("undecodable records:")[1].split("\n\n")[0]
    for where in wheres:
        assert f"  {where}: " in listed, (where, report)
    assert f"undecodable {len(wheres)}" in report and "tombstone" in listed, report


def test_health_reports_each_poison_call(kafka_settings: KafkaSettings, capsys: pytest.CaptureFixture[str]) -> None:
    good = _call("r-1", 0)
    poison = _poison(good, packed=_call("r-1", 5, new_tokens=b"\x01\x02\x03"))
    offsets = _produce(kafka_settings, CALLS, [good, *(v for _, v in poison), _call("r-1", 1)])
    assert health_report.main(_kafka_args(kafka_settings)) == 0
    captured = capsys.readouterr()
    for offset in offsets[1:-1]:
        assert f"health: undecodable {_where(kafka_settings, CALLS, offset)}: " in captured.err, captured.err
    assert "2 call(s) of 1 rollout(s)" in captured.err and "6 undecodable record(s)" in captured.err


def test_harness_report_skips_each_poison_trajectory(
    kafka_settings: KafkaSettings, capsys: pytest.CaptureFixture[str]
) -> None:
    good = sample_trajectory("r-1").to_bytes()
    broken = sample_trajectory("r-2").to_record()
    broken["segments"][0]["tokens"] = b"\x01\x02\x03"
    poison = _poison(good, packed=default_codec().encode("Trajectory", broken))
    offsets = _produce(
        kafka_settings, TRAJECTORIES, [good, *(v for _, v in poison), sample_trajectory("r-3").to_bytes()]
    )
    assert harness_report.main(_kafka_args(kafka_settings)) == 0
    captured = capsys.readouterr()
    for offset in offsets[1:-1]:
        assert f"skipped {_where(kafka_settings, TRAJECTORIES, offset)}: " in captured.err, captured.err
    [row] = captured.out.strip().splitlines()[1:]
    assert row.split()[:2] == ["agentloop", "2"]  # both good trajectories, before and after the poison


def test_replay_reports_each_poison_batch_record_and_copies_on(kafka_settings: KafkaSettings) -> None:
    member = BatchRecord(
        batch_id="b-1",
        policy_version=0,
        timestamp_ms=T0,
        kind=BatchRecordKind.TRAJECTORY,
        step=1,
        index=0,
        trajectory=sample_trajectory("r-1").to_bytes(),
    ).to_bytes()
    seal = BatchRecord(
        batch_id="b-1", policy_version=0, timestamp_ms=T0, kind=BatchRecordKind.SEAL, step=1, index=1
    ).to_bytes()
    poison = _poison(seal)
    offsets = _produce(kafka_settings, BATCHES, [*(v for _, v in poison), member, seal])
    lines: list[str] = []
    dest = f"{kafka_settings.topic_prefix}replay."
    [copy] = replay(kafka_settings, ReplaySettings(to_prefix=dest), progress=lines.append)
    for offset in offsets[: len(poison)]:
        assert any(f"replay: undecodable {_where(kafka_settings, BATCHES, offset)}: " in x for x in lines), lines
    assert copy.batches == ["b-1"] and sum(p.records for p in copy.partitions) == len(offsets)


def test_dashboard_feed_counts_poison_and_stays_alive(kafka_settings: KafkaSettings) -> None:
    good = _call("r-1", 0)
    poison = _poison(good, packed=_call("r-1", 5, new_tokens=b"\x01\x02\x03"))
    offsets = _produce(kafka_settings, CALLS, [good, *(v for _, v in poison), _call("r-1", 1)])
    state, lock = DashboardState(), threading.Lock()
    feed = LiveFeed(kafka_settings, state, lock, topics=(CALLS,), recheck_s=0.5).start()
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with lock:
                if state.records[CALLS] == 2 and sum(state.errors.values()) == len(poison):
                    break
            time.sleep(0.2)
        with lock:
            assert state.records[CALLS] == 2 and sum(state.errors.values()) == len(poison), (
                state.errors,
                state.records,
            )
        assert feed.alive and feed.error is None
        assert state.last_error is not None and f"{_where(kafka_settings, CALLS, offsets[-2])}: " in state.last_error
    finally:
        feed.stop()
