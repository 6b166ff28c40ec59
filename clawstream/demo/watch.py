"""What a user watches while the quickstart trains: a progress bar of each step's rollouts, one line per trained
step, one line per weight version the engine starts serving, and one line per version measured on held-out tasks.

Topics in (the run's own prefix, from the beginning): ``clawstream.rollout.requests`` (which rollout belongs to which
step), ``clawstream.rewards`` (a rollout is done), ``clawstream.metrics`` (the learner's ``train_step`` and the
engine's ``weights_applied``), with evidence on ``clawstream.weights`` (each published version goes to the
background measurement of ``evidence.py``). Nothing is produced or committed.

Per trained step the line shows the mean reward of the batch's rollouts per harness, the policy-gradient loss
exactly as the learner computed it (``policy_loss``, in scientific notation: it is near 0 by construction, see
``learner.step``), the clipped-token fraction, the mean truncated-IS weight, the KL between the policy before and
after the step on the batch's own tokens (``update_kl``), π_old's entropy, and the learner's tokens/s.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from clawbase.errors import ClawstreamError
from clawbase.kafka.clients import make_consumer
from clawbase.settings import KafkaSettings
from clawstream.stack import Stack
from schemas.events import Metric, RewardEvent, RewardStatus, RolloutRequest, WeightVersion
from schemas.topics import METRICS, REWARDS, ROLLOUT_REQUESTS, WEIGHTS
from warmstart.progress import progress_bar


def step_line(metric: Metric) -> str:
    """The printed line of one trained step (every number straight from the learner's metric)."""
    v = metric.values
    rewards = "  ".join(
        f"{k.removeprefix('reward/')} {val:.2f}"
        for k, val in sorted(v.items())
        if k.startswith("reward/") and k != "reward/mean"
    )
    return (
        f"step {metric.step}: reward {rewards} | pg loss {v.get('policy_loss', float('nan')):+.4e}  "
        f"clipped {v.get('clip_frac', 0.0):.1%}  IS weight {v.get('is_weight_mean', float('nan')):.3f}  "
        f"KL {v.get('update_kl', float('nan')):.2e}  entropy {v.get('entropy', float('nan')):.3f}"
        + (f"  logit scale {v['logit_scale']:.3f}" if "logit_scale" in v else "")  # learner/logit_scale.py
        + f" | {v.get('tokens_per_s', 0.0):.0f} tok/s, {v.get('step_seconds', 0.0):.1f} s"
        f" → v{metric.policy_version}"
    )


@dataclass
class StepRollouts:
    expected: int
    issued: set[str] = field(default_factory=set)
    done: set[str] = field(default_factory=set)


class Watcher:
    """Follows a training run's topics and prints what happens; ``follow`` returns when ``steps`` are trained and
    served."""

    def __init__(
        self,
        kafka: KafkaSettings,
        steps: int,
        rollouts_per_step: int,
        *,
        progress: bool = True,
        say: Callable[[str], None] = print,
        on_step: Callable[[list[Metric]], None] | None = None,
        evidence: Any = None,
    ) -> None:
        """``on_step(trained so far)``: called after each trained step (the demo rewrites summary.json there);
        ``evidence`` (``evidence.Evidence``): given each published weight version, its lines printed as they come."""
        self.kafka, self.steps, self.per_step = kafka, steps, rollouts_per_step
        self.progress, self.say, self.on_step, self.evidence = progress, say, on_step, evidence
        self.consumer = make_consumer(kafka, f"{kafka.topic_prefix}demo-watch")
        topics = (METRICS, ROLLOUT_REQUESTS, REWARDS) + ((WEIGHTS,) if evidence is not None else ())
        self.consumer.subscribe([kafka.topic(t) for t in topics])
        self.by_rollout: dict[str, int] = {}
        self.rollouts: dict[int, StepRollouts] = defaultdict(lambda: StepRollouts(rollouts_per_step))
        self.trained: list[Metric] = []
        self.applied: list[Metric] = []
        self.started = time.monotonic()
        self._bar: Any = None
        self._bar_step = -1

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        self.consumer.close()

    def _print(self, line: str) -> None:
        elapsed = time.monotonic() - self.started
        text = f"[{elapsed:6.0f}s] {line}"
        if self._bar is not None and not getattr(self._bar, "disable", True):
            self._bar.write(text)
        else:
            self.say(text)

    def follow(self, stack: Stack, timeout_s: float, started: float | None = None) -> tuple[list[Metric], list[int]]:
        """Print until every step is trained and served; times are seconds since ``started`` (monotonic)."""
        deadline = time.monotonic() + timeout_s
        self.started = started if started is not None else time.monotonic()
        try:
            while len(self.trained) < self.steps or len(self.applied) < self.steps:
                if time.monotonic() > deadline:
                    raise ClawstreamError(
                        f"the demo did not finish {self.steps} steps within {timeout_s:.0f}s; see the logs"
                    )
                stack.check()
                for line in self.evidence.poll() if self.evidence is not None else ():
                    self._print(line)
                msg = self.consumer.poll(0.5)
                if msg is None or msg.error():
                    continue
                self._on(msg.topic(), msg.value())
                self._update_bar()
        finally:
            self.close()
        return self.trained, [m.policy_version for m in self.applied]

    def _on(self, topic: str, value: bytes) -> None:
        if topic == self.kafka.topic(ROLLOUT_REQUESTS):
            req = RolloutRequest.from_bytes(value)
            if not req.eval and req.step >= 0:
                self.by_rollout[req.rollout_id] = req.step
                self.rollouts[req.step].issued.add(req.rollout_id)
        elif topic == self.kafka.topic(REWARDS):
            reward = RewardEvent.from_bytes(value)
            step = self.by_rollout.get(reward.rollout_id)
            # An infrastructure failure may be re-issued (scheduler max_attempts): done only once finally graded.
            if step is not None and reward.status != RewardStatus.INFRA_FAILURE:
                self.rollouts[step].done.add(reward.rollout_id)
        elif topic == self.kafka.topic(WEIGHTS):
            if self.evidence is not None:
                self.evidence.submit(WeightVersion.from_bytes(value))
        elif topic == self.kafka.topic(METRICS):
            metric = Metric.from_bytes(value)
            # A resumed run reads its log again from the start, and its new engine applies the newest version once
            # more: count each version once, or a resumed run would stop before its last step.
            if metric.name == "train_step" and all(m.policy_version != metric.policy_version for m in self.trained):
                self.trained.append(metric)
                self._print(step_line(metric))
                if self.on_step is not None:
                    self.on_step(self.trained)
            elif metric.name == "weights_applied" and all(
                m.policy_version != metric.policy_version for m in self.applied
            ):
                self.applied.append(metric)
                self._print(
                    f"engine now serves v{metric.policy_version} "
                    f"(swap {metric.values.get('swap_latency_s', 0) * 1000:.0f} ms)"
                )

    def _update_bar(self) -> None:
        """One bar at a time: the lowest step whose rollouts are not all done (steps overlap under policy lag)."""
        open_steps = [s for s in range(self.steps) if len(self.rollouts[s].done) < self.per_step]
        if not open_steps:
            if self._bar is not None:
                self._bar.close()
                self._bar = None
            return
        step = open_steps[0]
        if step != self._bar_step:
            if self._bar is not None:
                self._bar.close()
            self._bar = progress_bar(
                self.per_step, f"step {step}/{self.steps} rollouts", "rollout", enabled=self.progress
            )
            self._bar_step = step
        done = len(self.rollouts[step].done)
        if done > self._bar.n:
            self._bar.update(done - self._bar.n)
