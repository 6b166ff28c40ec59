"""Held-out evidence of skill for one policy: the log-likelihood of scripted correct episodes and a greedy solve rate.

Two fixed held-out slices of the CPU suite (the first tasks of ``warmstart.demos.heldout_tasks``, never an SFT
prompt): (a) the scripted correct episode of each of ``ll_tasks`` tasks in each dialect, scored teacher-forced, only
the model-generated tokens counted (exactly the SFT loss mask, ``sft.episode_sequence``): forward passes only; (b)
``greedy_tasks`` tasks per dialect run greedily through the real built-in loop and graded (bounded by tokens: at most
``max_new_tokens`` per call and the loop's turns). :func:`compare` pairs a policy's record with the warm start's, per
episode: the change of the summed log-likelihood and of the reward, each with its paired standard error.

Pure torch + the agent loop, no Kafka. The demo evaluates each published version with it in a background process
(``clawstream.demo.evidence``); ``clawstream model evidence`` runs it on a model directory or a finished run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from producers.proxy.render import TemplateRenderer
from warmstart.demos import build_episodes, heldout_tasks
from warmstart.episodes import DIALECTS, run_episode
from warmstart.evaluate import greedy_policy
from warmstart.sft import Sequence, episode_sequence

LL_TASKS = 64  # held-out tasks whose correct episodes are scored (x dialects)
GREEDY_TASKS = 16  # held-out tasks run greedily (x dialects)
MAX_NEW_TOKENS = 96  # per model call in the greedy slice (warmstart.evaluate's default)


@dataclass(frozen=True)
class Slices:
    """The fixed held-out material: keyed correct-episode sequences and the greedy slice's tasks."""

    sequences: dict[str, Sequence]  # "task_id/dialect" -> the scripted correct episode as one sequence
    greedy: list[Any]  # Task
    dialects: tuple[str, ...]


def build_slices(
    tokenizer: Any,
    ll_tasks: int = LL_TASKS,
    greedy_tasks: int = GREEDY_TASKS,
    seed: int = 0,
    dialects: tuple[str, ...] = DIALECTS,
) -> Slices:
    """The slices for ``seed``'s held-out split: the same tasks for every version of a run."""
    tasks = heldout_tasks(max(ll_tasks, greedy_tasks), seed)
    episodes = build_episodes(tokenizer, tasks[:ll_tasks], dialects)
    seqs = {f"{e.task_id}/{e.dialect}": episode_sequence(e.dialect, e.turns) for e in episodes}
    return Slices(seqs, tasks[:greedy_tasks], dialects)


def episode_logliks(model: Any, seqs: list[Sequence], batch_size: int = 8) -> list[tuple[float, int]]:
    """(Σ log p of the target tokens, how many) per sequence: teacher-forced, only ``mask`` = 1 tokens counted.

    Sequences of one dialect share their system prompt and tools (never a target): that prefix's KV is computed once
    per batch and repeated over it, as the SFT loss does (``sft._batch_loss``).
    """
    results: dict[int, tuple[float, int]] = {}
    for dialect in sorted({s.dialect for s in seqs}):
        idx = sorted((i for i, s in enumerate(seqs) if s.dialect == dialect), key=lambda i: len(seqs[i].ids))
        prefix = _common_prefix([seqs[i] for i in idx])
        for start in range(0, len(idx), batch_size):  # similar lengths together: little padding
            batch = idx[start : start + batch_size]
            for i, value in zip(batch, _batch_logliks(model, [seqs[i] for i in batch], prefix), strict=True):
                results[i] = value
    return [results[i] for i in range(len(seqs))]


def _batch_logliks(model: Any, seqs: list[Sequence], prefix_len: int) -> list[tuple[float, int]]:
    import torch

    from warmstart import sft

    sft._CACHE_KW = sft._CACHE_KW or sft._cache_kw()
    b = len(seqs)
    tails = [s.ids[prefix_len:] for s in seqs]
    width = max(len(t) for t in tails)
    ids = torch.zeros((b, width), dtype=torch.long)  # (B, T), right-padded: padding never affects earlier tokens
    mask = torch.zeros((b, width), dtype=torch.bool)  # (B, T): the token at each position is a target
    for row, (s, tail) in enumerate(zip(seqs, tails, strict=True)):
        ids[row, : len(tail)] = torch.tensor(tail)
        mask[row, : len(tail)] = torch.tensor(s.mask[prefix_len:], dtype=torch.bool)
    with torch.no_grad():
        if prefix_len:
            out = model(input_ids=torch.tensor([seqs[0].ids[:prefix_len]]), use_cache=True)  # (1, P)
            cache = getattr(out, sft._CACHE_KW)
            cache.batch_repeat_interleave(b)  # (1, H, P, D) -> (B, H, P, D) per layer
            first = out.logits[:, -1:].expand(b, -1, -1)  # (B, 1, V): the prefix's last position predicts tail[0]
            rest = model(input_ids=ids, use_cache=False, **{sft._CACHE_KW: cache}).logits  # (B, T, V)
            pred, gold, target = torch.cat([first, rest[:, :-1]], 1), ids, mask  # (B, T, V), (B, T), (B, T)
        else:
            pred, gold, target = model(input_ids=ids).logits[:, :-1], ids[:, 1:], mask[:, 1:]
        token_lp = torch.log_softmax(pred.float(), dim=-1).gather(-1, gold[..., None])[..., 0]  # (B, T)
        sums, counts = (token_lp * target).sum(1), target.sum(1)
    return [(float(sums[r]), int(counts[r])) for r in range(b)]


def _common_prefix(seqs: list[Sequence]) -> int:
    """Tokens every sequence starts with, stopping one short of the first target (0 for a single sequence)."""
    if len(seqs) < 2:
        return 0
    from warmstart import sft

    return sft._common_prefix(seqs)


def greedy_rewards(
    model: Any, tokenizer: Any, slices: Slices, max_new_tokens: int = MAX_NEW_TOKENS
) -> dict[str, float]:
    """The graded reward of each greedy episode, by "task_id/dialect" (the real built-in loop, in-process proxy)."""
    renderer = TemplateRenderer(tokenizer)
    policy = greedy_policy(model, renderer.end_of_turn_id, max_new_tokens)
    out = {}
    for task in slices.greedy:
        for dialect in slices.dialects:
            out[f"{task.task_id}/{dialect}"] = run_episode(task, dialect, policy, renderer).reward or 0.0
    return out


def measure(model: Any, tokenizer: Any, slices: Slices, *, greedy: bool = True) -> dict[str, Any]:
    """One policy's record: per-episode log-likelihoods (and token counts), per-episode greedy rewards, seconds."""
    import time

    model.eval()
    t0 = time.perf_counter()
    keys = sorted(slices.sequences)
    lls = episode_logliks(model, [slices.sequences[k] for k in keys])
    t1 = time.perf_counter()
    rewards = greedy_rewards(model, tokenizer, slices) if greedy and slices.greedy else {}
    t2 = time.perf_counter()
    return {
        "ll": {k: round(s, 5) for k, (s, _) in zip(keys, lls, strict=True)},
        "tokens": {k: n for k, (_, n) in zip(keys, lls, strict=True)},
        "greedy": rewards,
        "ll_seconds": round(t1 - t0, 2),
        "greedy_seconds": round(t2 - t1, 2),
    }


def paired(before: dict[str, float], after: dict[str, float]) -> tuple[float | None, float | None, int]:
    """(mean of after − before over the keys in both, its standard error, how many); None without two."""
    diffs = [after[k] - before[k] for k in sorted(before.keys() & after.keys())]
    if len(diffs) < 2:
        return None, None, len(diffs)
    mean = sum(diffs) / len(diffs)
    var = sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1)
    return mean, math.sqrt(var / len(diffs)), len(diffs)


def family_of(key: str) -> str:
    """The task family (template) of an episode key ``"<split>-NNN-<template>/<dialect>"`` (the CPU suite's ids)."""
    return key.split("/", 1)[0].split("-", 2)[-1]


def by_family(base_ll: dict[str, float], ll: dict[str, float]) -> dict[str, dict[str, Any]]:
    """Per task family: the paired change of the correct episodes' log-likelihood (mean, s.e., how many, up, down).

    Why: the pooled change can rise while the families whose greedy answers are wrong stay flat (#49: delete's
    correct episodes did not move in any recipe while replace's rose); this shows which skill moves.
    """
    keys: dict[str, list[str]] = {}
    for k in sorted(base_ll.keys() & ll.keys()):
        keys.setdefault(family_of(k), []).append(k)
    out = {}
    for fam, ks in sorted(keys.items()):
        mean, se, n = paired({k: base_ll[k] for k in ks}, {k: ll[k] for k in ks})
        up, down = sum(ll[k] > base_ll[k] for k in ks), sum(ll[k] < base_ll[k] for k in ks)
        out[fam] = {"change": mean, "se": se, "n": n, "up": up, "down": down}
    return out


def compare(record: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """The printed/plotted numbers of ``record``, each change paired per episode with the warm start's ``base``."""
    ll, tokens, rewards = record["ll"], record["tokens"], record["greedy"]
    n_tok = sum(tokens.values())
    d_ll, d_ll_se, n_ll = paired(base["ll"], ll)
    d_r, d_r_se, _ = paired(base["greedy"], rewards)
    common = base["ll"].keys() & ll.keys()
    return {
        "ll_per_token": sum(ll.values()) / max(n_tok, 1),
        "ll_per_episode": sum(ll.values()) / max(len(ll), 1),
        "ll_change": d_ll,  # per episode, summed over its target tokens
        "ll_change_se": d_ll_se,
        "ll_change_per_token": (d_ll * n_ll / max(sum(tokens[k] for k in common), 1)) if d_ll is not None else None,
        "episodes_up": sum(ll[k] > base["ll"][k] for k in common),
        "episodes_down": sum(ll[k] < base["ll"][k] for k in common),
        "ll_episodes": len(ll),
        "ll_change_by_family": by_family(base["ll"], ll),
        "greedy_reward": sum(rewards.values()) / len(rewards) if rewards else None,
        "greedy_solved": sum(r >= 1.0 for r in rewards.values()) / len(rewards) if rewards else None,
        "greedy_change": d_r,
        "greedy_change_se": d_r_se,
        "greedy_episodes": len(rewards),
        "seconds": round(record["ll_seconds"] + record["greedy_seconds"], 1),
    }


def line(version: int, summary: dict[str, Any]) -> str:
    """One printed line of a version's evidence."""

    def pm(mean: float | None, se: float | None, digits: int) -> str:
        return "n/a" if mean is None else f"{mean:+.{digits}f}" + ("" if se is None else f" ± {se:.{digits}f}")

    greedy = (
        f"greedy reward {summary['greedy_reward']:.3f} "
        f"(Δ {pm(summary['greedy_change'], summary['greedy_change_se'], 3)}), "
        f"solved {summary['greedy_solved']:.1%} of {summary['greedy_episodes']}"
        if summary["greedy_reward"] is not None
        else "greedy slice off"
    )
    by_fam = summary.get("ll_change_by_family", {})
    families = " ".join(f"{fam} {f['change']:+.3f}" for fam, f in by_fam.items() if f["change"] is not None)
    return (
        f"evidence v{version}: held-out correct-episode log-lik {summary['ll_per_token']:.4f}/token, "
        f"Δ {pm(summary['ll_change'], summary['ll_change_se'], 4)} per episode "
        f"({summary['episodes_up']} up, {summary['episodes_down']} down of {summary['ll_episodes']}) | {greedy} "
        f"| {summary['seconds']:.0f} s" + (f"\n  Δ log-lik per episode by family: {families}" if families else "")
    )


def load_model(model_dir: str | Path) -> tuple[Any, Any]:
    """(model in eval mode, float32; its tokenizer) of a model directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    return model, tokenizer


def load_version(model: Any, weights: Path, sha256: str | None = None) -> None:
    """Copy a published weight version into ``model`` (its sha256 checked when given; names and shapes always)."""
    from policy.weight_store import WeightsRejected, copy_into, load_checked, sha256_file

    if sha256 is not None and sha256_file(weights) != sha256.lower():
        raise WeightsRejected("checksum_mismatch", f"sha256 of {weights} is not the published {sha256}")
    copy_into(model, load_checked(weights, model))
