"""The sandbox worker's seen-requests store belongs to one Kafka cluster.

Its committed positions are offsets, which mean something on one cluster only. A store the same group's workers
wrote against another cluster (a fresh local broker under the same topic prefix and group id) must not turn a
redelivered request at a low offset into a "replay" that is dead-lettered and never run.
"""

from __future__ import annotations

import asyncio

import pytest

from clawbase.kafka.clients import make_producer
from producers.sandbox.offsets import SeenRequests, open_store, seen_path
from producers.sandbox.settings import SandboxSettings
from schemas.events import RewardStatus
from schemas.topics import ROLLOUT_REQUESTS
from tests.support import sandbox_helpers as S
from tests.support.sandbox_stack import by_rollout, stack

pytestmark = pytest.mark.integration


def seed_other_cluster(path, topic: str, rollout_id: str) -> None:
    """A store as a worker left it on another cluster: the request read at partition 0 offset 0, and the partition
    done up to offset 1000 there."""
    store = open_store(path)
    seen = SeenRequests(limit=10, store=store)
    assert seen.check(rollout_id, 0, (topic, 0), 0) is None
    seen.committed((topic, 0), 1000)
    store.close()


@pytest.mark.timeout(180)
async def test_a_store_from_another_cluster_does_not_refuse_this_clusters_requests(
    kafka_settings, group_id, tmp_path
) -> None:
    seen_dir = tmp_path / "seen"
    topic = kafka_settings.topic(ROLLOUT_REQUESTS)
    req = S.request("hello", "agentloop", rollout_id="seen-ok")
    settings = SandboxSettings(group_id=group_id, seen_dir=seen_dir)
    # the layout before stores were kept per cluster, and another cluster's folder in the layout now
    seed_other_cluster(seen_dir, topic, req.rollout_id)
    seed_other_cluster(seen_path(settings, "another-cluster"), topic, req.rollout_id)
    async with stack(kafka_settings, group_id, tmp_path, seen_dir=seen_dir):
        producer = make_producer(kafka_settings)
        producer.produce(topic, key=req.rollout_id.encode(), value=req.to_bytes(), partition=0)
        assert producer.flush(30) == 0
        events, rewards = await asyncio.to_thread(S.collect, kafka_settings, {req.rollout_id}, 90.0, settle_s=1.0)
    _, rw = by_rollout(events, rewards)
    (reward,) = rw[req.rollout_id]
    assert reward.status == RewardStatus.OK and reward.reward == 1.0, reward
