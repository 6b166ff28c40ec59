"""Logprob memory benchmark: peak RSS and time of one row's forward+backward, full (T, V) logits vs chunked LM head.

A 1-layer random Qwen2-shaped model (hidden 256, vocabulary 151,936 as Qwen2.5/Qwen3; built locally, no model hub),
one row of T tokens, all trainable (one chain: the model's causal path). Per case, one forward+backward of the mean
token logprob in fp32 on the CPU (one torch thread by default), each case in its own subprocess: peak RSS growth
(VmHWM after the pass minus VmRSS before it, the peak reset through /proc/self/clear_refs after a short warm-up that
allocates the gradients), wall and CPU time. ``old``: ``packed_forward`` + ``gather_token_logprobs`` (the row's
(T, V) logits); ``new``: ``packed_logprobs`` (``logprob_chunk`` positions at a time, checkpointed:
docs/method.md#chunked-logprobs). Temperature 1 at each T, and one top-p 0.9 case. An old case whose growth,
extrapolated linearly in T from its last measured one, would exceed ``--max-gib`` is skipped and marked so (the
machine is shared).

Run: ``.venv/bin/python -m bench.logprob_memory [--lengths 1024,2048,4096] [--top-p-length 1024]
[--out bench/results/logprob_memory.md]``; prints and writes ``bench/results/logprob_memory.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "logprob_memory.md"
ROOT = Path(__file__).resolve().parents[1]
GIB = 1024**3


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux ≥ 4.0); False where that is not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _row(tokens: int, top_p: float, vocab: int):  # noqa: ANN202
    import numpy as np

    from learner.pack import pack_trees
    from schemas.events import TreeSegment

    rng = np.random.default_rng(0)
    seg = TreeSegment(
        parent=-1,
        tokens=rng.integers(3, vocab, tokens).astype("<i4"),
        trainable=True,
        logprobs=np.full(tokens, -1.0, "<f4"),
        policy_version=0,
        temperature=1.0,
        top_p=top_p,
        top_k=0,
    )
    [row] = pack_trees([[seg]], tokens)
    return row


def _case(path: str, tokens: int, top_p: float, vocab: int, hidden: int, chunk: int, threads: int) -> dict[str, float]:
    """One measurement, in this (fresh) process."""
    import torch

    torch.set_num_threads(threads)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from learner.forward import gather_token_logprobs, packed_forward, packed_logprobs

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    model = Qwen2ForCausalLM(config).to(torch.float32)

    def step(tokens: int) -> tuple[float, float, float]:
        row = _row(tokens, top_p, vocab)
        started, cpu = time.perf_counter(), time.process_time()
        if path == "old":
            logp = gather_token_logprobs(packed_forward(model, row).logits, row, only_trainable=True)
        else:
            logp = packed_logprobs(model, row, only_trainable=True, chunk=chunk)
        loss = -logp[row.loss_mask].mean()
        loss.backward()
        return time.perf_counter() - started, time.process_time() - cpu, float(loss.detach())

    step(16)  # warm-up: kernels, and the gradient buffers every step has
    exact = _reset_peak()
    before = _status_kib("VmRSS") if exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    seconds, cpu_seconds, loss = step(tokens)
    peak = _status_kib("VmHWM") if exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    growth = (peak - before) * 1024 / GIB
    return {"growth_gib": growth, "seconds": seconds, "cpu_seconds": cpu_seconds, "loss": loss, "exact_peak": exact}


def _run_case(args: argparse.Namespace, path: str, tokens: int, top_p: float) -> dict[str, float]:
    spec = json.dumps({"path": path, "tokens": tokens, "top_p": top_p})
    cmd = [sys.executable, "-m", "bench.logprob_memory", "--case", spec, "--vocab", str(args.vocab)]
    cmd += ["--hidden", str(args.hidden), "--chunk", str(args.chunk), "--threads", str(args.threads)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    if done.returncode:
        raise SystemExit(f"case {spec} failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _secs(case: dict[str, float]) -> str:
    return f"{case['seconds']:.1f} ({case['cpu_seconds']:.1f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--lengths", default="1024,2048,4096", help="row lengths T, temperature 1")
    parser.add_argument("--top-p-length", type=int, default=1024, help="T of the one top-p 0.9 case (0: none)")
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--chunk", type=int, default=256, help="logprob_chunk of the new path")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per case (1: CPU time ≈ the work)")
    parser.add_argument("--max-gib", type=float, default=9.0, help="skip an old case predicted to grow more")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--case", help=argparse.SUPPRESS)  # internal: one measurement, JSON on stdout
    args = parser.parse_args()
    if args.case:
        spec = json.loads(args.case)
        result = _case(spec["path"], spec["tokens"], spec["top_p"], args.vocab, args.hidden, args.chunk, args.threads)
        print(json.dumps(result))
        return

    started = time.perf_counter()
    cases = [(int(t), 1.0) for t in args.lengths.split(",")]
    if args.top_p_length:
        cases.append((args.top_p_length, 0.9))
    rows = [
        "| T | sampling | old: peak RSS growth | new: peak RSS growth | memory ratio old/new | new ÷ (chunk × V × 4 B) "
        "| old: fwd+bwd wall (CPU) s | new: fwd+bwd wall (CPU) s | CPU time ratio new/old | Δloss |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    unit_gib = args.chunk * args.vocab * 4 / GIB  # one (chunk, V) fp32 tensor
    last_old: dict[float, tuple[int, float]] = {}  # top_p -> (T, growth GiB) of the last measured old case
    for tokens, top_p in cases:
        new = _run_case(args, "new", tokens, top_p)
        prior = last_old.get(top_p)
        predicted = prior[1] * tokens / prior[0] if prior else 0.0
        sampling = "temperature 1" if top_p == 1.0 else f"top-p {top_p}"
        if predicted > args.max_gib:
            rows.append(
                f"| {tokens:,} | {sampling} | skipped (≈ {predicted:.1f} GiB predicted) | {new['growth_gib']:.2f} GiB "
                f"| ≈ {predicted / new['growth_gib']:.0f}x | {new['growth_gib'] / unit_gib:.1f} | – | {_secs(new)} "
                "| – | – |"
            )
        else:
            old = _run_case(args, "old", tokens, top_p)
            last_old[top_p] = (tokens, old["growth_gib"])
            rows.append(
                f"| {tokens:,} | {sampling} | {old['growth_gib']:.2f} GiB | {new['growth_gib']:.2f} GiB "
                f"| **{old['growth_gib'] / new['growth_gib']:.1f}x** | {new['growth_gib'] / unit_gib:.1f} "
                f"| {_secs(old)} | {_secs(new)} | {new['cpu_seconds'] / old['cpu_seconds']:.2f} "
                f"| {abs(old['loss'] - new['loss']):.1e} |"
            )
        print(rows[-1], flush=True)
    v, c = args.vocab, args.chunk
    out = args.out.resolve()
    shown_out = out.relative_to(ROOT) if out.is_relative_to(ROOT) else out
    chunk_mib = c * v * 4 / 2**20
    lines = [
        "# Logprob memory: full (T, V) logits vs chunked LM head",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores, Python {platform.python_version()}, fp32 on the "
        f"CPU with torch threads = {args.threads} per case (a CI run was using the same cores: wall times are noisy, "
        "CPU times less so; memory is not affected). Model: 1-layer random "
        f"Qwen2 (hidden {args.hidden}, vocabulary {v:,}, untied head). One row, all tokens trainable; one "
        "forward+backward of the mean token logprob; each case in its own process. Peak RSS growth = VmHWM after "
        "the pass − VmRSS before it (gradient buffers allocated by a warm-up). Old = `packed_forward` + "
        f"`gather_token_logprobs`; new = `packed_logprobs(chunk={c})`.",
        "",
        f"Command: `.venv/bin/python -m bench.logprob_memory --lengths {args.lengths} --top-p-length "
        f"{args.top_p_length} --threads {args.threads} "
        f"--out {shown_out}` "
        f"({time.perf_counter() - started:.0f} s).",
        "",
        *rows,
        "",
        f"Formula (docs/method.md#chunked-logprobs): the old path's extra memory grows as c' × T × V × 4 bytes (the "
        "logits, their temperature-scaled and log-softmaxed copies and their gradients); the new path's is "
        f"≈ c × chunk × V × 4 bytes whatever T, one (chunk, V) fp32 tensor being {chunk_mib:.0f} MiB here, c ≈ 5 "
        "with temperature only and ≈ 9 with top-k/top-p (their sort; the column after the ratio), plus the T × H "
        "hidden states and the checkpointed chunks' (chunk, H) inputs (the slow growth with T). The new path runs "
        "the LM head's forward twice (again in backward), which costs most on this 1-layer model, where the head is "
        "most of the work. "
        f"Δloss = |old − new| of the loss. Old cases are skipped when predicted above {args.max_gib:g} GiB.",
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
