"""Refills (pure): the groups a training step over-issues so that its batches still fill when some groups train nothing.

The grouper (``streams.group.score``) emits nothing for a group whose settled members carry no reward (infrastructure
failures out of attempts, ungraded rollouts) and, with ``zero_variance="drop"``, for one whose rewards are all equal
(exactly: no float tolerance). The batcher then waits for other groups, and a run of ``steps × tasks_per_step`` groups
forms fewer than ``steps`` batches: the learner waits for the last ones for good. :class:`Refills` follows the groups a
scheduler issued through the rewards it reads and the grouper's verdicts (``schemas.events.group_verdict``), and owes
one more group of the same step and harness for each group that trains nothing, up to ``max_per_step`` refills a
step. Refills are not gated by policy lag: their step was issued already.

Who decides. The rewards decide early only that a group trains nothing (:func:`emits_nothing` once every member has
settled: the grouper scores a subset of those rewards, so it drops that group too). That a group trains is the
grouper's word alone: a member the tree filter drops (DROPPED: a tampered call, no trainable tokens) still has a reward
here, and a group closed by its timeout is scored on the members it had; such a group, judged by its rewards, would
never be refilled and a batch of its step would wait for good (an opencode run's last batch did). A group stays
undecided until the verdict comes.

Deterministic, so a restarted scheduler (which rebuilds this state from the requests and rewards topics) issues none
twice: refill ``k`` of (step, harness) carries ``metadata["refill"] = k``, draws its task from
``random.Random(f"{seed}:refill:{step}:{harness}:{k}")`` among the tasks that (step, harness) has not used yet (so its
group id ``suite/task|harness|step`` is new), and its rollout ids are a hash of the run, the group id and the member.
What it cannot see: a group the batcher drops as stale (past ``max_policy_lag``; a dead letter, no verdict).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import random
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from producers.scheduler import curriculum
from producers.scheduler.plan import StepPlan, instance_requests
from producers.tasks.model import Task
from schemas.events import RewardEvent, RewardStatus, RolloutRequest

log = logging.getLogger("clawstream.scheduler")
REFILL_KEY = "refill"  # request metadata: the refill's number within its step and harness


def settled_reward(reward: RewardEvent | None) -> float | None:
    """What a settled rollout adds to its group's statistics: its reward when graded, else None (no reward)."""
    return reward.reward if reward is not None and reward.status == RewardStatus.OK else None


def emits_nothing(rewards: Sequence[float | None], expected: int, drop_equal: bool) -> bool | None:
    """Whether the grouper emits nothing for a group of ``expected`` members whose settled ones have ``rewards`` (None:
    settled without a reward); None while members are still to settle. ``drop_equal``: the streams drop groups whose
    rewards are all equal (``zero_variance="drop"``)."""
    if len(rewards) < expected:
        return None
    numbers = [r for r in rewards if r is not None]
    if not numbers:
        return True
    return drop_equal and max(numbers) == min(numbers)


def refill_rollout_id(run_key: str, group_id: str, member: int) -> str:
    """A refill's rollout id: the same for the same run, group and member, so a re-planned refill is recognised."""
    return hashlib.sha256(f"{run_key}|{group_id}|{member}".encode()).hexdigest()[:32]


@dataclass
class _Group:
    step: int
    harness: str
    size: int
    settled: dict[str, float | None] = field(default_factory=dict)
    ids: set[str] = field(default_factory=set)  # its rollouts issued
    trains: bool = False  # by its rewards; the grouper's verdict decides
    first: RolloutRequest | None = None  # a refill group's first request (the template of a cut-short one's rest)


@dataclass
class _Step:
    used: dict[str, set[str]] = field(default_factory=dict)  # harness → task ids of its groups
    dead: Counter[str] = field(default_factory=Counter)  # harness → groups that train nothing
    refills: dict[str, set[int]] = field(default_factory=dict)  # harness → refill numbers issued
    open: int = 0  # groups not decided yet (no verdict, and rewards that do not say "nothing")
    warned: bool = False


@dataclass
class Refill:
    """One refill owed: the ``k``-th of ``harness`` in ``step``."""

    step: int
    harness: str
    k: int


class Refills:
    """The groups a train run issued, as their rewards decide them, and the refills owed (pure)."""

    def __init__(self, max_per_step: int, *, drop_equal: bool, run_key: str, seed: int) -> None:
        self.max_per_step, self.drop_equal, self.run_key, self.seed = max_per_step, drop_equal, run_key, seed
        self.groups: dict[str, _Group] = {}
        self.steps: dict[int, _Step] = {}

    def add(self, requests: Iterable[RolloutRequest]) -> None:
        """Issued train requests (a re-issued attempt of a known rollout changes nothing)."""
        for r in requests:
            if r.eval or r.step < 0:
                continue
            g = self.groups.get(r.group_id)
            st = self.steps.setdefault(r.step, _Step())
            if g is None:
                size = r.metadata.get("group_size", "")
                g = self.groups[r.group_id] = _Group(r.step, r.harness, int(size) if size.isdigit() else 1)
                st.used.setdefault(r.harness, set()).add(r.task_id)
                st.open += 1
                if REFILL_KEY in r.metadata:
                    st.refills.setdefault(r.harness, set()).add(int(r.metadata[REFILL_KEY]))
            g.ids.add(r.rollout_id)
            if g.first is None and REFILL_KEY in r.metadata:
                g.first = r

    def settle(self, request: RolloutRequest, reward: RewardEvent | None) -> None:
        """A rollout got its final reward (None: given up after its last infrastructure failure)."""
        g = self.groups.get(request.group_id)
        if g is None or request.rollout_id in g.settled:
            return
        g.settled[request.rollout_id] = settled_reward(reward)
        nothing = emits_nothing(list(g.settled.values()), g.size, self.drop_equal)
        if nothing:
            self._decide(request.group_id, dead=True)
        elif nothing is not None and not self.max_per_step:
            self._decide(request.group_id, dead=False)  # no refill may follow whatever the verdict: not kept
        elif nothing is not None:
            g.trains = True  # so its rewards say; the grouper's verdict decides (the module's docstring)

    def verdict(self, group_id: str, trained: int) -> None:
        """The grouper closed ``group_id`` and sent ``trained`` of its rollouts on to the batcher (0: none)."""
        g = self.groups.get(group_id)
        if g is None:
            return
        if g.trains and trained == 0:
            log.info("group %s trains nothing by the grouper's verdict, though its rewards differ", group_id)
        self._decide(group_id, dead=trained == 0)

    def _decide(self, group_id: str, *, dead: bool) -> None:
        g = self.groups.pop(group_id)
        st = self.steps[g.step]
        st.open -= 1
        if dead:
            st.dead[g.harness] += 1

    def undecided(self) -> int:
        """Groups whose rewards have all come but not the grouper's verdict."""
        return sum(g.trains for g in self.groups.values())

    def owed(self) -> list[Refill]:
        """The refills to issue now: per step and harness, one per group that trains nothing and has none yet, while
        the step's budget lasts. Forgets the steps with nothing left to decide or owe."""
        out: list[Refill] = []
        for step in sorted(self.steps):
            st = self.steps[step]
            total = sum(len(ks) for ks in st.refills.values())
            for h in sorted(st.dead):
                have = len(st.refills.get(h, ()))
                for k in range(have, st.dead[h]):
                    if total >= self.max_per_step:
                        break
                    out.append(Refill(step, h, k))
                    total += 1
            if st.open == 0 and not any(r.step == step for r in out) and (st.warned or not self._missing(st)):
                del self.steps[step]  # decided, refilled, and any shortfall named by short()
        return out

    def short(self) -> list[tuple[int, int]]:
        """(step, groups short) of steps whose refill budget is spent with groups still training nothing: each named
        once (the caller warns)."""
        out = []
        for step, st in self.steps.items():
            if (missing := self._missing(st)) and not st.warned:
                st.warned = True
                out.append((step, missing))
        return out

    def _missing(self, st: _Step) -> int:
        """Groups of a step that train nothing and will get no refill: its budget is spent."""
        issued = sum(len(ks) for ks in st.refills.values())
        return max(0, sum(st.dead.values()) - issued) if issued >= self.max_per_step else 0

    def plan(self, refill: Refill, tasks: Sequence[Task], plan: StepPlan, version: int) -> list[RolloutRequest] | None:
        """The requests of ``refill`` at policy ``version``: a task its (step, harness) has not used, ``plan``'s
        sampling settings, deterministic rollout ids; None when the step used every task with that harness."""
        st = self.steps.setdefault(refill.step, _Step())
        used = st.used.get(refill.harness, set())
        free = [t for t in tasks if t.task_id not in used]
        if plan.curriculum:  # only the families the curriculum draws, weighted as it weighs them
            free = [t for t, w in zip(free, curriculum.task_weights(free, plan.curriculum), strict=True) if w > 0]
        if not free:  # counted as issued: owed no more
            st.refills.setdefault(refill.harness, set()).add(refill.k)
            return None
        rng = random.Random(f"{self.seed}:{REFILL_KEY}:{refill.step}:{refill.harness}:{refill.k}")
        task = curriculum.draw(free, 1, rng, plan.curriculum)[0] if plan.curriculum else rng.choice(free)
        used.add(task.task_id)  # the next refill of this step and harness, planned before this one is added, differs
        st.used[refill.harness] = used
        out = instance_requests(task, refill.harness, refill.step, plan, version)
        for i, r in enumerate(out):
            r.rollout_id = refill_rollout_id(self.run_key, r.group_id, i)
            r.metadata[REFILL_KEY] = str(refill.k)
        return out

    def cut_short(self) -> list[RolloutRequest]:
        """Members of refill groups on the log whose publishing a kill cut short (their rollout ids are known)."""
        out = []
        for gid, g in self.groups.items():
            if g.first is None or len(g.ids) >= g.size:
                continue
            for i in range(g.size):
                rid = refill_rollout_id(self.run_key, gid, i)
                if rid not in g.ids:
                    out.append(dataclasses.replace(g.first, rollout_id=rid, attempt=0, metadata=dict(g.first.metadata)))
        return out
