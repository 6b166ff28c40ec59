"""The models a demo run uses: the warm start RL begins from (the shipped checkpoint, or a recipe trained once and
cached) and a served weight version exported as a model directory (the final policy the evaluation measures)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

from clawstream.demo.config import DemoConfig
from warmstart.sft import SHIPPED_RECIPE


def warm_start_dir(models: Path, cfg: DemoConfig) -> Path:
    """Where the warm start of this recipe is cached: the recipe is in the name, so another recipe trains anew."""
    if cfg.sft_steps is None:
        digest = hashlib.sha256(json.dumps(list(SHIPPED_RECIPE), sort_keys=True).encode()).hexdigest()[:8]
        return models / f"tiny-qwen3-sft-shipped-recipe-{digest}"
    recipe = {
        "steps": cfg.sft_steps,
        "seed": cfg.sft_seed,
        "batch_size": cfg.sft_batch_size,
        "n_tasks": cfg.sft_n_tasks,
    }
    digest = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:8]
    return models / f"tiny-qwen3-sft-{cfg.sft_steps}steps-seed{cfg.sft_seed}-{digest}"


def prepare_model(models: Path, cfg: DemoConfig, say: Any = print) -> Path:
    """The warm start RL begins from: by default the repository's shipped checkpoint (when intact; else its recipe
    is trained once and cached), or the single-stage recipe of ``cfg.sft_steps`` (trained once; cached; 0: the tiny
    base model itself)."""
    from policy.architectures import is_current
    from policy.tiny_model import init_tiny_model
    from warmstart import sft

    if cfg.sft_steps is None:  # the shipped checkpoint: RL starts at once
        shipped, why = sft.shipped_warm_start()
        if shipped is not None:
            say(f"==> warm start: {shipped} (shipped; {why})")
            return shipped
        say(f"==> warm start: not using the shipped checkpoint: {why}")
    base = models / "tiny-qwen3"
    if not is_current(base):  # missing, or built by an older builder (e.g. fewer positions): rebuild all of it
        for stale in models.glob("tiny-qwen3-sft*"):
            shutil.rmtree(stale, ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)
        say(f"==> building the tiny Qwen3-architecture model into {base}")
        init_tiny_model(base, seed=0, progress=lambda _msg: None)
    if cfg.sft_steps is not None and cfg.sft_steps <= 0:
        return base
    _quiet_transformers()
    warm = warm_start_dir(models, cfg)
    if (warm / "sft_summary.json").exists():
        summary = json.loads((warm / "sft_summary.json").read_text())
        say(f"==> warm start: {warm} (cached; {summary.get('steps')} SFT steps)")
        return warm
    partial = warm.with_name(warm.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    if cfg.sft_steps is None:
        total = sum(stage["steps"] for stage in SHIPPED_RECIPE)
        say(
            f"==> warm start: training the shipped recipe ({total} SFT steps in {len(SHIPPED_RECIPE)} stages; about "
            f"an hour on 2 cores), once → {warm}"
        )
        sft.train_recipe(base, partial, eval_tasks=0, progress=cfg.progress)
    else:
        say(
            f"==> warm start: {cfg.sft_steps} SFT steps (seed {cfg.sft_seed}) on synthetic agent demonstrations, "
            f"once → {warm}"
        )
        sft.sft(
            base,
            partial,
            steps=cfg.sft_steps,
            seed=cfg.sft_seed,
            batch_size=cfg.sft_batch_size,
            n_tasks=cfg.sft_n_tasks,
            eval_tasks=0,
            progress=cfg.progress,
        )
    partial.rename(warm)  # only a finished warm start is ever found in the cache
    return warm


def export_version(model: Path, weights: Path, version: int, out: Path) -> Path:
    """A served weight version as a model directory (``model``'s config and tokenizer, the version's weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    from policy.weight_store import copy_into, load_checked, version_path
    from warmstart.sft import save_model

    _quiet_transformers()
    net = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    copy_into(net, load_checked(version_path(weights, "policy", version), net))
    save_model(net, None, model, out)
    return out


def _quiet_transformers() -> None:
    """transformers' own load/save progress bars would interleave with the demo's."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
