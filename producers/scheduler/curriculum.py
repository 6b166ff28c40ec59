"""Training curriculum (pure): which tasks a training step draws, weighted by task family.

A curriculum spec is ``family=weight,...`` (``CLAWSTREAM_SCHEDULER_CURRICULUM``; ``clawstream demo --curriculum``):
a family's weight is its share of a step's draws; ``*=w`` weighs every family not named, which otherwise gets 0. A
task's family (:func:`family`) is its ``template`` metadata (builtin:cpu: copy, write, write_two, count, append,
delete, replace, sum), else its task id's first ``-``-separated word that is not a split name or a number (``all``
when none is left). An empty spec is no curriculum: :func:`draw` then draws exactly as it always did
(``rng.sample``, then with replacement when there are fewer tasks than draws), byte for byte.

Weighted, a step draws its tasks without replacement with probability proportional to family weight / family size
(Efraimidis–Spirakis keys from the scheduler's RNG), so a restarted scheduler, replaying its steps with the same
seed, draws the same tasks. :func:`weights_from_rates` turns measured per-family solve rates into a spec
(``clawstream model curriculum``): the weight of a family is how often a GRPO group of its tasks is informative
(neither all solved nor all failed, at the sampled solve rate) times how often greedy decoding fails it.

Topics: none (used by ``producers.scheduler.plan.plan_step``).
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence

from clawbase.errors import ConfigError
from producers.tasks.model import Task

FIELD = "curriculum (CLAWSTREAM_SCHEDULER_CURRICULUM)"
OTHERS = "*"
_SPLITS = {"train", "heldout", "test", "eval", "dev", "val"}


def family(task: Task) -> str:
    """The task's family: its ``template`` metadata, else its id's first word that is no split name or number."""
    if task.metadata.get("template"):
        return str(task.metadata["template"])
    for word in task.task_id.replace("_", "-").split("-"):
        if word and word.lower() not in _SPLITS and not word.isdigit():
            return word
    return "all"


def parse(spec: str, tasks: Sequence[Task]) -> dict[str, float]:
    """``family=weight,...`` → weights, checked against the families of ``tasks``; {} for an empty spec."""
    known = sorted({family(t) for t in tasks})
    weights: dict[str, float] = {}
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        name, eq, value = (s.strip() for s in part.partition("="))
        if not eq or not name:
            raise ConfigError(f"{FIELD}: {part!r} is not FAMILY=WEIGHT (e.g. replace=2,sum=1,*=0.5)")
        if name != OTHERS and name not in known:
            raise ConfigError(f"{FIELD}: unknown family {name!r}; the tasks' families: {', '.join(known)} (or *)")
        try:
            w = float(value)
        except ValueError as exc:
            raise ConfigError(f"{FIELD}: weight of {name!r} is not a number: {value!r}") from exc
        if not math.isfinite(w) or w < 0:
            raise ConfigError(f"{FIELD}: weight of {name!r} must be a finite number >= 0, got {value!r}")
        weights[name] = w
    if weights and not any(_weight(weights, f) > 0 for f in known):
        raise ConfigError(f"{FIELD}: {spec!r} gives every family weight 0; give one a positive weight")
    return weights


def _weight(weights: Mapping[str, float], fam: str) -> float:
    return weights.get(fam, weights.get(OTHERS, 0.0))


def task_weights(tasks: Sequence[Task], weights: Mapping[str, float]) -> list[float]:
    """Per task: its family's weight divided by the family's size (so families share draws by their weights)."""
    fams = [family(t) for t in tasks]
    size: dict[str, int] = {}
    for f in fams:
        size[f] = size.get(f, 0) + 1
    return [_weight(weights, f) / size[f] for f in fams]


def draw(tasks: Sequence[Task], n: int, rng: random.Random, weights: Mapping[str, float] | None = None) -> list[Task]:
    """``n`` tasks for a step: distinct while there are enough (of positive weight), then drawn with replacement."""
    pool = list(tasks)
    if not weights:  # no curriculum: the scheduler's draw as it has always been
        chosen = rng.sample(pool, min(n, len(pool)))
        while len(chosen) < n:
            chosen.append(rng.choice(pool))
        return chosen
    w = task_weights(pool, weights)
    live = [(t, x) for t, x in zip(pool, w, strict=True) if x > 0]
    # Efraimidis–Spirakis: the n largest keys u^(1/w) are a weighted draw without replacement.
    keys = sorted(((rng.random() ** (1.0 / x), i) for i, (_, x) in enumerate(live)), reverse=True)
    chosen = [live[i][0] for _, i in keys[:n]]
    if len(chosen) < n:
        chosen += rng.choices([t for t, _ in live], weights=[x for _, x in live], k=n - len(chosen))
    return chosen


def informative(rate: float, group_size: int) -> float:
    """Probability that a group of ``group_size`` rollouts solving with probability ``rate`` is mixed."""
    return 1.0 - rate**group_size - (1.0 - rate) ** group_size


def weights_from_rates(
    rates: Mapping[str, tuple[float, float]], group_size: int = 8, floor: float = 0.05
) -> dict[str, float]:
    """Family → (greedy solve rate, sampled solve rate) → weight: (1 − greedy) × P(informative group), rounded to
    two places, at least ``floor`` (no family is dropped entirely: what is not trained on may be forgotten)."""
    return {
        fam: round(max(floor, (1.0 - greedy) * informative(sampled, group_size)), 2)
        for fam, (greedy, sampled) in sorted(rates.items())
    }


def format_spec(weights: Mapping[str, float]) -> str:
    """Weights → ``family=weight,...`` (the form :func:`parse` reads)."""
    return ",".join(f"{k}={v:g}" for k, v in weights.items())
