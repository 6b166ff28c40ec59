"""The demo's recipe flags: --logit-scale, --zero-variance, --train-/--eval-temperature (--temperature sets both), what
the run says it trained with, and a run recorded before the flags resumed as it was (groups kept)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from clawbase.errors import ClawstreamError
from clawstream.cli import main
from clawstream.demo.config import LOGIT_SCALE_ON_LR, DemoConfig, check, recipe
from clawstream.demo.run import eval_config, learner_hparams, open_run, scheduler_settings


def _cli(monkeypatch: pytest.MonkeyPatch, *args: str) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    monkeypatch.setattr("clawstream.demo.run_demo", lambda **kw: seen.update(kw))
    out = CliRunner().invoke(main, ["demo", *args])
    assert out.exit_code == 0, out.output
    return seen


def test_the_flags_reach_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not {"logit_scale_lr", "zero_variance", "train_temperature", "eval_temperature"} & _cli(monkeypatch).keys()
    seen = _cli(monkeypatch, "--logit-scale", "on", "--zero-variance", "keep", "--temperature", "0.7")
    assert seen["logit_scale_lr"] == LOGIT_SCALE_ON_LR and seen["zero_variance"] == "keep"
    assert seen["train_temperature"] == seen["eval_temperature"] == 0.7
    seen = _cli(monkeypatch, "--logit-scale", "off", "--temperature", "0.7", "--eval-temperature", "0.5")
    assert seen["logit_scale_lr"] == 0.0 and (seen["train_temperature"], seen["eval_temperature"]) == (0.7, 0.5)


def test_each_temperature_goes_where_it_belongs_and_the_recipe_says_which() -> None:
    cfg = DemoConfig(train_temperature=0.8, eval_temperature=0.5)
    mix = {"agentloop": 1.0}
    assert scheduler_settings(cfg, mix)["temperature"] == 0.8 and eval_config(cfg).temperature == 0.5
    assert scheduler_settings(cfg, mix)["zero_variance"] == "drop" and learner_hparams(cfg)["logit_scale_lr"] == 0.0
    assert recipe(DemoConfig()).startswith("logit scale off; groups with equal rewards dropped, refilled")
    assert recipe(DemoConfig(logit_scale_lr=LOGIT_SCALE_ON_LR)).startswith("logit scale on (lr 0.1)")
    assert recipe(DemoConfig(hp=("logit_scale_lr=0.05",))).startswith("logit scale on (lr 0.05)")  # --hp wins
    for bad in (DemoConfig(zero_variance="maybe"), DemoConfig(train_temperature=0.0)):
        with pytest.raises(ClawstreamError, match="--zero-variance|--train-temperature"):
            check(bad)


def test_a_run_recorded_before_the_flag_resumes_with_its_groups_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CLAWSTREAM_HOME", str(tmp_path))
    for name, recorded in (("old", {}), ("new", {"zero_variance": "drop"})):
        run_dir = tmp_path / "demo" / name
        run_dir.mkdir(parents=True)
        config = {k: v for k, v in asdict(DemoConfig(logit_scale_lr=0.1)).items() if k != "zero_variance"}
        (run_dir / "state.json").write_text(json.dumps({"prefix": f"demo-{name}.", "config": config | recorded}))
        run = open_run(None, name, {}, lambda _: None)
        assert run.cfg.zero_variance == ("keep" if name == "old" else "drop") and run.cfg.logit_scale_lr == 0.1
        assert json.loads((run_dir / "summary.json").read_text())["recipe"].startswith("logit scale on (lr 0.1)")
