"""What a topic is, independent of which topics exist: a spec (name, key, partitions, configs, co-partition group),
the largest record any topic carries, and how many replicas a cluster of N brokers gives each topic
(:func:`replication_for`: the one rule the topic creation, the local cluster recipe and the Faust app share).
The catalog of clawstream's own topics is ``schemas.topics``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from clawbase.errors import ConfigError

# The largest record any clawstream topic carries (a big prefix tree with logprobs); matches the broker recipe.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
# More replicas than 3 buy no safety a development or CI cluster needs, and cost a copy of every write each.
MAX_REPLICATION = 3


@dataclass(frozen=True)
class Replication:
    """How a topic is replicated: ``factor`` copies; an ``acks=all`` write needs ``min_insync`` of them."""

    factor: int
    min_insync: int


def replication_for(brokers: int, factor: int | None = None) -> Replication:
    """The replication of every topic on a cluster of ``brokers`` brokers: ``factor`` copies if given, else
    min(3, brokers); from 3 copies on a write needs all but one in sync — one broker may die without stopping writes
    or losing an acknowledged record. Below 3 copies min ISR is 1: with 2 of 2 required, losing either broker would
    stop every write."""
    if brokers < 1:
        raise ConfigError(f"a Kafka cluster has at least one broker, got brokers={brokers}; pass 1 or more")
    factor = min(MAX_REPLICATION, brokers) if factor is None else factor
    return Replication(factor, factor - 1 if factor >= 3 else 1)


@dataclass(frozen=True)
class TopicSpec:
    """One topic (``name`` without prefix)."""

    name: str
    key: str
    value_schema: str
    partitions: int
    configs: dict[str, str] = field(default_factory=dict)
    co_partition_group: str | None = None
    description: str = ""


def co_partition_groups(specs: Iterable[TopicSpec]) -> dict[str, list[TopicSpec]]:
    """The specs of each co-partition group (topics joined by key must have equal partition counts)."""
    groups: dict[str, list[TopicSpec]] = {}
    for spec in specs:
        if spec.co_partition_group:
            groups.setdefault(spec.co_partition_group, []).append(spec)
    return groups
