"""`clawstream demo --harnesses opencode,agentloop` at its smallest (#32 item 4): one RL step mixing a real harness
binary (opencode, run by the sandbox worker) with the built-in loop in one batch, every service a real process on
the real broker; then `--resume` of the finished run.

Asserts: the trained step's batch holds both harnesses (the learner's ``reward/<harness>`` metrics), summary.json
has the step, the per-phase seconds of its version and the cost per rollout of each harness (opencode's prompt is
~14k tokens, the built-in loop's ~1.5k); state.json records the mix; a resume of the run trains nothing again
(same versions), finds its evaluation-less summary and counts its resume. Numbers are not asserted: the shipped warm
start was never trained on opencode's format, so its rollouts there score ~0 (docs/quickstart.md).

Without npm or the opencode package the test SKIPS with the reason (and FAILS under ``CI=true``, as
``tests/e2e/test_real_harness_rl.py``). 92 s on 2 shared cores (the resume included).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.support.harness_tasks import installed

pytestmark = [pytest.mark.e2e, pytest.mark.integration]


def _install_or_skip() -> None:
    try:
        installed("opencode")
    except pytest.skip.Exception as exc:
        if os.environ.get("CI", "").strip().lower() in {"1", "true", "yes", "on"}:
            pytest.fail(f"CI=true: the real harness must run, but {exc.msg}", pytrace=False)
        raise


@pytest.mark.timeout(1800)
def test_one_step_through_opencode_and_agentloop_then_resume(
    kafka_bootstrap: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from clawbase.settings import clawstream_home
    from clawstream.demo import run_demo
    from clawstream.demo.config import DemoConfig
    from clawstream.demo.models import prepare_model
    from producers.harnesses.install import harness_root

    _install_or_skip()
    warm = prepare_model(clawstream_home() / "models", DemoConfig(progress=False))
    shared = harness_root()
    home = tmp_path / "home"
    home.mkdir()
    (home / "harnesses").symlink_to(shared)  # the installed binaries; runs, caches and models stay private
    monkeypatch.setenv("CLAWSTREAM_KAFKA_BOOTSTRAP_SERVERS", kafka_bootstrap)
    monkeypatch.setenv("CLAWSTREAM_HOME", str(home))
    sizes = {"steps": 1, "tasks_per_step": 2, "group_size": 2, "concurrency": 4, "eval_tasks": 0}
    sizes["zero_variance"] = "keep"  # the wiring, not learning: a group solved alike trains (no refills to wait for)
    result = run_demo(
        harnesses=("opencode", "agentloop"),
        model=warm,
        rollout_timeout_s=300.0,
        timeout_s=1200,
        progress=False,
        **sizes,
    )
    run_dir = Path(result["run_dir"])
    (step,) = result["trained"]
    assert {"reward/opencode", "reward/agentloop"} <= step.values.keys(), step.values
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [t["policy_version"] for t in summary["trained"]] == [1]
    assert summary["timeline"][0]["phases_s"]["learner"] is not None
    costs = summary["rollout_costs"]
    assert costs["opencode"]["rollouts"] >= 2 and costs["agentloop"]["rollouts"] >= 2
    assert costs["opencode"]["prompt_tokens"] > 5 * costs["agentloop"]["prompt_tokens"] > 0
    state = json.loads((run_dir / "state.json").read_text())
    assert state["config"]["harnesses"] == ["opencode", "agentloop"] and state["prefix"] == result["prefix"]

    again = run_demo(resume=run_dir.name, progress=False)
    assert again["prefix"] == result["prefix"] and again["applied"] == result["applied"]
    assert [m.policy_version for m in again["trained"]] == [1]
    assert json.loads((run_dir / "summary.json").read_text())["resumed"] == 1
