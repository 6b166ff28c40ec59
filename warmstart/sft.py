"""Supervised warm start of the tiny policy on synthetic agent demonstrations (``clawstream model sft``).

RL through the built-in agent loops only has signal once the policy solves some tasks (docs/method.md#warm-start:
a start of ~30-60%). This module trains the model with plain cross-entropy on the assistant tokens of a
correct solution episode for each task of the built-in CPU suite (``producers.tasks.cpu``) in both agent-loop
dialects. The episodes come from the *real* agent loop driven by a scripted policy (``warmstart.demos``,
through the in-process proxy of ``warmstart.episodes``); the model is then evaluated greedily on held-out
tasks (``warmstart.evaluate``).

Training uses two exact shortcuts (one forward over each append-only episode; the shared system prompt's KV computed
once per batch) and is bounded by optimizer steps and seeded, so a recipe gives the same model on any machine;
``--minutes`` is only a safety cap; ``sft_summary.json`` beside the weights records the recipe, seed, sha256s and
held-out evaluation. Both, and the shipped recipe: docs/quickstart.md#the-warm-start-recipe. ``--from-topics PREFIX``
trains on a topic prefix's recorded trajectories instead (``warmstart.sft_topics``).

Topics: none (offline). Run::

    HF_HUB_OFFLINE=1 .venv/bin/python -m warmstart.sft --model-dir models/tiny --out models/tiny-sft \
        [--steps 300 --seed 0 --minutes 30]
    .venv/bin/python -m warmstart.sft --model-dir models/tiny-sft --eval-only   # evaluation only
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import shutil
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from clawbase.errors import ClawstreamError
from policy.token_prefix import common_prefix_len_all
from warmstart.demos import build_episodes, train_tasks
from warmstart.episodes import DIALECTS
from warmstart.evaluate import evaluate, evaluate_model, format_report, progress_bar

# Steps of the default recipe (see docs/quickstart.md#warm-start for what it reaches and how long it takes).
DEFAULT_STEPS = 300

# --- episodes as training sequences -----------------------------------------------------------------------------


@dataclass
class Sequence:
    """An episode as one training sequence: ``ids`` (L,) and ``mask`` (L,) = 1 on the assistant tokens."""

    dialect: str
    ids: list[int]
    mask: list[int]


def episode_sequence(dialect: str, turns: list[tuple[list[int], list[int]]]) -> Sequence:
    """Merge an append-only episode into one sequence (raises if TITO's prefix property does not hold)."""
    last_prompt, last_gen = turns[-1]
    ids = last_prompt + last_gen
    mask = [0] * len(ids)
    for prompt, gen in turns:
        if ids[: len(prompt) + len(gen)] != prompt + gen:
            raise ValueError("episode is not append-only: a later prompt does not extend an earlier turn")
        mask[len(prompt) : len(prompt) + len(gen)] = [1] * len(gen)
    return Sequence(dialect, ids, mask)


# --- training ---------------------------------------------------------------------------------------------------


def _cache_kw() -> str:
    """transformers >= 5.2x calls the KV-cache argument ``cache``; earlier versions ``past_key_values``."""
    import inspect

    from transformers import Qwen3ForCausalLM

    return "cache" if "cache" in inspect.signature(Qwen3ForCausalLM.forward).parameters else "past_key_values"


_CACHE_KW = ""


def _batch_loss(model: Any, seqs: list[Sequence], prefix_len: int, pad_id: int) -> tuple[Any, int]:
    """Summed token cross-entropy of a same-dialect batch and its number of target tokens.

    The first ``prefix_len`` tokens are identical in every sequence (system prompt + tools, never a target): their
    KV is computed once, with grad, and repeated over the batch.
    """
    import torch

    global _CACHE_KW
    _CACHE_KW = _CACHE_KW or _cache_kw()
    b = len(seqs)
    tails = [s.ids[prefix_len:] for s in seqs]
    width = max(len(t) for t in tails)
    ids = torch.full((b, width), pad_id, dtype=torch.long)  # (B, T); right padding never affects earlier tokens
    labels = torch.full((b, width), -100, dtype=torch.long)  # (B, T): label of the token at each position
    for i, (s, tail) in enumerate(zip(seqs, tails, strict=True)):
        ids[i, : len(tail)] = torch.tensor(tail)
        m = torch.tensor(s.mask[prefix_len:], dtype=torch.bool)
        labels[i, : len(tail)] = torch.where(m, torch.tensor(tail), torch.tensor(-100))
    if prefix_len:
        prefix = torch.tensor([seqs[0].ids[:prefix_len]])  # (1, P)
        out = model(input_ids=prefix, use_cache=True)
        cache = getattr(out, _CACHE_KW)
        cache.batch_repeat_interleave(b)  # (1, H, P, D) -> (B, H, P, D) per layer, still attached to the graph
        first = out.logits[:, -1:].expand(b, -1, -1)  # (B, 1, V): the prefix's last position predicts tail[0]
        rest = model(input_ids=ids, use_cache=False, **{_CACHE_KW: cache}).logits  # (B, T, V)
        pred, gold = torch.cat([first, rest[:, :-1]], 1), labels  # (B, T, V), (B, T)
    else:
        pred, gold = model(input_ids=ids).logits[:, :-1], labels[:, 1:]  # (B, T-1, V), (B, T-1)
    loss = torch.nn.functional.cross_entropy(pred.reshape(-1, pred.shape[-1]), gold.reshape(-1), reduction="sum")
    return loss, int((gold != -100).sum())


@dataclass
class SFTConfig:
    steps: int = DEFAULT_STEPS  # the budget: optimizer steps (the learning-rate schedule spans these by default)
    schedule_steps: int = 0  # the cosine spans this many steps (0: ``steps``); more than ``steps`` stops part-way
    # through a longer schedule: the first N steps of any run are then the same, whatever the run's length
    checkpoint_every: int = 0  # also save the model every this many steps to OUT/checkpoints/step-N (0: off)
    minutes: float | None = None  # safety cap on training time (evaluations excluded); None: no cap
    lr: float = 2e-3
    warmup_steps: int = 20
    batch_size: int = 16
    n_tasks: int = 1024
    seed: int = 0
    eval_every: int = 0  # steps; 0: evaluate only at the end
    eval_tasks: int = 64
    log_every: int = 10
    shared_prefix: bool = True
    progress: bool = True  # a progress bar with ETA (stdout); log lines every log_every steps either way

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.minutes is not None and self.minutes <= 0:
            raise ValueError(f"minutes (a cap) must be > 0 or None, got {self.minutes}")
        if self.schedule_steps and self.schedule_steps < self.steps:
            raise ValueError(f"schedule_steps ({self.schedule_steps}) must be 0 or >= steps ({self.steps})")


def lr_scale(step: int, steps: int, warmup_steps: int) -> float:
    """Linear warmup over ``warmup_steps``, then cosine from 1 to 0.1 over the ``steps`` budget (``step`` from 0)."""
    progress = min(step / steps, 1.0)
    return min(1.0, (step + 1) / max(warmup_steps, 1)) * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def sft(model_dir: str | Path, out_dir: str | Path, cfg: SFTConfig | None = None, **overrides: Any) -> dict[str, Any]:
    """Train on demonstrations for ``cfg.steps`` optimizer steps (``cfg.minutes`` caps it) and save to ``out_dir``.

    Returns a summary (steps, minutes, steps/s, final loss, whether the cap cut the run, sha256 of base and result,
    and the held-out evaluation when ``cfg.eval_tasks`` > 0); also written to ``out_dir/sft_summary.json``.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = replace(cfg or SFTConfig(), **overrides)  # unknown names raise TypeError
    t_start = time.perf_counter()
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    episodes = build_episodes(tokenizer, train_tasks(cfg.n_tasks, cfg.seed))
    pools = {d: [episode_sequence(e.dialect, e.turns) for e in episodes if e.dialect == d] for d in DIALECTS}
    prefix = {d: _common_prefix(p) if cfg.shared_prefix else 0 for d, p in pools.items()}
    n_target = sum(sum(s.mask) for p in pools.values() for s in p)
    cap = f", capped at {cfg.minutes:g} min" if cfg.minutes else ""
    _say(
        f"[sft] {len(episodes)} episodes, {n_target} target tokens, shared prefix {prefix} "
        f"({time.perf_counter() - t_start:.1f}s); {cfg.steps} steps of {cfg.batch_size}, lr {cfg.lr:g}, "
        f"seed {cfg.seed}{cap}"
    )

    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    budget_s = cfg.minutes * 60.0 if cfg.minutes else math.inf
    t0 = time.perf_counter()
    step, window_loss, window_tok, window_pos, t_log, eval_s, all_pos = 0, 0.0, 0, 0, 0.0, 0.0, 0
    history: list[tuple[int, float]] = []
    order: dict[str, list[int]] = {d: [] for d in DIALECTS}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    bar = progress_bar(cfg.steps, "warm start (SFT)", "step", enabled=cfg.progress)
    cut = False
    model.train()
    while step < cfg.steps:
        if time.perf_counter() - t0 - eval_s >= budget_s:
            cut = True
            break
        scale = lr_scale(step, cfg.schedule_steps or cfg.steps, cfg.warmup_steps)
        for group in opt.param_groups:
            group["lr"] = cfg.lr * scale
        dialect = DIALECTS[step % len(DIALECTS)]
        if len(order[dialect]) < cfg.batch_size:  # reshuffle each epoch
            order[dialect] += rng.sample(range(len(pools[dialect])), len(pools[dialect]))
        batch = [pools[dialect][order[dialect].pop()] for _ in range(min(cfg.batch_size, len(pools[dialect])))]
        loss_sum, n_tok = _batch_loss(model, batch, prefix[dialect], pad)
        opt.zero_grad(set_to_none=True)
        (loss_sum / max(n_tok, 1)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        window_loss += float(loss_sum.detach())
        window_tok += n_tok
        positions = sum(len(s.ids) for s in batch)
        window_pos += positions
        all_pos += positions
        bar.update(1)
        if step % cfg.log_every == 0 or step == cfg.steps:
            dt = time.perf_counter() - t0 - eval_s
            history.append((step, window_loss / max(window_tok, 1)))
            rate = window_pos / max(dt - t_log, 1e-9)
            bar.set_postfix_str(f"loss {history[-1][1]:.3f}, {rate:.0f} tok/s", refresh=False)
            _log(
                bar,
                f"[sft] step {step}/{cfg.steps} {dt / 60:.1f}min loss {history[-1][1]:.4f} "
                f"lr {cfg.lr * scale:.2e} {rate:.0f} tok/s",
            )
            t_log = dt
            window_loss, window_tok, window_pos = 0.0, 0, 0
        if cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and step < cfg.steps:
            save_model(model, tokenizer, model_dir, Path(out_dir, "checkpoints", f"step-{step}"))
        if cfg.eval_every and step % cfg.eval_every == 0:  # not counted in the time cap
            t_eval = time.perf_counter()
            model.eval()
            report = evaluate_model(model, tokenizer, n=min(cfg.eval_tasks, 16), seed=cfg.seed)
            model.train()
            eval_s += time.perf_counter() - t_eval
            _log(bar, f"[sft] eval step {step} ({time.perf_counter() - t_eval:.0f}s): {format_report(report)}")
    bar.close()
    train_s = time.perf_counter() - t0 - eval_s
    if cut:
        _say(
            f"[sft] WARNING: the --minutes {cfg.minutes:g} cap cut the run at step {step} of {cfg.steps}: this "
            "model is NOT the recipe's (raise or drop the cap to reproduce it)"
        )
    model.eval()
    save_model(model, tokenizer, model_dir, out_dir)
    summary: dict[str, Any] = {
        "steps": step,
        "steps_planned": cfg.steps,
        "cut_by_minutes": cut,
        "train_minutes": round(train_s / 60, 2),
        "steps_per_s": round(step / max(train_s, 1e-9), 4),
        "tokens_per_s": round(all_pos / max(train_s, 1e-9)),
        "final_loss": history[-1][1] if history else None,
        "history": history,
        "config": vars(cfg),
        "base_sha256": weights_sha256(model_dir),
        "sha256": weights_sha256(out_dir),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    _say(
        f"[sft] {step} steps in {train_s / 60:.1f} min ({summary['steps_per_s']:.2f} steps/s, "
        f"{summary['tokens_per_s']} tok/s); weights sha256 {summary['sha256'][:16]}…"
    )
    if cfg.eval_tasks:
        summary["eval"] = evaluate_model(model, tokenizer, n=cfg.eval_tasks, seed=cfg.seed, progress=cfg.progress)
        _say(f"[sft] held-out eval: {format_report(summary['eval'])}")
    Path(out_dir, "sft_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _say(message: str) -> None:
    print(message, flush=True)


def _log(bar: Any, message: str) -> None:
    """A log line that does not tear the progress bar (tqdm.write when a bar is shown)."""
    if getattr(bar, "disable", True):
        _say(message)
    else:
        bar.write(message)


def weights_sha256(model_dir: str | Path) -> str:
    """sha256 over the model's safetensors files (sorted by name): the checksum a shipped warm start is checked by."""
    digest = hashlib.sha256()
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with open(path, "rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


# The warm start shipped with the repository (docs/quickstart.md#the-warm-start-recipe): the stages below, each a
# `clawstream model sft` run on the previous stage's output (the first on the tiny base model, `clawstream model
# init`). Its sft_summary.json records the stages and the sha256 of its weights. Stage 2 reseeds the data (other
# training tasks) at half the peak learning rate: the first stage's loss fell only after ~900 steps (copying names
# and contents out of the prompt), and the held-out score was still rising at its end. Stage 2 stops at step 520 of
# its 800-step schedule, in the middle of learning to copy: 42 % of held-out tasks solved at the demo's sampling
# temperature, inside the 30-60 % band the method recommends for GRPO (all 800 steps: 62 % sampled, 74 % greedy).
SHIPPED_DIR = Path(__file__).resolve().parents[1] / "models" / "warmstart"
SHIPPED_RECIPE: tuple[dict[str, Any], ...] = (
    {"steps": 1200, "seed": 0, "n_tasks": 4096, "lr": 2e-3, "batch_size": 16},
    {"steps": 520, "schedule_steps": 800, "seed": 1, "n_tasks": 4096, "lr": 1e-3, "batch_size": 16},
)


def recipe_commands(recipe: tuple[dict[str, Any], ...] = SHIPPED_RECIPE) -> list[str]:
    """The `clawstream model sft` command lines that reproduce a staged recipe from the tiny base model."""
    lines, source = [], "BASE"
    for i, stage in enumerate(recipe, 1):
        out = "OUT" if i == len(recipe) else f"STAGE{i}"
        flags = " ".join(
            f"--{k.replace('_', '-')} {v:g}" if isinstance(v, float) else f"--{k.replace('_', '-')} {v}"
            for k, v in stage.items()
        )
        lines.append(f"clawstream model sft --model-dir {source} --out {out} {flags}")
        source = out
    return lines


def train_recipe(
    base: str | Path, out: str | Path, recipe: tuple[dict[str, Any], ...] = SHIPPED_RECIPE, **overrides: Any
) -> dict[str, Any]:
    """Run a staged recipe (each stage an :func:`sft` run on the previous output); the last stage's summary, with
    ``recipe`` (the stages) added, is also written to ``out/sft_summary.json``."""
    out = Path(out)
    source, summary = Path(base), {}
    for i, stage in enumerate(recipe, 1):
        target = out if i == len(recipe) else out.with_name(f"{out.name}.stage{i}")
        _say(f"[sft] recipe stage {i}/{len(recipe)}: {stage}")
        last = i == len(recipe)  # only the result is evaluated
        summary = sft(source, target, **{**overrides, **stage, **({} if last else {"eval_tasks": 0})})
        if i > 1:
            shutil.rmtree(source, ignore_errors=True)  # an intermediate stage
        source = target
    summary["recipe"] = list(recipe)
    Path(out, "sft_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def shipped_warm_start(
    recipe: tuple[dict[str, Any], ...] = SHIPPED_RECIPE, shipped: Path = SHIPPED_DIR
) -> tuple[Path | None, str]:
    """The shipped checkpoint when ``recipe`` is the one that made it and its weights still have the recorded
    sha256; else ``(None, why not)``. A mismatch of the weights is never used silently."""
    summary_path = shipped / "sft_summary.json"
    if not summary_path.exists():
        return None, f"no shipped warm start at {shipped}"
    summary = json.loads(summary_path.read_text())
    if summary.get("recipe") != [dict(stage) for stage in recipe]:
        return None, f"the shipped warm start was made by {summary.get('recipe')}, not {list(recipe)}"
    actual = weights_sha256(shipped)
    if actual != summary.get("sha256"):
        return None, (
            f"the shipped warm start's weights have sha256 {actual[:16]}…, not the recorded "
            f"{str(summary.get('sha256'))[:16]}… (damaged or changed; train it with `clawstream model sft`)"
        )
    return shipped, f"{len(recipe)}-stage SFT recipe (docs/quickstart.md), sha256 {actual[:16]}… verified"


def verify_recorded_sha256(model_dir: Path) -> str:
    """Check a model directory against the sha256 its ``sft_summary.json`` records (a shipped or downloaded warm
    start); returns what was checked. A model without a summary or a recorded sha256 passes, said so; a mismatch
    raises: RL from weights other than the recorded ones would be reported as the recipe's."""
    summary_path = model_dir / "sft_summary.json"
    if not summary_path.exists():
        return "no sft_summary.json: sha256 not checked"
    recorded = json.loads(summary_path.read_text()).get("sha256")
    if not recorded:
        return "no sha256 recorded in sft_summary.json: not checked"
    actual = weights_sha256(model_dir)
    if actual != recorded:
        raise ClawstreamError(
            f"{model_dir}: weights have sha256 {actual[:16]}…, sft_summary.json records {recorded[:16]}… (damaged "
            "or changed since it was made; restore it, e.g. `git checkout -- DIR`, or remove sft_summary.json's sha256 "
            "to use it as it is)"
        )
    return f"sha256 {actual[:16]}… verified"


def _common_prefix(seqs: list[Sequence]) -> int:
    """Tokens every sequence starts with, minus one so the shared part never reaches a target (P >= 0)."""
    n = common_prefix_len_all([s.ids for s in seqs])
    first_target = min(s.mask.index(1) for s in seqs)
    return max(0, min(n, first_target) - 1)


def save_model(model: Any, tokenizer: Any, model_dir: str | Path, out_dir: str | Path) -> None:
    """HF-format weights + the source directory's tokenizer / template / model-info files."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for src in Path(model_dir).iterdir():
        skip = src.suffix == ".safetensors" or src.name in ("config.json", "generation_config.json", "sft_summary.json")
        if src.is_file() and not skip:
            shutil.copy2(src, out / src.name)


def main(argv: list[str] | None = None) -> int:
    d = SFTConfig()
    p = argparse.ArgumentParser(prog="python -m warmstart.sft", description=__doc__.split("\n")[0])
    p.add_argument("--model-dir", type=Path, required=True, help="model to warm-start (policy.tiny_model output)")
    p.add_argument("--out", type=Path, help="where to save the warm-started model (required unless --eval-only)")
    p.add_argument("--steps", type=int, default=d.steps, help="optimizer steps: the recipe's budget (%(default)s)")
    p.add_argument(
        "--schedule-steps",
        type=int,
        default=d.schedule_steps,
        help="the learning-rate cosine spans this many steps (0: --steps); larger than --steps stops "
        "part-way through that schedule (%(default)s)",
    )
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=d.checkpoint_every,
        help="also save OUT/checkpoints/step-N every this many steps (0: off)",
    )
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the data, its order and torch (%(default)s)")
    p.add_argument(
        "--minutes",
        type=float,
        default=None,
        help="safety cap on training minutes (default: none); a cut run is reported, not the recipe",
    )
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate, then cosine to 10%% (%(default)s)")
    p.add_argument(
        "--batch-size", type=int, default=d.batch_size, help="episodes per step, one dialect per step (%(default)s)"
    )
    p.add_argument("--n-tasks", type=int, default=d.n_tasks, help="training tasks, each in both dialects (%(default)s)")
    p.add_argument("--eval-every", type=int, default=d.eval_every, help="steps between small evals (0: off)")
    p.add_argument(
        "--eval-tasks",
        type=int,
        default=d.eval_tasks,
        help="held-out tasks for the final eval, x2 dialects (%(default)s)",
    )
    p.add_argument("--eval-only", action="store_true", help="only evaluate --model-dir")
    p.add_argument(
        "--shipped-recipe",
        action="store_true",
        help="train the shipped warm start's staged recipe from --model-dir (the tiny base model; "
        "the stage flags above are then ignored): " + " && ".join(recipe_commands()),
    )
    p.add_argument("--no-progress", action="store_true", help="log lines only, no progress bar")
    p.add_argument(
        "--from-topics",
        metavar="PREFIX",
        help="train on a topic prefix's trajectories instead: `clawstream model sft --from-topics PREFIX ...` "
        "(warmstart/sft_topics.py; --min-reward, Kafka flags)",
    )
    a = p.parse_args(argv)
    if a.from_topics:
        p.error("--from-topics: run `clawstream model sft --from-topics PREFIX` or `python -m warmstart.sft_topics`")
    if a.eval_only:
        report = evaluate(a.model_dir, n=a.eval_tasks, seed=a.seed, progress=not a.no_progress)
        print(json.dumps(report, indent=2))
        return 0
    if a.out is None:
        p.error("--out is required")
    if a.shipped_recipe:
        summary = train_recipe(a.model_dir, a.out, eval_tasks=a.eval_tasks, progress=not a.no_progress)
        shipped = (
            json.loads((SHIPPED_DIR / "sft_summary.json").read_text()).get("sha256")
            if (SHIPPED_DIR / "sft_summary.json").exists()
            else None
        )
        same = "the same as" if summary["sha256"] == shipped else "NOT the same as"
        print(f"sha256 {summary['sha256']}: {same} the shipped warm start's ({shipped})")
        return 0
    try:
        cfg = SFTConfig(
            steps=a.steps,
            schedule_steps=a.schedule_steps,
            checkpoint_every=a.checkpoint_every,
            minutes=a.minutes,
            lr=a.lr,
            batch_size=a.batch_size,
            n_tasks=a.n_tasks,
            seed=a.seed,
            eval_every=a.eval_every,
            eval_tasks=a.eval_tasks,
            progress=not a.no_progress,
        )
    except ValueError as exc:
        p.error(str(exc))
    sft(a.model_dir, a.out, cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
