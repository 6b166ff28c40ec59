"""Every event type through the real broker: idempotent zstd producer → read_committed consumer, and topic creation."""

from __future__ import annotations

import time

import pytest
from confluent_kafka.admin import NewTopic

from clawbase.errors import TopicError
from clawbase.kafka.clients import create_topics, make_admin, make_consumer, make_producer
from clawbase.settings import KafkaSettings
from schemas.events import CallEvent
from schemas.topics import BY_NAME, CATALOG, DEADLETTER
from tests.support.factories import sample_events

pytestmark = pytest.mark.integration

TOPIC_OF = {spec.value_schema: spec.name for spec in CATALOG}


def _consume(settings: KafkaSettings, group_id: str, topics: list[str], n: int, timeout: float = 30.0) -> list:
    consumer = make_consumer(settings, group_id)
    consumer.subscribe(topics)
    out = []
    deadline = time.monotonic() + timeout
    try:
        while len(out) < n and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            assert msg.error() is None, msg.error()
            out.append(msg)
    finally:
        consumer.close()
    return out


def test_every_event_type_round_trips_through_the_broker(kafka_settings: KafkaSettings, group_id: str) -> None:
    events = sample_events("r-42")
    producer = make_producer(kafka_settings)
    assert producer.list_topics(timeout=10).brokers
    for event in events:
        key = event.rollout_id or event.SCHEMA
        producer.produce(kafka_settings.topic(TOPIC_OF[event.SCHEMA]), key=key.encode(), value=event.to_bytes())
    assert producer.flush(30) == 0
    msgs = _consume(kafka_settings, group_id, [kafka_settings.topic(s.name) for s in CATALOG], len(events))
    assert len(msgs) == len(events)
    by_type = {}
    for msg in msgs:
        for event in events:
            if msg.topic() == kafka_settings.topic(TOPIC_OF[event.SCHEMA]):
                by_type[type(event)] = type(event).from_bytes(msg.value())
    assert set(by_type) == {type(e) for e in events}
    for event in events:
        assert by_type[type(event)].to_bytes() == event.to_bytes(), type(event).__name__
    call = by_type[CallEvent]
    assert call.generated_tokens.tolist() == [102, 103, 2] and call.parent_call_id == "c-0"


def test_large_call_event_fits(kafka_settings: KafkaSettings, group_id: str) -> None:
    """A call with 64k prompt tokens + logprobs (~1 MB before zstd) is accepted end to end."""
    import numpy as np

    big = sample_events("r-big")[2]
    assert isinstance(big, CallEvent)
    rng = np.random.default_rng(0)
    big.new_tokens = rng.integers(0, 150_000, 65_536).astype("<i4")
    big.generated_tokens = rng.integers(0, 150_000, 65_536).astype("<i4")
    big.logprobs = -rng.random(65_536).astype("<f4")
    big.prompt_len = big.shared_prefix_len + 65_536
    producer = make_producer(kafka_settings)
    producer.produce(kafka_settings.topic(BY_NAME["clawstream.calls"].name), key=b"r-big", value=big.to_bytes())
    assert producer.flush(30) == 0
    [msg] = _consume(kafka_settings, group_id, [kafka_settings.topic("clawstream.calls")], 1)
    back = CallEvent.from_bytes(msg.value())
    assert np.array_equal(back.logprobs, big.logprobs) and len(msg.value()) > 500_000


def test_create_topics_is_idempotent_and_applies_configs(kafka_settings: KafkaSettings) -> None:
    again = create_topics(kafka_settings, CATALOG)
    assert set(again.values()) == {"exists"} and len(again) == len(CATALOG)
    admin = make_admin(kafka_settings)
    meta = admin.list_topics(timeout=10).topics
    assert len(meta[kafka_settings.topic("clawstream.calls")].partitions) == BY_NAME["clawstream.calls"].partitions
    from confluent_kafka.admin import ConfigResource

    res = ConfigResource(ConfigResource.Type.TOPIC, kafka_settings.topic(DEADLETTER))
    configs = admin.describe_configs([res])[res].result()
    assert configs["retention.ms"].value == "-1"


def test_co_partition_mismatch_is_refused(kafka_bootstrap: str, topic_prefix: str) -> None:
    settings = KafkaSettings(bootstrap_servers=kafka_bootstrap, topic_prefix=topic_prefix)
    admin = make_admin(settings)
    admin.create_topics([NewTopic(settings.topic("clawstream.rewards"), num_partitions=3)])[
        "" or settings.topic("clawstream.rewards")
    ].result()
    with pytest.raises(TopicError, match="co-partitioned group 'rollout'"):
        create_topics(settings, CATALOG)
