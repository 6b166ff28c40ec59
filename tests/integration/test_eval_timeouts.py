"""``run_eval`` reads back which of its rollouts were killed at the task timeout (real broker, CPU engine, proxy,
sandbox worker, the agent loop): its count equals the TIMED_OUT lifecycle events on the evaluation's own topic, and
those rollouts are still graded (a timeout is the rollout's result, not an infrastructure failure)."""

from __future__ import annotations

import pytest

from clawbase.settings import KafkaSettings
from clawstream.stack.evaluate import EvalConfig, run_eval
from schemas.events import RolloutEvent, RolloutState
from schemas.topics import ROLLOUT_EVENTS
from tests.support.proxy_helpers import tiny_model_dir
from tests.support.topic_reader import read_events

pytestmark = pytest.mark.integration


def _timed_out_ids(kafka: KafkaSettings) -> set[str]:
    events = read_events(kafka, ROLLOUT_EVENTS, RolloutEvent)
    return {e.rollout_id for e in events if e.state == RolloutState.TIMED_OUT}


@pytest.mark.timeout(600)
def test_an_evaluation_counts_its_rollouts_killed_at_the_task_timeout(kafka_settings: KafkaSettings, tmp_path) -> None:
    # 0.3 s: no rollout gets through the sandbox's start, a model call and its answer in that (the limit, not the
    # machine, decides which rollouts time out: every one)
    cfg = EvalConfig(harnesses=("agentloop",), tasks=4, modes=("greedy",), max_tokens=24, rollout_timeout_s=0.3)
    result = run_eval(tiny_model_dir(), cfg, kafka=kafka_settings, run_dir=tmp_path / "run", progress=False)
    on_topic = _timed_out_ids(kafka_settings.model_copy(update={"topic_prefix": result.extra["topic_prefix"]}))
    print(f"timed out: {result.extra['timed_out']}; on the topic: {len(on_topic)}; rows: {result.rows}")
    assert on_topic, "no rollout timed out at 0.3 s: the test no longer exercises the count"
    assert result.extra["timed_out"] == {"agentloop/greedy": len(on_topic)}
    assert result.timed_out() == len(on_topic)
    assert result.rows[0].graded == 4 and result.rows[0].infra == 0  # graded as they stood
