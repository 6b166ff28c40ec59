"""clawstream.demo.seeds: several demo runs side by side (table, commands, plot) from their summary.json."""

from __future__ import annotations

import json
import math
import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner

from clawbase.errors import ClawstreamError
from clawstream.cli import main
from clawstream.cli.runs import demo as demo_command
from clawstream.demo import seeds


def summary(seed: int, gain: float, se: float = 0.02) -> dict:
    rows = [
        {
            "harness": h,
            "mode": m,
            "before": 0.5,
            "after": 0.5 + gain,
            "gain": gain,
            "gain_se": se,
            "n_paired": 128,
            "n_after": 128,
            "significant": gain > 2 * se,
        }
        for h in ("opencode", "agentloop")
        for m in ("greedy", "sampled")
    ]
    trained = [
        {"step": s, "values": {"reward/opencode": 0.4 + 0.01 * s, "reward/agentloop": 0.6, "reward/mean": 0.5}}
        for s in range(3)
    ]
    config = {
        "model": "/x/models/opencode-warmstart",
        "harnesses": ["opencode", "agentloop"],
        "steps": 8,
        "tasks_per_step": 4,
        "group_size": 8,
        "lr": 1e-4,
        "seed": seed,
        "eval_tasks": 128,
        "concurrency": 4,
        "rollout_timeout_s": 300.0,
        "timeout_s": 5400.0,
        "engine": "cpu",
        "eval_modes": ["greedy", "sampled"],
        "hp": [],
        "logit_scale_lr": 0.1,
    }
    return {"config": config, "before_after": rows, "trained": trained}


def write(tmp: Path, name: str, data: dict) -> Path:
    (tmp / name).mkdir()
    (tmp / name / "summary.json").write_text(json.dumps(data))
    return tmp / name


def test_table_gives_each_run_and_the_mean_over_runs_with_its_spread(tmp_path: Path) -> None:
    runs = [seeds.load_run(write(tmp_path, f"r{s}", summary(s, g))) for s, g in ((0, 0.06), (1, 0.02), (2, 0.01))]
    text = seeds.table(runs)
    line = next(x for x in text.splitlines() if x.startswith("| opencode | greedy"))
    assert "0.500 → 0.560 (+0.060 ± 0.020 *)" in line and "(+0.020 ± 0.020)" in line  # * only above 2 s.e.
    mean, se = seeds.mean_over_runs([0.06, 0.02, 0.01])
    assert math.isclose(mean, 0.03) and math.isclose(se, math.sqrt(((0.03**2 + 0.01**2 + 0.02**2) / 2) / 3))
    assert line.endswith(f"| +0.030 ± {se:.3f} |") and "| 128 |" in line
    assert len([x for x in text.splitlines() if x.startswith("| ")]) == 1 + 4  # header + harness × mode


def test_commands_are_valid_demo_command_lines_that_carry_the_recipe(tmp_path: Path) -> None:
    cfg = summary(2, 0.0)["config"] | {"hp": ["kl_coef=0.01"], "model": str(tmp_path)}
    argv = shlex.split(seeds.command(cfg))[2:]
    ctx = demo_command.make_context("demo", argv)  # every flag exists and takes its value
    assert ctx.params["seed"] == 2 and ctx.params["lr"] == 1e-4 and ctx.params["steps"] == 8
    assert ctx.params["harnesses"] == "opencode,agentloop" and ctx.params["eval_tasks"] == 128
    assert "kl_coef=0.01" in ctx.params["hp"] and ctx.params["model_dir"] == tmp_path


def test_missing_or_unevaluated_runs_are_clear_errors(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ClawstreamError, match="no summary.json"):
        seeds.load_run(tmp_path / "empty")
    with pytest.raises(ClawstreamError, match="no held-out before/after"):
        seeds.load_run(write(tmp_path, "noeval", {"config": {}, "before_after": None}))


def test_cli_writes_the_table_and_a_png(tmp_path: Path) -> None:
    dirs = [str(write(tmp_path, f"r{s}", summary(s, 0.01 * s))) for s in range(3)]
    result = CliRunner().invoke(main, ["demo-seeds", *dirs, "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "out" / "seeds.md").read_text().count("clawstream demo --model") == 3
    assert (tmp_path / "out" / "seeds.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
