"""Supervised warm start of the tiny policy on synthetic agent demonstrations (``clawstream model sft``).

RL through the built-in agent loops only has signal once the policy solves some tasks (docs/method.md#warm-start:
a start of ~30-60%). This module trains the model with plain cross-entropy on the assistant tokens of a
correct solution episode for each task of the built-in CPU suite (``producers.tasks.cpu``) in both agent-loop
dialects. The episodes come from the *real* agent loop driven by a scripted policy (``learner.warmstart.demos``,
through the in-process proxy of ``learner.warmstart.episodes``); the model is then evaluated greedily on held-out
tasks (``learner.warmstart.evaluate``).

Training uses two exact shortcuts (same gradients as training every turn separately on its full prompt):
* TITO makes an episode append-only (turn k+1's prompt starts with turn k's prompt + generated ids), so one
  forward over the final sequence with the loss on every assistant span equals one forward per turn.
* Episodes of one dialect share the system prompt + tool schemas; its KV is computed once per batch (with grad)
  and repeated over the batch (docs/method.md#measurements: 2.2x).

Topics: none (offline). Run::

    HF_HUB_OFFLINE=1 .venv/bin/python -m learner.warmstart.sft --model-dir models/tiny --out models/tiny-sft \
        [--minutes 8]
    .venv/bin/python -m learner.warmstart.sft --model-dir models/tiny-sft --eval-only   # evaluation only
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from learner.warmstart.demos import build_episodes, train_tasks
from learner.warmstart.episodes import DIALECTS
from learner.warmstart.evaluate import evaluate, evaluate_model, format_report
from producers.proxy.render import common_prefix_len

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
    minutes: float = 8.0
    steps: int = 0  # 0: time budget only
    lr: float = 2e-3
    warmup_steps: int = 20
    batch_size: int = 16
    n_tasks: int = 1024
    seed: int = 0
    eval_every: int = 0  # steps; 0: evaluate only at the end
    eval_tasks: int = 64
    log_every: int = 10
    shared_prefix: bool = True


def sft(model_dir: str | Path, out_dir: str | Path, cfg: SFTConfig | None = None, **overrides: Any) -> dict[str, Any]:
    """Train on demonstrations for ``cfg.minutes`` (or ``cfg.steps``) and save the model to ``out_dir``.

    Returns a summary (steps, minutes, final loss, and the held-out evaluation when ``cfg.eval_tasks`` > 0).
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
    print(f"[sft] {len(episodes)} episodes, {n_target} target tokens, shared prefix {prefix} "
          f"({time.perf_counter() - t_start:.1f}s)", flush=True)  # fmt: skip

    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    budget_s = cfg.minutes * 60.0
    t0 = time.perf_counter()
    step, window_loss, window_tok, window_pos, t_log, eval_s = 0, 0.0, 0, 0, 0.0, 0.0
    history: list[tuple[int, float]] = []
    order: dict[str, list[int]] = {d: [] for d in DIALECTS}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    model.train()
    while True:
        elapsed = time.perf_counter() - t0 - eval_s
        progress = max(step / cfg.steps if cfg.steps else 0.0, elapsed / budget_s if budget_s > 0 else 0.0)
        if progress >= 1.0:
            break
        # Linear warmup, then cosine to 10% over the budget (by steps or by time, whichever runs out first).
        scale = min(1.0, (step + 1) / cfg.warmup_steps) * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))
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
        window_pos += sum(len(s.ids) for s in batch)
        if step % cfg.log_every == 0:
            dt = time.perf_counter() - t0 - eval_s
            history.append((step, window_loss / max(window_tok, 1)))
            print(f"[sft] step {step} {dt / 60:.1f}min loss {history[-1][1]:.4f} lr {cfg.lr * scale:.2e} "
                  f"{window_pos / max(dt - t_log, 1e-9):.0f} tok/s", flush=True)  # fmt: skip
            t_log = dt
            window_loss, window_tok, window_pos = 0.0, 0, 0
        if cfg.eval_every and step % cfg.eval_every == 0:  # not counted in the time budget
            t_eval = time.perf_counter()
            model.eval()
            report = evaluate_model(model, tokenizer, n=min(cfg.eval_tasks, 16), seed=cfg.seed)
            model.train()
            eval_s += time.perf_counter() - t_eval
            print(f"[sft] eval step {step} ({time.perf_counter() - t_eval:.0f}s): {format_report(report)}", flush=True)
    train_s = time.perf_counter() - t0 - eval_s
    model.eval()
    save_model(model, tokenizer, model_dir, out_dir)
    summary: dict[str, Any] = {"steps": step, "train_minutes": round(train_s / 60, 2),
                               "final_loss": history[-1][1] if history else None, "history": history,
                               "config": vars(cfg)}  # fmt: skip
    if cfg.eval_tasks:
        summary["eval"] = evaluate_model(model, tokenizer, n=cfg.eval_tasks, seed=cfg.seed)
        print(f"[sft] held-out eval: {format_report(summary['eval'])}", flush=True)
    Path(out_dir, "sft_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _common_prefix(seqs: list[Sequence]) -> int:
    """Tokens every sequence starts with, minus one so the shared part never reaches a target (P >= 0)."""
    n = min(len(s.ids) for s in seqs)
    for s in seqs[1:]:
        n = min(n, common_prefix_len(seqs[0].ids, s.ids))
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
    p = argparse.ArgumentParser(prog="python -m learner.warmstart.sft", description=__doc__.split("\n")[0])
    p.add_argument("--model-dir", type=Path, required=True, help="model to warm-start (policy.tiny_model output)")
    p.add_argument("--out", type=Path, help="where to save the warm-started model (required unless --eval-only)")
    p.add_argument("--minutes", type=float, default=d.minutes, help="training time budget")
    p.add_argument("--steps", type=int, default=d.steps, help="step budget (0: time budget only)")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--n-tasks", type=int, default=d.n_tasks, help="training tasks (each in both dialects)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--eval-every", type=int, default=d.eval_every, help="steps between small evals (0: off)")
    p.add_argument("--eval-tasks", type=int, default=d.eval_tasks, help="held-out tasks for the final eval (x2)")
    p.add_argument("--eval-only", action="store_true", help="only evaluate --model-dir")
    a = p.parse_args(argv)
    if a.eval_only:
        report = evaluate(a.model_dir, n=a.eval_tasks, seed=a.seed)
        print(json.dumps(report, indent=2))
        return 0
    if a.out is None:
        p.error("--out is required")
    cfg = SFTConfig(minutes=a.minutes, steps=a.steps, lr=a.lr, batch_size=a.batch_size, n_tasks=a.n_tasks,
                    seed=a.seed, eval_every=a.eval_every, eval_tasks=a.eval_tasks)  # fmt: skip
    sft(a.model_dir, a.out, cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
