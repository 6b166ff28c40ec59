"""Grouper: settled trajectories → GRPO groups (task × harness × step) with one advantage per rollout.

Topics in: ``clawstream.trajectories`` (key = rollout id), re-keyed by group id into the app's internal ``by-group``
topic, and the app's tick topic. Out: the internal ``scored-groups`` topic (one partition) for the batcher,
``clawstream.metrics`` (one ``group`` metric per closed group) and ``clawstream.deadletter``. The Faust agents live in
``streams.app``; this module is the pure core: no Kafka, no Faust.

Closing. A group closes when it holds as many finished rollouts as its expected size — the trajectory's
``metadata["group_size"]`` when it is a positive integer (the scheduler copies it from the rollout request), else
``StreamsSettings.group_size`` — or ``group_timeout_s`` after its first trajectory. An infrastructure failure is
finished unless the scheduler will re-issue it (``metadata["attempt"]`` + 1 < ``metadata["max_attempts"]``, both
copied from the request): then its place waits for the re-issued attempt, which replaces it. Trajectories of a closed
group are late (dead-lettered), also long after: ``late_retention_s`` after closing, a group is compacted to a kept
tombstone (:meth:`GroupState.tombstone`, ~40 bytes). A second trajectory of the same rollout replaces the first only
when the first was an infrastructure failure of another attempt (a re-issue); an identical one is a duplicate
(ignored); anything else is rejected. Eval trajectories (step < 0 or ``metadata["eval"]=="true"``) are not grouped.

Advantages: A = (R − μ) / (σ + ε) over the group's rollouts with a reward (docs/method.md#advantages; which
rollouts count and which are emitted, GRPO and PPO: docs/method.md#how-the-grouper-applies-them). Each trained
rollout goes out as a :class:`BatchRecord` envelope (``batch_id`` = group id, kind TRAJECTORY, advantage, reward,
the trajectory's original bytes), then one SEAL (``index`` = rollout count, ``harness_counts``, ``policy_version`` =
the group's oldest version) so the batcher takes a group as a unit. State (key → bytes maps, Faust tables in the
app): ``groups[group_id]`` the JSON :class:`GroupState`, ``members[group_id + NUL + rollout_id]`` the original bytes
of trainable trajectories, ``index[str(partition)]`` a :class:`streams.state.DueIndex` of timeouts and forget times.
"""

from __future__ import annotations

import json
import logging
from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from schemas.events import GROUP_METRIC, GROUPER, BatchRecord, BatchRecordKind, Metric, Trajectory, TrajectoryStatus
from streams.settings import StreamsSettings
from streams.state import TOMBSTONE, TRAINABLE_STATUSES, Deadlines, Outcome, Verdict, is_tombstone

log = logging.getLogger(__name__)
SOURCE = GROUPER


def expected_size(trajectory: Trajectory, default: int) -> int:
    """The group size the trajectory's metadata announces, else ``default``."""
    raw = trajectory.metadata.get("group_size", "")
    return int(raw) if raw.isdigit() and int(raw) > 0 else default


def awaits_reissue(trajectory: Trajectory) -> bool:
    """An infrastructure failure the scheduler will re-issue (attempts left, as the request announced)."""
    if trajectory.status is not TrajectoryStatus.INFRA_FAILURE:
        return False
    attempt, most = trajectory.metadata.get("attempt", ""), trajectory.metadata.get("max_attempts", "")
    return attempt.isdigit() and most.isdigit() and int(attempt) + 1 < int(most)


def is_eval(trajectory: Trajectory) -> bool:
    return trajectory.step < 0 or trajectory.metadata.get("eval", "").lower() == "true"


def advantages(rewards: Sequence[float], eps: float) -> tuple[list[float], float, float]:
    """GRPO advantages (R − μ) / (σ + ε) with the population σ; returns (advantages, μ, σ)."""
    r = np.asarray(rewards, dtype=np.float64)
    mu, sigma = float(r.mean()), float(r.std())
    return [float(x) for x in (r - mu) / (sigma + eps)], mu, sigma


@dataclass
class GroupState:
    """One group being collected (JSON-serialisable); trainable trajectories' bytes are stored apart."""

    group_id: str
    expected: int
    first_ms: int
    harness: str = ""
    step: int = -1
    members: dict[str, dict[str, Any]] = field(default_factory=dict)  # rollout id → status, reward, attempt, ...
    closed: dict[str, Any] | None = None  # at_ms, by, outcome once emitted

    def to_bytes(self) -> bytes:
        # Fields hold plain JSON values: dump them as they are (dataclasses.asdict deep-copies, half the core time).
        return json.dumps(self.__dict__, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> GroupState:
        return cls(**json.loads(data))

    def tombstone(self) -> bytes:
        """The closed group compacted to what a replayed trajectory's dead letter says: how and when it closed, its
        outcome, members and expected size (~40 bytes)."""
        assert self.closed is not None
        keep = [self.closed["by"], self.closed["outcome"], self.closed["at_ms"], len(self.members), self.expected]
        return TOMBSTONE + json.dumps(keep, separators=(",", ":")).encode()

    def deadline_ms(self, cfg: StreamsSettings, since_ms: int = 0) -> int:
        """Timeout (or, once closed, when it is compacted to its tombstone). Not before ``settle_timeout_s`` after this
        worker started listening (``since_ms``): after a restart, members may still be settling upstream or waiting in
        Kafka."""
        if self.closed:
            return int(self.closed["at_ms"] + cfg.late_retention_s * 1000)
        return int(max(self.first_ms + cfg.group_timeout_s * 1000, since_ms + cfg.settle_timeout_s * 1000))

    def complete(self) -> bool:
        return sum(not m.get("reissue", False) for m in self.members.values()) >= self.expected

    def add(self, t: Trajectory) -> Outcome:
        """Record a trajectory; ACCEPTED means the caller stores its bytes when ``trainable(t)``."""
        old = self.members.get(t.rollout_id)
        if old is not None and old["attempt_id"] == t.attempt_id and old["status"] == t.status.value:
            return Outcome(Verdict.DUPLICATE)  # a replay (also after the group closed): skipped, not a dead letter
        if self.closed:
            why = f"{self.closed['by']}, {len(self.members)}/{self.expected} rollouts"
            return Outcome(Verdict.LATE, f"late trajectory {t.rollout_id}: group {self.group_id} closed ({why})")
        if old is not None:
            if old["status"] != TrajectoryStatus.INFRA_FAILURE or old["attempt_id"] == t.attempt_id:
                why = f"attempt {t.attempt_id}, {t.status.value}, after {old['status']}"
                return Outcome(Verdict.REJECTED, f"second trajectory of rollout {t.rollout_id} ({why})")
        self.members[t.rollout_id] = {
            "attempt_id": t.attempt_id,
            "status": t.status.value,
            "reward": t.reward,
            "harness": t.harness,
            "policy_version": t.policy_version,
            "trainable": trainable(t),
            "reissue": awaits_reissue(t),
        }
        self.harness, self.step = self.harness or t.harness, t.step if self.step < 0 else self.step
        return Outcome(Verdict.ACCEPTED)


def trainable(t: Trajectory) -> bool:
    return t.status in TRAINABLE_STATUSES and t.reward is not None and bool(t.segments)


@dataclass
class Scored:
    """The outcome of closing a group: per trained rollout its advantage, plus the group's statistics."""

    advantages: dict[str, float]  # trained rollout id → advantage (empty when the group is dropped)
    mean: float | None
    std: float | None
    scored: int  # rollouts with a reward (the statistics' sample)
    infra: int
    outcome: str  # trained | zero_variance_dropped | zero_variance_kept | no_reward | nothing_trainable | ppo


def score(group: GroupState, cfg: StreamsSettings) -> Scored:
    """GRPO statistics and advantages of a group (rules: docs/method.md#how-the-grouper-applies-them)."""
    members = group.members
    with_reward = {
        rid: m["reward"]
        for rid, m in members.items()
        if m["reward"] is not None and m["status"] != TrajectoryStatus.DROPPED
    }
    infra = sum(m["status"] == TrajectoryStatus.INFRA_FAILURE for m in members.values())
    if not with_reward:
        return Scored({}, None, None, 0, infra, "no_reward")
    ids = list(with_reward)
    adv, mu, sigma = advantages([with_reward[r] for r in ids], cfg.advantage_eps)
    train = [r for r in ids if members[r]["trainable"]]
    zero = max(with_reward.values()) == min(with_reward.values())  # exact: float noise in σ must not decide this
    by_id = dict(zip(ids, adv, strict=True))
    if cfg.advantage_estimator == "ppo":  # the learner uses R − V(s_t): no variance needed, nothing dropped
        result = {r: 0.0 if zero else by_id[r] for r in train}
        return Scored(result, mu, sigma, len(ids), infra, "ppo" if train else "nothing_trainable")
    if zero and cfg.zero_variance == "drop":
        return Scored({}, mu, sigma, len(ids), infra, "zero_variance_dropped")
    result = {r: 0.0 if zero else by_id[r] for r in train}
    outcome = "zero_variance_kept" if zero else "trained"
    return Scored(result, mu, sigma, len(ids), infra, outcome if train else "nothing_trainable")


@dataclass
class Emission:
    records: list[BatchRecord] = field(default_factory=list)  # envelopes then SEAL, per closed group
    metrics: list[Metric] = field(default_factory=list)
    rejected: Outcome | None = None


def member_key(group_id: str, rollout_id: str) -> str:
    return f"{group_id}\x00{rollout_id}"


class Grouper:
    """The grouper over three key → bytes maps (Faust tables in the app, dicts in tests); pure."""

    def __init__(
        self,
        cfg: StreamsSettings,
        groups: MutableMapping[str, bytes],
        members: MutableMapping[str, bytes],
        index: MutableMapping[str, bytes],
    ) -> None:
        self.cfg, self.groups, self.members, self.index = cfg, groups, members, index
        self.deadlines = Deadlines(groups, index)

    def on_trajectory(self, t: Trajectory, raw: bytes, partition: int, now_ms: int) -> Emission:
        out = Emission()
        if is_eval(t):
            return out
        if not t.group_id:
            out.rejected = Outcome(Verdict.REJECTED, f"trajectory {t.rollout_id} has no group id")
            return out
        data = self.groups.get(t.group_id)
        if is_tombstone(data):
            by, outcome, _at, members, expected = json.loads(data[1:])  # type: ignore[index]
            why = f"{by}, {members}/{expected} rollouts, {outcome}"
            out.rejected = Outcome(Verdict.LATE, f"late trajectory {t.rollout_id}: group {t.group_id} closed ({why})")
            return out
        group = (
            GroupState.from_bytes(data)
            if data
            else GroupState(t.group_id, expected_size(t, self.cfg.group_size), now_ms)
        )
        replaced = group.members.get(t.rollout_id)
        outcome = group.add(t)
        if outcome.verdict is not Verdict.ACCEPTED:
            out.rejected = None if outcome.verdict is Verdict.DUPLICATE else outcome
            return out
        if replaced is not None and replaced["trainable"]:
            self.members.pop(member_key(t.group_id, t.rollout_id), None)
        if group.members[t.rollout_id]["trainable"]:
            self.members[member_key(t.group_id, t.rollout_id)] = raw
        if group.complete():
            self._close(group, now_ms, "complete", out)
        self.groups[group.group_id] = group.to_bytes()
        self.deadlines.schedule(partition, group.group_id, group.deadline_ms(self.cfg))
        return out

    def on_tick(self, partition: int, now_ms: int, since_ms: int = 0) -> Emission:
        """Close timed-out groups of the partition; compact closed ones past ``late_retention_s`` to tombstones."""
        out = Emission()

        def visit(group_id: str, data: bytes) -> int | bytes | None:
            group = GroupState.from_bytes(data)
            if now_ms >= group.deadline_ms(self.cfg, since_ms):
                if group.closed:
                    return group.tombstone()  # kept for good: a replayed trajectory at any later time is late
                self._close(group, now_ms, "timeout", out)
                self.groups[group_id] = group.to_bytes()
            return group.deadline_ms(self.cfg, since_ms)

        self.deadlines.tick(partition, now_ms, visit)
        return out

    def _close(self, group: GroupState, now_ms: int, by: str, out: Emission) -> None:
        scored = score(group, self.cfg)
        group.closed = {"at_ms": now_ms, "by": by, "outcome": scored.outcome}
        raws = {
            rid: self.members.pop(member_key(group.group_id, rid), None)
            for rid, m in group.members.items()
            if m["trainable"]
        }
        versions = [m["policy_version"] for m in group.members.values()] or [0]
        counts: dict[str, int] = {}
        for rid, adv in scored.advantages.items():
            raw, m = raws.get(rid), group.members[rid]
            if raw is None:  # stored with the member; missing only if the state was tampered with
                log.error("group %s: bytes of trajectory %s are missing; left out", group.group_id, rid)
                continue
            out.records.append(
                BatchRecord(
                    batch_id=group.group_id,
                    policy_version=m["policy_version"],
                    timestamp_ms=now_ms,
                    kind=BatchRecordKind.TRAJECTORY,
                    step=group.step,
                    index=sum(counts.values()),
                    rollout_id=rid,
                    group_id=group.group_id,
                    harness=m["harness"],
                    advantage=adv,
                    reward=m["reward"],
                    trajectory=raw,
                )
            )
            counts[m["harness"]] = counts.get(m["harness"], 0) + 1
        if counts:
            out.records.append(
                BatchRecord(
                    batch_id=group.group_id,
                    policy_version=min(versions),
                    timestamp_ms=now_ms,
                    kind=BatchRecordKind.SEAL,
                    step=group.step,
                    index=sum(counts.values()),
                    group_id=group.group_id,
                    harness=group.harness,
                    harness_counts=counts,
                )
            )
        values = {
            "members": float(len(group.members)),
            "expected": float(group.expected),
            "scored": float(scored.scored),
            "infra": float(scored.infra),
            "trained": float(sum(counts.values())),
        }
        if scored.mean is not None:
            values.update(reward_mean=scored.mean, reward_std=scored.std or 0.0)
        out.metrics.append(
            Metric(
                policy_version=min(versions),
                timestamp_ms=now_ms,
                source=SOURCE,
                name=GROUP_METRIC,
                values=values,
                step=group.step,
                labels={
                    "group_id": group.group_id,
                    "harness": group.harness,
                    "outcome": scored.outcome,
                    "closed_by": by,
                },
            )
        )
        log.info(
            "group %s closed (%s): %s, %d/%d rollouts, %d infra, %d trained",
            group.group_id,
            by,
            scored.outcome,
            len(group.members),
            group.expected,
            scored.infra,
            sum(counts.values()),
        )
