"""clawstream.demo.families: held-out before/after per task family, paired, from summary.json's per-task rewards."""

from __future__ import annotations

import math

from clawstream.demo import families, seeds


def result(mode: str, rewards: dict[str, float], harnesses: tuple[str, ...] = ("agentloop",)) -> dict:
    return {"per_task": {f"{h}/{mode}": dict(rewards) for h in harnesses}}


def test_family_is_the_builtin_ids_template_suffix_and_other_ids_are_other() -> None:
    assert families.family_of("heldout-017-replace") == "replace"
    assert families.family_of("train-003-write_two") == "write_two"
    assert families.family_of("pinchbench/calendar-1") == "other"
    assert families.family_of("heldout-017-") == "other"


def test_rows_pair_the_same_tasks_per_family_with_the_paired_standard_error() -> None:
    before = result("greedy", {"heldout-000-sum": 0.0, "heldout-001-sum": 1.0, "heldout-002-copy": 1.0, "x-9": 0.5})
    after = result("greedy", {"heldout-000-sum": 1.0, "heldout-001-sum": 1.0, "heldout-002-copy": 0.0})
    rows = {r["family"]: r for r in families.family_rows(families.pairs(before, after, "greedy"))}
    assert list(rows) == ["copy", "sum", "all"]  # "x-9" has no "after": not a pair
    assert (rows["sum"]["n"], rows["sum"]["before"], rows["sum"]["after"]) == (2, 0.5, 1.0)
    assert rows["sum"]["gain"] == 0.5 and math.isclose(rows["sum"]["gain_se"], 0.5)  # diffs 1, 0: s.d. .707 / √2
    assert rows["copy"]["gain"] == -1.0 and rows["copy"]["gain_se"] is None  # one pair: no s.e.
    assert (rows["all"]["n"], rows["all"]["up"], rows["all"]["down"]) == (3, 1, 1)
    assert math.isclose(rows["all"]["gain"], 0.0)


def test_other_modes_are_not_mixed_in_and_harnesses_pool() -> None:
    before = {**result("greedy", {"heldout-000-sum": 0.0}, ("a", "b")), "x": 1}
    before["per_task"]["a/sampled"] = {"heldout-000-sum": 1.0}
    after = result("greedy", {"heldout-000-sum": 1.0}, ("a", "b"))
    after["per_task"]["a/sampled"] = {"heldout-000-sum": 0.0}
    greedy = families.family_rows(families.pairs(before, after, "greedy"))
    assert [(r["family"], r["n"], r["gain"]) for r in greedy] == [("sum", 2, 1.0), ("all", 2, 1.0)]
    table = families.family_tables([(before, after)], ["greedy", "sampled"])
    assert "greedy, per task family" in table and "sampled, per task family" in table
    assert "| sum | 1 | 1.000 | 0.000 | -1.000 | 0 / 1 |" in table


def test_results_without_per_task_rewards_give_no_table() -> None:
    assert families.family_tables([({}, {})], ["greedy"]) == ""


def test_the_seeds_report_pools_the_runs_per_family() -> None:
    runs = []
    for seed, gained in enumerate((1.0, 0.0)):
        before = result("greedy", {"heldout-000-delete": 0.0, "heldout-001-copy": 1.0})
        after = result("greedy", {"heldout-000-delete": gained, "heldout-001-copy": 1.0})
        row = {"harness": "agentloop", "mode": "greedy", "before": 0.5, "after": 0.5 + gained / 2}
        row |= {"gain": gained / 2, "gain_se": 0.1, "n_paired": 2, "significant": False}
        runs.append(
            seeds.Run(f"r{seed}", {"config": {"seed": seed}, "before": before, "after": after, "before_after": [row]})
        )
    text = seeds.report(runs)
    assert "| delete | 2 | 0.000 | 0.500 | +0.500 ± 0.500 | 1 / 0 |" in text
    assert "| copy | 2 | 1.000 | 1.000 | +0.000 ± 0.000 | 0 / 0 |" in text
