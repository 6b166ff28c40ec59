"""SFT-from-topics benchmark: one optimizer step on real-harness rows, each row's whole context computed (off) or
the common prefix of a harness's rows computed once (on: ``warmstart.sft_topics.rows_loss``, the default).

The rows are recorded real-harness rollouts (``bench/data/router_harness_calls.jsonl.xz``, taken as
``bench.kv_share`` takes them: the first rows of a group of distinct rollouts of one harness sharing a long head):
each row is a rollout's last call, prompt + answer, the answer its target (what ``--from-topics`` trains on).
Each round runs one step of ``rows_loss`` + backward + clipping + AdamW on a fresh copy of the quickstart's tiny
model, off and on in alternating order; medians over rounds; the two losses must agree. A shared CPU: read the
ratio, not the seconds.

Run: ``.venv/bin/python -m bench.sft_share [--rounds 2] [--sizes 7] [--rows 4]``; writes ``bench/results/sft_share.md``.
"""

from __future__ import annotations

import argparse
import copy
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.kv_share import groups
from bench.router import Rollout, read_jsonl
from warmstart.sft_rows import Row
from warmstart.sft_topics import rows_loss

DATA = Path(__file__).resolve().parent / "data" / "router_harness_calls.jsonl.xz"
RESULTS = Path(__file__).resolve().parent / "results" / "sft_share.md"


def row(rollout: Rollout, harness: str) -> Row:
    last = rollout.calls[-1]
    gen = [t % 2000 for t in last.completion] or [1]  # the tiny model's vocabulary, as bench.kv_share
    return Row(rollout.rollout_id, harness, "", 1.0, last.prompt + gen, [0] * len(last.prompt) + [1] * len(gen))


def _step(model: torch.nn.Module, rows: list[Row], shared: bool) -> tuple[float, float]:
    m = copy.deepcopy(model).train()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
    t0 = time.perf_counter()
    loss, n = rows_loss(m, rows, pad_id=0, shared_prefix=shared)
    (loss / n).backward()
    torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
    opt.step()
    return time.perf_counter() - t0, float(loss.detach()) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--sizes", type=int, nargs="+", default=[7], help="sizes of the row groups (harnesses)")
    parser.add_argument("--rows", type=int, default=4, help="rows per group in the step (the batch)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    from policy.tiny_model import init_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        init_tiny_model(Path(tmp), seed=0, progress=None)
        model = AutoModelForCausalLM.from_pretrained(tmp, attn_implementation="sdpa").float()
    chosen = groups(read_jsonl(DATA), tuple(args.sizes))
    rows = [row(r, f"harness{g}") for g, grp in enumerate(chosen) for r in grp[: args.rows]]
    tokens = sum(len(r.ids) for r in rows)
    runs: dict[str, list[tuple[float, float]]] = {"off": [], "on": []}
    load = [os.getloadavg()[0]]
    for r in range(args.rounds):
        for name in ("off", "on") if r % 2 == 0 else ("on", "off"):
            runs[name].append(_step(model, rows, name == "on"))
            load.append(os.getloadavg()[0])
            print(f"round {r} {name}: {runs[name][-1][0]:.1f} s (load {load[-1]:.1f})", flush=True)
    pairs = list(zip(runs["on"], runs["off"], strict=True))
    paired = [off[0] / on[0] for on, off in pairs]
    loss_diff = max(abs(on[1] - off[1]) for on, off in pairs)
    sizes = ", ".join(
        f"{min(len(g), args.rows)} rows of {min(len(r.calls[-1].prompt) for r in g[: args.rows]):,}+ tokens"
        for g in chosen
    )
    lines = [
        "# SFT from the event log: a harness's shared prefix computed once",
        "",
        f"One SFT step (`warmstart.sft_topics.rows_loss`, backward, clipping, AdamW) on {len(rows)} recorded "
        f"real-harness rows ({sizes}; {tokens:,} tokens in all; `bench/data/router_harness_calls.jsonl.xz`), the "
        f"quickstart's tiny Qwen3, fp32 on {torch.get_num_threads()} CPU threads (1-minute load average "
        f"{min(load):.1f}–{max(load):.1f}, {os.cpu_count()} cores, shared with other jobs; peak RSS "
        f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.1f} GiB); median of {args.rounds} "
        "interleaved rounds, each on a fresh copy of the model. Run: `.venv/bin/python -m bench.sft_share`.",
        "",
        "| context | step (s) |",
        "|---|---:|",
        f"| every row whole (`--no-shared-prefix`) | {statistics.median(s for s, _ in runs['off']):.1f} |",
        f"| a harness's common prefix once (default) | {statistics.median(s for s, _ in runs['on']):.1f} |",
        "",
        f"**{statistics.median(paired):.2f}× faster step** (off/on per round: {', '.join(f'{x:.2f}' for x in paired)})."
        f" The same loss both ways to {loss_diff:.1e} (exactness, gradients included, is tested at 1e-5: "
        "tests/unit/test_sft_topics_share.py).",
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
