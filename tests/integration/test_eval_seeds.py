"""A seeded evaluation reruns exactly: ``run_eval`` twice on one model (the real broker, CPU engine, proxy and
sandbox worker; the agent loop; sampled at temperature 1 with random weights, so every token is a draw) generates
the same tokens for every task, call by call, read back from each run's calls topic; the rewards agree too. Fails
if the seed does not travel request → sandbox worker → proxy registration → engine (the tokens differ at once)."""

from __future__ import annotations

import os
from collections import defaultdict

import pytest
from confluent_kafka import OFFSET_BEGINNING, TopicPartition

from clawbase.kafka.clients import make_consumer, read_to_end
from clawbase.settings import KafkaSettings
from clawstream.stack.evaluate import EvalConfig, run_eval
from schemas.events import CallEvent, Event, RolloutRequest
from schemas.topics import CALLS, ROLLOUT_REQUESTS
from tests.support.proxy_helpers import tiny_model_dir

pytestmark = pytest.mark.integration


def _read(kafka: KafkaSettings, name: str, cls: type[Event]) -> list:
    consumer = make_consumer(kafka, f"check-{os.urandom(4).hex()}")
    try:
        topic = kafka.topic(name)
        parts = sorted(consumer.list_topics(topic, timeout=30).topics[topic].partitions)
        marks = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10) for p in parts}
        ends = {p: hi for p, (lo, hi) in marks.items() if hi > lo}
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in ends])
        msgs = [
            m for m in read_to_end(consumer, topic, ends, timeout=60) if (m.offset() or 0) < ends[m.partition() or 0]
        ]
        return [cls.from_bytes(m.value() or b"") for m in msgs]
    finally:
        consumer.close()


def _generated_by_task(kafka: KafkaSettings, prefix: str) -> dict[str, list[list[int]]]:
    """Task id → the generated token ids of its rollout's calls, in call order."""
    run = kafka.model_copy(update={"topic_prefix": prefix})
    task_of = {r.rollout_id: r.task_id for r in _read(run, ROLLOUT_REQUESTS, RolloutRequest)}
    calls: dict[str, list[CallEvent]] = defaultdict(list)
    for c in _read(run, CALLS, CallEvent):
        calls[task_of[c.rollout_id]].append(c)
    return {t: [c.generated_tokens.tolist() for c in sorted(cs, key=lambda c: c.seq)] for t, cs in calls.items()}


@pytest.mark.timeout(600)
def test_a_seeded_evaluation_reruns_token_for_token(kafka_settings: KafkaSettings, tmp_path) -> None:
    cfg = EvalConfig(harnesses=("agentloop",), tasks=6, modes=("sampled",), max_tokens=24, concurrency=6)
    runs = [
        run_eval(tiny_model_dir(), cfg, kafka=kafka_settings, run_dir=tmp_path / f"run{i}", progress=False)
        for i in range(2)
    ]
    first, again = (_generated_by_task(kafka_settings, r.extra["topic_prefix"]) for r in runs)
    assert len(first) == 6 and all(first.values()), first.keys()
    tokens = sum(len(g) for calls in first.values() for g in calls)
    differing = [t for t in first if first[t] != again.get(t)]
    print(f"{len(first)} tasks, {tokens} generated tokens; differing on rerun: {differing}")
    assert not differing, f"a seeded rerun drew other tokens for {differing}"
    assert runs[0].task_rewards("agentloop", "sampled") == runs[1].task_rewards("agentloop", "sampled")
