"""Batcher: scored GRPO groups → training batches of G groups, harnesses mixed at random toward configured ratios.

Topics in: the app's internal ``scored-groups`` topic (one partition: BatchRecord envelopes + a SEAL per group, from
``streams.group``) and ``clawstream.weights`` (the newest policy version, for staleness). Out: ``clawstream.batches``
(key = batch id; the batch's TRAJECTORY records, then one SEAL with ``harness_counts``) and ``clawstream.deadletter``
(stale groups). The Faust agent lives in ``streams.app`` (run ``python -m streams.app worker``); this module is the
pure core: no Kafka, no Faust.

Rules. A group becomes available when its SEAL arrived (with all its records). A group is stale — dropped, with a
dead letter — when its oldest policy version is more than ``max_policy_lag`` behind the newest published weights
(checked when groups arrive and when weights move). Batch ``n`` draws from ``random.Random(f"{mix_seed}:{n}")``, so a
restarted worker mixes exactly as the crashed one would have. With a ``harness_mix``, each mixed harness has a quota of
the G slots in proportion to its weight (largest remainder, the odd slots drawn at random); the batch forms as soon
as every harness has its quota available — or, so that a silent harness cannot stall training, once 2·G groups wait,
in which case the shortfall goes to the other harnesses (∝ weight, then ∝ backlog for harnesses outside the mix).
Without a mix, a batch forms as soon as G groups wait, slots shared evenly among the harnesses present. Within a
harness the oldest groups go first; the chosen groups are shuffled (a group's rollouts stay together). Batch ids are
``{app id}-{n:06d}`` and the batch's ``step`` is ``n``.

State layout (key → bytes maps, Faust tables in the app): ``state["batcher"]`` the JSON :class:`BatcherState`,
``members[group_id + NUL + index]`` the envelopes of groups not yet batched, ``members[group_id]`` the tombstone of a
batched or dropped group (~30 bytes, kept for good in the changelogged table). Idempotent under replay: an envelope
counts once, a record of a pending, batched or dropped group is ignored however long ago and however many groups ago
it was batched.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from schemas.events import BatchRecord, BatchRecordKind
from streams.settings import StreamsSettings
from streams.state import TOMBSTONE, is_tombstone

log = logging.getLogger(__name__)
STATE_KEY = "batcher"


def apportion(
    slots: int, weights: Mapping[str, float], capacity: Mapping[str, int], rng: random.Random
) -> dict[str, int]:
    """Split ``slots`` among harnesses ∝ ``weights`` (largest remainder, random ties), each capped by ``capacity``.

    Slots a capped harness cannot take go to the others ∝ their weight, then — when no weighted harness has room
    left — to harnesses without weight ∝ their capacity. Returns harness → count, summing to min(slots, Σ capacity).
    """
    quota = {h: 0 for h in capacity}
    left = min(slots, sum(capacity.values()))
    while left > 0:
        room = {h: capacity[h] - quota[h] for h in capacity if capacity[h] > quota[h]}
        w = {h: weights.get(h, 0.0) for h in room if weights.get(h, 0.0) > 0}
        if not w:  # only unweighted harnesses have room: share by backlog
            w = {h: float(room[h]) for h in room}
        total = sum(w.values())
        exact = {h: left * w[h] / total for h in w}
        give = {h: min(int(exact[h]), room[h]) for h in w}
        rest = left - sum(give.values())
        order = sorted(w, key=lambda h: (-(exact[h] - int(exact[h])), rng.random()))
        for h in order:
            if rest == 0:
                break
            if give[h] < room[h]:
                give[h] += 1
                rest -= 1
        for h, n in give.items():
            quota[h] += n
        taken = sum(give.values())
        if taken == 0:  # cannot happen with room > 0, but never loop forever
            break
        left -= taken
    return {h: n for h, n in quota.items() if n}


def select(
    pending: Sequence[Mapping[str, Any]], slots: int, mix: Mapping[str, float], rng: random.Random
) -> list[int] | None:
    """Indices into ``pending`` (oldest first) of the groups of the next batch, in batch order; None: wait."""
    if len(pending) < slots:
        return None
    by_harness: dict[str, list[int]] = {}
    for i, g in enumerate(pending):
        by_harness.setdefault(g["harness"], []).append(i)
    capacity = {h: len(ix) for h, ix in sorted(by_harness.items())}
    if mix:
        ideal = apportion(slots, mix, {h: slots for h in sorted(mix) if mix[h] > 0}, rng)
        if all(capacity.get(h, 0) >= n for h, n in ideal.items()):
            quota = ideal
        elif len(pending) >= 2 * slots:  # backlog: a harness is missing, do not stall training for it
            quota = apportion(slots, mix, capacity, rng)
        else:
            return None
    else:
        quota = apportion(slots, {h: 1.0 for h in capacity}, capacity, rng)
    chosen = [i for h, n in sorted(quota.items()) for i in by_harness[h][:n]]
    rng.shuffle(chosen)
    return chosen


@dataclass
class BatcherState:
    newest_version: int | None = None
    next_batch: int = 0
    pending: list[dict[str, Any]] = field(default_factory=list)  # sealed groups, oldest first
    open: dict[str, int] = field(default_factory=dict)  # group id → envelopes received before its SEAL
    recent: list[str] = field(default_factory=list)  # older workers' batched or dropped group ids: made tombstones

    def to_bytes(self) -> bytes:
        # Fields hold plain JSON values: dump them as they are (dataclasses.asdict deep-copies, half the core time).
        return json.dumps(self.__dict__, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes | None) -> BatcherState:
        return cls(**json.loads(data)) if data else cls()

    def stale(self, group: Mapping[str, Any], lag: int) -> bool:
        return self.newest_version is not None and self.newest_version - group["policy_version"] > lag


@dataclass
class BatchOutput:
    records: list[BatchRecord] = field(default_factory=list)  # TRAJECTORY records then SEAL, per formed batch
    dropped: list[tuple[str, str]] = field(default_factory=list)  # (group id, reason)


def member_key(group_id: str, index: int) -> str:
    return f"{group_id}\x00{index}"


def done_tombstone(what: str, where: str) -> bytes:
    """A batched or dropped group's mark: what became of it and where (its batch id, or the drop reason's start)."""
    return TOMBSTONE + json.dumps([what, where], separators=(",", ":")).encode()


class Batcher:
    """The batcher over two key → bytes maps (Faust tables in the app, dicts in tests); pure."""

    def __init__(
        self,
        cfg: StreamsSettings,
        state: MutableMapping[str, bytes],
        members: MutableMapping[str, bytes],
        batch_prefix: str,
    ) -> None:
        self.cfg, self.state, self.members, self.prefix = cfg, state, members, batch_prefix

    def _load(self) -> BatcherState:
        st = BatcherState.from_bytes(self.state.get(STATE_KEY))
        for gid in st.recent:  # state written before tombstones: its remembered groups become tombstones
            if gid not in self.members:
                self.members[gid] = done_tombstone("batched or dropped", "")
        st.recent = []
        return st

    def on_envelope(self, rec: BatchRecord, raw: bytes, now_ms: int) -> BatchOutput:
        """One record of the scored-groups topic (a group's TRAJECTORY envelope or its SEAL)."""
        st, out = self._load(), BatchOutput()
        gid = rec.group_id or rec.batch_id
        if is_tombstone(done := self.members.get(gid)):
            what, where = json.loads(done[1:])  # type: ignore[index]
            log.info("group %s was already %s %s; replayed %s record ignored", gid, what, where, rec.kind.value)
            return out
        if any(g["group_id"] == gid for g in st.pending):
            # Sealed and waiting for a batch: a replayed envelope or SEAL changes nothing (a second SEAL appended the
            # group twice, and forming the batch then failed for good on its members, popped the first time).
            log.info("group %s is already pending; replayed %s record ignored", gid, rec.kind.value)
            return out
        if rec.kind is BatchRecordKind.TRAJECTORY:
            key = member_key(gid, rec.index)
            if key not in self.members:  # counted once however often it is replayed before its SEAL
                st.open[gid] = st.open.get(gid, 0) + 1
            self.members[key] = raw
        else:
            got = st.open.pop(gid, 0)
            group = {
                "group_id": gid,
                "harness": rec.harness or "",
                "step": rec.step,
                "size": rec.index,
                "policy_version": rec.policy_version,
                "arrived_ms": now_ms,
            }
            if got != rec.index:
                self._drop(st, group, f"group {gid}: SEAL announces {rec.index} records, {got} arrived", out)
            elif st.stale(group, self.cfg.max_policy_lag):
                self._drop(st, group, self._stale_reason(st, group), out)
            else:
                st.pending.append(group)
            self._form(st, now_ms, out)
        self.state[STATE_KEY] = st.to_bytes()
        return out

    def on_weights(self, version: int, now_ms: int) -> BatchOutput:
        """A new policy version was published: drop groups that became stale."""
        st, out = self._load(), BatchOutput()
        if st.newest_version is not None and version <= st.newest_version:
            return out
        st.newest_version = version
        for group in [g for g in st.pending if st.stale(g, self.cfg.max_policy_lag)]:
            st.pending.remove(group)
            self._drop(st, group, self._stale_reason(st, group), out)
        self.state[STATE_KEY] = st.to_bytes()
        return out

    def _stale_reason(self, st: BatcherState, group: Mapping[str, Any]) -> str:
        return (
            f"stale group {group['group_id']}: policy version {group['policy_version']}, newest "
            f"{st.newest_version}, lag bound {self.cfg.max_policy_lag}"
        )

    def _remember(self, gid: str, what: str, where: str) -> None:
        self.members[gid] = done_tombstone(what, where)

    def _drop(self, st: BatcherState, group: Mapping[str, Any], reason: str, out: BatchOutput) -> None:
        for i in range(group["size"]):
            self.members.pop(member_key(group["group_id"], i), None)
        self._remember(group["group_id"], "dropped", reason[:60])
        out.dropped.append((group["group_id"], reason))
        log.warning("%s", reason)

    def _form(self, st: BatcherState, now_ms: int, out: BatchOutput) -> None:
        while True:
            n = st.next_batch
            rng = random.Random(f"{self.cfg.mix_seed}:{n}")
            chosen = select(st.pending, self.cfg.batch_groups, self.cfg.harness_mix, rng)
            if chosen is None:
                return
            groups = [st.pending[i] for i in chosen]
            batch_id = f"{self.prefix}-{n:06d}"
            counts: dict[str, int] = {}
            missing = [
                g for g in groups if any(member_key(g["group_id"], i) not in self.members for i in range(g["size"]))
            ]
            if missing:  # never raise here: a group whose records are gone is dropped with the reason, the rest go on
                for group in missing:
                    st.pending.remove(group)
                    self._drop(st, group, f"group {group['group_id']}: records missing when forming a batch", out)
                continue
            for group in groups:
                for i in range(group["size"]):
                    raw = self.members.pop(member_key(group["group_id"], i))
                    rec = BatchRecord.from_bytes(raw)
                    rec.batch_id, rec.step, rec.index, rec.timestamp_ms = batch_id, n, sum(counts.values()), now_ms
                    out.records.append(rec)
                    counts[rec.harness or ""] = counts.get(rec.harness or "", 0) + 1
                self._remember(group["group_id"], "batched in", batch_id)
            out.records.append(
                BatchRecord(
                    batch_id=batch_id,
                    policy_version=st.newest_version
                    if st.newest_version is not None
                    else max(g["policy_version"] for g in groups),
                    timestamp_ms=now_ms,
                    kind=BatchRecordKind.SEAL,
                    step=n,
                    index=sum(counts.values()),
                    harness_counts=counts,
                )
            )
            st.pending = [g for i, g in enumerate(st.pending) if i not in set(chosen)]
            st.next_batch = n + 1
            log.info(
                "batch %s: %d groups, %d trajectories, harnesses %s",
                batch_id,
                len(groups),
                sum(counts.values()),
                counts,
            )
