"""The dashboard's running aggregates: typed events in (any topic, any order), one JSON-ready snapshot out.

What each panel shows and where it comes from (docs/dashboard.md has the same list):

* **reward per harness per step** — settled trajectories (``clawstream.trajectories``) with a reward, not
  infrastructure failures: mean reward by (harness, step); evaluation rollouts form their own series
  (``harness (eval)``). A re-settled rollout replaces its earlier trajectory.
* **rollout status** — each rollout's latest attempt (``clawstream.rollout.events``, ``clawstream.rewards``,
  trajectories): ``running`` (STARTED, no end yet), ``ok`` (harness exited 0), ``failed`` (harness exited non-zero),
  ``timed_out`` (killed at its limit), ``infra`` (FAILED, an INFRA_FAILURE reward or trajectory).
* **tree stats** per harness — trajectories that carry a tree: leaves per rollout, mean prefix reuse
  (Σ path tokens / unique tokens), tokens trained (trainable tokens) vs Σ path tokens.
* **throughput** — call events per ``bucket_s`` of their timestamp: calls/s, generated tokens/s, prompt tokens/s.
* **policy lag** — per main call, the newest version the learner had published (``clawstream.weights``) at the
  call's timestamp minus the version that served it; mean and max per bucket. A call read before the weight record
  published just before it counts that version as not yet published (the live feed reads topics side by side).
* **weight versions** — published versions, and per engine (``Metric`` "weights_applied", source
  ``inference-worker/<id>``) the versions applied and publish → applied latency; the latest "inference_stats" of
  each engine (prefix-cache hit rate, tokens/s).
* **capture health** — :class:`consumers.analytics.health_table.HealthAggregator` rows per harness and template.

Pure: no Kafka client, no aiohttp; ``consumers.analytics.dashboard.feed`` feeds it, ``.server`` serves it. Not
thread-safe: the server holds one lock around :meth:`DashboardState.add` and :meth:`DashboardState.snapshot`.
"""

from __future__ import annotations

import time
from bisect import bisect_right, insort
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from consumers.analytics.health_table import HealthAggregator
from schemas.events import (
    CallEvent,
    CallKind,
    Event,
    Metric,
    RewardEvent,
    RewardStatus,
    RolloutEvent,
    RolloutState,
    Trajectory,
    TrajectoryStatus,
    WeightVersion,
)

STATUSES = ("running", "ok", "failed", "timed_out", "infra")
TREE_STATUSES = frozenset({TrajectoryStatus.COMPLETE, TrajectoryStatus.TIMED_OUT})


def iso(timestamp_ms: float) -> str:
    return datetime.fromtimestamp(timestamp_ms / 1000, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


@dataclass
class _Bucket:
    calls: int = 0
    generated: int = 0
    prompt: int = 0
    lag_calls: int = 0
    lag_sum: int = 0
    lag_max: int = 0


@dataclass
class _RolloutStatus:
    attempt: tuple[int, int] = (-1, -1)  # (attempt number, STARTED timestamp) of the attempt shown
    attempt_id: str | None = None
    state: RolloutState | None = None
    exit_code: int | None = None
    infra: bool = False

    def status(self) -> str:
        if self.infra or self.state is RolloutState.FAILED:
            return "infra"
        if self.state is RolloutState.TIMED_OUT:
            return "timed_out"
        if self.state is RolloutState.HARNESS_EXITED:
            return "ok" if self.exit_code in (0, None) else "failed"
        return "running"


@dataclass(frozen=True)
class _Settled:
    """What the panels need of a trajectory (its tree is not kept)."""

    harness: str
    step: int
    status: TrajectoryStatus
    reward: float | None
    eval: bool
    leaves: int
    reuse: float
    trained: int
    path: int
    unique: int
    timestamp_ms: int


@dataclass
class _TreeSums:
    rollouts: int = 0
    leaves: int = 0
    reuse: float = 0.0
    trained: int = 0
    path: int = 0
    unique: int = 0


@dataclass
class DashboardState:
    """Running aggregates behind the dashboard. Feed :meth:`add`; read :meth:`snapshot`."""

    bucket_s: int = 10
    max_buckets: int = 360  # one hour of 10 s buckets
    max_rollouts: int = 20_000  # rollouts remembered for status, rewards and trees
    # Capture health keeps each rollout's token ids (no logprobs): fewer rollouts (a 40k-token harness rollout is
    # ~0.2 MB of ids, so 2,000 of them stay under ~0.5 GB).
    health: HealthAggregator = field(default_factory=lambda: HealthAggregator(max_rollouts=2_000))
    records: Counter[str] = field(default_factory=Counter)  # topic (catalog name) → records taken
    errors: Counter[str] = field(default_factory=Counter)  # topic → records that could not be decoded
    last_error: str | None = None
    started_ms: int = field(default_factory=lambda: int(time.time() * 1000))

    def __post_init__(self) -> None:
        self._buckets: dict[int, _Bucket] = {}
        self._published: list[tuple[int, int]] = []  # (timestamp, version), sorted
        self._published_steps: dict[int, int] = {}
        self._applied: dict[str, list[tuple[int, int, float]]] = {}  # engine → (timestamp, version, latency)
        self._engines: dict[str, dict[str, float]] = {}  # engine → latest inference_stats values
        self._status: dict[str, _RolloutStatus] = {}
        self._trajectories: dict[str, _Settled] = {}  # rollout → its latest trajectory
        self._learner: dict[int, dict[str, float]] = {}  # step → train_step metric values

    # ---- input ----------------------------------------------------------------------------------------------------
    def add(self, event: Event, topic: str = "") -> None:
        """Take one decoded event (``topic``: its catalog name, for the per-topic counts)."""
        self.records[topic or type(event).__name__] += 1
        self.health.add(event)
        if isinstance(event, CallEvent):
            self._call(event)
        elif isinstance(event, RolloutEvent):
            self._rollout_event(event)
        elif isinstance(event, RewardEvent):
            if event.status == RewardStatus.INFRA_FAILURE:
                self._status_of(event.rollout_id, event.attempt_id).infra = True
        elif isinstance(event, Trajectory):
            self._trajectory(event)
        elif isinstance(event, WeightVersion):
            if event.policy_version not in self._published_steps:  # the feed may read the topic twice
                insort(self._published, (event.timestamp_ms, event.policy_version))
                self._published_steps[event.policy_version] = event.step
        elif isinstance(event, Metric):
            self._metric(event)

    def add_error(self, topic: str, reason: str) -> None:
        """Count a record that could not be decoded (the dashboard shows the count and the last reason)."""
        self.errors[topic] += 1
        self.last_error = f"{topic}: {reason}"[:500]

    def _call(self, call: CallEvent) -> None:
        start = call.timestamp_ms // (self.bucket_s * 1000) * self.bucket_s * 1000
        bucket = self._buckets.get(start)
        if bucket is None:
            bucket = self._buckets[start] = _Bucket()
            if len(self._buckets) > self.max_buckets:
                del self._buckets[min(self._buckets)]
        bucket.calls += 1
        bucket.generated += len(call.generated_tokens)
        bucket.prompt += call.prompt_len
        if call.call_kind == CallKind.MAIN:
            i = bisect_right(self._published, (call.timestamp_ms, float("inf")))
            published = self._published[i - 1][1] if i else 0
            lag = max(0, published - call.policy_version)
            bucket.lag_calls += 1
            bucket.lag_sum += lag
            bucket.lag_max = max(bucket.lag_max, lag)

    def _status_of(self, rollout_id: str, attempt_id: str | None) -> _RolloutStatus:
        status = self._status.get(rollout_id)
        if status is None:
            status = self._status[rollout_id] = _RolloutStatus(attempt_id=attempt_id)
            if len(self._status) > self.max_rollouts:
                del self._status[next(iter(self._status))]
        return status

    def _rollout_event(self, event: RolloutEvent) -> None:
        status = self._status_of(event.rollout_id, event.attempt_id)
        if event.state == RolloutState.STARTED:
            key = (event.attempt, event.timestamp_ms)
            if key > status.attempt:  # a newer attempt (a re-run): show it from scratch
                infra_same = status.infra and status.attempt_id == event.attempt_id
                status.attempt, status.attempt_id, status.state = key, event.attempt_id, RolloutState.STARTED
                status.exit_code, status.infra = None, infra_same
            return
        if status.attempt_id not in (None, event.attempt_id) and status.attempt[0] > event.attempt:
            return  # the end of an attempt already superseded
        status.attempt_id = event.attempt_id
        if status.state is None or status.state is RolloutState.STARTED or event.state is RolloutState.FAILED:
            status.state, status.exit_code = event.state, event.exit_code

    def _trajectory(self, t: Trajectory) -> None:
        if t.status == TrajectoryStatus.INFRA_FAILURE:
            self._status_of(t.rollout_id, t.attempt_id).infra = True
        old = self._trajectories.get(t.rollout_id)
        if old is not None and old.timestamp_ms > t.timestamp_ms:
            return
        self._trajectories[t.rollout_id] = _Settled(
            t.harness,
            t.step,
            t.status,
            t.reward,
            t.metadata.get("eval") == "true",
            t.leaves,
            t.prefix_reuse_ratio,
            sum(len(s.tokens) for s in t.segments if s.trainable),
            t.path_tokens,
            t.unique_tokens,
            t.timestamp_ms,
        )
        if old is None and len(self._trajectories) > self.max_rollouts:
            del self._trajectories[next(iter(self._trajectories))]

    def _metric(self, m: Metric) -> None:
        if m.name == "weights_applied":
            latency = m.values.get("publish_to_applied_s", float("nan"))
            self._applied.setdefault(m.source, []).append((m.timestamp_ms, m.policy_version, latency))
        elif m.name == "inference_stats":
            self._engines[m.source] = {
                **m.values,
                "policy_version": float(m.policy_version),
                "timestamp_ms": float(m.timestamp_ms),
            }
        elif m.name == "train_step" and m.step is not None:
            self._learner[m.step] = dict(m.values)

    # ---- output ---------------------------------------------------------------------------------------------------
    def status_counts(self) -> dict[str, int]:
        counts = Counter(s.status() for s in self._status.values())
        return {name: counts.get(name, 0) for name in STATUSES}

    def _reward(self) -> dict[str, Any]:
        sums: dict[str, dict[int, list[float]]] = {}
        for t in self._trajectories.values():
            if t.reward is None or t.status == TrajectoryStatus.INFRA_FAILURE:
                continue
            series = t.harness + (" (eval)" if t.eval else "")
            sums.setdefault(series, {}).setdefault(t.step, []).append(t.reward)
        out: dict[str, Any] = {}
        for series in sorted(sums):
            steps = sorted(sums[series])
            out[series] = {
                "steps": steps,
                "mean": [sum(sums[series][s]) / len(sums[series][s]) for s in steps],
                "n": [len(sums[series][s]) for s in steps],
            }
        return out

    def _tree(self) -> dict[str, Any]:
        sums: dict[str, _TreeSums] = {}
        for t in self._trajectories.values():
            if t.status not in TREE_STATUSES or t.unique <= 0:
                continue
            s = sums.setdefault(t.harness, _TreeSums())
            s.rollouts += 1
            s.leaves += t.leaves
            s.reuse += t.reuse
            s.trained += t.trained
            s.path += t.path
            s.unique += t.unique
        names = sorted(sums)
        return {
            "harnesses": names,
            "rollouts": [sums[h].rollouts for h in names],
            "leaves_per_rollout": [sums[h].leaves / sums[h].rollouts for h in names],
            "prefix_reuse": [sums[h].reuse / sums[h].rollouts for h in names],
            "trained_tokens": [sums[h].trained for h in names],
            "path_tokens": [sums[h].path for h in names],
            "unique_tokens": [sums[h].unique for h in names],
        }

    def _series(self) -> tuple[dict[str, Any], dict[str, Any]]:
        if not self._buckets:
            empty: dict[str, list[Any]] = {"t": []}
            return {**empty, "calls_per_s": [], "generated_tokens_per_s": [], "prompt_tokens_per_s": []}, {
                **empty,
                "mean": [],
                "max": [],
            }
        step = self.bucket_s * 1000
        first, last = min(self._buckets), max(self._buckets)
        first = max(first, last - (self.max_buckets - 1) * step)
        times, calls, gen, prompt, lag_t, lag_mean, lag_max = [], [], [], [], [], [], []
        for start in range(first, last + step, step):
            b = self._buckets.get(start, _Bucket())
            times.append(iso(start))
            calls.append(b.calls / self.bucket_s)
            gen.append(b.generated / self.bucket_s)
            prompt.append(b.prompt / self.bucket_s)
            if b.lag_calls:
                lag_t.append(iso(start))
                lag_mean.append(b.lag_sum / b.lag_calls)
                lag_max.append(b.lag_max)
        return (
            {"t": times, "calls_per_s": calls, "generated_tokens_per_s": gen, "prompt_tokens_per_s": prompt},
            {"t": lag_t, "mean": lag_mean, "max": lag_max},
        )

    def _weights(self) -> dict[str, Any]:
        applied = {}
        for engine in sorted(self._applied):
            rows = sorted(self._applied[engine])
            applied[engine] = {
                "t": [iso(r[0]) for r in rows],
                "version": [r[1] for r in rows],
                "latency_s": [None if r[2] != r[2] else r[2] for r in rows],
            }
        return {
            "published": {
                "t": [iso(t) for t, _ in self._published],
                "version": [v for _, v in self._published],
                "step": [self._published_steps.get(v) for _, v in self._published],
            },
            "applied": applied,
            "latest_published": self._published[-1][1] if self._published else None,
        }

    def snapshot(self) -> dict[str, Any]:
        """Everything the page draws, JSON-ready (no NaN: missing values are null)."""
        throughput, lag = self._series()
        engines = {name: {k: v for k, v in values.items() if v == v} for name, values in sorted(self._engines.items())}
        return {
            "updated_ms": int(time.time() * 1000),
            "started_ms": self.started_ms,
            "records": dict(sorted(self.records.items())),
            "errors": {"count": sum(self.errors.values()), "by_topic": dict(self.errors), "last": self.last_error},
            "reward": self._reward(),
            "status": self.status_counts(),
            "tree": self._tree(),
            "throughput": throughput,
            "lag": lag,
            "weights": self._weights(),
            "engines": engines,
            "learner": {
                "steps": sorted(self._learner),
                "loss": [self._learner[s].get("loss") for s in sorted(self._learner)],
            },
            "health": [row.to_dict() for row in self.health.rows()],
        }
