"""Tests read a topic back whole, independently of the code under test: every record from the beginning to the end
it had when asked, decoded as one event class."""

from __future__ import annotations

import os
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, TopicPartition

from clawbase.kafka.clients import make_consumer, read_to_end
from clawbase.settings import KafkaSettings


def read_events(kafka: KafkaSettings, name: str, cls: Any) -> list:
    """Every record of catalog topic ``name`` under ``kafka``'s prefix, decoded with ``cls.from_bytes``."""
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
