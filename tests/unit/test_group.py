"""Unit tests of streams.group: closing rules, GRPO advantages, infra exclusion, zero variance, late records."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from schemas.events import BatchRecord, BatchRecordKind, Trajectory, TrajectoryStatus
from streams.group import Emission, Grouper, advantages, expected_size
from streams.settings import StreamsSettings
from streams.state import Verdict
from tests.support.factories import sample_trajectory

CFG = StreamsSettings(
    group_size=4, group_timeout_s=30.0, settle_timeout_s=10.0, late_retention_s=100.0, store="memory://"
)
GID = "suite/t1|openclaw|3"


def traj(
    i: int, reward: float | None, status: TrajectoryStatus = TrajectoryStatus.COMPLETE, **kw: object
) -> Trajectory:
    fields: dict[str, object] = {
        "group_id": GID,
        "harness": "openclaw",
        "step": 3,
        "status": status,
        "reward": reward,
        "attempt_id": f"a-{i}",
        "policy_version": 10 + i,
        "metadata": {},
    }
    if status not in (TrajectoryStatus.COMPLETE, TrajectoryStatus.TIMED_OUT):
        fields["segments"] = []
    return replace(sample_trajectory(f"r-{i}"), **(fields | kw))  # type: ignore[arg-type]


class Rig:
    def __init__(self, cfg: StreamsSettings = CFG) -> None:
        self.groups: dict[str, bytes] = {}
        self.members: dict[str, bytes] = {}
        self.index: dict[str, bytes] = {}
        self.cfg = cfg
        self.emitted = Emission()
        self.rejected: list[tuple[Verdict, str]] = []

    def feed(self, ts: list[Trajectory], now: int = 0) -> None:
        for t in ts:
            out = Grouper(self.cfg, self.groups, self.members, self.index).on_trajectory(t, t.to_bytes(), 1, now)
            self._take(out)

    def tick(self, now: int) -> None:
        self._take(Grouper(self.cfg, self.groups, self.members, self.index).on_tick(1, now))

    def _take(self, out: Emission) -> None:
        self.emitted.records += out.records
        self.emitted.metrics += out.metrics
        if out.rejected:
            self.rejected.append((out.rejected.verdict, out.rejected.reason))

    def advantages(self) -> dict[str, float]:
        return {r.rollout_id: r.advantage for r in self.emitted.records if r.kind is BatchRecordKind.TRAJECTORY}  # type: ignore[misc]


def manual(rewards: list[float], eps: float = 1e-6) -> list[float]:
    mu = sum(rewards) / len(rewards)
    sigma = math.sqrt(sum((r - mu) ** 2 for r in rewards) / len(rewards))
    return [(r - mu) / (sigma + eps) for r in rewards]


def test_advantages_formula() -> None:
    adv, mu, sigma = advantages([1.0, 0.0, 0.5, 1.0], 1e-6)
    assert adv == pytest.approx(manual([1.0, 0.0, 0.5, 1.0])) and mu == 0.625 and sigma == pytest.approx(0.4145, 1e-3)
    assert sum(adv) == pytest.approx(0.0, abs=1e-9)


def test_full_group_closes_with_grpo_advantages_and_a_seal() -> None:
    rig = Rig()
    rewards = [1.0, 0.0, 0.5, 1.0]
    rig.feed([traj(i, r) for i, r in enumerate(rewards[:3])])
    assert rig.emitted.records == []  # 3/4: still open
    rig.feed([traj(3, rewards[3])])
    recs = rig.emitted.records
    assert [r.kind for r in recs] == [BatchRecordKind.TRAJECTORY] * 4 + [BatchRecordKind.SEAL]
    assert rig.advantages() == pytest.approx(dict(zip([f"r-{i}" for i in range(4)], manual(rewards), strict=True)))
    assert [r.index for r in recs] == [0, 1, 2, 3, 4] and {r.batch_id for r in recs} == {GID}
    seal = recs[-1]
    assert seal.harness_counts == {"openclaw": 4} and seal.policy_version == 10 and seal.step == 3
    first = recs[0]
    assert first.trajectory is not None and Trajectory.from_bytes(first.trajectory).rollout_id == first.rollout_id
    assert first.reward == 1.0 and first.harness == "openclaw" and first.policy_version == 10
    [metric] = rig.emitted.metrics
    assert metric.labels["outcome"] == "trained" and metric.labels["closed_by"] == "complete"
    assert metric.values["reward_mean"] == 0.625 and metric.values["trained"] == 4
    assert rig.members == {}  # bytes freed once emitted


def test_infra_failures_count_for_closing_but_not_in_statistics_or_training() -> None:
    rig = Rig()
    rig.feed([traj(0, 1.0), traj(1, None, TrajectoryStatus.INFRA_FAILURE), traj(2, 0.0), traj(3, 0.5)])
    adv = rig.advantages()
    assert set(adv) == {"r-0", "r-2", "r-3"}
    assert list(adv.values()) == pytest.approx(manual([1.0, 0.0, 0.5]))
    assert rig.emitted.metrics[0].values["infra"] == 1 and rig.emitted.metrics[0].values["scored"] == 3


def test_incomplete_rollouts_count_in_statistics_only_and_capped_ones_not_at_all() -> None:
    rig = Rig()
    rig.feed(
        [
            traj(0, 1.0),
            traj(1, 0.0, TrajectoryStatus.DROPPED, drop_reason="branch leaf count 70 > cap 64"),
            traj(2, 0.0, TrajectoryStatus.INCOMPLETE),
            traj(3, 0.0, TrajectoryStatus.TIMED_OUT),
        ]
    )
    adv = rig.advantages()
    assert set(adv) == {"r-0", "r-3"}
    stats = manual([1.0, 0.0, 0.0])  # r-0, r-2 (incomplete, graded), r-3; the capped r-1 is not a sample
    assert adv["r-0"] == pytest.approx(stats[0]) and adv["r-3"] == pytest.approx(stats[2])
    assert rig.emitted.metrics[0].values["scored"] == 3


@pytest.mark.parametrize("policy", ["drop", "keep"])
def test_zero_variance_groups(policy: str) -> None:
    rig = Rig(CFG.model_copy(update={"zero_variance": policy}))
    rig.feed([traj(i, 1.0) for i in range(3)] + [traj(3, None, TrajectoryStatus.INFRA_FAILURE)])
    if policy == "drop":
        assert rig.emitted.records == []
        assert rig.emitted.metrics[0].labels["outcome"] == "zero_variance_dropped"
    else:
        assert rig.advantages() == {"r-0": 0.0, "r-1": 0.0, "r-2": 0.0}
        assert rig.emitted.records[-1].harness_counts == {"openclaw": 3}


def test_group_size_comes_from_metadata_with_the_setting_as_fallback() -> None:
    assert expected_size(traj(0, 1.0, metadata={"group_size": "2"}), 8) == 2
    assert expected_size(traj(0, 1.0, metadata={"group_size": "x"}), 8) == 8
    assert expected_size(traj(0, 1.0), 8) == 8
    rig = Rig()
    rig.feed([traj(0, 1.0, metadata={"group_size": "2"}), traj(1, 0.0, metadata={"group_size": "2"})])
    assert len(rig.advantages()) == 2


def test_a_group_missing_rollouts_closes_at_the_timeout() -> None:
    rig = Rig()
    rig.feed([traj(0, 1.0), traj(1, 0.0)], now=1000)
    rig.tick(1000 + 29_999)
    assert rig.emitted.records == []
    rig.tick(1000 + 30_000)
    assert list(rig.advantages().values()) == pytest.approx(manual([1.0, 0.0]))
    assert rig.emitted.metrics[0].labels["closed_by"] == "timeout"
    rig.feed([traj(2, 0.5)], now=40_000)  # late: the group is closed
    assert rig.rejected[0][0] is Verdict.LATE and "group suite/t1|openclaw|3 closed (timeout, 2/4" in rig.rejected[0][1]
    rig.tick(31_000 + 100_000)  # compacted to its tombstone after late_retention_s
    assert rig.groups == {"suite/t1|openclaw|3": b'~["timeout","trained",31000,2,4]'}


def test_after_a_restart_a_group_waits_for_its_members_to_settle() -> None:
    rig = Rig(CFG.model_copy(update={"settle_timeout_s": 10.0}))
    rig.feed([traj(0, 1.0)], now=0)
    since = 100_000  # the worker came back long after the group's timeout
    rig._take(Grouper(rig.cfg, rig.groups, rig.members, rig.index).on_tick(1, since + 9_999, since))
    assert rig.emitted.metrics == []
    rig._take(Grouper(rig.cfg, rig.groups, rig.members, rig.index).on_tick(1, since + 10_000, since))
    assert rig.emitted.metrics[0].labels["closed_by"] == "timeout"


def test_duplicates_replacements_and_rejections() -> None:
    rig = Rig()
    infra = traj(1, None, TrajectoryStatus.INFRA_FAILURE)
    rig.feed([traj(0, 1.0), traj(0, 1.0), infra])  # exact duplicate: ignored
    assert rig.rejected == []
    rig.feed([replace(traj(1, 0.0), attempt_id="a-1-reissue")])  # a re-issue replaces the infra failure
    rig.feed([replace(traj(0, 0.5), attempt_id="other")])  # a second, different trajectory: rejected
    assert [v for v, _ in rig.rejected] == [Verdict.REJECTED]
    rig.feed([traj(2, 0.0), traj(3, 0.5)])
    assert set(rig.advantages()) == {"r-0", "r-1", "r-2", "r-3"}


def test_eval_and_ungrouped_trajectories() -> None:
    rig = Rig()
    rig.feed([traj(0, 1.0, step=-1), traj(1, 1.0, metadata={"eval": "true"})])
    assert rig.groups == {} and rig.rejected == []
    rig.feed([traj(2, 1.0, group_id="")])
    assert rig.rejected[0][0] is Verdict.REJECTED


def test_restart_mid_group_keeps_state() -> None:
    rig = Rig()
    rig.feed([traj(0, 1.0), traj(1, 0.0)])
    restarted = Rig()
    restarted.groups, restarted.members, restarted.index = dict(rig.groups), dict(rig.members), dict(rig.index)
    restarted.feed([traj(2, 0.5), traj(3, 1.0)])
    assert list(restarted.advantages().values()) == pytest.approx(manual([1.0, 0.0, 0.5, 1.0]))
    assert BatchRecord.from_bytes(restarted.emitted.records[0].to_bytes()).advantage == pytest.approx(
        float(np.float64(manual([1.0, 0.0, 0.5, 1.0])[0]))
    )


def test_ppo_keeps_groups_of_one_and_equal_rewards() -> None:
    """The paper's PPO runs one rollout per task: GRPO's rules would emit nothing; PPO emits every trainable rollout."""
    ppo = Rig(CFG.model_copy(update={"advantage_estimator": "ppo"}))
    grpo = Rig()
    single = [traj(0, 1.0, metadata={"group_size": "1"}, group_id="suite/t9|openclaw|3")]
    equal = [traj(i, 0.5) for i in range(1, 5)]
    for rig in (ppo, grpo):
        rig.feed(single + equal)
    assert ppo.advantages() == {"r-0": 0.0, "r-1": 0.0, "r-2": 0.0, "r-3": 0.0, "r-4": 0.0}
    assert {r.reward for r in ppo.emitted.records if r.kind is BatchRecordKind.TRAJECTORY} == {1.0, 0.5}
    assert [m.labels["outcome"] for m in ppo.emitted.metrics] == ["ppo", "ppo"]
    assert grpo.emitted.records == []  # the same data under GRPO: both groups have no reward variance
    assert [m.labels["outcome"] for m in grpo.emitted.metrics] == ["zero_variance_dropped"] * 2


def test_ppo_group_with_variance_carries_the_grpo_value() -> None:
    rig = Rig(CFG.model_copy(update={"advantage_estimator": "ppo"}))
    rig.feed([traj(i, r) for i, r in enumerate([1.0, 0.0, 0.5, 1.0])])
    assert list(rig.advantages().values()) == pytest.approx(manual([1.0, 0.0, 0.5, 1.0]))


def reissued(i: int, attempt: int, max_attempts: int) -> dict[str, object]:
    return {"attempt_id": f"a-{i}.{attempt}", "metadata": {"attempt": str(attempt), "max_attempts": str(max_attempts)}}


def test_an_infra_failure_that_will_be_reissued_keeps_its_place_for_the_replacement() -> None:
    rig = Rig()
    rig.feed(
        [traj(0, 1.0), traj(1, None, TrajectoryStatus.INFRA_FAILURE, **reissued(1, 0, 3)), traj(2, 0.0), traj(3, 0.5)]
    )
    assert rig.emitted.records == [] and rig.emitted.metrics == []  # 3 finished + 1 awaiting its re-issue: open
    rig.feed([traj(1, None, TrajectoryStatus.INFRA_FAILURE, **reissued(1, 1, 3))])  # the re-issue failed too
    assert rig.emitted.metrics == []
    rig.feed([traj(1, 0.25, **reissued(1, 2, 3))])  # the last attempt succeeds and takes the place
    assert rig.rejected == []
    assert rig.advantages() == pytest.approx(
        dict(zip(["r-0", "r-1", "r-2", "r-3"], manual([1.0, 0.25, 0.0, 0.5]), strict=True))
    )
    assert rig.emitted.metrics[0].values["infra"] == 0 and rig.emitted.metrics[0].labels["closed_by"] == "complete"


def test_an_infra_failure_on_its_last_attempt_is_final() -> None:
    rig = Rig()
    rig.feed(
        [traj(0, 1.0), traj(1, None, TrajectoryStatus.INFRA_FAILURE, **reissued(1, 2, 3)), traj(2, 0.0), traj(3, 0.5)]
    )
    assert set(rig.advantages()) == {"r-0", "r-2", "r-3"} and rig.emitted.metrics[0].values["infra"] == 1


def test_a_member_replayed_after_its_group_closed_is_skipped_not_dead_lettered() -> None:
    """A replay after an exactly-once gap re-sends trajectories of a group that already closed: skipped silently
    (a dead letter for every replayed record would bury the real late ones); nothing is emitted twice."""
    rig = Rig()
    members = [traj(i, float(i % 2)) for i in range(4)]
    rig.feed(members)
    emitted = len(rig.emitted.records)
    rig.feed(members)
    assert rig.rejected == [] and len(rig.emitted.records) == emitted
    rig.feed([replace(members[0], attempt_id="another")])  # a different trajectory after closing is still late
    assert [v for v, _ in rig.rejected] == [Verdict.LATE]
