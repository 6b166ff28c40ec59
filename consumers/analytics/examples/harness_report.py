"""Custom analytics consumer, the pattern to copy: per-harness prefix reuse and mean reward of the trajectories.

Subscribes to ``clawstream.trajectories`` (under ``--topic-prefix``) with confluent-kafka, reads from the beginning
until the end of every partition (or Ctrl-C), decodes each value with the project's codec and prints one row per
harness: rollouts, prefix reuse (Σ path tokens / Σ unique tokens) and mean reward (over graded rollouts).
Infrastructure failures are left out, as training leaves them out. Nothing is committed.

Run: ``python -m consumers.analytics.examples.harness_report [--bootstrap HOST:PORT] [--topic-prefix P]``.
"""

from __future__ import annotations

import argparse
import sys
import uuid
from collections import defaultdict

from confluent_kafka import Consumer, KafkaError

from clawbase.errors import ClawstreamError
from clawbase.kafka.clients import client_config
from clawbase.settings import add_kafka_arguments, kafka_settings
from schemas.events import Trajectory, TrajectoryStatus
from schemas.topics import TRAJECTORIES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m consumers.analytics.examples.harness_report",
        description="Per-harness prefix reuse and mean reward of the trajectories.",
    )
    add_kafka_arguments(parser)
    settings = kafka_settings(parser.parse_args(argv))
    consumer = Consumer(
        {
            **client_config(settings),
            "group.id": f"harness-report-{uuid.uuid4().hex[:8]}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            "isolation.level": "read_committed",
        }
    )
    assigned: set[int] = set()
    at_end: set[int] = set()
    consumer.subscribe([settings.topic(TRAJECTORIES)], on_assign=lambda c, ps: assigned.update(p.partition for p in ps))
    stats: dict[str, dict] = defaultdict(lambda: {"rollouts": 0, "path": 0, "unique": 0, "rewards": []})
    try:
        while not assigned or not assigned <= at_end:
            msg = consumer.poll(1.0)
            if msg is None:
                continue
            if msg.error() is not None:
                if msg.error().code() != KafkaError._PARTITION_EOF:
                    raise ClawstreamError(f"reading {msg.topic()}: {msg.error()}")
                at_end.add(msg.partition())
                continue
            at_end.discard(msg.partition())
            try:  # a bad record (a tombstone, bytes of no known schema, a broken body) is reported and skipped
                if msg.value() is None:
                    raise ClawstreamError("a tombstone (no value)")
                t = Trajectory.from_bytes(msg.value())
            except (ClawstreamError, KeyError, TypeError, ValueError) as exc:
                print(f"skipped {msg.topic()}[{msg.partition()}]@{msg.offset()}: {exc}", file=sys.stderr)
                continue
            if t.status is TrajectoryStatus.INFRA_FAILURE:  # left out of statistics, as training does
                continue
            s = stats[t.harness]
            s["rollouts"] += 1
            s["path"] += t.path_tokens
            s["unique"] += t.unique_tokens
            if t.reward is not None:
                s["rewards"].append(t.reward)
    except KeyboardInterrupt:
        pass
    finally:
        consumer.close()
    print(f"{'harness':24} {'rollouts':>8} {'prefix reuse':>12} {'mean reward':>11}")
    for harness, s in sorted(stats.items()):
        reuse = f"{s['path'] / s['unique']:.3f}" if s["unique"] else "-"
        mean = f"{sum(s['rewards']) / len(s['rewards']):.3f}" if s["rewards"] else "-"
        print(f"{harness:24} {s['rollouts']:>8} {reuse:>12} {mean:>11}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ClawstreamError as exc:
        sys.exit(f"error: {exc}")
