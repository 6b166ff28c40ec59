"""Learner benchmark: tree-packed vs per-path training on rollout trees shaped like real harness traffic.

Trees are built by ``streams/tree.py`` from synthetic call sequences with the shapes
docs/harnesses.md#prompt-sizes-and-prefix-sharing describes:
- ``append-only`` (Claude Code, Codex, Qwen Code, opencode): every call = previous prompt + previous answer + tool
  result, plus one retry from an earlier point (a dead end the tree prunes) — one path, little sharing;
- ``openclaw``: one internal-context message is removed and re-appended at the end of every call, so each call
  branches from the previous one a few hundred tokens before its end — many paths sharing long prefixes;
- ``subagent-retry``: the main chain with two branches retried from the middle (kept with ``prune="none"``).

For each shape, one forward+backward of the same GRPO loss is timed both ways on the project's tiny Qwen3 model:
packed (one sequence per tree, tree attention mask) and per-path (every root-to-leaf path as its own plain causal
sequence, each trainable token counted on every path it lies on). Interleaved rounds, medians, one run.

Run: ``.venv/bin/python -m bench.learner [--calls 12] [--rounds 3]``; writes ``bench/results/learner.md``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from learner.forward import packed_logprobs
from learner.losses import grpo_loss
from learner.pack import pack_trees
from schemas.tree_paths import path_tokens, path_trainable_mask, paths
from streams.tree import Segment, TreeCall, build_tree

RESULTS = Path(__file__).resolve().parent / "results" / "learner.md"
SYSTEM, TOOL_RESULT, ANSWER = 600, 120, 60  # tokens: system prompt, each tool result, each generated turn


def _calls(shape: str, n_calls: int, rng: np.random.Generator) -> list[TreeCall]:
    def toks(n: int) -> list[int]:
        return rng.integers(3, 2000, n).tolist()

    calls: list[TreeCall] = []
    history = toks(SYSTEM)
    moving = toks(200)  # OpenClaw's internal-context message that moves to the end on every call
    for i in range(n_calls):
        prompt = history + (moving if shape == "openclaw" else [])
        gen = toks(ANSWER)
        calls.append(
            TreeCall(
                call_id=f"c{i}",
                seq=i,
                parent_call_id=None,
                shared_prefix_len=0,
                new_tokens=prompt,
                generated_tokens=gen,
                logprobs=(-rng.random(ANSWER)).tolist(),
                call_kind="main",
                policy_version=0,
            )
        )
        history = history + gen + toks(TOOL_RESULT)
        if shape != "openclaw" and i in (n_calls // 3, 2 * n_calls // 3):  # a retry from this point
            retry = toks(ANSWER)
            lps = (-rng.random(ANSWER)).tolist()
            calls.append(
                TreeCall(
                    call_id=f"r{i}",
                    seq=len(calls),
                    parent_call_id=None,
                    shared_prefix_len=0,
                    new_tokens=list(prompt),
                    generated_tokens=retry,
                    logprobs=lps,
                    call_kind="main",
                    policy_version=0,
                )
            )
    return [TreeCall(**{**c.__dict__, "seq": k}) for k, c in enumerate(calls)]


def _tree(shape: str, n_calls: int, seed: int) -> list[Segment]:
    rng = np.random.default_rng(seed)
    prune = "none" if shape == "subagent-retry" else "carried"
    result = build_tree(_calls(shape, n_calls, rng), max_leaves=None, prune=prune)
    return result.segments


def _per_path_time(model: torch.nn.Module, segments: list[list[Segment]]) -> float:
    """The baseline a trainer without trees runs: every root-to-leaf path as a plain causal sequence (no custom
    mask, SDPA's causal fast path), the loss over each path's trainable tokens (shared ones once per path)."""
    jobs = []
    for tree in segments:
        for path in paths(tree):
            tokens = torch.tensor(path_tokens(tree, path))
            mask = torch.tensor(path_trainable_mask(tree, path))
            lps = torch.tensor([lp for i in path if tree[i].trainable for lp in tree[i].logprobs])
            jobs.append((tokens, mask, lps))
    n_tokens = sum(int(m.sum()) for _, m, _ in jobs)
    device = next(model.parameters()).device
    model.zero_grad(set_to_none=True)
    _sync(device)
    started = time.perf_counter()
    for k, (tokens, mask, lps) in enumerate(jobs):
        tokens, mask, lps = tokens.to(device), mask.to(device), lps.to(device)
        with _autocast(device):
            logits = model(input_ids=tokens[None], use_cache=False).logits[0, :-1]  # (L-1, V)
        logp_all = torch.log_softmax(logits.float(), -1).gather(-1, tokens[1:, None])[:, 0]  # (L-1,)
        logp = torch.cat([torch.zeros(1, device=device), logp_all])  # (L,) aligned with tokens
        rollout_lp = torch.zeros(len(tokens), device=device)
        rollout_lp[mask] = lps
        ones, index = torch.ones(len(jobs), device=device), torch.full((len(tokens),), k, device=device)
        loss, _ = grpo_loss(logp, None, rollout_lp, ones, index, mask, num_tokens=n_tokens, num_rollouts=len(jobs))
        loss.backward()
    _sync(device)
    return time.perf_counter() - started


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _autocast(device: torch.device) -> torch.autocast:
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def _packed_time(model: torch.nn.Module, trees: list[list[Segment]], budget: int) -> float:
    device = next(model.parameters()).device
    rows = [r.to(device) for r in pack_trees(trees, budget)]
    adv = torch.ones(len(trees), device=device)
    n_tokens = sum(int(r.loss_mask.sum()) for r in rows)
    model.zero_grad(set_to_none=True)
    _sync(device)
    started = time.perf_counter()
    for row in rows:
        with _autocast(device):
            logp = packed_logprobs(model, row, only_trainable=True)
        loss, _ = grpo_loss(
            logp,
            None,
            row.rollout_logprobs,
            adv,
            row.rollout_index,
            row.loss_mask,
            num_tokens=n_tokens,
            num_rollouts=len(trees),
        )
        loss.backward()
    _sync(device)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=12, help="model calls per rollout")
    parser.add_argument("--rollouts", type=int, default=2, help="rollout trees per shape")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (bf16 autocast on cuda)")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size of the Qwen3 model (tiny default: 256)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    from transformers import AutoModelForCausalLM

    from policy.tiny_model import init_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        init_tiny_model(
            Path(tmp), hidden_size=args.hidden, intermediate_size=3 * args.hidden, num_layers=args.layers, progress=None
        )
        model = AutoModelForCausalLM.from_pretrained(tmp, attn_implementation="sdpa").to(args.device)
    model.train()
    params = sum(p.numel() for p in model.parameters())
    where = (
        f"{torch.cuda.get_device_name()} (bf16 autocast)"
        if args.device == "cuda"
        else (f"fp32 on {torch.get_num_threads()} CPU threads")
    )

    lines = [
        "# Learner benchmark: tree-packed vs per-path training",
        "",
        f"Qwen3-architecture model ({params / 1e6:.1f}M params, {args.layers} layers, hidden {args.hidden}), {where}; "
        f"{args.rollouts} rollouts x {args.calls} calls per shape; one forward+backward of the GRPO loss; median of "
        f"{args.rounds} interleaved rounds. Run: `.venv/bin/python -m bench.learner`.",
        "",
        "| shape | leaves/tree | unique tokens | Σ path tokens | Σpath/unique | packed (s) | per-path (s) | speed-up |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for shape in ("append-only", "subagent-retry", "openclaw"):
        trees = [_tree(shape, args.calls, seed) for seed in range(args.rollouts)]
        path_lists = [paths(t) for t in trees]
        budget = max(sum(len(s.tokens) for s in t) for t in trees)
        unique = sum(len(s.tokens) for t in trees for s in t)
        path_total = sum(len(path_tokens(t, p)) for t, ps in zip(trees, path_lists, strict=True) for p in ps)
        times: dict[str, list[float]] = {"packed": [], "per_path": []}
        _packed_time(model, trees, budget), _per_path_time(model, trees)  # warm-up
        for _ in range(args.rounds):
            times["packed"].append(_packed_time(model, trees, budget))
            times["per_path"].append(_per_path_time(model, trees))
        packed, naive = statistics.median(times["packed"]), statistics.median(times["per_path"])
        leaves = sum(map(len, path_lists)) / len(trees)
        lines.append(
            f"| {shape} | {leaves:.1f} | {unique:,} | {path_total:,} | {path_total / unique:.2f} | "
            f"{packed:.2f} | {naive:.2f} | **{naive / packed:.2f}x** |"
        )
        print(lines[-1], flush=True)
    lines += [
        "",
        "Packed training does the work once per unique token; per-path training repeats shared prefixes on every path "
        "(and counts shared trainable tokens once per path). The speed-up tracks Σpath/unique, minus the cost of the "
        "dense tree mask (T×T) that grows with the packed length.",
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
