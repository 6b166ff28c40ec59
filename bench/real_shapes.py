"""Real shapes on the CPU: a Qwen3-0.6B-shaped policy (full width and vocabulary, few layers) trained on a 38k-token
rollout and served with a 40k-token prompt.

The shape is Qwen3-0.6B's (hidden 1,024, intermediate 3,072, 16 query / 8 key-value heads of 128, vocabulary 151,936,
tied embeddings) with ``--layers`` decoder layers (default 2, so a 2-core step takes minutes), random init, built
locally. 1. **Learner step**: one ``learner.step.train_step`` on one Claude-Code-like rollout of ``--tokens`` tokens
(a 34k-token system prompt and tools, then turns of 256 generated and 256 tool-result tokens; an append-only chain, so
one row of its own past the token budget), with the learner's pre-step plan (``learner.memory.plan_step``: activation
checkpointing when needed); peak RSS growth of the step against the plan's estimate. 2. **Engine**: the project's CPU
engine (``consumers.inference.server --no-weights``) on the same directory, one ``--prompt-tokens`` prompt, then a
second one sharing all but its last 64 tokens: time to the first token and the cached tokens it reports.

Run: ``.venv/bin/python -m bench.real_shapes [--layers 2] [--tokens 38000] [--out bench/results/real_shapes.md]``
(~15–25 min on 2 cores, ~12 GiB). ``--layers 28 --device cuda`` is bench/gpu_checks.py's shape.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results" / "real_shapes.md"
ROOT = Path(__file__).resolve().parents[1]
GIB = 1024**3
PROMPT = 34_000  # a real Claude Code first call: ~35-40k tokens of system prompt and tool schemas (docs/harnesses.md)
TURN = 256  # generated tokens per call, and tool-result tokens after it


def qwen3_06b_config(layers: int, max_positions: int = 40_960):  # noqa: ANN201 - transformers.Qwen3Config
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=151_936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        rope_theta=1_000_000.0,
        attn_implementation="sdpa",
    )


@dataclass
class Segment:
    """A rollout tree's segment as the learner packs it (``learner.pack.SegmentLike`` with its call's sampling
    settings); not ``schemas.events.TreeSegment``, so that bench/gpu_checks.py needs no Avro library."""

    parent: int
    tokens: Any  # (n,) int32
    trainable: bool
    logprobs: Any  # (n,) float32 for a trainable segment, else empty
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0


def rollout(tokens: int, seed: int = 0) -> list[Segment]:
    """An append-only rollout of ``tokens`` tokens: the prompt, then (generated, tool result) turns."""
    import numpy as np

    rng = np.random.default_rng(seed)
    prompt = min(PROMPT, tokens * 9 // 10)
    segs = [Segment(-1, rng.integers(3, 151_000, prompt).astype("<i4"), False, np.zeros(0, "<f4"))]
    left, trainable = tokens - prompt, True
    while left > 0:
        n = min(TURN, left)
        ids = rng.integers(3, 151_000, n).astype("<i4")
        lps = (-rng.random(n) * 2).astype("<f4") if trainable else np.zeros(0, "<f4")
        segs.append(Segment(len(segs) - 1, ids, trainable, lps))
        left, trainable = left - n, not trainable
    return segs


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(field)


def learner_step(layers: int, tokens: int, threads: int) -> dict:
    """One train_step on the rollout with the learner's memory plan; peak RSS growth against the estimate."""
    import torch
    from transformers import Qwen3ForCausalLM

    from learner.hparams import Hyperparams
    from learner.memory import available_bytes, plan_step
    from learner.pack import pack_trees
    from learner.step import ScoredTree, train_step

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(qwen3_06b_config(layers)).float()
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    config = Hyperparams(lr=1e-5)
    segs = rollout(tokens)
    rows = pack_trees([segs], config.token_budget, model.config.max_position_embeddings)
    shapes = [(r.num_tokens, not r.is_chain, r.uses_top_k or r.uses_top_p) for r in rows]
    limit = available_bytes(torch.device("cpu"))
    plan = plan_step(model, optimizer, shapes, mode="auto", limit=limit, chunk=config.logprob_chunk)
    if plan.refusal:
        return {"refused": plan.refusal, "params": params, "limit": limit}
    if plan.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    Path("/proc/self/clear_refs").write_text("5")
    before = _rss_kib("VmRSS") * 1024
    started, cpu = time.perf_counter(), time.process_time()
    metrics = train_step(model, optimizer, [ScoredTree(segs, 1.0, 1.0, "claude-code")], config)
    wall, cpu_s = time.perf_counter() - started, time.process_time() - cpu
    growth = _rss_kib("VmHWM") * 1024 - before
    est = plan.estimate
    return {
        "params": params,
        "rows": len(rows),
        "row_tokens": est.row_tokens,
        "trainable": int(metrics["trainable_tokens"]),
        "checkpointing": plan.checkpointing,
        "estimate_needed": est.needed,
        "estimate_raw": est.activations + est.gradients + est.optimizer,
        "activations": est.activations,
        "limit": limit,
        "growth": growth,
        "wall_s": wall,
        "cpu_s": cpu_s,
        "tokens_per_s": metrics["tokens_per_s"],
        "loss": metrics["loss"],
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _post(url: str, body: dict, timeout: float) -> tuple[dict, float]:
    started = time.perf_counter()
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as resp:  # noqa: S310 - loopback
        return json.loads(resp.read()), time.perf_counter() - started


def engine_prefix(layers: int, prompt_tokens: int, threads: int, work: Path) -> dict:
    """The CPU engine on the saved shape: a first long prompt, then one sharing all but its last 64 tokens."""
    import numpy as np
    import torch
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    model_dir = work / "model"
    Qwen3ForCausalLM(qwen3_06b_config(layers)).save_pretrained(model_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):  # ids are sent, never text
        shutil.copy(ROOT / "models" / "warmstart" / name, model_dir / name)
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    log = (work / "engine.log").open("w")
    cmd = [sys.executable, "-m", "consumers.inference.server", "--model", str(model_dir), "--port", str(port)]
    cmd += [
        "--no-weights",
        "--metrics-interval-s",
        "0",
        "--prefill-chunk-tokens",
        "2048",
        "--max-prefill-tokens",
        "2048",
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=5).read()  # noqa: S310 - loopback
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"engine did not start: {(work / 'engine.log').read_text()[-2000:]}") from None
                time.sleep(1)
        rng = np.random.default_rng(1)
        prompt = rng.integers(3, 2000, prompt_tokens).tolist()
        body = {"model": "policy", "prompt": prompt, "max_tokens": 1, "temperature": 0}
        first, first_s = _post(f"{url}/v1/completions", body, 3600)
        second_prompt = prompt[:-64] + rng.integers(3, 2000, 64).tolist()
        second, second_s = _post(f"{url}/v1/completions", {**body, "prompt": second_prompt}, 3600)
        cached = lambda r: r["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)  # noqa: E731
        return {
            "prompt_tokens": prompt_tokens,
            "first_s": first_s,
            "first_cached": cached(first),
            "second_s": second_s,
            "second_cached": cached(second),
        }
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=38_000, help="the rollout's tokens (learner step)")
    parser.add_argument("--prompt-tokens", type=int, default=40_000, help="the engine's prompt")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--part", help=argparse.SUPPRESS)  # internal: one part in a fresh process, JSON on stdout
    args = parser.parse_args()
    if args.part:
        with tempfile.TemporaryDirectory(prefix="real-shapes-") as tmp:
            if args.part == "learner":
                out = learner_step(args.layers, args.tokens, args.threads)
            else:
                out = engine_prefix(args.layers, args.prompt_tokens, args.threads, Path(tmp))
        print(json.dumps(out))
        return
    started = time.perf_counter()
    results = {}
    for part in ("learner",) + (() if args.skip_engine else ("engine",)):
        cmd = [sys.executable, "-m", "bench.real_shapes", "--part", part, "--layers", str(args.layers)]
        cmd += [
            "--tokens",
            str(args.tokens),
            "--prompt-tokens",
            str(args.prompt_tokens),
            "--threads",
            str(args.threads),
        ]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=7200)
        if done.returncode:
            raise SystemExit(f"{part} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
        results[part] = json.loads(done.stdout.strip().splitlines()[-1])
        print(part, results[part], flush=True)
    args.out.write_text(_report(args, results, time.perf_counter() - started))
    print(f"wrote {args.out}")


def _report(args: argparse.Namespace, results: dict, seconds: float) -> str:
    lines = [
        "# Real shapes on the CPU: Qwen3-0.6B width and vocabulary",
        "",
        f"`.venv/bin/python -m bench.real_shapes --layers {args.layers} --tokens {args.tokens} --prompt-tokens "
        f"{args.prompt_tokens}` on {platform.machine()}, {os.cpu_count()} CPU cores (shared), Python "
        f"{platform.python_version()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} ({seconds:.0f} s). Shape: "
        f"hidden 1,024, intermediate 3,072, 16/8 heads of 128, vocabulary 151,936, tied, {args.layers} layers, random "
        "init, fp32. What is measured: `bench/real_shapes.py`; the formula: docs/method.md#learner-memory.",
        "",
    ]
    step = results["learner"]
    if "refused" in step:
        lines += [f"**Learner step refused by the pre-step check**: {step['refused']}", ""]
    else:
        ratio = step["growth"] / step["estimate_raw"]
        lines += [
            "## Learner step",
            "",
            "| parameters | rollout tokens (row) | trainable | checkpointing | estimate (× 1.25) | formula | measured "
            "peak RSS growth | measured ÷ formula | may use | wall s (CPU s) | tokens/s |",
            "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
            f"| {step['params'] / 1e6:.0f} M | {step['row_tokens']:,} | {step['trainable']:,} "
            f"| {'on' if step['checkpointing'] else 'off'} | {step['estimate_needed'] / GIB:.2f} GiB "
            f"| {step['estimate_raw'] / GIB:.2f} GiB | {step['growth'] / GIB:.2f} GiB | {ratio:.2f} "
            f"| {step['limit'] / GIB:.1f} GiB | {step['wall_s']:.0f} ({step['cpu_s']:.0f}) "
            f"| {step['tokens_per_s']:.0f} |",
            "",
            "The formula counts the row's activations, the gradients and AdamW's moments that did not exist before "
            "the step; measured = VmHWM during the step − VmRSS before it.",
            "",
        ]
    if "engine" in results:
        e = results["engine"]
        lines += [
            "## CPU engine, prefix cache",
            "",
            "| prompt tokens | first call s | cached | second call (shares all but 64) s | cached |",
            "|---:|---:|---:|---:|---:|",
            f"| {e['prompt_tokens']:,} | {e['first_s']:.1f} | {e['first_cached']:,} | {e['second_s']:.1f} "
            f"| {e['second_cached']:,} |",
            "",
        ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
