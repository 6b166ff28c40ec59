"""Consumer lag (pure, no Kafka): per (group, topic, partition) the committed offset, the end offset and the lag.

Lag is ``end - committed`` in offsets, floored at 0, where ``end`` is the partition's **last stable offset** (what a
``read_committed`` consumer can reach; the Kafka edge, ``consumers/analytics/lag.py``, asks for it) and
``committed`` the group's committed offset: what a restarted member resumes from, not a member's in-memory position.
A partition a member owns with nothing committed has no lag (``None``: printed ``-``, exported as no sample).
On a topic written in transactions a commit marker takes an offset after the last record (an aborted transaction's
records take offsets too), so offsets overstate what is left to read: a group that committed the offset after its
last record (the learner does) would show a lag of 1 for good, as Kafka's own ``kafka-consumer-groups`` does. So for
a small gap the Kafka edge counts the records a ``read_committed`` reader gets between the two (``records``), and
that count is the lag.
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
    records: int | None = None  # records a read_committed reader gets from committed to end, when counted

    @property
    def lag(self) -> int | None:
        if self.committed is None:
            return None
        return self.records if self.records is not None else max(0, self.end - self.committed)


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
    counted: Mapping[tuple[str, int, int], int] | None = None,
) -> GroupLag:
    """A group's rows: every partition of the run's topics it has committed or a member owns, with its end offset;
    ``counted``: (topic, partition, from offset) → the records a read_committed reader gets from there to the end."""
    keys = {k for k in (*committed, *owners) if in_run(k[0], prefix) and k in ends}
    counted = counted or {}
    rows = []
    for topic, part in sorted(keys):
        at = committed.get((topic, part))
        records = counted.get((topic, part, at)) if at is not None else None
        rows.append(PartitionLag(group, topic, part, at, ends[(topic, part)], owners.get((topic, part)), records))
    return GroupLag(group, state, rows)


def gaps_to_count(
    committed: Mapping[TopicPartitionKey, int], ends: Mapping[TopicPartitionKey, int], most: int
) -> set[tuple[str, int, int]]:
    """(topic, partition, committed) of the gaps worth counting record by record: 1 to ``most`` offsets."""
    return {(t, p, at) for (t, p), at in committed.items() if (t, p) in ends and 0 < ends[(t, p)] - at <= most}


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
