"""A seeded evaluation reruns exactly: ``run_eval`` twice on one model (the real broker, CPU engine, proxy and
sandbox worker; the agent loop; sampled at temperature 1 with random weights, so every token is a draw) generates
the same tokens for every task, call by call, read back from each run's calls topic; the rewards agree too. Fails
if the seed does not travel request → sandbox worker → proxy registration → engine (the tokens differ at once)."""

from __future__ import annotations

from collections import defaultdict

import pytest

from clawbase.settings import KafkaSettings
from clawstream.stack.evaluate import EvalConfig, run_eval
from schemas.events import CallEvent, RolloutRequest
from schemas.topics import CALLS, ROLLOUT_REQUESTS
from tests.support.proxy_helpers import tiny_model_dir
from tests.support.topic_reader import read_events

pytestmark = pytest.mark.integration


def _generated_by_task(kafka: KafkaSettings, prefix: str) -> dict[str, list[list[int]]]:
    """Task id → the generated token ids of its rollout's calls, in call order."""
    run = kafka.model_copy(update={"topic_prefix": prefix})
    task_of = {r.rollout_id: r.task_id for r in read_events(run, ROLLOUT_REQUESTS, RolloutRequest)}
    calls: dict[str, list[CallEvent]] = defaultdict(list)
    for c in read_events(run, CALLS, CallEvent):
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
