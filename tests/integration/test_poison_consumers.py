"""Poison on the input topics of the sandbox worker and of the inference worker's weight follower (issue #29).

Each test writes real poison records to a real broker topic — undecodable bytes, an unknown writer fingerprint, a
tombstone, a record of another schema, truncated bytes, and valid records that make no sense (unknown suite, task or
harness, a bad rollout id, a negative timeout, a duplicate, an older attempt; a weight version going backwards or
claiming the served version with another file) — then one good record behind them on the same partition. Each
poison record must come out as one dead letter naming what is wrong, and the good record must still be served.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from confluent_kafka import OFFSET_BEGINNING, TopicPartition
from safetensors.torch import load_file, save_file

from clawbase.kafka.clients import make_consumer, make_producer
from clawbase.settings import KafkaSettings
from policy.tiny_model import init_tiny_model
from schemas.events import DeadLetter, Metric, RewardEvent, RewardStatus, RolloutState, WeightVersion, now_ms
from schemas.topics import DEADLETTER, METRICS, ROLLOUT_REQUESTS, WEIGHTS
from tests.support import sandbox_helpers as S
from tests.support.inference import Worker
from tests.support.sandbox_stack import assert_solved_by_harness, by_rollout, stack

pytestmark = pytest.mark.integration


def _produce(kafka: KafkaSettings, topic: str, records: list[tuple[bytes, bytes | None]]) -> list[int]:
    """Produce ``(key, value)`` records in order to partition 0 of ``topic``; their offsets."""
    producer = make_producer(kafka)
    offsets: list[int] = []
    for key, value in records:
        producer.produce(
            kafka.topic(topic), key=key, value=value, partition=0, on_delivery=lambda _e, m: offsets.append(m.offset())
        )
        producer.flush(30)  # one at a time: offsets in produce order
    assert len(offsets) == len(records)
    return offsets


def _read(kafka: KafkaSettings, topic: str, n: int, timeout: float = 60.0) -> list[Any]:
    """The first ``n`` records of partition 0 of ``topic`` (fewer if the timeout passes)."""
    consumer = make_consumer(kafka, f"t-{time.monotonic_ns()}")
    consumer.assign([TopicPartition(kafka.topic(topic), 0, OFFSET_BEGINNING)])
    found: list[Any] = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and len(found) < n:
            msg = consumer.poll(0.5)
            if msg is not None and msg.error() is None:
                found.append(msg)
    finally:
        consumer.close()
    return found


def _unknown_fingerprint(value: bytes) -> bytes:
    return value[:2] + b"\xee" * 8 + value[10:]


# ---- sandbox worker -----------------------------------------------------------------------------------------------
@pytest.mark.timeout(240)
async def test_sandbox_worker_dead_letters_poison_and_serves_the_next_request(
    kafka_settings: KafkaSettings, group_id: str, tmp_path: Path
) -> None:
    first = S.request("hello", "agentloop", rollout_id="dup-r", attempt=1)
    invalid = {
        "bad-suite": S.request("hello", "agentloop", suite="no-such-suite", rollout_id="bad-suite"),
        "bad-task": S.request("no_such_task", "agentloop", rollout_id="bad-task"),
        "bad-harness": S.request("hello", "no-such-harness", rollout_id="bad-harness"),
        "neg-timeout": S.request("hello", "agentloop", rollout_id="neg-timeout", timeout_s=-1.0),
    }
    good = first.to_bytes()
    other_schema = RewardEvent("x", 0, now_ms(), "x.a0", RewardStatus.OK, "g", 1.0).to_bytes()
    stale = S.request("hello", "agentloop", rollout_id="dup-r", attempt=0)
    poison: list[tuple[bytes, bytes | None, str, str]] = [  # key, value, reason says, error type
        (b"junk", b"\x00not avro at all", "not Avro single-object encoding", "CorruptRecordError"),
        (b"fp", _unknown_fingerprint(good), "unknown writer schema fingerprint", "UnknownSchemaError"),
        (b"tomb", None, "tombstone", "CodecError"),
        (b"x", other_schema, "expected a io.clawstream.RolloutRequest record", "CorruptRecordError"),
        (b"cut", good[:-7], "corrupt io.clawstream.RolloutRequest body", "CorruptRecordError"),
        *((rid.encode(), r.to_bytes(), "invalid request", "InvalidRequest") for rid, r in invalid.items()),
        (b"a/b", S.request("hello", "agentloop", rollout_id="a/b").to_bytes(), "rollout_id 'a/b'", "InvalidRequest"),
        (b"dup-r", good, "duplicate: rollout dup-r attempt 1 was already read at", "DuplicateRequest"),
        (b"dup-r", stale.to_bytes(), "stale: rollout dup-r attempt 0 after attempt 1", "DuplicateRequest"),
    ]
    after = S.request("hello", "agentloop", rollout_id="after")
    async with stack(kafka_settings, group_id, tmp_path) as st:
        [first_at] = _produce(kafka_settings, ROLLOUT_REQUESTS, [(b"dup-r", good)])
        await asyncio.to_thread(S.collect, kafka_settings, {"dup-r"}, 90)  # its reward is out: it ran here
        offsets = _produce(kafka_settings, ROLLOUT_REQUESTS, [(k, v) for k, v, _, _ in poison])
        [after_at] = _produce(kafka_settings, ROLLOUT_REQUESTS, [(b"after", after.to_bytes())])
        ids = {*invalid, "dup-r", "after"}
        events, rewards = await asyncio.to_thread(
            S.collect, kafka_settings, ids, 90, until_rewards=len(ids), settle_s=2.0
        )
        assert st["worker"].fatal is None
        # everything up to and past the poison is committed: nothing left to retry
        consumer = make_consumer(kafka_settings, group_id)
        try:
            tp = TopicPartition(kafka_settings.topic(ROLLOUT_REQUESTS), 0)
            deadline = time.monotonic() + 20
            while (committed := consumer.committed([tp], timeout=10)[0].offset) <= after_at:
                assert time.monotonic() < deadline, f"committed {committed}, not past {after_at}"
                await asyncio.sleep(0.3)
        finally:
            consumer.close()

    assert_solved_by_harness(events, rewards, "after")  # the worker went on past every poison record
    ev, rw = by_rollout(events, rewards)
    assert len(rw["dup-r"]) == 1, rw["dup-r"]  # ran once: its duplicate and its older attempt did not run
    for rid in invalid:  # settled as a failed setup would be, never started
        assert [e.state for e in ev[rid]] == [RolloutState.FAILED], ev[rid]
        (reward,) = rw[rid]
        assert reward.status == RewardStatus.INFRA_FAILURE and reward.reward is None
        assert reward.reason.startswith("invalid request: "), reward.reason
    letters = [DeadLetter.from_bytes(m.value()) for m in _read(kafka_settings, DEADLETTER, len(poison) + 1, 15)]
    assert len(letters) == len(poison), [d.reason for d in letters]
    for letter, (key, value, says, kind), offset in zip(letters, poison, offsets, strict=True):
        assert letter.source == "sandbox_worker" and letter.error_type == kind, (letter, says)
        assert says in letter.reason, (letter.reason, says)
        assert letter.original_topic == kafka_settings.topic(ROLLOUT_REQUESTS)
        assert (letter.original_partition, letter.original_offset) == (0, offset)
        assert letter.original_key == key and letter.original_value == value
    for rid, says in (("bad-suite", "unknown suite"), ("bad-task", "has no task"), ("bad-harness", "unknown harness")):
        assert says in rw[rid][0].reason, rw[rid][0].reason
    assert f"[0]@{first_at}" in letters[-2].reason  # the duplicate names where the original was read


# ---- weight follower ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("models") / "tiny"
    init_tiny_model(
        out, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, progress=None
    )
    return out


def _version(model_dir: Path, out: Path, version: int, *, seed: int | None = None) -> WeightVersion:
    """Perturbed weights written to ``out/vN-S/model.safetensors``; their WeightVersion (not published)."""
    seed = version if seed is None else seed
    path = out / f"v{version}-{seed}" / "model.safetensors"
    path.parent.mkdir(parents=True)
    tensors = load_file(str(model_dir / "model.safetensors"))
    generator = torch.Generator().manual_seed(seed)
    save_file(
        {k: (v + 0.05 * torch.randn(v.shape, generator=generator)).contiguous() for k, v in tensors.items()}, path
    )
    data = path.read_bytes()
    return WeightVersion(
        policy_version=version,
        timestamp_ms=now_ms(),
        model_name="tiny",
        step=version,
        uri=path.as_uri(),
        sha256=hashlib.sha256(data).hexdigest(),
        size_bytes=len(data),
    )


async def _served_version(url: str) -> int:
    async with aiohttp.ClientSession() as session:
        body = {"prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0}
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            assert resp.status == 200
            return int((await resp.json())["policy_version"])


@pytest.mark.timeout(240)
async def test_weight_follower_dead_letters_poison_and_applies_the_next_version(
    kafka_settings: KafkaSettings, model_dir: Path, tmp_path: Path
) -> None:
    env = {
        "CLAWSTREAM_KAFKA_BOOTSTRAP_SERVERS": kafka_settings.bootstrap_servers or "",
        "CLAWSTREAM_KAFKA_TOPIC_PREFIX": kafka_settings.topic_prefix,
    }
    v1 = _version(model_dir, tmp_path, 1)
    w = Worker(["--model", str(model_dir), "--served-model-name", "tiny", "--metrics-interval-s", "0"], env)
    try:
        _produce(kafka_settings, WEIGHTS, [(b"tiny", v1.to_bytes())])
        assert [Metric.from_bytes(m.value()).policy_version for m in _read(kafka_settings, METRICS, 1)] == [1]
        other = _version(model_dir, tmp_path, 1, seed=99)  # version 1 again, another file
        older = _version(model_dir, tmp_path, 0, seed=98)
        poison: list[tuple[bytes, bytes | None, str]] = [  # key, value, error type (None: skipped, no letter)
            (b"tiny", b"\x00garbage", "CorruptRecordError"),
            (b"tiny", _unknown_fingerprint(v1.to_bytes()), "UnknownSchemaError"),
            (b"tiny", None, "CodecError"),
            (b"tiny", S.request("hello", "agentloop").to_bytes(), "CorruptRecordError"),
            (b"tiny", v1.to_bytes(), ""),  # the served version again, same file: skipped and logged
            (b"tiny", other.to_bytes(), "conflicting_version"),
            (b"tiny", older.to_bytes(), "version_backwards"),
        ]
        offsets = _produce(kafka_settings, WEIGHTS, [(k, v) for k, v, _ in poison])
        v2 = _version(model_dir, tmp_path, 2)
        _produce(kafka_settings, WEIGHTS, [(b"tiny", v2.to_bytes())])
        applied = [Metric.from_bytes(m.value()) for m in _read(kafka_settings, METRICS, 2)]
        assert [m.policy_version for m in applied] == [1, 2], w.log()  # went on past every poison record
        assert applied[1].values["previous_version"] == 1.0
        assert await _served_version(w.url) == 2
        expected = [(kind, offset) for (_, _, kind), offset in zip(poison, offsets, strict=True) if kind]
        letters = [DeadLetter.from_bytes(m.value()) for m in _read(kafka_settings, DEADLETTER, len(expected) + 1, 5)]
        assert [(d.error_type, d.original_offset) for d in letters] == expected, [d.reason for d in letters]
        assert all(d.original_topic == kafka_settings.topic(WEIGHTS) for d in letters)
        assert "tombstone" in letters[2].reason
        assert letters[4].policy_version == 1 and "another sha256" in letters[4].reason
        assert letters[5].policy_version == 0 and "goes backwards: serving 1" in letters[5].reason
        assert f"skipping version 1 at {kafka_settings.topic(WEIGHTS)}[0]@{offsets[4]}" in w.log()
    finally:
        w.stop()
