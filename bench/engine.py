"""Benchmark of the inference engines: an agent rollout's calls on the CPU engine with prefix caching on and off
and on the real vLLM CPU server, side by side (``bench.engine_rollout``); then the CPU engine's throughput vs a
naive per-request ``model.generate`` loop, and the weight-swap latency from publishing a ``WeightVersion`` to the
engine serving it.

Topics: ``clawstream.weights`` in, ``clawstream.metrics`` out (swap part only, on a private local broker).

Run (about 20 minutes on 2 cores, most of it the cache-off engine and vLLM re-reading 35k-token prompts)::

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.engine [--model DIR] [--engines cpu,cpu-nocache,vllm]
        [--calls 20] [--skip-throughput] [--max-tokens 64] [--rounds 3] [--no-kafka]

The vLLM column needs ``clawstream vllm install`` first (otherwise it says so and the others still run).

Without ``--model`` it builds the project's tiny Qwen3 (``policy.tiny_model`` defaults) in a temp dir. Throughput
is measured in-process (scheduler thread, no HTTP): ``k`` requests submitted at once, each generating exactly
``--max-tokens`` tokens (eos ignored) at temperature 1; tokens/s = generated tokens / wall time, median of
``--rounds``. The naive baseline runs the same requests one after another with ``model.generate(do_sample=True)``
(its own KV cache, batch 1). The swap part starts ``clawstream.local_kafka.LocalKafka`` in a temp home, follows
the weights topic with ``consumers.inference.weight_follower.WeightsFollower``, publishes perturbed weights and times
publish →
``engine.policy_version`` changing, idle and with 8 requests in flight (those finish on the old weights first).
Results go to ``bench/results/engine.md`` and stdout.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig  # noqa: E402

from bench import engine_rollout  # noqa: E402
from consumers.inference.engine import Engine, SamplingParams  # noqa: E402
from schemas.topics import CATALOG

RESULTS = Path(__file__).resolve().parent / "results" / "engine.md"
TEXTS = [
    "list the files in src",
    "count the lines of notes.txt",
    "read config.json and print the port",
    "rename data.csv to old.csv",
    "what is 7 + 5?",
    "fix the failing test in tests/test_io.py",
    "write a summary of the report",
    "delete the empty folders under build",
]


def _prompts(tokenizer: Any, k: int) -> list[list[int]]:
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": TEXTS[i % len(TEXTS)]}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        for i in range(k)
    ]


def run_engine(engine: Engine, prompts: list[list[int]], max_tokens: int, seed: int = 0) -> tuple[float, int]:
    """Submit all prompts at once; wall seconds and generated tokens once all finished."""
    done = threading.Event()
    results: list[Any] = []
    lock = threading.Lock()

    def callback(outcome: Any) -> None:
        with lock:
            results.append(outcome)
            if len(results) == len(prompts):
                done.set()

    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.submit(
            [prompt], SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed + i, ignore_eos=True), callback
        )
    if not done.wait(600):
        raise RuntimeError("engine did not finish")
    wall = time.perf_counter() - start
    bad = [r for r in results if isinstance(r, BaseException)]
    if bad:
        raise RuntimeError(f"engine failed: {bad[0]}")
    return wall, sum(len(o.token_ids) for r in results for o in r.outputs)


def run_naive(model: Any, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
    """One ``model.generate`` per request, sequentially (what serving without a scheduler does)."""
    config = GenerationConfig(
        do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_tokens, eos_token_id=[], pad_token_id=0
    )
    start, tokens = time.perf_counter(), 0
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        tokens += out.shape[1] - len(prompt)
    return time.perf_counter() - start, tokens


def throughput(model: Any, tokenizer: Any, max_tokens: int, rounds: int) -> list[dict[str, Any]]:
    eos = tokenizer.eos_token_id
    engine = Engine(model, eos_token_ids=[eos], max_batch_size=32)
    engine.start()
    rows = []
    try:
        run_engine(engine, _prompts(tokenizer, 2), 8)  # warm-up
        run_naive(model, _prompts(tokenizer, 1), 8)
        for k in (1, 8):
            prompts = _prompts(tokenizer, k)
            eng = [run_engine(engine, prompts, max_tokens, seed=r * 100) for r in range(rounds)]
            nai = [run_naive(model, prompts, max_tokens) for _ in range(rounds)]
            eng_tps = statistics.median(t / w for w, t in eng)
            nai_tps = statistics.median(t / w for w, t in nai)
            rows.append(
                {
                    "concurrency": k,
                    "tokens": eng[0][1],
                    "engine_tps": eng_tps,
                    "naive_tps": nai_tps,
                    "engine_wall": statistics.median(w for w, _ in eng),
                    "naive_wall": statistics.median(w for w, _ in nai),
                }
            )
            print(
                f"  {k} concurrent: engine {eng_tps:8.1f} tok/s, naive generate loop {nai_tps:8.1f} tok/s "
                f"({eng_tps / nai_tps:.2f}x)",
                flush=True,
            )
    finally:
        engine.stop()
    return rows


def swap_latency(model_dir: Path, model: Any, tokenizer: Any, max_tokens: int, repeats: int) -> list[dict[str, Any]]:
    """Publish → applied, idle and under load, through a private local broker."""
    from safetensors.torch import load_file, save_file

    from clawbase.kafka.clients import create_topics, make_producer
    from clawbase.settings import KafkaSettings
    from clawstream.local_kafka import LocalKafka
    from consumers.inference.weight_follower import EngineWeightsTarget, Reporter, WeightsFollower
    from schemas.events import WeightVersion, now_ms
    from schemas.topics import WEIGHTS

    home = Path(tempfile.mkdtemp(prefix="bench-kafka-"))
    broker = LocalKafka(home=home)
    state = broker.up(timeout=120, quiet=True)
    rows: list[dict[str, Any]] = []
    engine = Engine(model, eos_token_ids=[tokenizer.eos_token_id], max_batch_size=32)
    engine.start()
    follower = None
    try:
        settings = KafkaSettings(bootstrap_servers=state.bootstrap, topic_prefix="bench.")
        create_topics(settings, CATALOG)
        reporter = Reporter(settings, "inference-worker/bench")
        follower = WeightsFollower(settings, EngineWeightsTarget(engine), model_name="tiny", reporter=reporter)
        follower.start()
        if not follower.caught_up.wait(60):
            raise RuntimeError("weights follower did not start")
        producer = make_producer(settings)
        base = load_file(str(model_dir / "model.safetensors"))
        size_mb = sum(t.numel() * t.element_size() for t in base.values()) / 1e6
        version = 0
        for load in ("idle", "8 in flight"):
            for _ in range(repeats):
                version += 1
                path = home / "weights" / f"v{version}" / "model.safetensors"
                path.parent.mkdir(parents=True)
                save_file({k: (v + 0.01 * version).contiguous() for k, v in base.items()}, str(path))
                data = path.read_bytes()
                event = WeightVersion(
                    policy_version=version,
                    timestamp_ms=now_ms(),
                    model_name="tiny",
                    step=version,
                    uri=path.as_uri(),
                    sha256=hashlib.sha256(data).hexdigest(),
                    size_bytes=len(data),
                )
                busy = None
                if load != "idle":
                    busy = threading.Thread(target=run_engine, args=(engine, _prompts(tokenizer, 8), max_tokens))
                    busy.start()
                    time.sleep(0.2)  # let them be admitted before the version is published
                t0 = time.perf_counter()
                producer.produce(settings.topic(WEIGHTS), key=b"tiny", value=event.to_bytes())
                producer.flush(30)
                while engine.policy_version != version:
                    if time.perf_counter() - t0 > 120:
                        raise RuntimeError(f"version {version} not applied")
                    time.sleep(0.002)
                latency = time.perf_counter() - t0
                if busy is not None:
                    busy.join()
                rows.append({"load": load, "version": version, "latency_s": latency, "size_mb": size_mb})
                print(f"  swap to v{version} ({load}): published → serving in {latency * 1000:7.1f} ms", flush=True)
    finally:
        if follower is not None:
            follower.stop()
        engine.stop()
        broker.down()
    return rows


def write_report(
    args: argparse.Namespace,
    model: Any,
    thr: list[dict[str, Any]] | None,
    swaps: list[dict[str, Any]] | None,
    skipped: str | None,
    rollout: list[str],
) -> str:
    n_params = sum(p.numel() for p in model.parameters()) / 1e6
    cfg = model.config
    lines = [
        "# CPU inference engine benchmark",
        "",
        f"Generated by `python -m bench.engine` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
        f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__} ({torch.get_num_threads()} threads).",
        f"Model: tiny Qwen3 ({n_params:.2f}M parameters, {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
        f"vocab {cfg.vocab_size}), float32.",
        "",
        *rollout,
        "",
        "## Throughput (generated tokens/s)",
        "",
        f"Each request: a chat prompt of ~20-30 tokens, exactly {args.max_tokens} generated tokens (eos ignored), "
        f"temperature 1. Median of {args.rounds} rounds.",
        "",
        "| concurrent requests | engine (continuous batching, KV cache) | naive `model.generate` loop | speed-up |",
        "|---:|---:|---:|---:|",
    ]
    for row in thr or []:
        speedup = row["engine_tps"] / row["naive_tps"]
        lines.append(
            f"| {row['concurrency']} | {row['engine_tps']:.0f} ({row['engine_wall']:.2f} s) | "
            f"{row['naive_tps']:.0f} ({row['naive_wall']:.2f} s) | {speedup:.2f}x |"
        )
    lines += ["", "## Weight swap: `WeightVersion` published → engine serving it", ""]
    if swaps:
        lines += [
            f"Through a private local Kafka broker; safetensors of {swaps[0]['size_mb']:.1f} MB, sha256 "
            "checked, shapes checked, copied in between decode steps. Under load the swap first waits for the "
            f"8 in-flight requests ({args.max_tokens} tokens each) to finish on the old weights.",
            "",
            "| load | swaps | median | max |",
            "|---|---:|---:|---:|",
        ]
        for load in ("idle", "8 in flight"):
            lat = [r["latency_s"] * 1000 for r in swaps if r["load"] == load]
            lines.append(f"| {load} | {len(lat)} | {statistics.median(lat):.0f} ms | {max(lat):.0f} ms |")
    else:
        lines.append(f"Not measured: {skipped}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.engine", description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, help="HF model dir (default: build the tiny model in a temp dir)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--swaps", type=int, default=3, help="swaps per load condition")
    parser.add_argument("--no-kafka", action="store_true", help="skip the swap-latency part")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--engines",
        default=",".join(engine_rollout.ENGINES),
        help="engines of the rollout scenario, comma-separated (cpu, cpu-nocache, vllm; '' skips it)",
    )
    parser.add_argument("--calls", type=int, default=engine_rollout.CALLS, help="follow-up calls of the rollout")
    parser.add_argument("--nocache-calls", type=int, default=2, help="follow-up calls for cpu-nocache (slow)")
    parser.add_argument("--first-prompt", type=int, default=engine_rollout.FIRST_PROMPT, help="call 1's tokens")
    parser.add_argument("--skip-throughput", action="store_true", help="rollout scenario only")
    args = parser.parse_args(argv)

    model_dir = args.model
    if model_dir is None:
        from policy.tiny_model import init_tiny_model

        model_dir = Path(tempfile.mkdtemp(prefix="bench-engine-")) / "tiny"
        print(f"building the tiny model in {model_dir} ...", flush=True)
        init_tiny_model(model_dir, progress=None)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    rollout: list[str] = []
    engines = [e for e in args.engines.split(",") if e]
    if engines:
        scenario = engine_rollout.scenario(len(tokenizer), first=args.first_prompt, calls=args.calls)
        calls = {e: args.nocache_calls if e == "cpu-nocache" else args.calls for e in engines}
        print(f"rollout scenario on {', '.join(engines)}:", flush=True)
        with tempfile.TemporaryDirectory(prefix="bench-engine-logs-") as logs:
            runs = engine_rollout.measure(engines, model_dir, scenario, calls, Path(logs))
        rollout = engine_rollout.report(runs, scenario)
    thr, swaps, skipped = None, None, None
    if args.skip_throughput:
        skipped = "--skip-throughput given"
    else:
        print("throughput:", flush=True)
        thr = throughput(model, tokenizer, args.max_tokens, args.rounds)
    if args.no_kafka or args.skip_throughput:
        skipped = skipped or "--no-kafka given"
    else:
        print("weight swap latency:", flush=True)
        try:
            swaps = swap_latency(model_dir, model, tokenizer, args.max_tokens, args.swaps)
        except Exception as exc:  # no Java, no jar cache, ...: report, don't fail the throughput numbers
            skipped = f"no local broker could be started ({type(exc).__name__}: {exc})"
            print(f"  skipped: {skipped}", flush=True)
    report = write_report(args, model, thr, swaps, skipped, rollout)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report)
    print("\n" + report)
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
