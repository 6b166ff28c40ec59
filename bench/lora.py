"""LoRA benchmark: one learner step on the warm start with low-rank adapters vs full weights, side by side.

Each case runs in a fresh process (peak RSS is per process): the warm start (``models/warmstart``) loaded as the
learner loads it (fp32, ``learner.precision``), the optimizer the learner builds (AdamW over every weight, or over the
adapters of ``learner.lora.LoRA`` with the base frozen), then ``--steps`` GRPO steps (``learner.step.train_step``) on
the same batch: ``--rollouts`` agent-loop-shaped trees (``bench.learner``'s append-only shape, a 600-token system
prompt and ``--calls`` calls), ±1 advantages. Reported per case: the median step time after the first (AdamW's state
is allocated in the first), the first step's, tokens/s, the peak RSS (VmHWM) and its growth over the loaded model
(VmHWM − VmRSS before the first step), the trained parameters and the trainer state's size. Cases alternate
(off, on, off, on, ...) over ``--rounds``; medians over the rounds, and on ÷ off.

Run: ``.venv/bin/python -m bench.lora [--rank 8] [--rounds 2]``; writes ``bench/results/lora.md``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "lora.md"
MODEL = ROOT / "models" / "warmstart"
MIB = 1024**2


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _case(spec: dict) -> dict[str, float]:
    """One measurement in this fresh process (``spec``: rank, steps, rollouts, calls, threads)."""
    import torch

    from bench.learner import _tree
    from learner.hparams import Hyperparams
    from learner.lora import LoRA
    from learner.precision import load_policy
    from learner.step import ScoredTree, train_step

    torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    rank = spec["rank"]
    config = Hyperparams(lr=1e-5, lora_rank=rank, lora_lr=1e-4)
    model = load_policy(MODEL)
    params = list(model.parameters())
    if rank:
        lora = LoRA(model, rank, config.lora_alpha, config.lora_targets, config.seed)
        params = list(lora.parameters())
    optimizer = torch.optim.AdamW(params, lr=config.lora_lr if rank else config.lr, weight_decay=0.0)
    trees = [
        ScoredTree(_tree("append-only", spec["calls"], seed), 1.0 if seed % 2 else -1.0, float(seed % 2), "agentloop")
        for seed in range(spec["rollouts"])
    ]
    rss_before = _status_kib("VmRSS")
    times, tokens = [], 0.0
    for _ in range(spec["steps"]):
        started = time.perf_counter()
        metrics = train_step(model, optimizer, trees, config)
        times.append(time.perf_counter() - started)
        tokens = metrics["tokens"]
    state = io.BytesIO()
    torch.save({"optimizer": optimizer.state_dict(), **({"lora": lora.state()} if rank else {})}, state)
    return {
        "first_s": times[0],
        "step_s": statistics.median(times[1:]) if len(times) > 1 else times[0],
        "tokens": tokens,
        "peak_mib": _status_kib("VmHWM") / 1024,
        "growth_mib": (_status_kib("VmHWM") - rss_before) / 1024,
        "trained": float(sum(p.numel() for p in params)),
        "state_mib": state.tell() / MIB,
    }


def _run(spec: dict) -> dict[str, float]:
    cmd = [sys.executable, "-m", "bench.lora", "--case", json.dumps(spec)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200, check=False)
    if done.returncode:
        raise SystemExit(f"case {spec} failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--rollouts", type=int, default=8)
    parser.add_argument("--calls", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--case", help=argparse.SUPPRESS)  # internal: one measurement, JSON on stdout
    args = parser.parse_args()
    if args.case:
        print(json.dumps(_case(json.loads(args.case))))
        return
    started, load = time.perf_counter(), os.getloadavg()[0]
    spec = {"steps": args.steps, "rollouts": args.rollouts, "calls": args.calls, "threads": args.threads}
    runs: dict[int, list[dict[str, float]]] = {0: [], args.rank: []}
    for _ in range(args.rounds):
        for rank in (0, args.rank):
            runs[rank].append(_run({**spec, "rank": rank}))
            print(f"rank {rank}: {json.dumps(runs[rank][-1])}", flush=True)
    med = {r: {k: statistics.median(x[k] for x in xs) for k in xs[0]} for r, xs in runs.items()}
    off, on = med[0], med[args.rank]
    fields = [
        ("step time (median after the first)", "step_s", "{:.2f} s"),
        ("first step (AdamW state allocated)", "first_s", "{:.2f} s"),
        ("tokens/s", None, "{:,.0f}"),
        ("peak RSS (VmHWM)", "peak_mib", "{:.0f} MiB"),
        ("peak RSS growth over the loaded model", "growth_mib", "{:.0f} MiB"),
        ("trained parameters", "trained", "{:,.0f}"),
        ("trainer state (optimizer + adapters)", "state_mib", "{:.1f} MiB"),
    ]
    rows = [f"| | full weights | LoRA r = {args.rank} | LoRA ÷ full |", "|---|---:|---:|---:|"]
    for label, key, fmt in fields:
        a, b = (m["tokens"] / m["step_s"] for m in (off, on)) if key is None else (off[key], on[key])
        rows.append(f"| {label} | {fmt.format(a)} | {fmt.format(b)} | {b / a:.2f} |")
    print("\n".join(rows))
    lines = [
        "# LoRA vs full-weight learner step on the warm start (CPU)",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores (shared with other work: load average "
        f"{load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end), Python "
        f"{platform.python_version()}; fp32, {args.threads} torch threads, each case its own process, cases "
        f"alternating, medians over {args.rounds} rounds. Batch: {args.rollouts} agent-loop-shaped rollouts of "
        f"{args.calls} calls ({off['tokens']:,.0f} tokens), {args.steps} GRPO steps per case. What is measured: "
        "`bench/lora.py`.",
        "",
        f"Command: `.venv/bin/python -m bench.lora --rank {args.rank} --rounds {args.rounds}` "
        f"({time.perf_counter() - started:.0f} s).",
        "",
        *rows,
    ]
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
