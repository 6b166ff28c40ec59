"""`clawstream demo --harnesses` and `--resume` (#32 item 4), without a broker: the harness list is parsed and
checked before anything starts (unknown name, real harness not installed, too few groups per step), flows from the
CLI to the run; a run's recorded state restores its config and refuses changes other than --steps / --timeout;
summary.json is rewritten whole at each update; the per-harness rollout cost and the paired gain's arithmetic."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from clawbase.errors import ClawstreamError
from clawstream.cli import main
from clawstream.demo.config import HARNESS_MIX, DemoConfig, check
from clawstream.demo.costs import rollout_costs
from clawstream.demo.report import before_after_rows, paired_gain
from clawstream.demo.state import Summary, check_harnesses, harness_mix, load_state, parse_harnesses, save_state
from clawstream.stack.evaluate import EvalConfig, EvalResult
from producers.harnesses.install import HARNESSES, MARKER
from producers.scheduler.plan import EvalScore
from schemas.events import CallEvent, CallKind, Dialect, RewardEvent, RewardStatus, RolloutRequest
from schemas.topics import CALLS, REWARDS, ROLLOUT_REQUESTS


def test_default_is_todays_mix_and_names_parse_in_order() -> None:
    assert DemoConfig().harnesses == tuple(HARNESS_MIX)  # `make demo` unchanged
    assert harness_mix(DemoConfig().harnesses) == HARNESS_MIX
    assert parse_harnesses(" opencode, agentloop,,opencode ") == ("opencode", "agentloop")
    with pytest.raises(ClawstreamError, match="at least one harness"):
        parse_harnesses(" , ")


def test_unknown_harness_and_too_few_groups_are_refused_by_flag() -> None:
    check(DemoConfig(harnesses=("agentloop", "agentloop-anthropic")))
    with pytest.raises(ClawstreamError, match=r"--harnesses: unknown harness 'opencod'.*clawstream harness list"):
        check(DemoConfig(harnesses=("opencod", "agentloop")))
    with pytest.raises(ClawstreamError, match=r"--tasks-per-step 1 .* use --tasks-per-step 2"):
        check(DemoConfig(harnesses=("agentloop", "agentloop-anthropic"), tasks_per_step=1))


def test_a_real_harness_must_be_installed_and_the_error_names_the_install(tmp_path: Path) -> None:
    check_harnesses(("agentloop",), 1, home=tmp_path)  # built in: nothing to install
    with pytest.raises(ClawstreamError, match=r"opencode is a real harness.*`clawstream harness install opencode`"):
        check_harnesses(("opencode", "agentloop"), 2, home=tmp_path)
    exe = tmp_path / "harnesses" / "opencode" / "node_modules" / ".bin" / "opencode"
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\n")
    with pytest.raises(ClawstreamError, match="not installed"):  # a half-finished install (no marker) is not one
        check_harnesses(("opencode",), 1, home=tmp_path)
    marker = tmp_path / "harnesses" / "opencode" / MARKER
    marker.write_text('{"package": "opencode-ai"}\n')  # installed before versions were pinned
    with pytest.raises(ClawstreamError, match=r"not installed"):
        check_harnesses(("opencode",), 1, home=tmp_path)
    marker.write_text('{"package": "opencode-ai", "spec": "opencode-ai@1.0.0"}\n')
    with pytest.raises(ClawstreamError, match=r"installed as opencode-ai@1.0.0, pinned opencode-ai@1\.18\.33"):
        check_harnesses(("opencode",), 1, home=tmp_path)
    marker.write_text(json.dumps({"package": "opencode-ai", "spec": HARNESSES["opencode"].spec}) + "\n")
    check_harnesses(("opencode", "agentloop"), 2, home=tmp_path)


def test_cli_passes_harnesses_and_resume_to_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}
    monkeypatch.setattr("clawstream.demo.run_demo", lambda **kw: seen.update(kw))
    out = CliRunner().invoke(main, ["demo", "--harnesses", "opencode,agentloop", "--steps", "2"])
    assert out.exit_code == 0, out.output
    assert seen["harnesses"] == ("opencode", "agentloop") and seen["steps"] == 2 and seen["resume"] is None
    seen.clear()
    out = CliRunner().invoke(main, ["demo", "--resume", "20261204-230000", "--steps", "4"])
    assert out.exit_code == 0, out.output
    assert seen["resume"] == "20261204-230000" and seen["steps"] == 4 and "engine" not in seen


def test_resume_restores_the_recorded_config_and_refuses_other_changes(tmp_path: Path) -> None:
    run_dir = tmp_path / "demo" / "r1"
    run_dir.mkdir(parents=True)
    cfg = DemoConfig(harnesses=("opencode", "agentloop"), steps=2, model=tmp_path / "m", eval_modes=("greedy",))
    save_state(run_dir, "demo-r1.", cfg)
    found_dir, prefix, got = load_state(
        tmp_path, "r1", DemoConfig, {"steps": 5, "harnesses": ("opencode", "agentloop")}
    )
    assert (found_dir, prefix) == (run_dir, "demo-r1.")
    assert got == DemoConfig(harnesses=("opencode", "agentloop"), steps=5, model=tmp_path / "m", eval_modes=("greedy",))
    with pytest.raises(ClawstreamError, match=r"--resume r1: --group-size, --harnesses differ"):
        load_state(tmp_path, "r1", DemoConfig, {"group_size": 4, "harnesses": ("agentloop",)})
    with pytest.raises(ClawstreamError, match="no run directory"):
        load_state(tmp_path, "r2", DemoConfig, {})
    (tmp_path / "demo" / "r3").mkdir()
    with pytest.raises(ClawstreamError, match="state.json is missing"):
        load_state(tmp_path, "r3", DemoConfig, {})


def test_summary_is_rewritten_whole_and_a_resume_starts_from_it(tmp_path: Path) -> None:
    s = Summary(tmp_path)
    s.update(trained=[{"step": 0}])
    s.update(before={"rows": []})
    assert json.loads((tmp_path / "summary.json").read_text()) == {"trained": [{"step": 0}], "before": {"rows": []}}
    assert Summary(tmp_path).data["trained"] == [{"step": 0}]
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]  # no temporary file left behind


def _call(rid: str, at: int, prompt: int, cached: int | None) -> bytes:
    empty = np.zeros(0, dtype=np.int32)
    return CallEvent(
        rollout_id=rid,
        policy_version=0,
        timestamp_ms=at,
        call_id=f"{rid}-{at}",
        seq=0,
        dialect=Dialect.OPENAI_CHAT,
        requested_model="m",
        call_kind=CallKind.MAIN,
        new_tokens=empty,
        prompt_len=prompt,
        generated_tokens=empty,
        logprobs=np.zeros(0, dtype=np.float32),
        finish_reason="stop",
        cached_prompt_tokens=cached,
    ).to_bytes()


def _req(rid: str, harness: str, eval_: bool = False) -> bytes:
    return RolloutRequest(
        rollout_id=rid,
        policy_version=0,
        timestamp_ms=0,
        suite="s",
        task_id="t",
        harness=harness,
        group_id=f"s/t|{harness}|0",
        step=0,
        timeout_s=60.0,
        eval=eval_,
    ).to_bytes()


def _reward(rid: str, at: int, status: RewardStatus = RewardStatus.OK) -> bytes:
    return RewardEvent(
        rollout_id=rid, policy_version=0, timestamp_ms=at, status=status, reward=1.0, attempt_id=rid, grader="g"
    ).to_bytes()


def test_rollout_cost_per_harness() -> None:
    records = {
        ROLLOUT_REQUESTS: [_req("a", "opencode"), _req("b", "opencode"), _req("c", "agentloop"), _req("e", "x", True)],
        CALLS: [
            _call("a", 1000, 13000, 0),
            _call("a", 3000, 13500, 13000),
            _call("b", 2000, 13000, 12000),
            _call("c", 1000, 800, None),
            _call("e", 1000, 10, 0),
        ],
        REWARDS: [_reward("a", 5000), _reward("b", 2500, RewardStatus.INFRA_FAILURE), _reward("c", 1500)],
    }
    got = rollout_costs(records)
    assert set(got) == {"opencode", "agentloop"}  # eval requests are not the run's rollouts
    oc = got["opencode"]
    assert (oc["rollouts"], oc["rewarded"], oc["calls"]) == (2, 1, 1.5)  # b's only reward was an infra failure
    assert oc["prompt_tokens"] == (13000 + 13500 + 13000) / 2 and oc["cached_tokens"] == 25000 / 2
    assert oc["seconds"] == 4.0 and oc["cached_share"] == round(25000 / 39500, 4)  # a: first call 1 s → reward 5 s
    assert got["agentloop"]["cached_tokens"] == 0 and got["agentloop"]["seconds"] == 0.5


def _result(per_task: dict[str, float]) -> EvalResult:
    values = list(per_task.values())
    mean = sum(values) / len(values)
    se = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1) / len(values))
    row = EvalScore("opencode", "greedy", len(values), len(values), mean, se, None, 0, 0, 0)
    return EvalResult(
        "m", EvalConfig(harnesses=("opencode",)), [row], 1.0, "", {"per_task": {"opencode/greedy": per_task}}
    )


def test_gain_is_paired_over_the_same_tasks() -> None:
    before = {"t1": 0.2, "t2": 0.8, "t3": 0.5, "t4": 1.0}
    after = {"t1": 0.3, "t2": 0.9, "t3": 0.5, "t4": 1.0, "t5": 0.0}  # t5: graded only after, not paired
    g, se, n = paired_gain(before, after)
    assert n == 4 and g == pytest.approx(0.05) and se == pytest.approx(0.05 / math.sqrt(4) * math.sqrt(4 / 3))
    row = before_after_rows(_result(before), _result(after))[0]
    assert row["se_kind"] == "paired" and row["n_paired"] == 4 and row["gain_se"] == pytest.approx(se)
    round_trip = EvalResult.from_json(_result(before).to_json())
    assert round_trip.task_rewards("opencode", "greedy") == before
    old = _result(before)
    old.extra.clear()  # a result cached before per-task records: the independent estimate
    assert before_after_rows(old, _result(after))[0]["se_kind"] == "independent"


def test_rollout_timeout_reaches_the_run_and_keeps_older_eval_cache_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}
    monkeypatch.setattr("clawstream.demo.run_demo", lambda **kw: seen.update(kw))
    out = CliRunner().invoke(main, ["demo", "--harnesses", "opencode,agentloop", "--rollout-timeout", "300"])
    assert out.exit_code == 0, out.output
    assert seen["rollout_timeout_s"] == 300.0
    with pytest.raises(ClawstreamError, match="--rollout-timeout must be > 0"):
        check(DemoConfig(rollout_timeout_s=0.0))
    with pytest.raises(ClawstreamError, match="--rollout-timeout must be > 0"):  # clawstream eval's flag
        EvalConfig(rollout_timeout_s=-1.0)
    # The field is absent from the cache key when unset, so results cached before it existed are still found.
    assert EvalConfig(sampling_seed=None).key() == "e76c6212fea8e725"  # the key before either field was added
    # Seeded (the default) results are not unseeded ones: a cached unseeded evaluation is not reused as seeded.
    assert EvalConfig().key() != EvalConfig(sampling_seed=None).key() != EvalConfig(sampling_seed=1).key()
    assert EvalConfig().key() != EvalConfig(rollout_timeout_s=300.0).key()
    assert "rollout_timeout_s" in EvalResult.from_json(_result({"t": 1.0, "u": 0.0}).to_json()).config.__dict__
    stored = _result({"t": 1.0, "u": 0.0}).to_json()
    del stored["config"]["sampling_seed"]  # an eval.json written before seeding: read back as unseeded
    assert EvalResult.from_json(stored).config.sampling_seed is None


def test_real_harnesses_are_told_from_the_built_in_loops() -> None:
    from clawstream.demo.state import real_harnesses

    assert real_harnesses(("opencode", "agentloop", "codex", "agentloop-anthropic")) == ("opencode", "codex")
    assert real_harnesses(tuple(HARNESS_MIX)) == ()


def test_a_real_harness_s_evaluation_is_reused_the_same_utc_day_only(tmp_path: Path) -> None:
    """opencode's prompt carries the date: another day's "before" was measured on other prompts (#32)."""
    from clawstream.demo.run import eval_cache_path

    model = Path(__file__).resolve().parents[2] / "models" / "opencode-warmstart"
    real = EvalConfig(harnesses=("opencode", "agentloop"), tasks=128)
    day1 = eval_cache_path(model, real, tmp_path, today="2026-12-06")
    assert day1.name.endswith("-2026-12-06.json") and day1 != eval_cache_path(model, real, tmp_path, "2026-12-07")
    assert eval_cache_path(model, real, tmp_path).name != eval_cache_path(model, real, tmp_path, "1999-01-01").name
    built_in = EvalConfig(harnesses=("agentloop", "agentloop-anthropic"), tasks=128)  # no date in their prompts
    assert eval_cache_path(model, built_in, tmp_path, "2026-12-06") == eval_cache_path(model, built_in, tmp_path)
