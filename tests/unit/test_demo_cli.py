"""`clawstream demo --help` states the defaults of DemoConfig (the CLI imports the demo lazily, so the numbers are
written in the help text: this keeps them honest), and `clawstream eval --help` the defaults of EvalConfig."""

from __future__ import annotations

import re

import pytest
from click.testing import CliRunner

from clawstream.cli import main
from clawstream.demo.config import DemoConfig
from clawstream.stack.evaluate import EvalConfig


def _defaults(command: str) -> dict[str, str]:
    out = CliRunner().invoke(main, [command, "--help"], terminal_width=400).output
    found = {}
    for match in re.finditer(r"--([a-z-]+)[^\n]*?\[default:\s*([^\]]+)\]", out.replace("\n" + " " * 30, " ")):
        found[match.group(1)] = " ".join(match.group(2).split())
    return found


def test_demo_help_states_the_configs_defaults() -> None:
    d, cfg = _defaults("demo"), DemoConfig()
    fields = {
        "steps": "steps",
        "tasks-per-step": "tasks_per_step",
        "group-size": "group_size",
        "lr": "lr",
        "seed": "seed",
        "sft-seed": "sft_seed",
        "eval-tasks": "eval_tasks",
        "concurrency": "concurrency",
        "timeout": "timeout_s",
    }
    for flag, name in fields.items():
        value = getattr(cfg, name)
        assert flag in d, (flag, d)
        assert float(d[flag]) == float(value), (flag, d[flag], value)
    assert d["eval-mode"] == ", ".join(cfg.eval_modes)
    assert cfg.sft_steps is None and d["sft-steps"].startswith("the shipped warm start")  # not a step count


def test_eval_help_states_the_configs_defaults() -> None:
    d, cfg = _defaults("eval"), EvalConfig()
    assert d["harness"] == ", ".join(cfg.harnesses) and d["suite"] == cfg.suite and d["split"] == cfg.split
    assert int(d["tasks"]) == cfg.tasks and d["mode"] == ", ".join(cfg.modes)
    assert float(d["temperature"]) == cfg.temperature and int(d["max-tokens"]) == cfg.max_tokens
    assert int(d["concurrency"]) == cfg.concurrency


def test_demo_passes_learner_hyperparameters_by_name_and_refuses_unknown_ones() -> None:
    from clawbase.errors import ClawstreamError
    from clawstream.demo.config import check

    check(DemoConfig(hp=("mini_batches=2", "kl_coef=0.01")))
    for bad in ("bogus=1", "mini_batches", "lr=1e-4"):  # unknown; no value; has its own flag
        with pytest.raises(ClawstreamError, match="--hp"):
            check(DemoConfig(hp=(bad,)))
