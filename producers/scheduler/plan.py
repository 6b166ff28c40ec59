"""Scheduling logic (pure): which rollouts a training step asks for, when a step may be issued, re-issues, eval table.

* A step samples ``tasks_per_step`` tasks; each task becomes one training *instance* (task × harness) whose harness
  is drawn so that the step's instances follow the configured harness ratios as closely as integers allow (largest
  remainder), shuffled so harnesses mix at random in the batch. Each instance asks for ``group_size`` rollouts
  with group id ``f"{suite}/{task}|{harness}|{step}"`` (GRPO groups = task × harness) and
  ``metadata["group_size"]``.
* Policy lag: step ``s`` may be issued once the newest published weight version is ≥ ``s − max_policy_lag``.
* Re-issue: a rollout whose reward says INFRA_FAILURE is re-published with the same rollout id and ``attempt + 1``
  (streams reopen a rollout for a newer attempt) until ``max_attempts`` attempts were made. A reward counts only for
  the latest attempt issued (its number is in the attempt id, :func:`reward_attempt`); an older attempt's is ignored.
* Refill: a group the streams will train nothing of (its rewards all equal, or none) is replaced by one more group
  of its step and harness (``producers.scheduler.refill``).
* Resume (:func:`rebuild`): from a run's issued requests and rewards, the step to go on at, what is outstanding and
  which re-issues are owed; :func:`missing_requests` completes a step whose publishing was cut short.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
import uuid
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from producers.scheduler import curriculum
from producers.tasks.model import Task
from schemas.events import RewardEvent, RewardStatus, RolloutRequest, now_ms


def harness_counts(n: int, mix: Mapping[str, float]) -> dict[str, int]:
    """Split ``n`` instances over harnesses by ratio (largest remainder; ties broken by name)."""
    weights = {h: float(w) for h, w in mix.items() if w > 0}
    if not weights:
        raise ValueError("the harness mix has no harness with a positive weight")
    total = sum(weights.values())
    exact = {h: n * w / total for h, w in weights.items()}
    counts = {h: int(x) for h, x in exact.items()}
    rest = n - sum(counts.values())
    for h in sorted(weights, key=lambda h: (-(exact[h] - counts[h]), h))[:rest]:
        counts[h] += 1
    return counts


def group_id(suite: str, task_id: str, harness: str, step: int) -> str:
    return f"{suite}/{task_id}|{harness}|{step}"


@dataclass(frozen=True)
class StepPlan:
    tasks_per_step: int
    group_size: int
    mix: Mapping[str, float]
    timeout_s: float | None = None  # None: each task's own
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 2048
    max_attempts: int = 1  # announced to the grouper: an infra failure with attempts left waits for its re-issue
    top_k: int = 0  # 0 = off
    curriculum: Mapping[str, float] = field(default_factory=dict)  # family → weight (curriculum.parse); {}: uniform


def plan_step(
    step: int,
    tasks: Sequence[Task],
    plan: StepPlan,
    rng: random.Random,
    policy_version: int = 0,
    *,
    eval_mode: bool = False,
) -> list[RolloutRequest]:
    if not tasks:
        raise ValueError("no tasks to sample from")
    chosen = curriculum.draw(tasks, plan.tasks_per_step, rng, plan.curriculum)  # with replacement when too few
    harnesses = [h for h, c in harness_counts(len(chosen), plan.mix).items() for _ in range(c)]
    rng.shuffle(harnesses)
    return [
        r
        for task, h in zip(chosen, harnesses, strict=True)
        for r in instance_requests(task, h, step, plan, policy_version, eval_mode=eval_mode)
    ]


def instance_requests(
    task: Task, harness: str, step: int, plan: StepPlan, policy_version: int = 0, *, eval_mode: bool = False
) -> list[RolloutRequest]:
    gid = group_id(task.suite, task.task_id, harness, step)
    return [
        RolloutRequest(
            rollout_id=uuid.uuid4().hex,
            policy_version=policy_version,
            timestamp_ms=now_ms(),
            suite=task.suite,
            task_id=task.task_id,
            harness=harness,
            group_id=gid,
            step=step,
            timeout_s=plan.timeout_s or task.timeout_s,
            temperature=plan.temperature,
            top_p=plan.top_p,
            top_k=plan.top_k,
            max_tokens=plan.max_tokens,
            min_policy_version=max(0, policy_version),
            eval=eval_mode,
            metadata={"group_size": str(plan.group_size), "split": task.split, "max_attempts": str(plan.max_attempts)},
        )
        for _ in range(plan.group_size)
    ]


def may_issue(step: int, newest_version: int, max_policy_lag: int) -> bool:
    """Step ``step``'s rollouts may start once the policy is at most ``max_policy_lag`` versions behind."""
    return newest_version >= step - max_policy_lag


@dataclass
class Outstanding:
    """Requests waiting for a final reward; re-issues infrastructure failures up to ``max_attempts``.

    A settled rollout's reward is kept in ``final`` (or ``gave_up``: infra failures with no attempt left) only with
    ``keep_settled``: eval mode's table needs each one, and an eval is as big as its task list. A train run settles
    10^5–10^6 rollouts whose rewards the streams hold, so train mode keeps none (they only count in ``n_final`` /
    ``n_gave_up``): its state is then what is in flight, however long the run."""

    max_attempts: int
    pending: dict[str, RolloutRequest] = field(default_factory=dict)
    final: dict[str, RewardEvent] = field(default_factory=dict)
    gave_up: dict[str, RewardEvent] = field(default_factory=dict)
    keep_settled: bool = True
    n_final: int = 0
    n_gave_up: int = 0

    def add(self, requests: Sequence[RolloutRequest]) -> None:
        for r in requests:
            self.pending[r.rollout_id] = r

    def on_reward(self, reward: RewardEvent) -> RolloutRequest | None:
        """Record a reward; returns the request to re-publish when it was an infra failure with attempts left.

        A reward of another attempt than the latest issued (a late one of an attempt already re-issued) settles and
        re-issues nothing; one whose attempt id names no number counts for the latest."""
        req = self.pending.get(reward.rollout_id)
        if req is None:
            return None
        attempt = reward_attempt(reward)
        if attempt is not None and attempt != req.attempt:
            return None
        if reward.status != RewardStatus.INFRA_FAILURE:
            self.n_final += 1
            if self.keep_settled:
                self.final[req.rollout_id] = reward
            del self.pending[req.rollout_id]
            return None
        if req.attempt + 1 >= self.max_attempts:
            self.n_gave_up += 1
            if self.keep_settled:
                self.gave_up[req.rollout_id] = reward
            del self.pending[req.rollout_id]
            return None
        again = dataclasses.replace(req, attempt=req.attempt + 1, timestamp_ms=now_ms())
        self.pending[req.rollout_id] = again
        return again


def reward_attempt(reward: RewardEvent) -> int | None:
    """The attempt number a reward is for, read from its attempt id (``{rollout_id}.a{attempt}.{random}``, as the
    sandbox worker makes it); None when the id names none (hand-made or older events)."""
    prefix = f"{reward.rollout_id}.a"
    if not reward.attempt_id.startswith(prefix):
        return None
    number, dot, _ = reward.attempt_id[len(prefix) :].partition(".")
    return int(number) if dot and number.isdigit() else None


@dataclass
class Rebuilt:
    """A train-mode scheduler's state, rebuilt from its run's log (:func:`rebuild`)."""

    next_step: int  # the step to issue next
    issued: dict[str, RolloutRequest]  # train rollout id → its latest issued attempt
    outstanding: Outstanding  # every issued rollout without a final reward (an owed re-issue as its new attempt)
    reissue: list[RolloutRequest]  # owed re-issues: an INFRA_FAILURE of the latest attempt, attempts left
    steps: dict[int, list[RolloutRequest]]  # issued step → its rollouts (latest attempts, log order)


def rebuild(
    requests: Iterable[RolloutRequest], rewards: Iterable[RewardEvent], max_attempts: int, start_step: int = 0
) -> Rebuilt:
    """Replay a run's requests and rewards (each in log order; eval requests are ignored) into the state the scheduler
    had: per rollout id the latest attempt issued, settled by the rewards as :meth:`Outstanding.on_reward` would have
    (a stale attempt's reward ignored). Goes on at the highest step issued + 1, never before ``start_step``."""
    latest: dict[str, RolloutRequest] = {}
    for r in requests:
        if not r.eval and (r.rollout_id not in latest or r.attempt > latest[r.rollout_id].attempt):
            latest[r.rollout_id] = r
    out = Outstanding(max_attempts)
    out.add(list(latest.values()))
    for reward in rewards:
        out.on_reward(reward)
    reissue = [req for rid, req in out.pending.items() if req.attempt > latest[rid].attempt]
    steps: dict[int, list[RolloutRequest]] = {}
    for r in latest.values():
        steps.setdefault(r.step, []).append(r)
    next_step = max([start_step, *(s + 1 for s in steps)])
    return Rebuilt(next_step, latest, out, reissue, steps)


def missing_requests(
    planned: Sequence[RolloutRequest], issued: Sequence[RolloutRequest]
) -> list[RolloutRequest] | None:
    """The requests of a re-planned step (``planned``, :func:`plan_step` with the run's RNG) that the log lacks
    (``issued``: the step's rollouts found there), stamped with the policy version the step was issued at: a step
    whose publishing a kill cut short. ``[]`` when complete or never issued; None when the log's step is not this
    plan's (a group the plan lacks, or more rollouts than it asks for: another seed, suite or size)."""
    if not issued:
        return []
    have = Counter(r.group_id for r in issued)
    if have - Counter(r.group_id for r in planned):
        return None
    version = issued[0].policy_version
    out = []
    for r in planned:
        if have[r.group_id] > 0:
            have[r.group_id] -= 1
        else:
            out.append(dataclasses.replace(r, policy_version=version, min_policy_version=max(0, version)))
    return out


def score_table(requests: Mapping[str, RolloutRequest], out: Outstanding) -> str:
    """Per-harness eval table: rollouts, graded, mean reward, grader errors by the rollout (graded 0s), infra
    failures, ungraded, still pending."""
    rows: dict[str, dict[str, float]] = {}
    for rid, req in requests.items():
        zero = {"n": 0, "graded": 0, "sum": 0.0, "grader": 0, "infra": 0, "ungraded": 0, "pending": 0}
        row = rows.setdefault(req.harness, zero)
        row["n"] += 1
        reward = out.final.get(rid)
        if reward is not None and reward.status == RewardStatus.OK and reward.reward is not None:
            row["graded"] += 1
            row["sum"] += reward.reward
            row["grader"] += reward.grader_error_by_rollout
        elif reward is not None:
            row["ungraded"] += 1
        elif rid in out.gave_up:
            row["infra"] += 1
        else:
            row["pending"] += 1
    lines = [
        "| harness | rollouts | graded | mean reward | grader errors | infra failures | ungraded | pending |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for h, r in sorted(rows.items()):
        mean = f"{r['sum'] / r['graded']:.3f}" if r["graded"] else "n/a"
        counts = " | ".join(str(r[k]) for k in ("grader", "infra", "ungraded", "pending"))
        lines.append(f"| {h} | {r['n']} | {r['graded']} | {mean} | {counts} |")
    return "\n".join(lines)


# --- evaluation scores: per harness and decoding mode, with standard errors --------------------------------------

EVAL_MODES = ("greedy", "sampled")  # greedy: temperature 0; sampled: the scheduler's sampling settings
EVAL_MODE_KEY = "eval_mode"  # the request metadata label naming an eval rollout's mode


def eval_seed(base: int, suite: str, task_id: str, harness: str, mode: str, sample: int) -> int:
    """The sampling seed of one eval rollout: the same task, harness, mode and sample draw the same noise in every
    evaluation (before and after training: common random numbers, so the paired difference is the policy's), and
    differ from each other. 31 bits: the proxy adds the call's sequence number, every engine accepts it."""
    key = f"{base}|{suite}|{task_id}|{harness}|{mode}|{sample}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:4], "big") & 0x7FFFFFFF


@dataclass(frozen=True)
class EvalScore:
    """One row of an evaluation: a harness in one decoding mode.

    ``mean``/``stderr``/``solved`` are over the graded rollouts (None when none was graded): ``stderr`` is the
    standard error of the mean (sample standard deviation / sqrt(n)), ``solved`` the fraction with reward ≥ 1.
    ``grader_errors``: of the graded, the 0s given because the grader failed on what the rollout left in its
    workspace (``RewardEvent.grader_error_by_rollout``); results written before it was counted read 0.
    """

    harness: str
    mode: str
    rollouts: int
    graded: int
    mean: float | None
    stderr: float | None
    solved: float | None
    infra: int
    ungraded: int
    pending: int
    grader_errors: int = 0

    def as_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def mean_stderr(values: Sequence[float]) -> tuple[float | None, float | None]:
    """(mean, standard error of the mean); the error needs two values (None below that)."""
    n = len(values)
    if n == 0:
        return None, None
    mean = sum(values) / n
    if n < 2:
        return mean, None
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, (var / n) ** 0.5


def eval_scores(requests: Mapping[str, RolloutRequest], out: Outstanding) -> list[EvalScore]:
    """Rows per (harness, mode) of the eval ``requests`` (mode: the ``eval_mode`` label, else ``sampled``)."""
    cells: dict[tuple[str, str], dict[str, list]] = {}
    for rid, req in requests.items():
        key = (req.harness, req.metadata.get(EVAL_MODE_KEY, "sampled"))
        cell = cells.setdefault(key, {"rewards": [], "infra": [], "ungraded": [], "pending": [], "grader": []})
        reward = out.final.get(rid)
        if reward is not None and reward.status == RewardStatus.OK and reward.reward is not None:
            cell["rewards"].append(reward.reward)
            if reward.grader_error_by_rollout:
                cell["grader"].append(rid)
        elif reward is not None:
            cell["ungraded"].append(rid)
        elif rid in out.gave_up:
            cell["infra"].append(rid)
        else:
            cell["pending"].append(rid)
    order = {m: i for i, m in enumerate(EVAL_MODES)}
    rows = []
    for (harness, mode), cell in sorted(cells.items(), key=lambda kv: (order.get(kv[0][1], 99), kv[0])):
        rewards = cell["rewards"]
        mean, stderr = mean_stderr(rewards)
        solved = sum(r >= 1.0 for r in rewards) / len(rewards) if rewards else None
        n = len(rewards) + len(cell["infra"]) + len(cell["ungraded"]) + len(cell["pending"])
        rows.append(
            EvalScore(
                harness,
                mode,
                n,
                len(rewards),
                mean,
                stderr,
                solved,
                len(cell["infra"]),
                len(cell["ungraded"]),
                len(cell["pending"]),
                len(cell["grader"]),
            )
        )
    return rows


def _num(value: float | None, fmt: str = ".3f") -> str:
    return "n/a" if value is None else format(value, fmt)


def eval_table(rows: Sequence[EvalScore], sampling: str = "") -> str:
    """Markdown tables, one per decoding mode: rollouts, graded, mean reward ± standard error, solved fraction."""
    out: list[str] = []
    for mode in dict.fromkeys(r.mode for r in rows):
        note = "temperature 0" if mode == "greedy" else (sampling or "the scheduler's sampling settings")
        out += [
            f"{mode} ({note}):",
            "| harness | rollouts | graded | mean reward | ± s.e. | solved | grader errors | infra failures | ungraded "
            "| pending |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in (r for r in rows if r.mode == mode):
            out.append(
                f"| {r.harness} | {r.rollouts} | {r.graded} | {_num(r.mean)} | {_num(r.stderr)} | "
                f"{_num(r.solved, '.1%')} | {r.grader_errors} | {r.infra} | {r.ungraded} | {r.pending} |"
            )
        out.append("")
    return "\n".join(out).rstrip("\n")
