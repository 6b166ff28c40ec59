"""The SFT warm start is a recipe bounded by steps and a seed, not by the clock: the same recipe gives the same
weights (checksum recorded in sft_summary.json), another seed other weights, the learning-rate schedule spans exactly
the steps, and a minutes cap that cuts the run is reported as such. Uses a small model from ``policy.tiny_model``."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from clawbase.errors import ClawstreamError

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from policy.tiny_model import init_tiny_model  # noqa: E402
from warmstart import sft  # noqa: E402

RECIPE = {
    "lr": 3e-3,
    "warmup_steps": 2,
    "batch_size": 2,
    "n_tasks": 8,
    "eval_tasks": 0,
    "log_every": 2,
    "progress": False,
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sft-recipe") / "tiny"
    init_tiny_model(
        out,
        seed=0,
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        num_documents=3000,
        progress=None,
    )
    return out


def test_same_steps_and_seed_give_the_same_weights(model_dir: Path, tmp_path: Path) -> None:
    a = sft.sft(model_dir, tmp_path / "a", steps=4, seed=3, **RECIPE)
    b = sft.sft(model_dir, tmp_path / "b", steps=4, seed=3, **RECIPE)
    c = sft.sft(model_dir, tmp_path / "c", steps=4, seed=4, **RECIPE)
    assert a["steps"] == b["steps"] == 4 and not a["cut_by_minutes"]
    assert a["sha256"] == b["sha256"] == sft.weights_sha256(tmp_path / "a")
    assert c["sha256"] != a["sha256"]  # the seed decides the data order (and torch's draws)
    assert a["base_sha256"] == sft.weights_sha256(model_dir) != a["sha256"]
    saved = json.loads((tmp_path / "a" / "sft_summary.json").read_text())
    assert saved["sha256"] == a["sha256"] and saved["config"]["seed"] == 3 and saved["config"]["steps"] == 4
    assert saved["steps_per_s"] > 0


def test_a_run_cut_part_way_through_a_longer_schedule_is_that_schedule_s_checkpoint(
    model_dir: Path, tmp_path: Path
) -> None:
    long = sft.sft(model_dir, tmp_path / "long", steps=6, checkpoint_every=3, seed=3, **RECIPE)
    cut = sft.sft(model_dir, tmp_path / "cut", steps=3, schedule_steps=6, seed=3, **RECIPE)
    short = sft.sft(model_dir, tmp_path / "short", steps=3, seed=3, **RECIPE)
    checkpoint = tmp_path / "long" / "checkpoints" / "step-3"
    assert sorted(p.name for p in checkpoint.parent.iterdir()) == ["step-3"]  # none at the end: that is OUT itself
    assert cut["sha256"] == sft.weights_sha256(checkpoint) != long["sha256"]
    assert short["sha256"] != cut["sha256"]  # its own, shorter cosine: other learning rates from the first step
    with pytest.raises(ValueError, match="schedule_steps"):
        sft.SFTConfig(steps=6, schedule_steps=3)


def test_a_minutes_cap_that_cuts_the_run_is_reported(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    summary = sft.sft(model_dir, tmp_path / "cut", steps=10_000, minutes=1e-6, **RECIPE)
    assert summary["cut_by_minutes"] and summary["steps"] < 10_000
    assert "cap cut the run" in capsys.readouterr().out


def test_learning_rate_schedule_spans_the_steps() -> None:
    steps, warmup = 100, 10
    scales = [sft.lr_scale(s, steps, warmup) for s in range(steps)]
    assert scales[0] == pytest.approx(0.1 * (0.1 + 0.45 * 2))  # first warmup step
    assert max(scales) == pytest.approx(scales[warmup - 1])  # peak right after warmup
    assert scales[-1] == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 99 / 100)))  # ~10 % at the end
    assert all(x >= y for x, y in zip(scales[warmup - 1 :], scales[warmup:], strict=False))  # then only down


def test_bad_budgets_are_refused() -> None:
    with pytest.raises(ValueError, match="steps"):
        sft.SFTConfig(steps=0)
    with pytest.raises(ValueError, match="minutes"):
        sft.SFTConfig(minutes=0)


def test_a_shipped_warm_start_is_used_only_for_its_recipe_and_checksum(model_dir: Path, tmp_path: Path) -> None:
    stage = {k: v for k, v in RECIPE.items() if k in ("lr", "batch_size", "n_tasks")}
    recipe = ({"steps": 2, "seed": 5, **stage}, {"steps": 1, "seed": 6, **stage})
    made = sft.train_recipe(model_dir, tmp_path / "shipped", recipe, eval_tasks=0, progress=False, log_every=1)
    assert made["recipe"] == list(recipe) and made["steps"] == 1  # the last stage's summary
    assert made["base_sha256"] != sft.weights_sha256(model_dir)  # stage 2 started from stage 1, not the base
    assert not (tmp_path / "shipped.stage1").exists()  # the intermediate stage is removed
    found, why = sft.shipped_warm_start(recipe, tmp_path / "shipped")
    assert found == tmp_path / "shipped" and "verified" in why and made["sha256"] == sft.weights_sha256(found)
    other, why = sft.shipped_warm_start((recipe[0],), tmp_path / "shipped")
    assert other is None and "not" in why  # another recipe trains anew
    weights = next((tmp_path / "shipped").glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one flipped bit in the last tensor
    weights.write_bytes(bytes(data))
    damaged, why = sft.shipped_warm_start(recipe, tmp_path / "shipped")
    assert damaged is None and "damaged" in why
    assert sft.shipped_warm_start(recipe, tmp_path / "missing")[0] is None
    commands = sft.recipe_commands(recipe)
    assert commands[0].startswith("clawstream model sft --model-dir BASE --out STAGE1 --steps 2 --seed 5")
    assert commands[1].startswith("clawstream model sft --model-dir STAGE1 --out OUT --steps 1 --seed 6")


def test_the_repository_ships_its_warm_start_intact() -> None:
    """The checkpoint in models/warmstart/ is found where the demo looks and its sha256 holds (a package move once
    pointed SHIPPED_DIR outside the repository, and the demo silently fell back to an hour of SFT)."""
    found, why = sft.shipped_warm_start()
    assert found == Path(__file__).resolve().parents[2] / "models" / "warmstart", why


def test_a_model_given_to_the_demo_is_checked_against_its_recorded_sha256(tmp_path: Path) -> None:
    """`clawstream demo --model DIR` checks DIR/sft_summary.json's sha256 (models/opencode-warmstart ships one)."""
    shipped = Path(__file__).resolve().parents[2] / "models" / "opencode-warmstart"
    assert "verified" in sft.verify_recorded_sha256(shipped)
    model = tmp_path / "m"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"weights")
    assert "not checked" in sft.verify_recorded_sha256(model)  # no summary: nothing to check against
    (model / "sft_summary.json").write_text(json.dumps({"sha256": sft.weights_sha256(model)}))
    assert "verified" in sft.verify_recorded_sha256(model)
    (model / "model.safetensors").write_bytes(b"weightz")
    with pytest.raises(ClawstreamError, match="sft_summary.json records"):
        sft.verify_recorded_sha256(model)
