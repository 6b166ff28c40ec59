"""Unit tests of streams.batch: quotas toward the harness mix, seeded mixing, staleness, seals, replays."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from schemas.events import BatchRecord, BatchRecordKind
from streams.batch import Batcher, BatchOutput, apportion, select
from streams.settings import StreamsSettings
from streams.state import is_tombstone

CFG = StreamsSettings(
    batch_groups=4, harness_mix={"cc": 0.5, "oc": 0.5}, max_policy_lag=2, mix_seed=7, store="memory://"
)


def live(members: dict[str, bytes]) -> dict[str, bytes]:
    """The envelopes waiting for a batch (without the tombstones of batched or dropped groups)."""
    return {k: v for k, v in members.items() if not is_tombstone(v)}


def group(gid: str, harness: str, n: int = 2, version: int = 5) -> list[BatchRecord]:
    recs = [
        BatchRecord(
            batch_id=gid,
            policy_version=version,
            timestamp_ms=0,
            kind=BatchRecordKind.TRAJECTORY,
            step=3,
            index=i,
            rollout_id=f"{gid}-r{i}",
            group_id=gid,
            harness=harness,
            advantage=float(i) - 0.5,
            reward=float(i),
            trajectory=b"traj-" + gid.encode() + bytes([i]),
        )
        for i in range(n)
    ]
    recs.append(
        BatchRecord(
            batch_id=gid,
            policy_version=version,
            timestamp_ms=0,
            kind=BatchRecordKind.SEAL,
            step=3,
            index=n,
            group_id=gid,
            harness=harness,
            harness_counts={harness: n},
        )
    )
    return recs


class Rig:
    def __init__(self, cfg: StreamsSettings = CFG) -> None:
        self.state: dict[str, bytes] = {}
        self.members: dict[str, bytes] = {}
        self.cfg = cfg
        self.out = BatchOutput()

    def core(self) -> Batcher:
        return Batcher(self.cfg, self.state, self.members, "app")

    def feed(self, *groups: list[BatchRecord]) -> None:
        for recs in groups:
            for rec in recs:
                self._take(self.core().on_envelope(rec, rec.to_bytes(), 1000))

    def weights(self, version: int) -> None:
        self._take(self.core().on_weights(version, 1000))

    def _take(self, out: BatchOutput) -> None:
        self.out.records += out.records
        self.out.dropped += out.dropped

    def batches(self) -> list[list[BatchRecord]]:
        result: dict[str, list[BatchRecord]] = {}
        for rec in self.out.records:
            result.setdefault(rec.batch_id, []).append(rec)
        return list(result.values())


def test_apportion_follows_weights_and_caps() -> None:
    rng = random.Random(0)
    assert apportion(4, {"a": 1, "b": 1}, {"a": 9, "b": 9}, rng) == {"a": 2, "b": 2}
    assert apportion(4, {"a": 3, "b": 1}, {"a": 9, "b": 9}, rng) == {"a": 3, "b": 1}
    assert apportion(4, {"a": 1, "b": 1}, {"a": 1, "b": 9}, rng) == {"a": 1, "b": 3}  # a's shortfall goes to b
    assert apportion(4, {"a": 1}, {"a": 1, "c": 5}, rng) == {"a": 1, "c": 3}  # unweighted c only fills shortfalls
    assert apportion(4, {"a": 1, "b": 1}, {"a": 1, "b": 1}, rng) == {"a": 1, "b": 1}  # not enough groups at all
    seen = Counter(
        tuple(sorted(apportion(3, {"a": 1, "b": 1}, {"a": 5, "b": 5}, random.Random(s)).items())) for s in range(200)
    )
    assert set(seen) == {(("a", 2), ("b", 1)), (("a", 1), ("b", 2))}  # the odd slot goes either way, at random
    for s in range(300):
        r = random.Random(s)
        caps = {h: r.randrange(0, 6) for h in "abc"}
        weights = {h: r.random() for h in "ab"}
        quota = apportion(5, weights, caps, r)
        assert sum(quota.values()) == min(5, sum(caps.values())) and all(quota[h] <= caps[h] for h in quota)


def test_select_takes_oldest_per_harness_and_is_seeded() -> None:
    pending = [{"harness": h} for h in ["cc", "cc", "cc", "oc", "cc", "oc", "oc"]]
    chosen = select(pending, 4, {"cc": 1, "oc": 1}, random.Random("s"))
    assert chosen is not None and sorted(chosen) == [0, 1, 3, 5]
    assert select(pending[:3], 4, {}, random.Random("s")) is None
    assert chosen == select(pending, 4, {"cc": 1, "oc": 1}, random.Random("s"))
    orders = {tuple(select(pending, 4, {"cc": 1, "oc": 1}, random.Random(s)) or ()) for s in range(50)}
    assert len(orders) > 1  # the batch order is shuffled


def test_batches_wait_for_the_mix_quota_then_seal() -> None:
    rig = Rig()
    rig.feed(group("g0", "cc"), group("g1", "cc"), group("g2", "cc"), group("g3", "oc"), group("g4", "cc"))
    assert rig.out.records == []  # 5 groups wait, but the 50/50 quota needs 2 of each harness
    rig.feed(group("g5", "oc"))
    rig.feed(group("g6", "oc"), group("g7", "cc"), group("g8", "oc"))
    b0, b1 = rig.batches()
    assert {r.group_id for r in b0[:-1]} == {"g0", "g1", "g3", "g5"}  # oldest first within a harness
    assert {r.group_id for r in b1[:-1]} == {"g2", "g4", "g6", "g8"}
    for n, batch in enumerate((b0, b1)):
        *trajs, seal = batch
        assert seal.kind is BatchRecordKind.SEAL and seal.batch_id == f"app-{n:06d}" and seal.step == n
        assert [r.index for r in trajs] == list(range(8)) and seal.index == 8
        assert seal.harness_counts == {"cc": 4, "oc": 4} == dict(Counter(r.harness for r in trajs))
        assert all(r.kind is BatchRecordKind.TRAJECTORY and r.step == n and r.trajectory for r in trajs)
        for gid in {r.group_id for r in trajs}:  # a group's rollouts stay together, in order
            idx = [i for i, r in enumerate(trajs) if r.group_id == gid]
            assert idx == list(range(idx[0], idx[0] + 2)) and trajs[idx[0]].rollout_id == f"{gid}-r0"
            assert trajs[idx[0]].trajectory == b"traj-" + gid.encode() + b"\x00"
    assert [r.group_id for r in b0[:-1]] != sorted(r.group_id for r in b0[:-1]) or [
        r.group_id for r in b1[:-1]
    ] != sorted(r.group_id for r in b1[:-1])  # shuffled, not in arrival order
    assert set(live(rig.members)) == {"g7\x000", "g7\x001"}  # g7 (cc) still waits for an oc partner


def test_a_backlog_forms_a_batch_off_ratio() -> None:
    rig = Rig()
    rig.feed(*(group(f"c{i}", "cc") for i in range(7)))
    assert rig.out.records == []
    rig.feed(group("c7", "cc"))  # 2·G groups wait: no oc in sight, so train on cc alone
    [b0] = rig.batches()
    assert b0[-1].harness_counts == {"cc": 8} and {r.group_id for r in b0[:-1]} == {"c0", "c1", "c2", "c3"}


def test_without_a_mix_batches_form_at_g() -> None:
    rig = Rig(CFG.model_copy(update={"harness_mix": {}}))
    rig.feed(group("c0", "cc"), group("c1", "cc"), group("c2", "cc"), group("o0", "oc"))
    [b0] = rig.batches()
    assert b0[-1].harness_counts == {"cc": 6, "oc": 2}


def test_ratio_quota() -> None:
    rig = Rig(CFG.model_copy(update={"harness_mix": {"cc": 0.75, "oc": 0.25}}))
    rig.feed(*(group(f"o{i}", "oc") for i in range(3)))
    rig.feed(*(group(f"c{i}", "cc") for i in range(6)))
    assert [b[-1].harness_counts for b in rig.batches()] == [{"cc": 6, "oc": 2}, {"cc": 6, "oc": 2}]


def test_stale_groups_are_dropped() -> None:
    rig = Rig()
    rig.weights(9)
    rig.feed(group("old", "cc", version=6), group("ok", "cc", version=7))
    assert [gid for gid, _ in rig.out.dropped] == ["old"]
    assert rig.out.dropped[0][1] == "stale group old: policy version 6, newest 9, lag bound 2"
    rig.weights(10)  # now "ok" (version 7) is 3 behind
    assert [gid for gid, _ in rig.out.dropped] == ["old", "ok"] and live(rig.members) == {}
    rig.weights(4)  # an older version changes nothing
    assert len(rig.out.dropped) == 2


def test_seal_count_mismatch_and_replays() -> None:
    rig = Rig()
    broken = group("b", "cc", n=3)
    rig.feed(broken[:1] + broken[2:])  # one envelope lost
    assert rig.out.dropped[0][0] == "b" and "SEAL announces 3 records, 2 arrived" in rig.out.dropped[0][1]
    rig.feed(group("g0", "cc"), group("g1", "oc"), group("g2", "cc"), group("g3", "oc"))
    n = len(rig.out.records)
    rig.feed(group("g0", "cc"))  # replayed after batching: ignored
    assert len(rig.out.records) == n and live(rig.members) == {}


@pytest.mark.parametrize("split", [1, 5, 13])
def test_a_restarted_batcher_forms_the_same_batches(split: int) -> None:
    feed = [rec for i in range(8) for rec in group(f"g{i}", "cc" if i % 3 else "oc")]
    one = Rig()
    one.feed(feed)
    two = Rig()
    two.feed(feed[:split])
    restarted = Rig()
    restarted.state, restarted.members, restarted.out = dict(two.state), dict(two.members), two.out
    restarted.feed(feed[split:])
    key = [(r.batch_id, r.rollout_id, r.index) for r in one.out.records]
    assert key == [(r.batch_id, r.rollout_id, r.index) for r in restarted.out.records]


@pytest.mark.parametrize("split", [1, 3, 7, 13, 20])
def test_replaying_records_onto_the_state_that_already_holds_them_changes_nothing(split: int) -> None:
    """An exactly-once gap replays records since the last commit on top of tables that hold them (#28): envelopes
    replayed before their SEAL, a SEAL replayed while its group is pending, a batched group replayed. The batches
    are exactly those of a run without the replay, nothing is dropped, nothing raises."""
    feed = [rec for i in range(8) for rec in group(f"g{i}", "cc" if i % 3 else "oc")]
    once = Rig()
    once.feed(feed)
    replayed = Rig()
    replayed.feed(feed[:split])
    replayed.feed(feed[max(0, split - 6) :])  # the last six records again, then the rest
    key = [(r.batch_id, r.rollout_id, r.index, r.kind) for r in once.out.records]
    assert [(r.batch_id, r.rollout_id, r.index, r.kind) for r in replayed.out.records] == key
    assert replayed.out.dropped == [] and replayed.members == once.members


def test_a_group_whose_records_vanished_is_dropped_not_raised() -> None:
    rig = Rig()
    rig.feed(group("g0", "cc"), group("g1", "oc"), group("g2", "cc"))
    rig.members.pop(next(iter(rig.members)))  # an inconsistent table (a lost changelog record, say)
    rig.feed(group("g3", "oc"), group("g4", "oc"), group("g5", "cc"))
    assert [gid for gid, why in rig.out.dropped if "records missing" in why] == ["g0"]
    assert len(rig.batches()) == 1  # g1..g4 formed the batch; g5 waits
