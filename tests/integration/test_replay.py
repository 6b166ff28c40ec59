"""Replay on the real broker: a recorded run's batches replayed into a fresh prefix train a fresh learner into the
same first step (loss, metrics and every parameter to 1e-6); time ranges, pacing, refusals and cut batches."""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from clawbase.errors import ClawstreamError
from clawbase.kafka.clients import (
    assign_from_beginning,
    bootstrap_servers,
    create_topics,
    make_consumer,
    make_producer,
    read_to_end,
)
from clawbase.settings import KafkaSettings
from consumers.analytics.replay import replay
from consumers.analytics.replay_plan import summary_text
from consumers.analytics.settings import ReplaySettings
from policy.weight_store import verify_file
from schemas.events import BatchRecord, WeightVersion
from schemas.topics import BATCHES, BY_NAME, CATALOG, METRICS, TRAJECTORIES, WEIGHTS
from tests.support.learner_data import batch_records, small_model

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def _timing(metric: str) -> bool:
    """Metrics that measure time, not the step: the only ones allowed to differ between two runs of one step."""
    return metric.endswith(("_seconds", "_per_s"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_model(tmp_path_factory.mktemp("tiny"))


def _other(settings: KafkaSettings, name: str = "replay") -> KafkaSettings:
    """The same broker under a fresh prefix (topics not created: replay creates what it writes)."""
    return KafkaSettings(
        bootstrap_servers=settings.bootstrap_servers,
        topic_prefix=f"{settings.topic_prefix}{name}-{uuid.uuid4().hex[:6]}.",
    )


def _records(settings: KafkaSettings, topic: str) -> list[tuple]:
    """(partition, offset, key, value, headers, timestamp) of every committed record of ``topic``, in order per
    partition."""
    consumer = make_consumer(settings, f"check-{uuid.uuid4().hex[:8]}")
    try:
        ends = assign_from_beginning(consumer, settings.topic(topic), missing_ok=True)
        msgs = list(read_to_end(consumer, settings.topic(topic), ends))
    finally:
        consumer.close()
    out = [(m.partition(), m.offset(), m.key(), m.value(), m.headers() or [], m.timestamp()[1]) for m in msgs]
    return sorted(out, key=lambda r: (r[0], r[1]))


def _content(records: list[tuple]) -> list[tuple]:
    """What replay must keep: partition, key, value, headers, in order (offsets and timestamps may differ)."""
    return [(p, k, v, h) for p, _, k, v, h, _ in records]


def _produce_batches(settings: KafkaSettings, specs: list[tuple[str, int]]) -> list[BatchRecord]:
    producer = make_producer(settings)
    out = []
    for batch_id, step in specs:
        for rec in batch_records(batch_id, step, 4, seed=step):
            headers = [("recorded-by", b"test"), ("batch", batch_id.encode())]
            producer.produce(settings.topic(BATCHES), key=batch_id.encode(), value=rec.to_bytes(), headers=headers)
            out.append(rec)
    assert producer.flush(30) == 0
    return out


def _env(settings: KafkaSettings, **extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), **extra)
    for name in ("CLAWSTREAM_KAFKA_TOPIC_PREFIX", "CLAWSTREAM_KAFKA_BOOTSTRAP_SERVERS", "CLAWSTREAM_FAULTS"):
        env.pop(name, None)
    return env


def _run(cmd: list[str], env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False)


LEARNER_ARGS = ["--max-steps", "1", "--idle-exit", "20", "--hp", "lr=1e-3", "--hp", "seed=7"]


def _versions(settings: KafkaSettings) -> list[WeightVersion]:
    return [WeightVersion.from_bytes(r[3]) for r in _records(settings, WEIGHTS)]


def test_replayed_batches_train_a_fresh_learner_into_the_recorded_first_step(
    kafka_settings: KafkaSettings, model_dir: Path, tmp_path: Path
) -> None:
    """Record: two batches on prefix A, a learner trains the first into v1. Replay A's batches into B with the CLI
    and run the learner command it prints (fresh weight store, same model and hyperparameters): B's v1 must equal
    A's — the loss, every other step metric and every parameter to 1e-6."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    a = kafka_settings
    b = _other(a)
    _produce_batches(a, [("b-1", 1), ("b-2", 2)])
    bootstrap = bootstrap_servers(a)
    recorded = _run(
        [
            sys.executable,
            "-m",
            "learner.train",
            "--model-dir",
            str(model_dir),
            "--weight-store",
            str(tmp_path / "store-a"),
            "--bootstrap",
            bootstrap,
            "--topic-prefix",
            a.topic_prefix,
            *LEARNER_ARGS,
        ],
        _env(a),
    )
    assert recorded.returncode == 0, recorded.stderr[-3000:]
    [va] = _versions(a)
    assert (va.policy_version, va.batch_id) == (1, "b-1")

    home = tmp_path / "home"
    copied = _run(
        [
            sys.executable,
            "-m",
            "consumers.analytics.replay",
            "--bootstrap",
            bootstrap,
            "--topic-prefix",
            a.topic_prefix,
            "--to-prefix",
            b.topic_prefix,
        ],
        _env(a, CLAWSTREAM_HOME=str(home)),
    )
    assert copied.returncode == 0, copied.stderr[-3000:]
    assert f"{a.topic(BATCHES)} → {b.topic(BATCHES)} (created): copied 10 record(s)" in copied.stdout, copied.stdout
    # one transaction per batch: b-1 at 0..4, its commit marker at 5, b-2 at 6..10
    assert "[0] range 0..9: 10 record(s), source 0..9 → destination 0..10" in copied.stdout, copied.stdout
    assert "whole batches: 2 (b-1, b-2)" in copied.stdout
    assert _content(_records(b, BATCHES)) == _content(_records(a, BATCHES))  # keys, values, headers, order
    assert _records(b, WEIGHTS) == []  # a fresh prefix: nothing published there yet

    [line] = [ln.strip() for ln in copied.stdout.splitlines() if ln.strip().startswith("clawstream learner ")]
    store_b = home / "replay" / b.topic_prefix.strip(".") / "weights"
    assert line == (
        f"clawstream learner --model-dir MODEL_DIR --weight-store {store_b} --topic-prefix "
        f"{b.topic_prefix} --bootstrap {bootstrap}"
    )
    args = shlex.split(line.replace("MODEL_DIR", shlex.quote(str(model_dir))))[1:]
    fresh = _run([sys.executable, "-m", "clawstream", *args, *LEARNER_ARGS], _env(a))
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert "no published version of policy" in fresh.stderr  # trained from --model-dir, not resumed
    [vb] = _versions(b)
    assert (vb.policy_version, vb.batch_id, vb.step) == (1, "b-1", 1)
    assert verify_file(vb).is_relative_to(store_b)

    # The loss is small (the test's recorded logprobs are far from the tiny model's: IS weights ~0.003), so also
    # relative: 1e-6 of it, not only 1e-6 absolute.
    la, lb = va.metrics["loss"], vb.metrics["loss"]
    assert la != 0.0 and abs(lb - la) <= 1e-6 and math.isclose(lb, la, rel_tol=1e-6), (va.metrics, vb.metrics)
    assert va.metrics["is_weight_mean"] > 0  # the IS weights came from the recorded rollout logprobs on both sides
    assert set(va.metrics) == set(vb.metrics)
    off = {
        k: (va.metrics[k], vb.metrics[k])
        for k in va.metrics
        if not _timing(k) and abs(va.metrics[k] - vb.metrics[k]) > 1e-6
    }
    assert not off, f"step metrics differ: {off}"
    sa, sb = load_file(str(verify_file(va))), load_file(str(verify_file(vb)))
    base = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    assert set(sa) == set(sb) and any(not torch.equal(sa[k], base[k]) for k in sa)  # the step moved the weights
    worst = max(float((sa[k] - sb[k]).abs().max()) for k in sa)
    assert worst <= 1e-6, f"replayed v1 differs from the recorded v1 by {worst}"


def test_a_time_range_selects_exactly_the_records_in_it(kafka_settings: KafkaSettings) -> None:
    """Ten records on each of three partitions, one second apart (explicit timestamps): --since/--until pick
    seconds 3..6 of every partition, nothing else; --keep-timestamps keeps them, the default stamps the copy."""
    t0 = (int(time.time()) - 3600) * 1000  # within retention: the broker keeps it
    producer = make_producer(kafka_settings)
    for p in (0, 3, 7):
        for i in range(10):
            producer.produce(
                kafka_settings.topic(TRAJECTORIES),
                key=f"r-{p}-{i}".encode(),
                value=f"{p}/{i}".encode(),
                partition=p,
                timestamp=t0 + i * 1000,
                headers=[("i", str(i).encode())],
            )
    assert producer.flush(30) == 0
    since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime((t0 + 3000) / 1000))  # ISO 8601, as a person types it
    kept = _other(kafka_settings, "kept")
    started_ms = int(time.time() * 1000)
    [copy] = replay(
        kafka_settings,
        ReplaySettings(
            to_prefix=kept.topic_prefix,
            topics=["trajectories"],
            since=since,
            until=str(t0 + 7000),
            keep_timestamps=True,
        ),
    )
    got = _records(kept, TRAJECTORIES)
    source = _records(kafka_settings, TRAJECTORIES)
    want = [r for r in source if t0 + 3000 <= r[5] < t0 + 7000]
    assert len(want) == 12 and _content(got) == _content(want)
    assert [r[5] for r in got] == [r[5] for r in want]  # timestamps kept
    assert copy.records == 12 and {
        p.partition: (p.source_first, p.source_last) for p in copy.partitions if p.records
    } == {0: (3, 6), 3: (3, 6), 7: (3, 6)}
    assert copy.created and len(copy.partitions) == BY_NAME[TRAJECTORIES].partitions  # the source's count

    stamped = _other(kafka_settings, "stamped")
    replay(
        kafka_settings,
        ReplaySettings(
            to_prefix=stamped.topic_prefix, topics=["trajectories"], since=str(t0 + 3000), until=str(t0 + 7000)
        ),
    )
    fresh = _records(stamped, TRAJECTORIES)
    assert _content(fresh) == _content(want) and min(r[5] for r in fresh) >= started_ms


def test_rate_paces_the_copy_and_keeps_every_record_in_order(kafka_settings: KafkaSettings) -> None:
    """30 records at --rate 20: all arrive, in order; record i is produced no earlier than i/20 s after record 0,
    so the copy's own timestamps (taken at produce time) span at least 29/20 s (a lower bound: a slow machine only
    widens it). Unpaced, the same copy takes a fraction of that."""
    producer = make_producer(kafka_settings)
    for i in range(30):
        producer.produce(kafka_settings.topic(METRICS), key=b"bench", value=f"m{i:02d}".encode())
    assert producer.flush(30) == 0
    lines: list[str] = []
    paced = _other(kafka_settings, "paced")
    wall0, mono0 = time.time(), time.monotonic()
    [copy] = replay(
        kafka_settings,
        ReplaySettings(to_prefix=paced.topic_prefix, topics=["metrics"], rate=20, commit_every=7),
        progress=lines.append,
    )
    # CI once measured 1,431 ms for 1,450 ms paced. The pacer keeps monotonic time and its schedule starts when
    # record 0 is released; the timestamps are the wall clock (which clock sync may slew: the bound is scaled by its
    # rate over the copy) taken when each produce() runs (record 0's may lag its release by a transaction's begin on
    # a loaded machine: 50 ms of slack). Unpaced, the 30 records take a few ms; at 21/s the bound already fails.
    wall_rate = (time.time() - wall0) / (time.monotonic() - mono0)
    got = _records(paced, METRICS)
    assert [r[3] for r in got] == [f"m{i:02d}".encode() for i in range(30)] and copy.records == 30
    spread = got[-1][5] - got[0][5]
    assert spread >= 29 / 20 * 1000 * min(wall_rate, 1.0) - 50, (
        f"30 records at 20/s were produced within {spread} ms (wall clock ran at {wall_rate:.4f}x monotonic)"
    )
    # commit_every=7: 5 transactions, each ends with a commit marker taking one offset
    assert (copy.partitions[0].dest_first, copy.partitions[0].dest_last) == (0, 30 + 4 - 1)
    assert f"replay: copying {kafka_settings.topic(METRICS)}[0] offsets 0..29 (30)" in lines, lines  # progress

    unpaced = _other(kafka_settings, "unpaced")
    replay(kafka_settings, ReplaySettings(to_prefix=unpaced.topic_prefix, topics=["metrics"]))
    quick = _records(unpaced, METRICS)
    assert [r[3] for r in quick] == [r[3] for r in got]


def test_a_non_empty_or_too_small_destination_is_refused_and_nothing_is_written(
    kafka_settings: KafkaSettings,
) -> None:
    _produce_batches(kafka_settings, [("b-1", 1)])
    dest = _other(kafka_settings)
    replay(kafka_settings, ReplaySettings(to_prefix=dest.topic_prefix))
    assert len(_records(dest, BATCHES)) == 5

    # 6 offsets: the 5 records and the marker of the transaction that committed them
    with pytest.raises(ClawstreamError, match=r"already holds records \(\[0\] 6 offsets\).*--append"):
        replay(kafka_settings, ReplaySettings(to_prefix=dest.topic_prefix))
    assert len(_records(dest, BATCHES)) == 5  # refused: nothing added
    cli = _run(
        [
            sys.executable,
            "-m",
            "consumers.analytics.replay",
            "--bootstrap",
            bootstrap_servers(kafka_settings),
            "--topic-prefix",
            kafka_settings.topic_prefix,
            "--to-prefix",
            dest.topic_prefix,
        ],
        _env(kafka_settings),
    )
    assert cli.returncode == 1 and cli.stderr.startswith("error: destination ") and "Traceback" not in cli.stderr
    assert len(cli.stderr.strip().splitlines()) == 1, cli.stderr

    [copy] = replay(kafka_settings, ReplaySettings(to_prefix=dest.topic_prefix, append=True))
    assert copy.records == 5 and not copy.created
    assert _content(_records(dest, BATCHES)) == 2 * _content(_records(kafka_settings, BATCHES))

    # A destination with fewer partitions than the source: refused before anything, even the batches, is written.
    small = _other(kafka_settings, "small")
    create_topics(small, [BY_NAME[TRAJECTORIES]], partitions={TRAJECTORIES: 2})
    with pytest.raises(ClawstreamError, match=r"has 2 partition\(s\), the source .* 8: partition numbers are kept"):
        replay(kafka_settings, ReplaySettings(to_prefix=small.topic_prefix, topics=["batches", "trajectories"]))
    assert _records(small, BATCHES) == []
    with pytest.raises(ClawstreamError, match="is the source prefix"):
        replay(kafka_settings, ReplaySettings(to_prefix=kafka_settings.topic_prefix))
    with pytest.raises(ClawstreamError, match=r"no topic .*\.clawstream\.batches"):
        replay(_other(kafka_settings, "nothing"), ReplaySettings(to_prefix=small.topic_prefix + "x."))


def test_a_batch_cut_by_the_range_is_skipped_whole(kafka_settings: KafkaSettings) -> None:
    """b-1 at offsets 0-4, b-2 at 5-9, b-3 at 10-14; --from 2 --to 12 cuts b-1 and b-3: only b-2 is copied, and the
    summary says which bound to move for each of the others."""
    _produce_batches(kafka_settings, [("b-1", 1), ("b-2", 2), ("b-3", 3)])
    dest = _other(kafka_settings)
    out = _run(
        [
            sys.executable,
            "-m",
            "consumers.analytics.replay",
            "--bootstrap",
            bootstrap_servers(kafka_settings),
            "--topic-prefix",
            kafka_settings.topic_prefix,
            "--to-prefix",
            dest.topic_prefix,
            "--from",
            "2",
            "--to",
            "0:12",
            "--json",
        ],
        _env(kafka_settings),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    [summary] = json.loads(out.stdout)["topics"]
    assert summary["batches"] == ["b-2"] and summary["records"] == 5
    assert summary["partitions"][0]["source_offsets"] == [5, 9]
    skipped = {s["batch_id"]: (s["offsets"], s["reason"]) for s in summary["skipped_batches"]}
    assert skipped["b-1"][0] == [2, 3, 4] and "lower --from/--since" in skipped["b-1"][1]
    assert skipped["b-3"][0] == [10, 11] and "raise --to/--until" in skipped["b-3"][1]
    source = _records(kafka_settings, BATCHES)
    assert _content(_records(dest, BATCHES)) == _content(source[5:10])
    assert {BatchRecord.from_bytes(r[3]).batch_id for r in _records(dest, BATCHES)} == {"b-2"}

    dry = _other(kafka_settings, "dry")
    [plan] = replay(kafka_settings, ReplaySettings(to_prefix=dry.topic_prefix, from_offsets=["4"], dry_run=True))
    assert plan.batches == ["b-2", "b-3"] and plan.records == 10 and plan.created
    assert _records(dry, BATCHES) == []  # a dry run creates and writes nothing
    assert "would copy 10 record(s)" in summary_text([plan], dry_run=True)


def test_a_paced_replay_feeds_a_learner_already_running_on_the_prefix(
    kafka_settings: KafkaSettings, model_dir: Path, tmp_path: Path
) -> None:
    """docs/replay.md's second pattern: topics created, a learner started on the empty prefix, then a paced replay
    (a transaction per batch) into it: the learner trains each replayed batch once, in order."""
    _produce_batches(kafka_settings, [("b-1", 1), ("b-2", 2)])
    dest = _other(kafka_settings, "live")
    create_topics(dest, CATALOG)
    cmd = [
        sys.executable,
        "-m",
        "learner.train",
        "--model-dir",
        str(model_dir),
        "--weight-store",
        str(tmp_path / "w"),
        "--bootstrap",
        bootstrap_servers(dest),
        "--topic-prefix",
        dest.topic_prefix,
        "--max-steps",
        "2",
        "--idle-exit",
        "60",
        "--hp",
        "lr=1e-3",
    ]
    learner = subprocess.Popen(
        cmd, cwd=ROOT, env=_env(dest), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    seen: list[str] = []
    try:
        assert learner.stdout is not None
        for line in learner.stdout:  # wait until it runs: it logs this just before subscribing to the batches
            seen.append(line)
            if "no published version of policy" in line:
                break
        assert learner.poll() is None, "".join(seen)[-3000:]
        [copy] = replay(kafka_settings, ReplaySettings(to_prefix=dest.topic_prefix, rate=4))  # 10 records: ~2.5 s
        assert copy.records == 10 and not copy.created  # empty, existing topics: no --append needed
        rest, _ = learner.communicate(timeout=240)
        out = "".join(seen) + rest
    finally:
        if learner.poll() is None:
            learner.kill()
            learner.wait()
    assert learner.returncode == 0, out[-3000:]
    assert [(v.policy_version, v.batch_id) for v in _versions(dest)] == [(1, "b-1"), (2, "b-2")], out[-3000:]
