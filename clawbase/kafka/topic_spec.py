"""What a topic is, independent of which topics exist: a spec (name, key, partitions, configs, co-partition group)
and the largest record any topic carries. The catalog of clawstream's own topics is ``schemas.topics``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

# The largest record any clawstream topic carries (a big prefix tree with logprobs); matches the broker recipe.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024


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
