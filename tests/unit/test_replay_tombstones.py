"""A replay never re-opens what settled: not after ``late_retention_s``, not after any number of other entities.

The pure cores over dicts (the Faust tables in the app), time driven by explicit processing times: a rollout's records
replayed long after it settled are late (no second trajectory); a closed group's trajectories replayed after its
retention are late (no second group); a batched group's envelopes replayed after many more groups were batched are
ignored (no second batch). The worker on a real broker: ``tests/integration/test_streams_replay.py``.
"""

from __future__ import annotations

import pytest

from schemas.events import BatchRecord, BatchRecordKind, Trajectory, TrajectoryStatus
from streams import batch as batch_module
from streams.assemble import Assembler
from streams.batch import Batcher
from streams.group import Grouper
from streams.settings import StreamsSettings
from streams.state import Verdict, is_tombstone
from tests.support.stream_load import SynthRollout, build

CFG = StreamsSettings(
    settle_interval_s=1.0,
    settle_timeout_s=10.0,
    late_retention_s=5.0,
    group_size=2,
    batch_groups=1,
    max_policy_lag=100,
    store="memory://",
)
P = 0
DAY_MS = 86_400_000


def rollout(rid: str, reward: float, fault: str = "", group: str = "suite/t|cc|1") -> SynthRollout:
    fields = {"rollout_id": rid, "group_id": group, "task_id": "suite/t", "harness": "cc", "step": 1}
    return build(SynthRollout(**fields, reward_value=reward, fault=fault, n_calls=2, group_size=2))  # type: ignore[arg-type]


class Streams:
    """Assembler → grouper → batcher over dicts, each record at an explicit processing time."""

    def __init__(self) -> None:
        self.a_state: dict[str, bytes] = {}
        self.a_calls: dict[str, bytes] = {}
        self.a_index: dict[str, bytes] = {}
        self.g_groups: dict[str, bytes] = {}
        self.g_members: dict[str, bytes] = {}
        self.g_index: dict[str, bytes] = {}
        self.b_state: dict[str, bytes] = {}
        self.b_members: dict[str, bytes] = {}
        self.trajectories: list[Trajectory] = []
        self.envelopes: list[BatchRecord] = []
        self.batches: list[BatchRecord] = []
        self.late: list[tuple[Verdict, str]] = []

    def assemble(self, records: list, now: int) -> None:
        core = Assembler(CFG, self.a_state, self.a_calls, self.a_index)
        for _, ev in records:
            res = core.on_record(ev, ev.to_bytes(), P, now)
            self.late += [(res.rejected.verdict, res.rejected.reason)] if res.rejected else []
            self.group(res.trajectories, now)

    def group(self, trajectories: list[Trajectory], now: int) -> None:
        core = Grouper(CFG, self.g_groups, self.g_members, self.g_index)
        for t in trajectories:
            self.trajectories.append(t)
            out = core.on_trajectory(t, t.to_bytes(), P, now)
            self.late += [(out.rejected.verdict, out.rejected.reason)] if out.rejected else []
            self.batch(out.records, now)

    def batch(self, envelopes: list[BatchRecord], now: int) -> None:
        core = Batcher(CFG, self.b_state, self.b_members, "app")
        for rec in envelopes:
            self.envelopes.append(rec)
            self.batches += core.on_envelope(BatchRecord.from_bytes(rec.to_bytes()), rec.to_bytes(), now).records

    def tick(self, now: int) -> None:
        self.group(Assembler(CFG, self.a_state, self.a_calls, self.a_index).on_tick(P, now).trajectories, now)
        out = Grouper(CFG, self.g_groups, self.g_members, self.g_index).on_tick(P, now)
        self.batch(out.records, now)

    def run_group(self, rollouts: list[SynthRollout], now: int) -> int:
        for r in rollouts:
            self.assemble(r.records, now)
        self.tick(now + 2_000)  # quiet period over: settle, group, batch
        return now + 2_000


def seals(records: list[BatchRecord]) -> list[str]:
    return [r.batch_id for r in records if r.kind is BatchRecordKind.SEAL]


def test_a_rollout_replayed_after_its_retention_is_late_not_settled_again() -> None:
    s = Streams()
    pair = [rollout("r-a", 1.0), rollout("r-b", 0.0)]
    t = s.run_group(pair, 0)
    assert len(s.trajectories) == 2 and len(seals(s.batches)) == 1
    s.tick(t + 5_000)  # past late_retention_s: compacted, not forgotten
    assert all(is_tombstone(s.a_state.get(r.rollout_id)) for r in pair)
    assert is_tombstone(s.g_groups.get("suite/t|cc|1"))
    for later in (t + 6_000, t + 30 * DAY_MS):  # a replay right after the window, and a month later
        s.late.clear()
        s.run_group(pair, later)
        assert len(s.trajectories) == 2, "a replayed rollout settled a second time"
        assert len(seals(s.batches)) == 1, "a replayed group was batched a second time"
        assert s.late and all(v is Verdict.LATE for v, _ in s.late), s.late
        assert any("settled as COMPLETE" in why for _, why in s.late), s.late


def test_a_trajectory_replayed_after_its_group_closed_long_ago_is_late() -> None:
    s = Streams()
    t = s.run_group([rollout("r-a", 1.0), rollout("r-b", 0.0)], 0)
    first = list(s.trajectories)
    s.tick(t + 10 * DAY_MS)
    s.group(first, t + 10 * DAY_MS + 1)  # the trajectories topic replayed
    assert len(seals(s.envelopes)) == 1, "a replayed trajectory re-opened its closed group"
    assert [v for v, _ in s.late] == [Verdict.LATE, Verdict.LATE]
    assert "group suite/t|cc|1 closed (complete, 2/2 rollouts, trained)" in s.late[0][1]


def test_an_infrastructure_failure_is_still_reissued_after_its_tombstone() -> None:
    s = Streams()
    failed = rollout("r-a", 1.0, fault="infra")
    t = s.run_group([failed, rollout("r-b", 0.0)], 0)
    s.tick(t + 10 * DAY_MS)  # the failure is a tombstone
    assert is_tombstone(s.a_state.get("r-a"))
    reissue = build(
        SynthRollout(**{**failed.__dict__, "fault": "", "records": [], "late_records": [], "seed": 1})  # type: ignore[arg-type]
    )
    reissue.records = [(topic, _attempt(ev, "r-a-a1", 1)) for topic, ev in reissue.records]
    t = s.run_group([reissue], t + 10 * DAY_MS + 1)
    settled = [x for x in s.trajectories if x.rollout_id == "r-a"]
    assert [x.status for x in settled] == [TrajectoryStatus.INFRA_FAILURE, TrajectoryStatus.COMPLETE]
    s.late.clear()
    s.assemble([rec for rec in failed.records if type(rec[1]).__name__ == "RolloutEvent"], t + 1)
    assert len([x for x in s.trajectories if x.rollout_id == "r-a"]) == 2, "the failed attempt's replay re-opened it"


def _attempt(ev, attempt_id: str, attempt: int):  # noqa: ANN001, ANN202 - a record of the re-issued attempt
    fields = dict(ev.__dict__)
    if "attempt_id" in fields:
        fields["attempt_id"] = attempt_id
    if "attempt" in fields:
        fields["attempt"] = attempt
    return type(ev)(**fields)


def test_a_group_batched_before_many_others_is_not_batched_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batch_module, "RECENT", 3, raising=False)  # a count cap, where there was one
    s = Streams()
    t = s.run_group([rollout("r-0a", 1.0, group="g0"), rollout("r-0b", 0.0, group="g0")], 0)
    g0 = list(s.envelopes)
    for i in range(1, 6):
        t = s.run_group([rollout(f"r-{i}a", 1.0, group=f"g{i}"), rollout(f"r-{i}b", 0.0, group=f"g{i}")], t + 1)
    assert len(seals(s.batches)) == 6
    s.batch(g0, t + 1)  # the scored-groups topic replayed
    assert len(seals(s.batches)) == 6, "a group batched before the cap's worth of others was batched again"
    assert all(len(v) < 40 for v in s.b_members.values()), "a batched group's mark is a few dozen bytes"
