"""The training curriculum (producers/scheduler/curriculum.py): spec parsing, families, the weighted draw, its hook in
``plan_step`` (no curriculum: the old draw byte for byte) and the spec derived from measured solve rates."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace

import pytest

from clawbase.errors import ConfigError
from producers.scheduler import curriculum as C
from producers.scheduler.plan import StepPlan, plan_step
from producers.scheduler.settings import SchedulerSettings
from producers.tasks.cpu import TEMPLATES, cpu_suite

TASKS = cpu_suite().split("train")
FAMILIES = sorted(TEMPLATES)


def old_draw(tasks: list, n: int, rng: random.Random) -> list:
    """plan_step's task draw before the curriculum existed."""
    chosen = rng.sample(list(tasks), min(n, len(tasks)))
    while len(chosen) < n:
        chosen.append(rng.choice(list(tasks)))
    return chosen


def test_families_of_builtin_cpu_are_its_templates() -> None:
    assert sorted({C.family(t) for t in TASKS}) == FAMILIES
    other = replace(TASKS[0], task_id="train-017-csv_merge", metadata={})
    assert C.family(other) == "csv"
    assert C.family(replace(TASKS[0], task_id="007", metadata={})) == "all"


def test_parse() -> None:
    assert C.parse("", TASKS) == {}
    assert C.parse(" replace=3, sum=1.5 ,*=0.25", TASKS) == {"replace": 3.0, "sum": 1.5, "*": 0.25}


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("replce=2", "unknown family 'replce'; the tasks' families: append, copy, count"),
        ("replace", "not FAMILY=WEIGHT"),
        ("replace=x", "not a number"),
        ("replace=-1", ">= 0"),
        ("replace=nan", ">= 0"),
        ("replace=0,*=0", "every family weight 0"),
    ],
)
def test_parse_errors_name_the_field(spec: str, says: str) -> None:
    with pytest.raises(ConfigError, match="CLAWSTREAM_SCHEDULER_CURRICULUM") as err:
        C.parse(spec, TASKS)
    assert says in str(err.value)


@pytest.mark.parametrize(("seed", "n"), [(0, 4), (1, 32), (7, 96), (3, 150)])
def test_no_curriculum_draws_exactly_as_before(seed: int, n: int) -> None:
    a, b = random.Random(seed), random.Random(seed)
    for _ in range(3):
        assert C.draw(TASKS, n, a) == old_draw(TASKS, n, b)
        assert C.draw(TASKS, n, a, {}) == old_draw(TASKS, n, b)
    assert a.random() == b.random()  # the RNG moved by the same amount


def test_plan_step_without_curriculum_is_unchanged() -> None:
    plan = StepPlan(4, 2, {"agentloop": 1.0, "agentloop-anthropic": 1.0})
    a, b = random.Random(5), random.Random(5)
    for step in range(5):
        got = [r.group_id for r in plan_step(step, TASKS, plan, a)]
        chosen = old_draw(TASKS, 4, b)
        harnesses = ["agentloop"] * 2 + ["agentloop-anthropic"] * 2
        b.shuffle(harnesses)
        want = [f"{t.suite}/{t.task_id}|{h}|{step}" for t, h in zip(chosen, harnesses, strict=True) for _ in range(2)]
        assert got == want


def test_weighted_draw_is_distinct_deterministic_and_follows_the_weights() -> None:
    weights = C.parse("replace=3,delete=1", TASKS)
    draws = [C.draw(TASKS, 8, random.Random(s), weights) for s in range(300)]
    assert all(len({t.task_id for t in d}) == 8 for d in draws)  # 24 tasks of positive weight: all distinct
    assert draws[:5] == [C.draw(TASKS, 8, random.Random(s), weights) for s in range(5)]
    fams = Counter(C.family(t) for d in draws for t in d)
    assert set(fams) == {"replace", "delete"}
    # 12 tasks each: at most 8 of one family per step, so replace's share is under 3/4 but well above delete's.
    assert fams["replace"] > 1.2 * fams["delete"]


def test_unnamed_families_get_the_star_weight_and_few_tasks_are_drawn_again() -> None:
    weights = C.parse("sum=1,*=1", TASKS)
    fams = Counter(C.family(t) for s in range(200) for t in C.draw(TASKS, 4, random.Random(s), weights))
    assert set(fams) == set(FAMILIES)
    few = C.draw(TASKS, 20, random.Random(0), C.parse("sum=1", TASKS))
    assert len(few) == 20 and {C.family(t) for t in few} == {"sum"} and len({t.task_id for t in few}) == 12


def test_a_restarted_scheduler_draws_the_same_steps() -> None:
    """The scheduler's RNG replayed step by step (as ``Scheduler._resume`` re-plans) gives the same groups."""
    plan = StepPlan(4, 2, {"agentloop": 1.0}, curriculum=C.parse("replace=2,count=1,*=0.5", TASKS))
    first, again = random.Random(3), random.Random(3)
    run = [[r.group_id for r in plan_step(s, TASKS, plan, first)] for s in range(6)]
    assert [[r.group_id for r in plan_step(s, TASKS, plan, again)] for s in range(6)] == run


def test_weights_from_measured_rates() -> None:
    w = C.weights_from_rates({"copy": (1.0, 1.0), "replace": (0.0, 0.3), "sum": (0.5, 0.9), "x": (0.0, 0.0)})
    assert w["copy"] == w["x"] == 0.05  # always solved, or never: groups carry no signal; the floor keeps them
    assert w["replace"] > w["sum"] > 0.05
    assert C.parse(C.format_spec(w), [replace(TASKS[0], metadata={"template": f}) for f in w]) == w


def test_the_setting_is_read_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLAWSTREAM_SCHEDULER_CURRICULUM", "replace=2,*=1")
    assert SchedulerSettings().curriculum == "replace=2,*=1"


def test_refills_follow_the_curriculum() -> None:
    """A refill group (a step's group that trained nothing, replaced) draws from the curriculum's families only; with
    none, as before (``Random(...).choice``)."""
    from producers.scheduler.refill import Refill, Refills

    weighted = StepPlan(1, 2, {"agentloop": 1.0}, curriculum=C.parse("replace=1,sum=1", TASKS))
    refills = Refills(100, drop_equal=True, run_key="k", seed=0)
    picked = [refills.plan(Refill(0, "agentloop", k), TASKS, weighted, 0) for k in range(30)]
    fams = Counter(C.family(TASKS_BY_ID[rs[0].task_id]) for rs in picked if rs)
    assert set(fams) == {"replace", "sum"} and sum(fams.values()) == 24  # 12 + 12 tasks, then none left
    plain = Refills(100, drop_equal=True, run_key="k", seed=0).plan(
        Refill(0, "agentloop", 0), TASKS, StepPlan(1, 2, {}), 0
    )
    assert plain and plain[0].task_id == random.Random("0:refill:0:agentloop:0").choice(TASKS).task_id


TASKS_BY_ID = {t.task_id: t for t in TASKS}


def test_a_runs_recorded_command_line_carries_the_curriculum() -> None:
    from clawstream.demo import seeds

    cfg = {"steps": 3, "seed": 0, "curriculum": "replace=2,*=1", "train_grader": "partial"}
    assert "--curriculum 'replace=2,*=1' --train-grader partial" in seeds.command(cfg)
    assert "--curriculum" not in seeds.command({**cfg, "curriculum": "", "train_grader": ""})
