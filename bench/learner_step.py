"""The learner's step on the demo's recorded batches, at two commits side by side: is the step slower than before?

``record`` reads sealed batches of a demo run from its ``clawstream.batches`` topic (a running broker; the run's
topic prefix) and keeps each trajectory's tree segments, advantage, reward and harness in
``bench/data/learner_step_batches.pkl.xz`` (plain dicts and numpy arrays: any commit's learner can read them).
``compare`` (the default) trains those batches at the current tree and at ``--base`` (a ``git worktree`` under /tmp):
each run is a fresh process (``--worker``) that loads models/warmstart in fp32, builds AdamW (lr 2e-5, the demo's)
and trains the batches in order, as the demo's learner would, with that commit's own packing dry run, memory plan
(where it has one) and ``train_step``; processes alternate base, current, base, current on the same torch threads
(the demo gives the learner 1 thread on 2 cores). Per run: each step's wall and CPU seconds, trainable tokens/s,
peak RSS growth; medians, and the ratio current / base per round. Writes ``bench/results/learner_step.md``.

Topics: clawstream.batches (record only). Run:
``.venv/bin/python -m bench.learner_step record --bootstrap 127.0.0.1:PORT --topic-prefix demo-YYYYMMDD-HHMMSS.``;
``.venv/bin/python -m bench.learner_step [--base 5780325] [--rounds 3] [--threads 1]``.
"""

from __future__ import annotations

import argparse
import json
import lzma
import os
import pickle
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "bench" / "data" / "learner_step_batches.pkl.xz"
RESULTS = ROOT / "bench" / "results" / "learner_step.md"
SEGMENT_FIELDS = ("parent", "tokens", "trainable", "logprobs", "policy_version", "call_id", "temperature", "top_p",
                  "top_k")  # fmt: skip


def record(bootstrap: str, prefix: str, n_batches: int, out: Path) -> None:
    """The first ``n_batches`` sealed batches of the run's batches topic, as plain data."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

    from schemas.events import BatchRecord, BatchRecordKind, Trajectory

    topic = f"{prefix}clawstream.batches"
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"bench-ls-{os.getpid()}",
                         "enable.auto.commit": False, "isolation.level": "read_committed"})  # fmt: skip
    parts = consumer.list_topics(topic, timeout=10).topics[topic].partitions
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in parts])
    pending: dict[str, list[dict[str, Any]]] = {}
    batches: list[dict[str, Any]] = []
    idle = time.monotonic()
    while len(batches) < n_batches and time.monotonic() - idle < 20:
        msg = consumer.poll(1.0)
        if msg is None or msg.error():
            continue
        idle = time.monotonic()
        rec = BatchRecord.from_bytes(msg.value())
        if rec.kind is BatchRecordKind.TRAJECTORY:
            traj = Trajectory.from_bytes(rec.trajectory)
            segs = [{f: getattr(s, f) for f in SEGMENT_FIELDS} for s in traj.segments]
            pending.setdefault(rec.batch_id, []).append(
                {
                    "segments": segs,
                    "advantage": rec.advantage,
                    "reward": rec.reward,
                    "harness": rec.harness or traj.harness,
                }  # fmt: skip
            )
        else:
            batches.append({"batch_id": rec.batch_id, "step": rec.step, "trees": pending.pop(rec.batch_id)})
    consumer.close()
    if len(batches) < n_batches:
        raise SystemExit(f"{topic}: {len(batches)} sealed batches, wanted {n_batches}")
    out.parent.mkdir(parents=True, exist_ok=True)
    with lzma.open(out, "wb") as f:
        pickle.dump({"source": topic, "batches": batches}, f)
    tokens = [sum(len(s["tokens"]) for t in b["trees"] for s in t["segments"]) for b in batches]
    print(f"{out}: {len(batches)} batches of {[len(b['trees']) for b in batches]} trees, {tokens} tree tokens")


def _adapter(model_dir: str) -> tuple[Any, Any, Any]:
    """This commit's (hyperparameters, model loader, step function: (model, optimizer, trees) -> metrics)."""
    import torch

    try:
        from learner.hparams import Hyperparams
    except ImportError:  # before the layout's renames: learner/config.py's LearnerConfig
        from learner.config import LearnerConfig as Hyperparams  # type: ignore[no-redef]
    from learner.pack import pack_trees
    from learner.step import max_path_tokens, train_step

    config = Hyperparams(lr=2e-5, seed=0)
    try:
        from learner.precision import load_policy
    except ImportError:
        from transformers import AutoModelForCausalLM

        def load_policy(path: str) -> Any:
            return AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")

    try:
        from learner.memory import available_bytes, plan_step, set_checkpointing
    except ImportError:
        plan_step = None

    def step(model: Any, optimizer: Any, trees: list) -> dict[str, float]:
        rows = pack_trees([t.segments for t in trees], config.token_budget, max_path_tokens(model, config))  # dry run
        if plan_step is not None:  # the learner's memory plan, as learner/train.py runs it before the step
            shapes = [(r.num_tokens, not r.is_chain, r.uses_top_k or r.uses_top_p) for r in rows]
            plan = plan_step(model, optimizer, shapes, mode="auto", limit=available_bytes(torch.device("cpu")),
                             chunk=config.logprob_chunk)  # fmt: skip
            set_checkpointing(model, plan.checkpointing)
        return train_step(model, optimizer, trees, config)

    return config, lambda: load_policy(model_dir), step


def worker(data: Path, model_dir: str, threads: int) -> None:
    """One process: load, then train every recorded batch once in order; prints one JSON line."""
    import torch

    torch.set_num_threads(threads)
    from learner.step import ScoredTree

    with lzma.open(data, "rb") as f:
        batches = pickle.load(f)["batches"]
    config, load, step = _adapter(model_dir)
    torch.manual_seed(0)
    model = load()
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=config.betas,
                                  weight_decay=config.weight_decay)  # fmt: skip
    out = []
    for b in batches:
        trees = [ScoredTree([SimpleNamespace(**s) for s in t["segments"]], t["advantage"], t["reward"], t["harness"])
                 for t in b["trees"]]  # fmt: skip
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        started, cpu = time.perf_counter(), time.process_time()
        metrics = step(model, optimizer, trees)
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
        rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        out.append({"seconds": seconds, "cpu_seconds": cpu, "tokens": metrics["trainable_tokens"],
                    "packed_tokens": metrics["tokens"],
                    "rss_growth_mib": (rss1 - rss0) / 1024, "peak_rss_mib": rss1 / 1024,
                    "update_kl": metrics.get("update_kl")})  # fmt: skip
    print("RESULT " + json.dumps(out), flush=True)


def _run(root: Path, data: Path, threads: int) -> list[dict[str, Any]]:
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--data", str(data),
           "--model", str(ROOT / "models" / "warmstart"), "--threads", str(threads)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(f"worker at {root} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def _worktree(base: str) -> Path:
    path = Path(f"/tmp/ls-{base}")
    if not path.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), base], check=True)
    return path


def compare(base: str, current: str, rounds: int, threads: int, data: Path, label: str) -> None:
    base_root = _worktree(base)
    current_root = _worktree(current) if current else ROOT
    runs: dict[str, list[list[dict[str, Any]]]] = {"base": [], "current": []}
    load = [os.getloadavg()[0]]
    for r in range(rounds):
        for name, root in (("base", base_root), ("current", current_root)):
            runs[name].append(_run(root, data, threads))
            load.append(os.getloadavg()[0])
            steps = runs[name][-1]
            print(f"round {r} {name:7s}: " + "  ".join(f"{s['seconds']:.2f} s ({s['cpu_seconds']:.2f} s CPU)"
                                                        for s in steps), flush=True)  # fmt: skip
    _report(base, runs, threads, load, data, label)


def _report(base: str, runs: dict, threads: int, load: list[float], data: Path, label: str) -> None:
    """Per commit: median wall and CPU seconds per step, tokens/s (wall and CPU), peak RSS growth; the ratio of
    current to base per round, on CPU seconds (what a loaded host disturbs least) and on wall seconds."""

    def total(run: list[dict[str, Any]], key: str) -> float:
        return sum(s[key] for s in run)

    def ratios(key: str) -> list[float]:
        return [total(c, key) / total(b, key) for b, c in zip(runs["base"], runs["current"], strict=True)]

    n_steps = len(runs["base"][0])
    steps = " | ".join(f"step {i} s (CPU s)" for i in range(n_steps))
    head = f"| commit | {steps} | packed tokens | trained tokens/s wall | trained tokens/s CPU | peak RSS growth MiB |"
    lines = [head, "|---|" + "---|" * (n_steps + 4)]
    for name, commit in (("base", base), ("current", label)):
        wall = [statistics.median(run[i]["seconds"] for run in runs[name]) for i in range(n_steps)]
        cpu = [statistics.median(run[i]["cpu_seconds"] for run in runs[name]) for i in range(n_steps)]
        tokens = total(runs[name][0], "tokens")
        tps = statistics.median(tokens / total(run, "seconds") for run in runs[name])
        tps_cpu = statistics.median(tokens / total(run, "cpu_seconds") for run in runs[name])
        rss = statistics.median(max(s["rss_growth_mib"] for s in run) for run in runs[name])
        cells = " | ".join(f"{w:.2f} ({c:.2f})" for w, c in zip(wall, cpu, strict=True))
        packed = " + ".join(str(int(s["packed_tokens"])) for s in runs[name][0])
        lines.append(f"| {commit} | {cells} | {packed} | {tps:.0f} | {tps_cpu:.0f} | {rss:.0f} |")
    cpu_r, wall_r = ratios("cpu_seconds"), ratios("seconds")
    summary = (
        f"current / {base}, CPU seconds: median {statistics.median(cpu_r):.3f} "
        f"(rounds {', '.join(f'{r:.3f}' for r in cpu_r)}); wall: median {statistics.median(wall_r):.3f} "
        f"(rounds {', '.join(f'{r:.3f}' for r in wall_r)}). {len(cpu_r)} alternating rounds, {threads} torch "
        f"thread(s), load average {min(load):.1f}-{max(load):.1f} on {os.cpu_count()} cores; batches of "
        f"{[int(s['tokens']) for s in runs['base'][0]]} trained tokens ({data.name})"
    )
    print("\n".join(lines) + "\n" + summary)
    _write(label, lines, summary)


def _write(label: str, table: list[str], summary: str) -> None:
    header = RESULTS.read_text().split("\n## ", 1)[0] if RESULTS.exists() else ""
    old = (
        ("\n## " + RESULTS.read_text().split("\n## ", 1)[1])
        if RESULTS.exists() and "\n## " in RESULTS.read_text()
        else ""
    )
    if not header.strip():
        header = "# The learner's step on the demo's batches, two commits side by side\n\n`bench/learner_step.py`.\n"
    section = f"\n## {label}\n\n" + "\n".join(table) + f"\n\n{summary}\n"
    RESULTS.write_text(header.rstrip() + "\n" + section + old)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", nargs="?", choices=["compare", "record"], default="compare")
    parser.add_argument("--base", default="5780325")
    parser.add_argument("--current", default="", help="a commit to run instead of the working tree")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--label", default="current tree", help="the current tree's name in the results")
    parser.add_argument("--bootstrap", default="127.0.0.1:9092")
    parser.add_argument("--topic-prefix", default="")
    parser.add_argument("--batches", type=int, default=2)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", default=str(ROOT / "models" / "warmstart"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        here = Path(__file__).resolve().parent  # bench/: its learner.py would shadow the learner package
        # The venv's editable install maps this checkout's modules by name: only the worked-on commit's may load.
        keep = [p for p in sys.path if p and "__editable__" not in p and Path(p).resolve() != here]
        sys.path[:] = [os.getcwd(), *keep]
        sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
        worker(args.data, args.model, args.threads)
    elif args.mode == "record":
        record(args.bootstrap, args.topic_prefix, args.batches, args.data)
    else:
        compare(args.base, args.current, args.rounds, args.threads, args.data, args.label)


if __name__ == "__main__":
    main()
