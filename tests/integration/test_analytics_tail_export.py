"""`clawstream tail` and `clawstream export` against the real broker (consumers/analytics/tail.py, export.py).

Records are produced here (real events through the project's codec, with chosen timestamps), their partitions and
offsets taken from the delivery reports; every expectation is computed from what was produced, not by the tools.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import NewTopic

from clawbase.errors import ClawstreamError
from clawbase.kafka.clients import make_admin, make_producer, producer_config
from clawbase.settings import KafkaSettings
from consumers.analytics.export import ExportRequest, export
from consumers.analytics.export import main as export_main
from consumers.analytics.records import DecodeOptions, EventLogError
from consumers.analytics.tail import TailRequest, tail
from consumers.analytics.tail import main as tail_main
from schemas.events import BatchRecord, BatchRecordKind, CallEvent, Event, Trajectory
from schemas.topics import BATCHES, CALLS, TRAJECTORIES
from tests.support.factories import T0, sample_events, sample_trajectory

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


# ---- producing -----------------------------------------------------------------------------------------------------
class Produced:
    """What went to the broker: (partition, offset) → (key, event or raw bytes, timestamp)."""

    def __init__(self) -> None:
        self.at: dict[tuple[int, int], tuple[str, Event | bytes, int]] = {}

    def where(self, pred: Any = lambda k, e, ts: True) -> set[tuple[int, int]]:
        return {pos for pos, (k, e, ts) in self.at.items() if pred(k, e, ts)}


def produce(
    settings: KafkaSettings,
    topic: str,
    items: list[tuple[str, Event | bytes, int]],
    into: Produced | None = None,
    producer: Producer | None = None,
) -> Produced:
    into = into or Produced()
    producer = producer or make_producer(settings)
    for key, event, ts in items:
        value = event if isinstance(event, bytes) else event.to_bytes()

        def delivered(err: Any, msg: Any, key: str = key, event: Any = event, ts: int = ts) -> None:
            assert err is None, err
            into.at[(msg.partition(), msg.offset())] = (key, event, ts)

        producer.produce(settings.topic(topic), key=key.encode(), value=value, timestamp=ts, on_delivery=delivered)
    assert producer.flush(30) == 0
    return into


def call(rollout: str, seq: int, rng: np.random.Generator) -> CallEvent:
    event = sample_events(rollout)[2]
    assert isinstance(event, CallEvent)
    n_new, n_gen = int(rng.integers(1, 50)), int(rng.integers(1, 30))
    event.call_id, event.seq = f"{rollout}-c{seq}", seq
    event.new_tokens = rng.integers(0, 150_000, n_new).astype("<i4")
    event.generated_tokens = rng.integers(0, 150_000, n_gen).astype("<i4")
    event.logprobs = -rng.random(n_gen).astype("<f4")
    event.prompt_len = event.shared_prefix_len + n_new
    return event


def calls_of(rollouts: list[str], per: int, t0: int = T0, seed: int = 0) -> list[tuple[str, Event | bytes, int]]:
    rng = np.random.default_rng(seed)
    items = []
    for seq in range(per):
        for r in rollouts:
            items.append((r, call(r, seq, rng), t0 + len(items)))
    return items


def run_tail(settings: KafkaSettings, topic: str, **kwargs: Any) -> list[dict[str, Any]]:
    out = io.StringIO()
    tail(settings, TailRequest(topic=topic, **kwargs), out)
    return [json.loads(line) for line in out.getvalue().splitlines()]


def positions(lines: list[dict[str, Any]]) -> set[tuple[int, int]]:
    return {(line["partition"], line["offset"]) for line in lines}


# ---- tail ----------------------------------------------------------------------------------------------------------
def test_tail_from_beginning_decodes_every_record_and_shows_bad_ones(kafka_settings: KafkaSettings) -> None:
    items = calls_of([f"r-{i}" for i in range(5)], 3) + [("r-bad", b"not an avro record", T0 + 99)]
    produced = produce(kafka_settings, CALLS, items)
    lines = run_tail(kafka_settings, "calls", from_beginning=True, decode=DecodeOptions(tokens="list"))
    assert positions(lines) == set(produced.at) and len(lines) == len(items)
    for line in lines:
        key, event, ts = produced.at[(line["partition"], line["offset"])]
        assert line["key"] == key and line["timestamp"] == ts and line["topic"] == kafka_settings.topic(CALLS)
        if isinstance(event, bytes):
            assert line["where"] == f"{kafka_settings.topic(CALLS)}[{line['partition']}]@{line['offset']}"
            assert "CorruptRecordError" in line["error"] and "value" not in line
            continue
        assert isinstance(event, CallEvent) and line["schema"] == "CallEvent"
        assert line["value"]["generated_tokens"] == event.generated_tokens.tolist()
        assert line["value"]["new_tokens"] == event.new_tokens.tolist()
        assert line["value"]["call_id"] == event.call_id
    counted = run_tail(kafka_settings, kafka_settings.topic(CALLS), from_beginning=True)  # full name, counts
    assert sorted(line["value"]["generated_tokens"] for line in counted if "value" in line) == sorted(
        len(e.generated_tokens) for _, e, _ in items if isinstance(e, CallEvent)
    )


def test_tail_without_a_start_prints_the_last_n_by_time(kafka_settings: KafkaSettings) -> None:
    items = calls_of([f"r-{i}" for i in range(6)], 5)  # 30 records, timestamps T0 .. T0+29, over the partitions
    produced = produce(kafka_settings, CALLS, items)
    newest = sorted(produced.at, key=lambda pos: produced.at[pos][2])
    lines = run_tail(kafka_settings, "calls")
    assert [(line["partition"], line["offset"]) for line in lines] == newest[-10:]  # default 10, oldest first
    lines = run_tail(kafka_settings, "calls", count=3)
    assert [line["timestamp"] for line in lines] == [T0 + 27, T0 + 28, T0 + 29]
    # The last 4 of one rollout: found though it means reading back past other rollouts' records.
    lines = run_tail(kafka_settings, "calls", count=4, rollouts=frozenset({"r-2"}))
    expected = sorted(produced.where(lambda k, e, ts: k == "r-2"), key=lambda pos: produced.at[pos][2])[-4:]
    assert [(line["partition"], line["offset"]) for line in lines] == expected
    assert run_tail(kafka_settings, "calls", count=0) == []


def test_tail_offsets_since_and_max(kafka_settings: KafkaSettings) -> None:
    items = calls_of([f"r-{i}" for i in range(8)], 4)
    produced = produce(kafka_settings, CALLS, items)
    part, offset = min(produced.at)  # some partition that holds records, and its first offset
    mine = {pos for pos in produced.at if pos[0] == part}
    lines = run_tail(kafka_settings, "calls", offsets={part: offset + 1})
    assert positions(lines) == {pos for pos in mine if pos[1] >= offset + 1}
    lines = run_tail(kafka_settings, "calls", offsets={-1: -2})  # the last two of every partition
    by_part: dict[int, list[int]] = {}
    for p, o in produced.at:
        by_part.setdefault(p, []).append(o)
    assert positions(lines) == {(p, o) for p, offs in by_part.items() for o in sorted(offs)[-2:]}
    cut = T0 + 20
    since = produced.where(lambda k, e, ts: ts >= cut)
    assert positions(run_tail(kafka_settings, "calls", since_ms=cut)) == since
    iso = datetime.fromtimestamp(cut / 1000, tz=UTC).isoformat(timespec="milliseconds")
    out = io.StringIO()
    assert _cli(tail_main, ["calls", "--since", iso, "-q"], kafka_settings, out) == 0
    assert positions([json.loads(x) for x in out.getvalue().splitlines()]) == since
    lines = run_tail(kafka_settings, "calls", from_beginning=True, count=5)
    assert len(lines) == 5 and positions(lines) <= set(produced.at)


def test_tail_rollout_filter_by_key_and_inside_batches(kafka_settings: KafkaSettings) -> None:
    produced = produce(kafka_settings, CALLS, calls_of(["r-1", "r-2", "r-3"], 4))
    lines = run_tail(kafka_settings, "calls", from_beginning=True, rollouts=frozenset({"r-2", "r-3"}))
    assert positions(lines) == produced.where(lambda k, e, ts: k in ("r-2", "r-3"))

    def record(rollout: str, index: int) -> BatchRecord:
        return BatchRecord(
            batch_id="b-1",
            policy_version=1,
            timestamp_ms=T0,
            kind=BatchRecordKind.TRAJECTORY,
            step=1,
            index=index,
            rollout_id=rollout,
            harness="agentloop",
            trajectory=sample_trajectory(rollout).to_bytes(),
        )

    seal = BatchRecord(batch_id="b-1", policy_version=1, timestamp_ms=T0, kind=BatchRecordKind.SEAL, step=1, index=2)
    batches = produce(
        kafka_settings,
        BATCHES,
        [("b-1", record("r-1", 0), T0), ("b-1", record("r-2", 1), T0 + 1), ("b-1", seal, T0 + 2)],
    )
    [line] = run_tail(kafka_settings, "batches", from_beginning=True, rollouts=frozenset({"r-2"}))
    assert (line["partition"], line["offset"]) in batches.at and line["key"] == "b-1"
    assert line["value"]["rollout_id"] == "r-2" and line["value"]["trajectory"]["rollout_id"] == "r-2"


def test_tail_ends_on_a_transactional_topic_and_skips_aborted_records(kafka_settings: KafkaSettings) -> None:
    """Trajectories are written in exactly-once transactions: commit markers take offsets, aborted records stay."""
    producer = Producer(producer_config(kafka_settings, **{"transactional.id": f"tx-{uuid.uuid4().hex[:8]}"}))
    producer.init_transactions(30)
    committed, aborted = Produced(), Produced()
    for i in range(6):
        producer.begin_transaction()
        traj = sample_trajectory(f"r-{i}")
        produce(kafka_settings, TRAJECTORIES, [(f"r-{i}", traj, T0 + i)], committed if i != 3 else aborted, producer)
        (producer.abort_transaction if i == 3 else producer.commit_transaction)(30)
    lines = run_tail(kafka_settings, "trajectories", from_beginning=True)  # returns: it would hang otherwise
    assert positions(lines) == set(committed.at) and {line["key"] for line in lines} == {
        f"r-{i}" for i in range(6) if i != 3
    }
    lines = run_tail(kafka_settings, "trajectories", count=4)
    assert [line["key"] for line in lines] == ["r-1", "r-2", "r-4", "r-5"]


def _cli(main: Any, args: list[str], settings: KafkaSettings, out: io.StringIO) -> int:
    """Run a tool's ``main`` in-process with stdout captured."""
    argv = [*args, "--bootstrap", settings.bootstrap_servers or "", "--topic-prefix", settings.topic_prefix]
    real, sys.stdout = sys.stdout, out
    try:
        return main(argv)
    finally:
        sys.stdout = real


def test_a_missing_topic_or_bad_argument_is_one_clear_error(
    kafka_settings: KafkaSettings, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _cli(tail_main, ["nosuch.topic", "--from-beginning"], kafka_settings, io.StringIO()) == 1
    assert f"no topic nosuch.topic on {kafka_settings.bootstrap_servers}" in capsys.readouterr().err
    assert _cli(tail_main, ["calls", "--since", "soon"], kafka_settings, io.StringIO()) == 1
    assert "cannot read 'soon' as a time" in capsys.readouterr().err
    assert _cli(tail_main, ["calls", "--offset", "99:0"], kafka_settings, io.StringIO()) == 1
    assert "no partition 99" in capsys.readouterr().err


def _reader(proc: subprocess.Popen[str], lines: list[dict[str, Any]]) -> threading.Thread:
    def run() -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            lines.append(json.loads(raw))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _wait_for(lines: list[dict[str, Any]], n: int, proc: subprocess.Popen[str], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while len(lines) < n:
        assert proc.poll() is None, f"tail exited early: {proc.stderr.read() if proc.stderr else ''}"
        assert time.monotonic() < deadline, f"only {len(lines)} of {n} lines after {timeout}s"
        time.sleep(0.05)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_tail_follow_prints_new_records_until_a_signal(kafka_settings: KafkaSettings, sig: signal.Signals) -> None:
    before = produce(kafka_settings, CALLS, calls_of(["r-1", "r-2"], 2))
    cmd = [
        sys.executable,
        "-m",
        "clawstream",
        "tail",
        "calls",
        "--follow",
        "-n",
        "2",
        "--rollout",
        "r-1",
        "--rollout",
        "r-2",
        "--bootstrap",
        kafka_settings.bootstrap_servers or "",
        "--topic-prefix",
        kafka_settings.topic_prefix,
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    lines: list[dict[str, Any]] = []
    reader = _reader(proc, lines)
    try:
        _wait_for(lines, 2, proc)  # the last two: tail now follows from the end offsets it read at start
        newest = sorted(before.at, key=lambda pos: before.at[pos][2])[-2:]
        assert [(x["partition"], x["offset"]) for x in lines] == newest
        after = produce(kafka_settings, CALLS, calls_of(["r-1", "r-3", "r-2"], 3, t0=T0 + 1000, seed=1))
        wanted = after.where(lambda k, e, ts: k != "r-3")
        _wait_for(lines, 2 + len(wanted), proc)
        time.sleep(1.0)  # anything else (r-3's records) would show up now
        proc.send_signal(sig)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(10)
    assert positions(lines[2:]) == wanted and len(lines) == 2 + len(wanted)
    assert {x["key"] for x in lines} == {"r-1", "r-2"}
    stderr = proc.stderr.read() if proc.stderr else ""
    assert f"tail: {len(lines)} records from {kafka_settings.topic(CALLS)}" in stderr and "Traceback" not in stderr
    # Partitions were assigned by hand: no consumer group was ever registered, nothing committed.
    # The admin client is held until its future resolves: a temporary one is freed at once, librdkafka then purges the
    # pending request ("Purging 2 unserved events from background queue") and the future never resolves (CI hung here
    # 600 s). A bounded wait says so instead of hanging.
    admin = make_admin(kafka_settings)
    groups = admin.list_consumer_groups(request_timeout=15).result(timeout=60)
    assert not [g.group_id for g in groups.valid if g.group_id.startswith("clawstream-reader-")]


# ---- export --------------------------------------------------------------------------------------------------------
def expected_value(event: Event) -> dict[str, Any]:
    """An event's fields as the Parquet columns should read back: arrays as lists, enums as text, nested events as
    dicts; computed from the dataclass, not by the exporter."""
    out: dict[str, Any] = {}
    for name, value in vars(event).items():
        if isinstance(value, np.ndarray):
            value = value.astype(type(event).PACKED[name]).tolist()
        elif hasattr(value, "value") and isinstance(value.value, str):
            value = value.value
        elif isinstance(value, list) and value and not isinstance(value[0], str):
            value = [expected_value(item) for item in value]
        elif isinstance(event, BatchRecord) and name == "trajectory" and value is not None:
            value = expected_value(Trajectory.from_bytes(value))
        out[name] = value
    return out


def _like(got: Any, expected: Any) -> Any:
    """``got`` with Arrow maps (read back as lists of (key, value) pairs) turned into dicts where ``expected`` has
    one, recursively."""
    if isinstance(expected, dict) and isinstance(got, list):
        return {k: _like(v, expected.get(k)) for k, v in got}
    if isinstance(expected, dict) and isinstance(got, dict):
        return {k: _like(v, expected.get(k)) for k, v in got.items()}
    if isinstance(expected, list) and isinstance(got, list) and len(got) == len(expected):
        return [_like(g, e) for g, e in zip(got, expected, strict=True)]
    return got


def _check_rows(rows: list[dict[str, Any]], produced: Produced, topic: str) -> None:
    assert {(r["partition"], r["offset"]) for r in rows} == set(produced.at) and len(rows) == len(produced.at)
    for row in rows:
        key, event, ts = produced.at[(row["partition"], row["offset"])]
        assert (row["topic"], row["key"]) == (topic, key)
        assert row["timestamp"] == datetime.fromtimestamp(ts / 1000, tz=UTC)
        if isinstance(event, bytes):
            assert row["raw_value"] == event and row["error"]
            continue
        assert row["error"] is None and row["raw_value"] is None
        expected = expected_value(event)
        assert _like({k: row[k] for k in expected}, expected) == expected, (row["partition"], row["offset"])


def test_export_parquet_reads_back_equal_to_what_was_produced(kafka_settings: KafkaSettings, tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    items = calls_of([f"r-{i}" for i in range(4)], 3, seed=3) + [("r-x", b"\xc3\x01garbage", T0 + 50)]
    big = call("r-big", 0, rng)
    big.new_tokens = rng.integers(0, 150_000, 40_000).astype("<i4")
    big.prompt_len = big.shared_prefix_len + 40_000
    items.append(("r-big", big, T0 + 60))
    produced = produce(kafka_settings, CALLS, items)
    out = tmp_path / "calls.parquet"
    assert _cli(export_main, ["calls", "--out", str(out), "--row-group", "5"], kafka_settings, io.StringIO()) == 0
    table = pq.read_table(out)
    assert table.schema.field("new_tokens").type.value_type.bit_width == 32
    assert pq.ParquetFile(out).metadata.num_row_groups == 3  # 14 records in groups of 5
    _check_rows(table.to_pylist(), produced, kafka_settings.topic(CALLS))

    trajectories = []
    for i in range(3):
        traj = sample_trajectory(f"r-{i}")
        traj.reward, traj.harness = [0.0, 0.5, None][i], ["agentloop", "codex", "openclaw"][i]
        trajectories.append((f"r-{i}", traj, T0 + i))
    produced = produce(kafka_settings, TRAJECTORIES, trajectories)
    out = tmp_path / "trajectories.parquet"
    export(kafka_settings, ExportRequest(topic="trajectories", out=out, format="parquet"))
    _check_rows(pq.read_table(out).to_pylist(), produced, kafka_settings.topic(TRAJECTORIES))

    batch = [e for e in sample_events("r-7") if isinstance(e, BatchRecord)]
    produced = produce(kafka_settings, BATCHES, [("b-5", batch[0], T0)])
    out = tmp_path / "batches.parquet"
    export(kafka_settings, ExportRequest(topic=kafka_settings.topic(BATCHES), out=out, format="parquet"))
    _check_rows(pq.read_table(out).to_pylist(), produced, kafka_settings.topic(BATCHES))


def test_export_offset_and_time_ranges_to_jsonl(kafka_settings: KafkaSettings, tmp_path: Path) -> None:
    produced = produce(kafka_settings, CALLS, calls_of([f"r-{i}" for i in range(8)], 4))
    part = min(produced.at)[0]
    offs = sorted(o for p, o in produced.at if p == part)
    out = tmp_path / "range.jsonl"
    args = ["calls", "--out", str(out), "--from", f"{part}:{offs[1]}", "--to", f"{part}:{offs[-1]}", "-q"]
    assert _cli(export_main, args, kafka_settings, io.StringIO()) == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert positions(lines) == {(part, o) for o in offs[1:-1]}
    for line in lines:
        event = produced.at[(line["partition"], line["offset"])][1]
        assert isinstance(event, CallEvent)
        assert line["value"]["generated_tokens"] == event.generated_tokens.tolist()
        assert line["value"]["logprobs"] == event.logprobs.astype("<f4").tolist()

    out = tmp_path / "window.parquet"
    export(kafka_settings, ExportRequest(topic="calls", out=out, format="parquet", since_ms=T0 + 5, until_ms=T0 + 17))
    rows = pq.read_table(out).to_pylist()
    assert {(r["partition"], r["offset"]) for r in rows} == produced.where(lambda k, e, ts: T0 + 5 <= ts < T0 + 17)

    out = tmp_path / "one.jsonl"
    export(
        kafka_settings,
        ExportRequest(
            topic="calls", out=out, format="jsonl", rollouts=frozenset({"r-4"}), decode=DecodeOptions(tokens="count")
        ),
    )
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert positions(lines) == produced.where(lambda k, e, ts: k == "r-4")
    assert all(isinstance(line["value"]["new_tokens"], int) for line in lines)


def test_export_writes_atomically_and_refuses_to_overwrite(
    kafka_settings: KafkaSettings, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    produce(kafka_settings, CALLS, calls_of([f"r-{i}" for i in range(6)], 5))
    out = tmp_path / "calls.parquet"
    out.write_text("an earlier export")
    assert _cli(export_main, ["calls", "--out", str(out)], kafka_settings, io.StringIO()) == 1
    assert "exists; pass --force" in capsys.readouterr().err and out.read_text() == "an earlier export"

    seen = {"n": 0}

    def stop_midway() -> bool:  # as Ctrl-C does, once reading has begun
        seen["n"] += 1
        return seen["n"] > 1

    with pytest.raises(EventLogError, match="interrupted"):
        export(
            kafka_settings,
            ExportRequest(topic="calls", out=tmp_path / "cut.parquet", format="parquet", row_group=1),
            stop=stop_midway,
        )
    # A topic outside the catalog (as a Faust app's internal topics are) needs its value schema named.
    other = f"{kafka_settings.topic_prefix}copy-of-trajectories"
    admin = make_admin(kafka_settings)
    admin.create_topics([NewTopic(other, num_partitions=1, replication_factor=1)])[other].result()
    copied = produce(kafka_settings, "copy-of-trajectories", [("r-1", sample_trajectory("r-1"), T0)])
    with pytest.raises(ClawstreamError, match="--schema NAME"):
        export(kafka_settings, ExportRequest(topic=other, out=tmp_path / "x.parquet", format="parquet"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calls.parquet"]  # nothing half-written left behind
    export(
        kafka_settings, ExportRequest(topic=other, out=tmp_path / "x.parquet", format="parquet", schema="Trajectory")
    )
    _check_rows(pq.read_table(tmp_path / "x.parquet").to_pylist(), copied, other)
    assert _cli(export_main, ["calls", "--out", str(out), "--force"], kafka_settings, io.StringIO()) == 0
    assert pq.read_table(out).num_rows == 30
    err = capsys.readouterr().err
    assert f"export: wrote 30 records of {kafka_settings.topic(CALLS)} to {out}" in err


def test_every_entry_point_has_help() -> None:
    cases = [
        (["-m", "clawstream", "tail", "--help"], "usage: clawstream tail"),
        (["-m", "clawstream", "export", "--help"], "usage: clawstream export"),
        (["-m", "consumers.analytics", "tail", "--help"], "usage: python -m consumers.analytics tail"),
        (["-m", "consumers.analytics", "export", "--help"], "--format {jsonl,parquet}"),
        (["-m", "consumers.analytics.examples.harness_report", "--help"], "--topic-prefix"),
    ]
    for cmd, expected in cases:
        done = subprocess.run([sys.executable, *cmd], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and expected in done.stdout, (cmd, done.stdout, done.stderr)
