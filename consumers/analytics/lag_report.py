"""Consumer lag (pure, no Kafka): per (group, topic, partition) the committed offset, the end offset and the lag.

Lag is ``end - committed`` in offsets, floored at 0, where ``end`` is the partition's **last stable offset** (what a
``read_committed`` consumer can reach; the Kafka edge, ``consumers/analytics/lag.py``, asks for it) and
``committed`` the group's committed offset: what a restarted member resumes from, not a member's in-memory position.
A partition a member owns with nothing committed has no lag (``None``: printed ``-``, exported as no sample).
On a topic written in transactions a commit marker takes an offset after the last record, so a group that has read
everything of such a topic may show a lag of 1 there (Kafka's own ``kafka-consumer-groups`` shows the same).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

TopicPartitionKey = tuple[str, int]


@dataclass(frozen=True)
class PartitionLag:
    """One partition of one group."""

    group: str
    topic: str
    partition: int
    committed: int | None  # the group's committed offset; None: nothing committed
    end: int  # the last stable offset
    owner: str | None = None  # the client id of the member assigned the partition (a stable group), else None

    @property
    def lag(self) -> int | None:
        return None if self.committed is None else max(0, self.end - self.committed)


@dataclass(frozen=True)
class GroupLag:
    """One consumer group: its state as the broker reports it and its partitions, sorted."""

    group: str
    state: str
    partitions: list[PartitionLag] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(p.lag or 0 for p in self.partitions)


def in_run(topic: str, prefix: str) -> bool:
    """Whether ``topic`` is one of the run's topics (every topic of a run, Faust's own included, starts with its
    prefix; an empty prefix takes every topic but Kafka's internal ones)."""
    return topic.startswith(prefix) and not topic.startswith("__")


def group_lag(
    group: str,
    state: str,
    committed: Mapping[TopicPartitionKey, int],
    owners: Mapping[TopicPartitionKey, str],
    ends: Mapping[TopicPartitionKey, int],
    prefix: str,
) -> GroupLag:
    """A group's rows: every partition of the run's topics it has committed or a member owns, with its end offset."""
    keys = {k for k in (*committed, *owners) if in_run(k[0], prefix) and k in ends}
    rows = [
        PartitionLag(group, topic, part, committed.get((topic, part)), ends[(topic, part)], owners.get((topic, part)))
        for topic, part in sorted(keys)
    ]
    return GroupLag(group, state, rows)


def report_json(groups: Iterable[GroupLag]) -> dict[str, Any]:
    """The JSON of ``clawstream lag --json`` and of the dashboard's ``/api/lag``."""
    return {
        "groups": [
            {
                "group": g.group,
                "state": g.state,
                "total": g.total,
                "partitions": [
                    {
                        "topic": p.topic,
                        "partition": p.partition,
                        "committed": p.committed,
                        "end": p.end,
                        "lag": p.lag,
                        "owner": p.owner,
                    }
                    for p in g.partitions
                ],
            }
            for g in groups
        ]
    }


def format_table(groups: Iterable[GroupLag]) -> str:
    """One line per partition (group, topic, partition, committed, end, lag, owner), a total line per group."""
    head = ("GROUP", "TOPIC", "PART", "COMMITTED", "END", "LAG", "OWNER")
    lines: list[tuple[str, ...]] = [head]
    for g in groups:
        for p in g.partitions:
            lines.append(
                (
                    g.group,
                    p.topic,
                    str(p.partition),
                    "-" if p.committed is None else str(p.committed),
                    str(p.end),
                    "-" if p.lag is None else str(p.lag),
                    p.owner or "-",
                )
            )
        lines.append((g.group, f"total ({g.state})", "", "", "", str(g.total), ""))
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in lines)
