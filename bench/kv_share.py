"""Learner benchmark: one step on real-harness rollouts over the token budget, each context computed per path (off)
or the rows' common prefix computed once (``kv_share_min``, on: ``learner.kv_share``).

The rollouts are recorded real-harness traffic (``bench/data/router_harness_calls.jsonl.xz``: the calls topics of
an integration-test run, real harness binaries through the real proxy, the tiny model's tokenizer; see
bench/results/router.md). Rollouts are grouped by their first 1,000 prompt tokens (one harness's system prompt and
tools); the default takes the two groups that are different rollouts of one harness with a long shared head: 7
rollouts of 17–18k tokens sharing 15.7k, and 4 of 37k sharing 34k (identical repeated prompts are left out). Each
rollout's calls become its tree (``streams.tree.build_tree``), advantages ±1 alternating within a group.

Each round runs ``learner.step.train_step`` (the learner's defaults: GRPO, token budget 4096, one update, AdamW) on
a fresh copy of the quickstart's tiny model, off and on in alternating order; medians over rounds; the losses and
gradient norms of the two must agree (printed). A shared CPU: read the ratio, not the seconds.

Run: ``.venv/bin/python -m bench.kv_share [--rounds 2]``; writes ``bench/results/kv_share.md``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import statistics
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

from bench.router import Rollout, read_jsonl
from learner.hparams import Hyperparams
from learner.step import ScoredTree, train_step

DATA = Path(__file__).resolve().parent / "data" / "router_harness_calls.jsonl.xz"
RESULTS = Path(__file__).resolve().parent / "results" / "kv_share.md"
HEAD = 1000


def _lcp(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def groups(rollouts: list[Rollout], sizes: tuple[int, ...]) -> list[list[Rollout]]:
    """Rollout groups by their first HEAD prompt tokens, of the given sizes, each of distinct rollouts."""
    by_head: dict[tuple[int, ...], list[Rollout]] = defaultdict(list)
    for r in rollouts:
        by_head[tuple(r.calls[0].prompt[:HEAD])].append(r)
    distinct = [g for g in by_head.values() if len({tuple(r.calls[-1].prompt) for r in g}) == len(g)]
    return [next(g for g in distinct if len(g) == size) for size in sizes]


def tree(rollout: Rollout) -> list:
    """The rollout's calls as its prefix tree (each call continues the previous one where its prompt does)."""
    from streams.tree import TreeCall, build_tree

    calls, before = [], None
    for i, c in enumerate(rollout.calls):
        shared = _lcp(before, c.prompt) if before is not None else 0
        gen = [t % 2000 for t in c.completion] or [1]
        calls.append(
            TreeCall(f"c{i}", i, f"c{i - 1}" if i and shared else None, shared, c.prompt[shared:], gen,
                     [-0.5] * len(gen), "main", 0)
        )  # fmt: skip
        before = c.prompt + gen
    return build_tree(calls).segments


def _step(model: torch.nn.Module, trees: list[ScoredTree], config: Hyperparams) -> dict[str, float]:
    m = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(m.parameters(), lr=config.lr, betas=config.betas, weight_decay=config.weight_decay)
    return train_step(m, optimizer, trees, config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--sizes", type=int, nargs="+", default=[7, 4], help="sizes of the groups to take")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    from policy.tiny_model import init_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        init_tiny_model(Path(tmp), seed=0, progress=None)
        model = AutoModelForCausalLM.from_pretrained(tmp, attn_implementation="sdpa").float()
    chosen = groups(read_jsonl(DATA), tuple(args.sizes))
    trees = [
        ScoredTree(tree(r), 1.0 if i % 2 == 0 else -1.0, float(i % 2 == 0), f"group{g}")
        for g, grp in enumerate(chosen)
        for i, r in enumerate(grp)
    ]
    shapes = []
    for grp in chosen:
        heads = [r.calls[0].prompt for r in grp]
        shared = min(_lcp(heads[0], h) for h in heads[1:])
        lengths = [len(r.calls[-1].prompt) + len(r.calls[-1].completion) for r in grp]
        shapes.append(f"{len(grp)} rollouts of {min(lengths):,}–{max(lengths):,} tokens sharing {shared:,}")
    on_cfg = Hyperparams()
    off_cfg = dataclasses.replace(on_cfg, kv_share_min=0)
    runs: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
    load = [os.getloadavg()[0]]
    for r in range(args.rounds):
        for name in ("off", "on") if r % 2 == 0 else ("on", "off"):
            runs[name].append(_step(model, trees, on_cfg if name == "on" else off_cfg))
            load.append(os.getloadavg()[0])
            print(f"round {r} {name}: {runs[name][-1]['step_seconds']:.1f} s (load {load[-1]:.1f})", flush=True)

    def med(name: str, key: str) -> float:
        return statistics.median(m.get(key, 0.0) for m in runs[name])

    pairs = list(zip(runs["on"], runs["off"], strict=True))
    loss_diff = max(abs(a["loss"] - b["loss"]) for a, b in pairs)
    norm_diff = max(abs(a["grad_norm"] - b["grad_norm"]) / b["grad_norm"] for a, b in pairs)
    paired = [b["step_seconds"] / a["step_seconds"] for a, b in pairs]
    params = sum(p.numel() for p in model.parameters())
    lines = [
        "# Learner benchmark: context shared by rows of their own, computed once",
        "",
        f"One learner step (`learner.step.train_step`, the learner's defaults: GRPO, token budget "
        f"{on_cfg.token_budget}, one update, AdamW) on recorded real-harness rollouts, every one over the token "
        f"budget, so trained path by path: {'; '.join(shapes)} (`bench/data/router_harness_calls.jsonl.xz`). The "
        f"quickstart's tiny Qwen3 ({params / 1e6:.1f}M params), fp32 on {torch.get_num_threads()} CPU threads "
        f"(1-minute load average {min(load):.1f}–{max(load):.1f}, {os.cpu_count()} cores); median of {args.rounds} "
        f"interleaved rounds, each on a fresh copy of the model. Run: `.venv/bin/python -m bench.kv_share`.",
        "",
        "| common prefix | tokens in rows | tokens computed once for several rows | step (s) |",
        "|---|---:|---:|---:|",
        f"| per path (`kv_share_min=0`) | {med('off', 'tokens'):,.0f} | 0 | {med('off', 'step_seconds'):.1f} |",
        f"| once (`kv_share_min={on_cfg.kv_share_min}`) | {med('on', 'tokens'):,.0f} | "
        f"{med('on', 'kv_shared_tokens'):,.0f} not recomputed | {med('on', 'step_seconds'):.1f} |",
        "",
        f"**{statistics.median(paired):.2f}× faster step** (off/on per round: "
        f"{', '.join(f'{x:.2f}' for x in paired)}). "
        f"The same step both ways: losses differ by at most {loss_diff:.1e}, gradient norms by {norm_diff:.1e} "
        f"relative (exactness is tested at 1e-5: tests/unit/test_kv_share.py).",
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
