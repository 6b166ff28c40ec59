"""Learner memory benchmark: a row's measured peak RSS growth against the formula the learner's pre-step check uses.

Each case builds a random Qwen3-shaped model (built locally, no model hub) in its own process, allocates its
gradients with a short warm-up pass, resets the peak (/proc/self/clear_refs) and runs one forward+backward of the
mean token logprob (``packed_logprobs``, chunked head) on one row of T tokens: a chain, or a tree (three segments,
so the dense (T, T) mask), with or without activation checkpointing (transformers' per-layer, non-reentrant).
Growth = VmHWM after the pass − VmRSS before it; formula = ``learner.memory.activation_bytes``. The check divides
by ``SAFETY`` = 1.25 of margin, so a ratio ≤ 1.25 is what the check needs.

Run: ``.venv/bin/python -m bench.learner_memory [--out bench/results/learner_memory.md]`` (~3 min on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "learner_memory.md"
ROOT = Path(__file__).resolve().parents[1]
MIB = 1024**2
# (layers, hidden, intermediate, heads, kv heads, vocabulary, T, tree, checkpointing)
CASES = [
    (1, 256, 768, 4, 2, 4096, 2048, False, False),
    (2, 256, 768, 4, 2, 4096, 2048, False, False),
    (4, 256, 768, 4, 2, 4096, 2048, False, False),
    (2, 256, 768, 4, 2, 4096, 2048, True, False),
    (2, 256, 768, 4, 2, 4096, 4096, True, False),
    (2, 512, 1536, 8, 4, 4096, 2048, False, False),
    (4, 256, 768, 4, 2, 4096, 2048, False, True),
    (2, 512, 1536, 8, 4, 4096, 2048, False, True),
    (4, 256, 768, 4, 2, 4096, 4096, True, True),
    (2, 256, 768, 4, 2, 32768, 2048, False, True),
]


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _case(spec: list) -> dict[str, float]:  # noqa: C901 - one measurement, in this fresh process
    import numpy as np
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from learner.forward import packed_logprobs
    from learner.memory import ModelShape, activation_bytes
    from learner.pack import pack_trees
    from schemas.events import TreeSegment

    layers, hidden, inter, heads, kv, vocab, tokens, tree, ckpt = spec
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=hidden // heads,
        max_position_embeddings=65536,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    model = Qwen3ForCausalLM(config).float().train()
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    rng = np.random.default_rng(0)

    def seg(parent: int, n: int) -> TreeSegment:
        return TreeSegment(
            parent=parent,
            tokens=rng.integers(3, vocab, n).astype("<i4"),
            trainable=True,
            logprobs=np.full(n, -1.0, "<f4"),
            policy_version=0,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
        )

    def step(n: int) -> None:
        segs = [seg(-1, n // 2), seg(0, n // 4), seg(0, n - n // 2 - n // 4)] if tree else [seg(-1, n)]
        [row] = pack_trees([segs], n)
        logp = packed_logprobs(model, row, only_trainable=True, chunk=256)
        (-logp[row.loss_mask].mean()).backward()

    step(32)  # kernels and the gradient buffers
    Path("/proc/self/clear_refs").write_text("5")
    before = _status_kib("VmRSS")
    started = time.process_time()
    step(tokens)
    growth = (_status_kib("VmHWM") - before) * 1024
    formula = activation_bytes(ModelShape.of(model), tokens, tree=tree, checkpointing=ckpt, chunk=256)
    return {"growth": growth, "formula": formula, "cpu_s": time.process_time() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--case", help=argparse.SUPPRESS)  # internal: one measurement, JSON on stdout
    args = parser.parse_args()
    if args.case:
        print(json.dumps(_case(json.loads(args.case))))
        return
    started = time.perf_counter()
    rows = [
        "| layers | hidden | intermediate | heads (kv) | V | T | row | checkpointing | measured | formula "
        "| measured ÷ formula | CPU s |",
        "|---:|---:|---:|---|---:|---:|---|---|---:|---:|---:|---:|",
    ]
    ratios = []
    for spec in CASES:
        cmd = [sys.executable, "-m", "bench.learner_memory", "--case", json.dumps(spec)]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
        if done.returncode:
            raise SystemExit(f"case {spec} failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
        r = json.loads(done.stdout.strip().splitlines()[-1])
        layers, hidden, inter, heads, kv, vocab, tokens, tree, ckpt = spec
        ratio = r["growth"] / r["formula"]
        ratios.append(ratio)
        rows.append(
            f"| {layers} | {hidden} | {inter} | {heads} ({kv}) | {vocab:,} | {tokens:,} "
            f"| {'tree' if tree else 'chain'} | {'on' if ckpt else 'off'} "
            f"| {r['growth'] / MIB:.0f} MiB | {r['formula'] / MIB:.0f} MiB "
            f"| {ratio:.2f} | {r['cpu_s']:.1f} |"
        )
        print(rows[-1], flush=True)
    lines = [
        "# Learner memory: measured peak RSS growth of one row against the pre-step check's formula",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores (shared), Python {platform.python_version()}; "
        "fp32 on the CPU, one torch thread per case, each case in its own process. What is measured and the "
        "formula: `bench/learner_memory.py`, docs/method.md#learner-memory.",
        "",
        f"Command: `.venv/bin/python -m bench.learner_memory` ({time.perf_counter() - started:.0f} s).",
        "",
        *rows,
        "",
        f"measured ÷ formula: {min(ratios):.2f}–{max(ratios):.2f} over {len(ratios)} cases; the check multiplies the "
        "formula by 1.25 (`learner.memory.SAFETY`).",
    ]
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
