"""Offset bookkeeping for a consumer that runs several requests at once and commits manually.

Each partition's requests start in offset order and finish in any order. The offset that may be committed is the
lowest offset still in flight (everything below it is done), or one past the highest finished offset when nothing is
in flight. A request's offset is marked done only after its terminal events were acknowledged by Kafka, so a
worker that dies mid-rollout leaves that request (and everything after it on its partition) uncommitted: the
group re-delivers it to another worker, which runs it under a new attempt id. Finished requests above an
unfinished one are then read again too; the proxy remembers them as finished, so the worker commits them without
running them again (docs/faults.md#sandbox-worker-rebalances). A revoked partition is forgotten; when it comes back,
the worker starts its offsets again as it reads them. :class:`SeenRequests`: where each request was read, to tell a
duplicate record or a replay from a redelivery, kept on disk (RocksDB, :func:`open_store`). No Kafka import.
"""

from __future__ import annotations

import json
import sys
from collections import OrderedDict
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clawbase.errors import ConfigError
from clawbase.settings import clawstream_home
from producers.sandbox.settings import SandboxSettings

Partition = tuple[str, int]  # (topic, partition)


@dataclass
class _PartitionState:
    in_flight: set[int] = field(default_factory=set)
    highest_done: int = -1
    committed: int = -1  # the last offset handed to commit (next offset to read)


class OffsetTracker:
    def __init__(self) -> None:
        self._parts: dict[Partition, _PartitionState] = {}

    def start(self, tp: Partition, offset: int) -> None:
        state = self._parts.setdefault(tp, _PartitionState())
        state.in_flight.add(offset)

    def done(self, tp: Partition, offset: int) -> None:
        """Mark finished; ignored for a partition this worker no longer owns (revoked meanwhile)."""
        state = self._parts.get(tp)
        if state is None or offset not in state.in_flight:
            return
        state.in_flight.discard(offset)
        state.highest_done = max(state.highest_done, offset)

    def commit_point(self, tp: Partition) -> int | None:
        """The offset to commit for ``tp`` (next to read), or None when nothing new is committable."""
        state = self._parts.get(tp)
        if state is None:
            return None
        point = min(state.in_flight) if state.in_flight else state.highest_done + 1
        return point if point > state.committed and point > 0 else None

    def commit_points(self) -> dict[Partition, int]:
        return {tp: p for tp in self._parts if (p := self.commit_point(tp)) is not None}

    def committed(self, tp: Partition, offset: int) -> None:
        if tp in self._parts:
            self._parts[tp].committed = max(self._parts[tp].committed, offset)

    def forget(self, tps: list[Partition]) -> None:
        for tp in tps:
            self._parts.pop(tp, None)

    def in_flight(self) -> int:
        return sum(len(s.in_flight) for s in self._parts.values())


class SeenRequests:
    """Where each request (rollout id, attempt) was read, for :meth:`check`: a duplicate or stale record is poison,
    the same record read again (a redelivery) is not, unless its offset is below the committed position of its
    partition (:meth:`committed`): everything there is done, so reading it again is a replay (a rewound group).

    Nothing is forgotten: every entry is kept in ``store`` (a RocksDB database on the worker's disk, ~60 bytes an
    entry with its key; a dict in tests) together with the committed positions, so a record replayed after any number
    of others, or after a restart of the worker, is still recognised. The ``limit`` rollout ids read last are also
    kept in memory as one flat tuple of (attempt, topic, partition, offset) fields each (the topic string interned,
    ~250 bytes an entry), so memory stays bounded whatever the store holds.
    """

    WIDTH = 4  # fields per attempt in an entry
    DONE = "\x00committed\x00"  # store key prefix of a partition's committed position (rollout ids hold no NUL)

    def __init__(self, limit: int, store: MutableMapping[str, bytes] | None = None) -> None:
        self.limit = limit  # entries kept in memory too
        self.store: MutableMapping[str, bytes] = {} if store is None else store
        self._seen: OrderedDict[str, tuple[int | str, ...]] = OrderedDict()
        self._done: dict[Partition, int] = {}

    def __len__(self) -> int:
        return len(self._seen)

    def _entry(self, rollout_id: str) -> tuple[int | str, ...]:
        entry = self._seen.get(rollout_id)
        if entry is None:
            data = self.store.get(rollout_id)
            entry = tuple(json.loads(data)) if data else ()
        return entry

    def committed(self, tp: Partition, offset: int) -> None:
        """Everything below ``offset`` on ``tp`` is done (committed by this worker, or by the group as read here)."""
        if offset > self.done(tp):
            self._done[tp] = offset
            self.store[f"{self.DONE}{tp[0]}\x00{tp[1]}"] = str(offset).encode()

    def done(self, tp: Partition) -> int:
        if tp not in self._done:
            data = self.store.get(f"{self.DONE}{tp[0]}\x00{tp[1]}")
            self._done[tp] = int(data) if data else 0
        return self._done[tp]

    def check(self, rollout_id: str, attempt: int, tp: Partition, offset: int) -> str | None:
        """Why ``rollout_id`` attempt ``attempt`` at ``tp@offset`` is a duplicate of a record read here, or a replay of
        a done one, or None (new, or the same record read again: a redelivery). Remembers it otherwise."""
        entry = self._entry(rollout_id)
        where: dict[int, tuple[str, int, int]] = {}
        for i in range(0, len(entry), self.WIDTH):
            a, t, p, o = entry[i : i + self.WIDTH]
            where[int(a)] = (str(t), int(p), int(o))
        if where.get(attempt) == (tp[0], tp[1], offset):
            if offset < (done := self.done(tp)):
                return (
                    f"replay: rollout {rollout_id} attempt {attempt} at {tp[0]}[{tp[1]}]@{offset} is below its "
                    f"partition's committed position {done}: already done"
                )
            return None
        if attempt in where:
            t, p, o = where[attempt]
            return f"duplicate: rollout {rollout_id} attempt {attempt} was already read at {t}[{p}]@{o}"
        newer = max(where, default=-1)
        if newer > attempt:
            t, p, o = where[newer]
            return f"stale: rollout {rollout_id} attempt {attempt} after attempt {newer} (read at {t}[{p}]@{o})"
        entry = (*entry, attempt, sys.intern(tp[0]), tp[1], offset)
        self.store[rollout_id] = json.dumps(entry, separators=(",", ":")).encode()
        self._seen[rollout_id] = entry
        self._seen.move_to_end(rollout_id)
        if len(self._seen) > self.limit:
            self._seen.popitem(last=False)
        return None


def seen_path(settings: SandboxSettings, cluster_id: str | None) -> Path:
    """Where a worker's seen requests live: under ``seen_dir`` (default ``$CLAWSTREAM_HOME/sandbox-seen/<group_id>``),
    one folder per Kafka cluster id. Offsets and committed positions mean something on one cluster only: a store a
    group's workers wrote against another cluster (a fresh local broker, the same topic prefix) would take new
    requests at low offsets for replays and never run them."""
    base = settings.seen_dir or clawstream_home() / "sandbox-seen" / settings.group_id
    return base / f"cluster-{cluster_id or 'unknown'}"


def open_store(path: Path) -> Any:
    """The RocksDB database of a worker's seen requests under ``path``: the first ``slot-N`` no other process holds
    (a restarted worker gets its own back), with small memtables and cache (memory stays ~10 MiB whatever it holds)."""
    import rocksdict

    for slot in range(64):
        opts = rocksdict.Options()
        opts.create_if_missing(True)
        opts.set_write_buffer_size(2 * 1024 * 1024)
        opts.set_max_write_buffer_number(2)
        table = rocksdict.BlockBasedOptions()
        table.set_block_cache(rocksdict.Cache(8 * 1024 * 1024))
        opts.set_block_based_table_factory(table)
        path.mkdir(parents=True, exist_ok=True)
        try:
            return rocksdict.Rdict(str(path / f"slot-{slot}"), opts)
        except Exception as exc:  # noqa: BLE001 - rocksdict raises a bare Exception when the lock is held
            if "lock" not in str(exc).lower():
                raise
    raise ConfigError(f"seen_dir: all 64 slots under {path} are held by running workers; set another seen_dir")
