"""GPU checks for the CUDA paths that the CPU test suite cannot reach (run on a machine with an NVIDIA GPU).

1. Tree packing on CUDA: packed-tree logprobs vs every root-to-leaf path run as a plain causal sequence, in fp32
   (must agree to 1e-4) and under bf16 autocast (the learner's CUDA path; the difference is reported).
2. One learner step (``learner.step.train_step``) on CUDA with bf16 autocast: finite loss, and the logprobs of a
   positively advantaged rollout go up while a negatively advantaged one's go down.
3. GPU telemetry through nvidia-ml-py, if ``consumers.inference.telemetry`` is present.
4. Real shape (issue #30 item 7): the full 28-layer Qwen3-0.6B shape (``bench.real_shapes``), fp32 master weights,
   one learner step under bf16 autocast on a 38k-token rollout with chunked logprobs and the learner's memory plan
   (``learner.memory``): tokens/s, peak GPU memory against the plan's estimate.

Run: ``python -m bench.gpu_checks [--layers 28] [--tokens 38000]``; prints a report and writes
``bench/results/gpu_checks.md``; exits 1 on a failed check. Needs only torch with CUDA, transformers and numpy (no
Kafka, Avro or pydantic: ``tests/integration/test_gpu_checks.py`` runs ``--dry-run-cpu`` with those imports blocked).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

RESULTS = Path(__file__).resolve().parent / "results" / "gpu_checks.md"
DEVICE = "cuda"  # `--dry-run-cpu` switches to "cpu" to check this script itself without a GPU


def _model(device: str, tmp: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from policy.tiny_model import init_tiny_model

    init_tiny_model(tmp, hidden_size=256, intermediate_size=768, num_layers=4, num_documents=800, progress=None)
    return AutoModelForCausalLM.from_pretrained(tmp, attn_implementation="sdpa").to(device)


def _branching(rng: np.random.Generator) -> list:
    """A tree with a shared prompt, two generated turns and a retry branch (token ids < 2000)."""
    from bench.real_shapes import Segment

    def toks(n: int) -> np.ndarray:
        return rng.integers(3, 2000, n).astype("<i4")

    def lps(n: int) -> np.ndarray:
        return (-rng.random(n) * 3).astype("<f4")

    none = np.zeros(0, "<f4")
    return [
        Segment(-1, toks(24), False, none),
        Segment(0, toks(6), True, lps(6)),
        Segment(1, toks(8), False, none),
        Segment(2, toks(5), True, lps(5)),
        Segment(0, toks(7), True, lps(7)),
    ]


def check_packing(model: torch.nn.Module, report: list[str]) -> bool:
    from learner.forward import packed_logprobs
    from learner.pack import pack_trees
    from schemas.tree_paths import path_tokens, paths

    rng = np.random.default_rng(0)
    trees = [_branching(rng) for _ in range(4)]
    [row] = pack_trees(trees, 10_000)
    row = row.to(DEVICE)
    ok = True
    for label, autocast in (("fp32", False), ("bf16 autocast", True)):
        with torch.no_grad(), torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
            packed = packed_logprobs(model, row)  # (T,)
            worst = 0.0
            offset = 0
            for k in row.tree_indices:  # trees sit in the row in packing order
                tree = trees[k]
                # token offsets of each segment inside this tree's packed block
                starts, pos = [], offset
                for seg in tree:
                    starts.append(pos)
                    pos += len(seg.tokens)
                for path in paths(tree):
                    tokens = torch.tensor(path_tokens(tree, path), device=DEVICE)
                    logits = model(input_ids=tokens[None], use_cache=False).logits[0].float()
                    ref = torch.log_softmax(logits[:-1], -1).gather(-1, tokens[1:, None])[:, 0]  # (L-1,)
                    idx = torch.tensor([starts[s] + k for s in path for k in range(len(tree[s].tokens))])[1:]
                    worst = max(worst, float((packed[idx.to(DEVICE)] - ref).abs().max()))
                offset = pos
        limit = 1e-4 if not autocast else 0.25
        passed = worst <= limit
        ok &= passed
        report.append(
            f"| packed vs per-path logprobs, {label} | max abs diff {worst:.2e} (limit {limit}) | "
            f"{'ok' if passed else 'FAIL'} |"
        )
    return ok


def check_train_step(model: torch.nn.Module, report: list[str]) -> bool:
    from learner.forward import packed_logprobs
    from learner.hparams import Hyperparams
    from learner.pack import pack_trees
    from learner.step import ScoredTree, train_step

    rng = np.random.default_rng(1)
    good, bad = _branching(rng), _branching(rng)

    def mean_lp(segments) -> float:  # noqa: ANN001
        [row] = pack_trees([segments], 10_000)
        row = row.to(DEVICE)
        with torch.no_grad():
            lp = packed_logprobs(model, row, only_trainable=True)
        return float(lp[row.loss_mask].mean())

    for traj in (good, bad):  # rollout logprobs = current policy's, so TIS weights are ~1
        [row] = pack_trees([traj], 10_000)
        with torch.no_grad():
            lp = packed_logprobs(model, row.to(DEVICE), only_trainable=True).cpu()
        offset = 0
        for seg in traj:
            if seg.trainable:
                seg.logprobs = lp[offset : offset + len(seg.tokens)].numpy().astype("<f4")
            offset += len(seg.tokens)
    before = mean_lp(good), mean_lp(bad)
    config = Hyperparams(lr=2e-3)
    trees = [ScoredTree(good, 1.0, 1.0, "a"), ScoredTree(bad, -1.0, 0.0, "b")]
    started = time.perf_counter()
    metrics = train_step(model, torch.optim.AdamW(model.parameters(), lr=config.lr), trees, config)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    after = mean_lp(good), mean_lp(bad)
    passed = np.isfinite(metrics["loss"]) and after[0] > before[0] and after[1] < before[1]
    report.append(
        f"| learner train_step on {DEVICE} (bf16 autocast on CUDA) | loss {metrics['loss']:.4f}, good lp "
        f"{before[0]:.3f}→{after[0]:.3f}, bad lp {before[1]:.3f}→{after[1]:.3f}, {elapsed * 1000:.0f} ms | "
        f"{'ok' if passed else 'FAIL'} |"
    )
    return bool(passed)


def check_real_shape(report: list[str], layers: int, tokens: int) -> bool:
    from transformers import Qwen3ForCausalLM

    from bench.real_shapes import qwen3_06b_config, rollout
    from learner.hparams import Hyperparams
    from learner.memory import available_bytes, plan_step
    from learner.pack import pack_trees
    from learner.step import ScoredTree, train_step

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(qwen3_06b_config(layers, max_positions=max(40_960, tokens))).float().to(DEVICE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    config = Hyperparams(lr=1e-5)
    segs = rollout(tokens)
    rows = pack_trees([segs], config.token_budget, model.config.max_position_embeddings)
    shapes = [(r.num_tokens, not r.is_chain, r.uses_top_k or r.uses_top_p) for r in rows]
    device = torch.device(DEVICE)
    plan = plan_step(model, optimizer, shapes, mode="auto", limit=available_bytes(device), chunk=config.logprob_chunk)
    label = f"learner step, Qwen3-0.6B shape ({layers} layers), {tokens:,}-token rollout"
    if plan.refusal:
        report.append(f"| {label} | refused by the memory plan: {plan.refusal} | FAIL |")
        return False
    if plan.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if DEVICE == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    started = time.perf_counter()
    metrics = train_step(model, optimizer, [ScoredTree(segs, 1.0, 1.0, "claude-code")], config)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    estimate = plan.estimate.activations + plan.estimate.gradients + plan.estimate.optimizer
    peak = (torch.cuda.max_memory_allocated() - before) if DEVICE == "cuda" else 0
    within = DEVICE != "cuda" or peak <= plan.estimate.needed
    passed = bool(np.isfinite(metrics["loss"])) and within
    report.append(
        f"| {label} | checkpointing {'on' if plan.checkpointing else 'off'}, "
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.0f} M parameters, {elapsed:.1f} s, "
        f"{tokens / elapsed:.0f} tokens/s, peak memory growth {peak / 2**30:.2f} GiB vs formula "
        f"{estimate / 2**30:.2f} GiB (× 1.25 = {plan.estimate.needed / 2**30:.2f}) | {'ok' if passed else 'FAIL'} |"
    )
    return passed


def check_telemetry(report: list[str]) -> bool:
    if DEVICE != "cuda":
        report.append("| GPU telemetry | no GPU in a CPU dry run | skipped |")
        return True
    try:
        from consumers.inference import telemetry
    except ImportError as exc:
        report.append(f"| GPU telemetry | consumers.inference.telemetry not importable: {exc} | skipped |")
        return True
    reader = getattr(telemetry, "gpu_readings", None) or getattr(telemetry, "read_gpu", None)
    if reader is None:
        report.append(
            f"| GPU telemetry | no reader function in consumers.inference.telemetry ({dir(telemetry)}) | skipped |"
        )
        return True
    values = reader()
    passed = bool(values)
    report.append(f"| GPU telemetry (nvidia-ml-py) | {values} | {'ok' if passed else 'FAIL'} |")
    return passed


def main() -> int:
    global DEVICE
    import argparse

    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--layers", type=int, default=28, help="decoder layers of the real-shape check")
    parser.add_argument("--tokens", type=int, default=38_000, help="rollout tokens of the real-shape check")
    parser.add_argument("--dry-run-cpu", action="store_true", help="check this script on the CPU (small sizes)")
    args = parser.parse_args()
    if args.dry_run_cpu:
        DEVICE = "cpu"
    elif not torch.cuda.is_available():
        print("no CUDA device: nothing to check here (run this on a GPU machine)")
        return 0
    torch.manual_seed(0)
    report = [
        "# GPU checks",
        "",
        f"{torch.cuda.get_device_name() if DEVICE == 'cuda' else 'CPU dry run'}, torch {torch.__version__}. "
        "Run: `python -m bench.gpu_checks`.",
        "",
        "| check | result | status |",
        "|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        model = _model(DEVICE, Path(tmp))
    ok = check_packing(model, report)
    ok &= check_train_step(model, report)
    ok &= check_telemetry(report)
    layers, tokens = (args.layers, args.tokens) if DEVICE == "cuda" else (1, 1_200)
    ok &= check_real_shape(report, layers, tokens)
    text = "\n".join(report) + "\n"
    if DEVICE == "cuda":
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(text)
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
