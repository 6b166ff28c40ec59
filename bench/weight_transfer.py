"""Weight transfer at a real size: a Qwen3-0.6B-shaped version published by the learner's code and served by real
vLLM on the CPU, from a disk directory and from a memory-backed one (/dev/shm).

The shape is ``bench.real_shapes``'s (Qwen3-0.6B: 28 layers, hidden 1,024, vocabulary 151,936, tied; random init, fp32
master weights as the learner keeps them). vLLM (``clawstream vllm install``) starts on the initial directory; then
per store and version: ``policy.weight_store.save_weights`` (the learner's publish: one safetensors file + its
sha256), the vLLM adapter's ``prepare`` (sha256 verified again, as every engine does) and ``apply`` (pause → reload
from the directory → refresh tied weights → reset the prefix cache → resume), then the first completion. Each phase
timed; the sum is publish → served.

Run: ``.venv/bin/python -m bench.weight_transfer [--layers 28] [--versions 2] [--out bench/results/weight_transfer.md]``
(~10 min on 2 cores; ~8 GiB: the learner-side model and vLLM's copy).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
import urllib.request
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "weight_transfer.md"
ROOT = Path(__file__).resolve().parents[1]
GIB = 1024**3


def _complete(url: str) -> float:
    body = {"model": "policy", "prompt": [5, 6, 7, 8], "max_tokens": 1, "temperature": 0}
    started = time.perf_counter()
    request = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as resp:  # noqa: S310 - loopback
        json.loads(resp.read())
    return time.perf_counter() - started


def main() -> None:  # noqa: PLR0915 - one linear measurement
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--versions", type=int, default=2, help="versions published per store")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    import torch
    from transformers import Qwen3ForCausalLM

    from bench.real_shapes import qwen3_06b_config
    from consumers.inference.vllm_adapter import VllmWeightsTarget
    from consumers.inference.vllm_server import is_installed, serve
    from policy.weight_store import save_weights
    from schemas.events import WeightVersion, now_ms

    if not is_installed():
        raise SystemExit("vLLM is not installed: run `make vllm` (clawstream vllm install) first")
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    rows = []
    with (
        tempfile.TemporaryDirectory(prefix="weight-transfer-") as disk,
        tempfile.TemporaryDirectory(prefix="weight-transfer-", dir="/dev/shm") as shm,
    ):
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(qwen3_06b_config(args.layers, max_positions=4096)).float()
        params = sum(p.numel() for p in model.parameters())
        initial = Path(disk) / "initial"
        model.save_pretrained(initial)
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):  # ids are sent, never text
            shutil.copy(ROOT / "models" / "warmstart" / name, initial / name)
        server = serve(
            initial, 0, max_model_len=4096, kv_cache_gib=1, threads=args.threads, log_path=Path(disk) / "v.log"
        )
        try:
            target = VllmWeightsTarget(server.url, policy_version=0, timeout_s=1200)
            version = 0
            for label, store in (("disk", Path(disk) / "store"), ("memory (/dev/shm)", Path(shm) / "store")):
                for _ in range(args.versions):
                    version += 1
                    with torch.no_grad():  # a new version: every weight moves, as after a step
                        for p in model.parameters():
                            p.add_(torch.randn_like(p), alpha=1e-4)
                    t0 = time.perf_counter()
                    saved = save_weights(model, store, "policy", version)
                    t1 = time.perf_counter()
                    event = WeightVersion(
                        policy_version=version,
                        timestamp_ms=now_ms(),
                        model_name="policy",
                        step=version,
                        uri=saved.uri,
                        sha256=saved.sha256,
                        size_bytes=saved.size_bytes,
                    )
                    prepared = target.prepare(event)
                    t2 = time.perf_counter()
                    report = target.apply(prepared, event)
                    t3 = time.perf_counter()
                    first = _complete(server.url)
                    rows.append((label, version, saved.size_bytes, t1 - t0, t2 - t1, t3 - t2, report, first))
                    print(rows[-1][:6], flush=True)
        finally:
            server.stop()
    lines = [
        "# Weight transfer at the Qwen3-0.6B shape: learner publish → vLLM (CPU) serving",
        "",
        f"`.venv/bin/python -m bench.weight_transfer --layers {args.layers} --versions {args.versions}` on "
        f"{platform.machine()}, {os.cpu_count()} CPU cores (shared), Python {platform.python_version()}, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} ({time.perf_counter() - started:.0f} s). "
        f"{params / 1e6:.0f} M parameters (tied embeddings stored once), fp32 file; vLLM {args.threads} threads, "
        f"float32. How: `bench/weight_transfer.py`; the adapter's request sequence: docs/vllm_cpu.md.",
        "",
        "| store | version | file | save + sha256 s | verify (sha256) s | vLLM apply s | first completion s "
        "| publish → served s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, version, size, save_s, verify_s, apply_s, _report, first in rows:
        total = save_s + verify_s + apply_s + first
        lines.append(
            f"| {label} | v{version} | {size / GIB:.2f} GiB | {save_s:.1f} | {verify_s:.1f} | {apply_s:.1f} "
            f"| {first:.2f} | **{total:.1f}** |"
        )
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
