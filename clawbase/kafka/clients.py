"""Kafka client plumbing shared by every service: configs, reading a topic to its end, producing without loss,
topic creation (replicated by the cluster's size: :func:`replication`).

Producers are idempotent with ``acks=all`` and zstd; consumers read large records; sizes match the broker recipe.
Consumers log positions as ``topic[partition]@offset`` (see :func:`where`). :func:`read_to_end` is the one way a
service reads what a topic held when it started (weights catch-up, resume, value pretraining);
:func:`produce_reliably` the one way to produce when the local queue is full (wait for deliveries, never drop).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from clawbase.errors import ClawstreamError, ConfigError, TopicError
from clawbase.kafka.local_state import LocalHome
from clawbase.kafka.topic_spec import MAX_MESSAGE_BYTES, Replication, TopicSpec, co_partition_groups, replication_for
from clawbase.settings import KafkaSettings

log = logging.getLogger(__name__)


def bootstrap_servers(settings: KafkaSettings) -> str:
    """The bootstrap address: configured, else the local broker's (``clawstream kafka up``), else a clear error."""
    if settings.bootstrap_servers:
        return settings.bootstrap_servers
    local = LocalHome()
    bootstrap = local.running_bootstrap()
    if bootstrap is None:
        raise ConfigError(
            f"no Kafka bootstrap address given, and no local broker runs under {local.home} (where `clawstream "
            "kafka up` keeps it; one started with another --home or CLAWSTREAM_HOME is not found there): pass "
            "--bootstrap host:port, set CLAWSTREAM_KAFKA_BOOTSTRAP_SERVERS=host:port, or run `clawstream kafka up`"
        )
    return bootstrap


def check_broker(settings: KafkaSettings, timeout: float = 15.0) -> str:
    """The bootstrap address, once a broker there has answered; a :class:`ConfigError` naming the address tried
    (and where it came from) when none answers within ``timeout`` seconds."""
    bootstrap = bootstrap_servers(settings)
    source = (
        "--bootstrap / CLAWSTREAM_KAFKA_BOOTSTRAP_SERVERS"
        if settings.bootstrap_servers
        else (f"the local broker's state in {LocalHome().home}")
    )
    try:
        AdminClient(client_config(settings)).list_topics(timeout=timeout)
    except KafkaException as exc:
        raise ConfigError(
            f"no Kafka broker answered at {bootstrap} (from {source}) within {timeout:g}s: "
            f"{exc.args[0] if exc.args else exc}"
        ) from exc
    return bootstrap


def require_topics(settings: KafkaSettings, names: Iterable[str], *, timeout: float = 15.0) -> None:
    """Raise a :class:`ConfigError` naming every catalog topic of ``names`` (unprefixed) that does not exist under
    ``settings.topic_prefix``, and the command that creates them. A service checks at start what it reads and writes,
    rather than failing with a library traceback at its first produce."""
    try:
        existing = set(AdminClient(client_config(settings)).list_topics(timeout=timeout).topics)
    except KafkaException as exc:
        raise ConfigError(f"cannot list the topics at {bootstrap_servers(settings)}: {exc}") from exc
    missing = [settings.topic(n) for n in names if settings.topic(n) not in existing]
    if missing:
        prefix = f" --prefix {settings.topic_prefix}" if settings.topic_prefix else ""
        raise ConfigError(
            f"topic(s) {', '.join(missing)} do not exist at {bootstrap_servers(settings)}; create the "
            f"catalog with `clawstream topics create{prefix}`"
        )


def client_config(settings: KafkaSettings) -> dict[str, Any]:
    """librdkafka properties common to producers, consumers and admin clients."""
    conf: dict[str, Any] = {
        "bootstrap.servers": bootstrap_servers(settings),
        "security.protocol": settings.security_protocol,
        "client.id": settings.client_id,
    }
    optional = {
        "sasl.mechanism": settings.sasl_mechanism,
        "sasl.username": settings.sasl_username,
        "sasl.password": settings.sasl_password,
        "ssl.ca.location": settings.ssl_ca_location,
        "ssl.certificate.location": settings.ssl_certificate_location,
        "ssl.key.location": settings.ssl_key_location,
    }
    conf.update({k: v for k, v in optional.items() if v is not None})
    conf.update(settings.extra)
    return conf


def where(msg: Message) -> str:
    """``topic[partition]@offset`` of a consumed message, for logs and dead letters."""
    return f"{msg.topic()}[{msg.partition()}]@{msg.offset()}"


def partitions_at_end(consumer: Consumer, topic: str, ends: dict[int, int]) -> set[int]:
    """Partitions of ``topic`` whose consumer position has reached ``ends[p]`` (high watermarks taken earlier).

    Use this, not "last offset + 1 == end", to know a read is complete: the last offsets of a transactional topic
    are commit/abort markers that are never delivered, but librdkafka moves the position past them.
    """
    positions = consumer.position([TopicPartition(topic, p) for p in ends])
    return {tp.partition for tp in positions if tp.offset >= ends[tp.partition]}


def assign_from_beginning(
    consumer: Consumer, topic: str, timeout: float = 30.0, *, missing_ok: bool = False
) -> dict[int, int]:
    """Assign every partition of ``topic`` from its beginning; return the end offset (high watermark, as of now) of
    each partition that holds records (an empty or fully expired one has nothing to read to). Partitions are
    assigned by hand: nothing is committed, no group rebalance is involved. A topic that does not exist (yet) is an
    error, or nothing to read with ``missing_ok``."""
    try:
        meta = consumer.list_topics(topic, timeout=timeout).topics[topic]
        if missing_ok and not meta.partitions:
            return {}
        if meta.error is not None or not meta.partitions:
            raise ClawstreamError(f"cannot read {topic}: {meta.error or 'no partitions yet'}")
        partitions = sorted(meta.partitions)
        marks = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=timeout) for p in partitions}
    except KafkaException as exc:
        raise ClawstreamError(f"cannot read {topic}: {exc}") from exc
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
    return {p: high for p, (low, high) in marks.items() if high > low}


def read_to_end(
    consumer: Consumer,
    topic: str,
    ends: dict[int, int],
    *,
    timeout: float | None = 30.0,
    poll_timeout: float = 0.2,
    stop: Callable[[], bool] | None = None,
) -> Iterator[Message]:
    """Yield the records of ``topic`` (already assigned to ``consumer``) until every partition reaches ``ends``.

    Completion is judged by consumer *positions* (:func:`partitions_at_end`), so a transactional topic whose last
    offsets are commit markers still ends. Consumer errors are logged and skipped. Raises :class:`ClawstreamError`
    when ``timeout`` seconds pass first; returns early when ``stop()`` turns true. The caller may stop iterating.
    """
    pending = {p for p, end in ends.items() if end > 0}
    deadline = None if timeout is None else time.monotonic() + timeout
    while pending:
        if stop is not None and stop():
            return
        if deadline is not None and time.monotonic() > deadline:
            left = ", ".join(f"{topic}[{p}]@{ends[p]}" for p in sorted(pending))
            raise ClawstreamError(f"reading {topic} to its end ({left}) took over {timeout:.0f}s")
        msg = consumer.poll(poll_timeout)
        pending -= partitions_at_end(consumer, topic, {p: ends[p] for p in pending})
        if msg is None:
            continue
        if msg.error() is not None:
            log.warning("consumer error on %s: %s", topic, msg.error())
            continue
        yield msg


def produce_reliably(
    producer: Producer,
    topic: str,
    key: bytes | None,
    value: bytes | None,
    *,
    on_delivery: Callable[..., None] | None = None,
    timeout: float = 60.0,
    wait: Callable[[float], object] | None = None,
) -> None:
    """``producer.produce`` that never drops a record: on a full local queue (``BufferError``) wait for deliveries
    and retry, up to ``timeout`` seconds (then :class:`ClawstreamError`). ``wait`` defaults to ``producer.poll``;
    pass ``time.sleep`` when another thread already polls the producer."""
    wait = wait or producer.poll
    deadline = time.monotonic() + timeout
    kwargs = {"on_delivery": on_delivery} if on_delivery is not None else {}
    while True:
        try:
            producer.produce(topic, key=key, value=value, **kwargs)
            return
        except BufferError:
            if time.monotonic() > deadline:
                raise ClawstreamError(f"producer queue for {topic} stayed full for {timeout:.0f}s") from None
            wait(0.05)


def producer_config(settings: KafkaSettings, **overrides: Any) -> dict[str, Any]:
    conf = client_config(settings)
    conf.update(
        {
            "enable.idempotence": True,
            "acks": "all",
            "compression.type": "zstd",
            "linger.ms": 5,
            # Java's (and aiokafka's) key hashing, not librdkafka's CRC32 default: a rollout's calls, events and rewards
            # must land on the same partition number whoever produces them (Faust joins them per partition).
            "partitioner": "murmur2_random",
            "message.max.bytes": MAX_MESSAGE_BYTES + 1024 * 1024,
        }
    )
    conf.update(overrides)
    return conf


def consumer_config(settings: KafkaSettings, group_id: str, **overrides: Any) -> dict[str, Any]:
    conf = client_config(settings)
    conf.update(
        {
            "group.id": group_id,
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
            "fetch.max.bytes": 4 * MAX_MESSAGE_BYTES,
            "max.partition.fetch.bytes": MAX_MESSAGE_BYTES + 1024 * 1024,
        }
    )
    conf.update(overrides)
    return conf


def make_producer(settings: KafkaSettings, **overrides: Any) -> Producer:
    return Producer(producer_config(settings, **overrides))


def make_consumer(settings: KafkaSettings, group_id: str, **overrides: Any) -> Consumer:
    return Consumer(consumer_config(settings, group_id, **overrides))


def make_admin(settings: KafkaSettings) -> AdminClient:
    return AdminClient(client_config(settings))


def create_topics(
    settings: KafkaSettings,
    catalog: Iterable[TopicSpec],
    *,
    partitions: dict[str, int] | None = None,
    timeout: float = 30.0,
) -> dict[str, str]:
    """Create the topics of ``catalog`` (``schemas.topics.CATALOG``: the system's own), with ``settings.topic_prefix``,
    that do not exist yet. Idempotent.

    Replication (:func:`replication`): ``settings.replication_factor``, else min(3, brokers in the cluster), with
    ``min.insync.replicas`` = factor - 1 from 3 replicas on (else 1); a spec's own configs win. Returns
    ``{full topic name: "created" | "exists"}``. Raises :class:`TopicError` when an existing topic's partition count
    breaks a co-partitioned group, or when the broker refuses a creation.
    """
    specs = list(catalog)
    partitions = partitions or {}
    admin = make_admin(settings)
    try:
        meta = admin.list_topics(timeout=timeout)
    except KafkaException as exc:
        raise TopicError(f"cannot list topics on {bootstrap_servers(settings)}: {exc}") from exc
    existing = meta.topics
    wanted = {settings.topic(s.name): s for s in specs}
    missing = [full for full in wanted if full not in existing]
    new: list[NewTopic] = []
    if missing:  # only then: topics that exist need no rule (and a broker may be down meanwhile)
        rule = _replication(settings, len(meta.brokers))
        new = [
            NewTopic(
                full,
                num_partitions=partitions.get(wanted[full].name, wanted[full].partitions),
                replication_factor=rule.factor,
                config={"min.insync.replicas": str(rule.min_insync), **wanted[full].configs},
            )
            for full in missing
        ]
    result = {full: "exists" for full in wanted if full in existing}
    if new:
        futures = admin.create_topics(new, operation_timeout=timeout, request_timeout=timeout)
        for full, future in futures.items():
            try:
                future.result()
                result[full] = "created"
            except KafkaException as exc:
                err = exc.args[0]
                if isinstance(err, KafkaError) and err.code() == KafkaError.TOPIC_ALREADY_EXISTS:
                    result[full] = "exists"  # another process won the race: still idempotent
                else:
                    raise TopicError(f"creating {full} failed: {exc}") from exc
    _check_co_partitioning(admin, settings, specs, timeout)
    return result


def replication(settings: KafkaSettings, timeout: float = 15.0) -> Replication:
    """How the topics clawstream creates on this cluster are replicated: ``settings.replication_factor``, else
    min(3, brokers the cluster lists now) (``clawbase.kafka.topic_spec.replication_for``). Asks the cluster."""
    try:
        brokers = len(make_admin(settings).list_topics(timeout=timeout).brokers)
    except KafkaException as exc:
        raise TopicError(f"cannot list the brokers at {bootstrap_servers(settings)}: {exc}") from exc
    return _replication(settings, brokers)


def _replication(settings: KafkaSettings, brokers: int) -> Replication:
    rule = replication_for(max(brokers, 1), settings.replication_factor)
    if rule.factor > brokers:
        raise TopicError(
            f"replication_factor (CLAWSTREAM_KAFKA_REPLICATION_FACTOR) is {rule.factor} but the cluster at "
            f"{bootstrap_servers(settings)} lists {brokers} broker(s); lower it, or start the missing brokers "
            "(`clawstream kafka up` restarts the dead nodes of a local cluster)"
        )
    return rule


def _check_co_partitioning(admin: AdminClient, settings: KafkaSettings, specs: list[TopicSpec], timeout: float) -> None:
    # Creation returns before every broker's metadata cache knows the topic: wait until all are visible.
    names = {settings.topic(s.name) for s in specs}
    deadline = time.monotonic() + timeout
    topics = admin.list_topics(timeout=timeout).topics
    while not names <= set(topics) and time.monotonic() < deadline:
        time.sleep(0.1)
        topics = admin.list_topics(timeout=timeout).topics
    missing = names - set(topics)
    if missing:
        raise TopicError(f"topics still invisible {timeout:.0f}s after creation: {', '.join(sorted(missing))}")
    for group, members in co_partition_groups(specs).items():
        counts = {settings.topic(s.name): len(topics[settings.topic(s.name)].partitions) for s in members}
        if len(set(counts.values())) > 1:
            detail = ", ".join(f"{t}={n}" for t, n in counts.items())
            raise TopicError(
                f"co-partitioned group '{group}' has different partition counts ({detail}); joins by rollout id "
                "need equal counts: recreate the odd topic or use a fresh --prefix"
            )
