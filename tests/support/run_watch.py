"""A live view of a running stack, read from its topics: weight versions published, attempts running, rewards.

Fault tests place their faults by this state (``wait_for``), never by a sleep: "version 2 is out and a rollout is
mid-flight" is a predicate over what the run itself has written. Reads committed records only, from the beginning
of each topic, with partitions assigned by hand (no group, nothing committed).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

from confluent_kafka import OFFSET_BEGINNING, TopicPartition

from clawbase.kafka.clients import make_consumer
from clawbase.settings import KafkaSettings
from schemas.events import RewardEvent, RolloutEvent, RolloutState, WeightVersion
from schemas.topics import REWARDS, ROLLOUT_EVENTS, WEIGHTS


class RunWatch:
    def __init__(self, kafka: KafkaSettings) -> None:
        self.kafka = kafka
        # log_level 2: the broker-outage test would print a connect failure every 50 ms
        self.consumer = make_consumer(kafka, f"{kafka.topic_prefix}run-watch", log_level=2)
        parts = []
        for name in (WEIGHTS, ROLLOUT_EVENTS, REWARDS):
            topic = kafka.topic(name)
            meta = self.consumer.list_topics(topic, timeout=30).topics[topic]
            parts += [TopicPartition(topic, p, OFFSET_BEGINNING) for p in sorted(meta.partitions)]
        self.consumer.assign(parts)
        self.versions: list[int] = []
        self.started: dict[str, str] = {}  # attempt id → rollout id
        self.ended: set[str] = set()  # attempts with a terminal lifecycle move
        self.rewarded: set[str] = set()
        self.statuses: Counter[str] = Counter()
        self.reward_times: list[float] = []  # time.monotonic() when each reward was read

    @property
    def version(self) -> int:
        return max(self.versions, default=0)

    @property
    def running(self) -> set[str]:
        """Attempts started and neither ended nor rewarded (as far as read)."""
        return set(self.started) - self.ended - self.rewarded

    def poll(self, timeout: float = 0.5) -> None:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            msg = self.consumer.poll(min(left, 0.2))
            if msg is None or msg.error():
                continue
            topic = msg.topic()
            if topic == self.kafka.topic(WEIGHTS):
                self.versions.append(WeightVersion.from_bytes(msg.value()).policy_version)
            elif topic == self.kafka.topic(ROLLOUT_EVENTS):
                ev = RolloutEvent.from_bytes(msg.value())
                if ev.state == RolloutState.STARTED:
                    self.started[ev.attempt_id] = ev.rollout_id
                else:
                    self.ended.add(ev.attempt_id)
            else:
                reward = RewardEvent.from_bytes(msg.value())
                self.rewarded.add(reward.attempt_id)
                self.statuses[reward.status.value] += 1
                self.reward_times.append(time.monotonic())

    def wait_for(
        self, what: str, predicate: Callable[[RunWatch], bool], timeout: float, check: Callable[[], None]
    ) -> float:
        """Poll until ``predicate(self)``; ``check`` raises when a service died meanwhile. Returns seconds waited."""
        t0 = time.monotonic()
        while not predicate(self):
            check()
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(
                    f"not reached within {timeout:.0f}s: {what} (version {self.version}, {len(self.running)} running, "
                    f"rewards {dict(self.statuses)})"
                )
            self.poll(0.5)
        return time.monotonic() - t0

    def close(self) -> None:
        self.consumer.close()
