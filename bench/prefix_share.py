"""Learner benchmark: one learner step on a quickstart-shaped batch without and with cross-rollout prefix sharing.

The batch is shaped like the quickstart's (docs/quickstart.md, "Where a step's time goes"): 4 tasks of the built-in
CPU suite × 4 rollouts, 2 in each chat dialect of the built-in loop (OpenAI, Anthropic). Each rollout is the task's
scripted correct episode (``warmstart.demos.build_episodes``: the real agent loop through the real TITO
renderer and tokenizer), turned into its rollout tree by ``streams.tree.build_tree``; advantages ±1 per dialect
within a task (scripted episodes are greedy: a task's rollouts in one dialect are the same episode). The model
is the quickstart's: ``policy.tiny_model.init_tiny_model`` with its defaults. Every rollout's root is its first
prompt: the dialect's system prompt + tool schemas, then the task's user prompt.

Each round runs ``learner.step.train_step`` (the learner's defaults: GRPO, token budget 4096, one update) on a fresh
copy of the model and AdamW, once with ``share_prefix_min=0`` (off) and once with the default (on), in alternating
order; medians over rounds. The two steps' losses and gradient norms must agree (printed). One run, side by side, on
whatever the machine is doing at the time (a shared CPU: the ratio is the number to read, not the seconds).

Run: ``.venv/bin/python -m bench.prefix_share [--rounds 5]``; writes ``bench/results/prefix_share.md``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import statistics
import tempfile
from pathlib import Path

import torch

from learner.hparams import Hyperparams
from learner.pack import pack_trees
from learner.step import ScoredTree, train_step

RESULTS = Path(__file__).resolve().parent / "results" / "prefix_share.md"


def quickstart_batch(tokenizer, tasks: int = 4, per_dialect: int = 2) -> list[ScoredTree]:  # noqa: ANN001
    """``tasks`` × 2 dialects × ``per_dialect`` rollout trees of scripted episodes, a GRPO group per task."""
    from streams.tree import TreeCall, build_tree
    from warmstart.demos import build_episodes, train_tasks

    out = []
    for e, ep in enumerate(build_episodes(tokenizer, train_tasks(tasks))):  # task 0 openai, task 0 anthropic, ...
        calls = [
            TreeCall(
                call_id=f"c{i}",
                seq=i,
                parent_call_id=None,
                shared_prefix_len=0,
                new_tokens=prompt,
                generated_tokens=gen,
                logprobs=[-0.5] * len(gen),
                call_kind="main",
                policy_version=0,
            )
            for i, (prompt, gen) in enumerate(ep.turns)
        ]
        segments = build_tree(calls).segments
        harness = "agentloop" if ep.dialect == "openai" else "agentloop-anthropic"
        # The copies of an episode are identical: they get the same advantage (opposite ones would cancel).
        advantage = 1.0 if e % 2 == (e // 2) % 2 else -1.0
        out += [ScoredTree(segments, advantage, float(advantage > 0), harness) for _ in range(per_dialect)]
    return out


def _step(model: torch.nn.Module, trees: list[ScoredTree], config: Hyperparams) -> dict[str, float]:
    m = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(m.parameters(), lr=config.lr, betas=config.betas, weight_decay=config.weight_decay)
    return train_step(m, optimizer, trees, config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from policy.tiny_model import init_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        init_tiny_model(Path(tmp), seed=0, progress=None)
        model = AutoModelForCausalLM.from_pretrained(tmp, attn_implementation="sdpa").float()
        tokenizer = AutoTokenizer.from_pretrained(tmp)
    trees = quickstart_batch(tokenizer)
    on_cfg = Hyperparams()
    off_cfg = dataclasses.replace(on_cfg, share_prefix_min=0)
    rows = {
        name: pack_trees([t.segments for t in trees], cfg.token_budget, share_prefix_min=cfg.share_prefix_min)
        for name, cfg in (("off", off_cfg), ("on", on_cfg))
    }
    runs: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
    load = [os.getloadavg()[0]]  # the machine is shared: say how busy it was
    _step(model, trees, on_cfg)  # warm-up
    for r in range(args.rounds):
        for name in ("off", "on") if r % 2 == 0 else ("on", "off"):
            runs[name].append(_step(model, trees, on_cfg if name == "on" else off_cfg))
            load.append(os.getloadavg()[0])
            print(f"round {r} {name}: {runs[name][-1]['step_seconds']:.2f} s (load {load[-1]:.1f})", flush=True)

    def med(name: str, key: str) -> float:
        return statistics.median(m[key] for m in runs[name])

    per_round = {name: ", ".join(f"{m['step_seconds']:.1f}" for m in runs[name]) for name in runs}
    pairs = list(zip(runs["on"], runs["off"], strict=True))
    loss_diff = max(abs(a["loss"] - b["loss"]) for a, b in pairs)
    norm_diff = max(abs(a["grad_norm"] - b["grad_norm"]) / b["grad_norm"] for a, b in pairs)
    shared = sum(mb.shared_tokens for mb in rows["on"])
    params = sum(p.numel() for p in model.parameters())
    lines = [
        "# Learner benchmark: cross-rollout prefix sharing",
        "",
        f"One learner step (`learner.step.train_step`, the learner's defaults: GRPO, token budget "
        f"{on_cfg.token_budget}, one update) on a quickstart-shaped batch: {len(trees)} rollouts = 4 CPU-suite tasks "
        f"× 2 per dialect of the built-in loop (OpenAI, Anthropic), scripted correct episodes through the real agent "
        f"loop, TITO renderer and tokenizer; the quickstart's tiny Qwen3 ({params / 1e6:.1f}M params), fp32 on "
        f"{torch.get_num_threads()} CPU threads (1-minute load average {min(load):.1f}–{max(load):.1f} during the "
        f"run, {os.cpu_count()} cores); median of {args.rounds} interleaved rounds, each step on a fresh copy "
        f"of the model. Run: `.venv/bin/python -m bench.prefix_share`.",
        "",
        "| sharing | packed tokens | trainable tokens | micro-batches | step (s) | tokens/s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    labels = {"off": "off (`share_prefix_min=0`)", "on": f"on (`share_prefix_min={on_cfg.share_prefix_min}`)"}
    for name, label in labels.items():
        lines.append(
            f"| {label} | {med(name, 'tokens'):,.0f} | {med(name, 'trainable_tokens'):,.0f} | "
            f"{med(name, 'micro_batches'):.0f} | {med(name, 'step_seconds'):.2f} | "
            f"{med(name, 'tokens_per_s'):,.0f} |"
        )
    tokens_ratio = med("off", "tokens") / med("on", "tokens")
    time_ratio = med("off", "step_seconds") / med("on", "step_seconds")
    # Each round's pair ran back to back: its ratio is less exposed to the machine's load drifting between rounds.
    paired = [b["step_seconds"] / a["step_seconds"] for a, b in zip(runs["on"], runs["off"], strict=True)]
    lines += [
        "",
        f"**{tokens_ratio:.2f}× fewer packed tokens, {time_ratio:.2f}× faster step** with sharing on. The shared "
        f"virtual segments hold {shared:,} tokens (the dialects' common header, each dialect's system prompt + tool "
        f"schemas, each task's user prompt). The same step both ways: over the rounds the losses differ by at most "
        f"{loss_diff:.1e}, the gradient norms ({runs['off'][0]['grad_norm']:.3g}) by {norm_diff:.1e} relative. "
        f"Step times per round: off {per_round['off']} s; on {per_round['on']} s; off/on per round "
        f"{', '.join(f'{x:.2f}' for x in paired)} (median {statistics.median(paired):.2f}×).",
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
