"""What a chaos run sees of itself: the run's topics read live, each event counted and timed by its kind.

``clawstream chaos`` places every kill by this state ("the learner after the next batch is sealed", "the proxy after
the next model call is recorded"), never by a sleep, and measures from it the run's progress (rewards, trajectories,
weight versions: the longest stretch without any) and when it has drained (every request settled into a trajectory,
every started attempt ended, every sealed batch trained). Reads committed records only, from the beginning of each
topic, partitions assigned by hand (no group, nothing committed); the broker kills it rides out are librdkafka's.
"""

from __future__ import annotations

import time
from collections import Counter

from confluent_kafka import OFFSET_BEGINNING, TopicPartition

from clawbase.kafka.clients import make_consumer
from clawbase.settings import KafkaSettings
from schemas.codec import default_codec
from schemas.events import RolloutRequest
from schemas.topics import BATCHES, CALLS, REWARDS, ROLLOUT_EVENTS, ROLLOUT_REQUESTS, TRAJECTORIES, WEIGHTS

KINDS = {  # topic → the kind of event one of its records is
    ROLLOUT_REQUESTS: "request",
    ROLLOUT_EVENTS: "lifecycle",
    CALLS: "call",
    REWARDS: "reward",
    TRAJECTORIES: "trajectory",
    BATCHES: "batch",
    WEIGHTS: "version",
}
PROGRESS = ("reward", "trajectory", "version")  # the run moves forward when one of these is read


class ChaosWatch:
    def __init__(self, kafka: KafkaSettings) -> None:
        self.kafka = kafka
        self.consumer = make_consumer(kafka, f"{kafka.topic_prefix}chaos-watch", log_level=2)
        self.kind_of = {kafka.topic(name): kind for name, kind in KINDS.items()}
        parts = []
        for topic in self.kind_of:
            meta = self.consumer.list_topics(topic, timeout=60).topics[topic]
            parts += [TopicPartition(topic, p, OFFSET_BEGINNING) for p in sorted(meta.partitions)]
        self.consumer.assign(parts)
        self.counts: Counter[str] = Counter()  # kind → events read ("started", "seal" split out of their topics)
        self.progress_times: list[float] = []  # time.monotonic() of every progress event
        self.requested: set[str] = set()  # rollout ids
        self.settled: set[str] = set()  # rollout ids with a trajectory (an infrastructure failure's included)
        self.started: set[str] = set()  # attempt ids
        self.ended: set[str] = set()  # attempt ids settled into a trajectory or rewarded
        self.versions: set[int] = set()
        self.last_step = -1  # the newest training step requested

    def poll(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            msg = self.consumer.poll(min(left, 0.2))
            if msg is None or msg.error():
                continue
            topic, value = msg.topic(), msg.value()
            if topic is None or value is None:
                continue
            kind = self._read(self.kind_of[topic], value)
            self.counts[kind] += 1
            if kind in PROGRESS:
                self.progress_times.append(time.monotonic())

    def _read(self, kind: str, value: bytes) -> str:
        """Keep what draining and the triggers need; returns the event's kind (a SEAL, a start: their own)."""
        if kind == "request":
            request = RolloutRequest.from_bytes(value)
            self.requested.add(request.rollout_id)
            self.last_step = max(self.last_step, request.step)
            return kind
        if kind == "call":
            return kind  # counted only: the trigger of a kill mid-call
        _, rec = default_codec().decode(value)
        if kind == "lifecycle":
            if rec["state"] == "STARTED":
                self.started.add(rec["attempt_id"])
                return "started"
        elif kind == "reward":
            self.ended.add(rec["attempt_id"])  # a redundant re-run's only end: its trajectory is dead-lettered late
        elif kind == "trajectory":
            self.ended.add(rec["attempt_id"])
            self.settled.add(rec["rollout_id"])
        elif kind == "batch":
            return "seal" if rec["kind"] == "SEAL" else kind
        elif kind == "version":
            self.versions.add(int(rec["policy_version"]))
        return kind

    def steps_issued(self) -> int:
        return self.last_step + 1

    def last_progress(self) -> float | None:
        return self.progress_times[-1] if self.progress_times else None

    def drained(self) -> bool:
        """Every request settled (one past ``max_attempts`` as its last infrastructure failure), every started attempt
        settled or rewarded (a second run of a settled rollout, after a sandbox worker's kill, ends with its reward
        only: the streams dead-letter it as late), every sealed batch trained (a version each)."""
        return (
            self.requested <= self.settled and self.started <= self.ended and len(self.versions) >= self.counts["seal"]
        )

    def sealed_all(self) -> bool:
        """A batch sealed per step issued (a step is one batch: ``batch_groups`` = the step's tasks)."""
        return self.counts["seal"] >= self.steps_issued()

    def longest_stall(self, start: float, end: float) -> tuple[float, float]:
        """(longest gap without a progress event within [start, end], when that gap began)."""
        times = [start, *(t for t in self.progress_times if start < t < end), end]
        gap, began = max(((b - a, a) for a, b in zip(times, times[1:], strict=False)), default=(0.0, start))
        return gap, began

    def close(self) -> None:
        self.consumer.close()
