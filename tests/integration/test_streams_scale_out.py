"""Scaling out: two streams workers of one app on one host share the partitions and emit each trajectory once.

Before, the second worker could not start at all: Faust's worker command binds its web server to 0.0.0.0:6066 unless
told ``--without-web`` (``streams.app.main`` now says so). The workers join one consumer group (the app id), the
broker splits the eight co-partitioned partition numbers between them, and every synthetic rollout comes out as
exactly one trajectory (read_committed) whichever worker assembled it.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import pytest
from confluent_kafka import KafkaException

from clawbase.kafka.clients import make_admin
from clawbase.settings import KafkaSettings
from schemas.events import Trajectory
from schemas.topics import CALLS, TRAJECTORIES
from tests.support.stream_harness import Collector, Worker, produce
from tests.support.stream_load import interleave, make_groups

pytestmark = pytest.mark.integration
SETTINGS = {
    "store": "memory://",
    "settle_interval_s": 1.0,
    "settle_timeout_s": 6.0,
    "session_timeout_s": 15.0,  # a worker evicted while restoring exits (streams.eos.close_dirty): not tested here
    "group_size": 4,
    "batch_groups": 4,
}


def _members(kafka: KafkaSettings, group: str) -> dict[str, set[int]]:
    """The app's consumer group: member id → partitions of the calls topic it holds (empty while rebalancing)."""
    admin = make_admin(kafka)  # kept referenced until the answer: a dropped client never completes its futures
    [future] = admin.describe_consumer_groups([group], request_timeout=10).values()
    try:
        description = future.result(timeout=15)
    except (KafkaException, TimeoutError):  # the coordinator is still loading the new group: ask again
        return {}
    if description.state.name != "STABLE":
        return {}
    topic = kafka.topic(CALLS)
    return {
        m.member_id: {tp.partition for tp in m.assignment.topic_partitions if tp.topic == topic}
        for m in description.members
    }


def test_two_workers_share_the_partitions_and_emit_each_trajectory_once(
    kafka_settings: KafkaSettings, group_id: str, tmp_path: Path
) -> None:
    app_id = f"streams-{group_id}"
    group = kafka_settings.topic_prefix + app_id  # the app's consumer group (streams.app prefixes its id)
    workers = [Worker(kafka_settings, tmp_path / f"w{k}", app_id=app_id, **SETTINGS) for k in range(2)]
    for k, worker in enumerate(workers):
        (tmp_path / f"w{k}").mkdir()
        worker.start()
    deadline = time.monotonic() + 120
    while len(members := _members(kafka_settings, group)) != 2 or not all(members.values()):
        assert all(w.alive() for w in workers), "\n".join(w.log_tail() for w in workers)
        assert time.monotonic() < deadline, f"the group never held both workers: {members}"
        time.sleep(1.0)
    held = sorted(sorted(p) for p in members.values())
    assert sorted(p for ps in held for p in ps) == list(range(8)), held  # every partition number, once

    rollouts = [r for g in make_groups(10, seed=21, faults=False) for r in g]
    produce(kafka_settings, interleave(rollouts, seed=21))
    collector = Collector(kafka_settings, group_id)
    try:
        deadline = time.monotonic() + 180
        while collector.count(TRAJECTORIES) < len(rollouts):
            assert all(w.alive() for w in workers), "\n".join(w.log_tail() for w in workers)
            assert time.monotonic() < deadline, f"{collector.count('clawstream.trajectories')} of {len(rollouts)}"
            collector.poll(0.5)
        collector.poll(3.0)  # a duplicate would arrive by now (commit interval ≪ 3 s)
        seen = Counter(Trajectory.from_bytes(o.value).rollout_id for o in collector.got[TRAJECTORIES])
        assert set(seen) == {r.rollout_id for r in rollouts} and set(seen.values()) == {1}, seen
        assert _members(kafka_settings, group).keys() == members.keys()  # no rebalance, both still in the group
    finally:
        collector.close()
        for worker in workers:
            worker.stop()
