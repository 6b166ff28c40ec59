"""Rollout throughput and sandbox overhead: the sandbox worker running ``agentloop`` against an instant policy.

Everything real except the policy: a local Apache Kafka broker (``LocalKafka`` in a temp home, or
``CLAWSTREAM_KAFKA_BOOTSTRAP_SERVERS``), the serving proxy, one in-process sandbox worker with local sandboxes, the
built-in agent loop as harness (a Python subprocess per rollout), and the task graders (a subprocess each). The
scripted engine answers instantly (write the file, then finish: 2 calls per rollout), so the numbers are the
system's own overhead. For 1, 4 and 16 concurrent rollouts it reports rollouts/s (first request published → last
reward received) and per-phase means: create (sandbox + task files), create → harness start (proxy registration,
config files, STARTED acknowledged), harness run, grade, grade → destroy (kill check, rmtree, verification).

Run: ``HF_HUB_OFFLINE=1 .venv/bin/python -m bench.rollouts [--rollouts 8 24 48]``; writes
``bench/results/rollouts.md``. Default run ≈ 1–3 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from clawbase.kafka.clients import create_topics  # noqa: E402
from clawbase.settings import KafkaSettings  # noqa: E402
from producers.sandbox.settings import SandboxSettings  # noqa: E402
from producers.sandbox.worker import SandboxWorker  # noqa: E402
from producers.tasks.cpu import cpu_suite  # noqa: E402
from schemas.events import RolloutRequest  # noqa: E402
from schemas.topics import CATALOG
from tests.support import proxy_helpers as H  # noqa: E402
from tests.support import sandbox_helpers as S  # noqa: E402
from tests.support.proxy_server import admin_url, running_proxy  # noqa: E402
from tests.support.scripted_engine import ScriptedEngine  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "rollouts.md"
PHASES = [
    ("create", "t0", "created"),
    ("create→harness start", "created", "harness_start"),
    ("harness run", "harness_start", "harness_end"),
    ("grade", "grade_start", "grade_end"),
    ("grade→destroy", "grade_end", "destroyed"),
]


def requests(n: int) -> list[RolloutRequest]:
    """``n`` agentloop requests, round robin over the CPU suite's write, copy and sum tasks (``bench.scale`` too)."""
    tasks = [t for t in cpu_suite().split("train") if t.metadata["template"] in ("write", "copy", "sum")]
    return [S.request(tasks[i % len(tasks)].task_id, "agentloop", suite="cpu_builtin") for i in range(n)]


async def run_level(kafka: KafkaSettings, concurrency: int, n: int, tmp: Path) -> dict:
    reqs = requests(n)
    group = f"bench-{concurrency}-{time.time_ns()}"
    async with (
        ScriptedEngine(H.tiny_tokenizer(), S.agent_responder()) as engine,
        running_proxy(kafka, engine.url, keepalive_s=5.0) as (_proxy, url),
    ):
        settings = SandboxSettings(
            proxy_url=admin_url(url),
            proxy_admin_token="admin",
            group_id=group,
            root=tmp / group,
            suites={"cpu_builtin": "builtin:cpu"},
            concurrency=concurrency,
        )
        worker = SandboxWorker(settings, kafka, keep_outcomes=True)
        stop = asyncio.Event()
        task = asyncio.create_task(worker.run(stop))
        await asyncio.sleep(4)  # join the group before the clock starts
        t0 = time.monotonic()
        S.publish(kafka, reqs)
        while len(worker.outcomes) < n and time.monotonic() - t0 < 600:
            await asyncio.sleep(0.05)
        wall = time.monotonic() - t0
        stop.set()
        await task
    outs = worker.outcomes
    rewards = [o.reward.reward for o in outs if o.reward and o.reward.reward is not None]
    phases = {}
    for name, a, b in PHASES:
        xs = [o.timings[b] - o.timings[a] for o in outs if a in o.timings and b in o.timings]
        phases[name] = 1000 * statistics.mean(xs) if xs else float("nan")
    return {
        "concurrency": concurrency,
        "n": len(outs),
        "wall": wall,
        "rps": len(outs) / wall,
        "mean_reward": statistics.mean(rewards) if rewards else float("nan"),
        "clean": all(o.cleanup is not None and o.cleanup.clean for o in outs),
        **phases,
    }


async def main_async(levels: list[tuple[int, int]]) -> list[dict]:
    tmp = Path(tempfile.mkdtemp(prefix="bench-rollouts-"))
    bootstrap = os.environ.get("CLAWSTREAM_KAFKA_BOOTSTRAP_SERVERS")
    broker = None
    if not bootstrap:
        from clawstream.local_kafka import LocalKafka

        broker = LocalKafka(home=tmp / "kafka")
        bootstrap = (await asyncio.to_thread(broker.up, timeout=120, quiet=True)).bootstrap
    try:
        results = []
        for concurrency, n in levels:
            # a fresh topic prefix per level: a new group must not find the previous level's requests
            kafka = KafkaSettings(bootstrap_servers=bootstrap, topic_prefix=f"bench-{time.time_ns()}.")
            create_topics(kafka, CATALOG)
            r = await run_level(kafka, concurrency, n, tmp)
            print(f"concurrency {concurrency}: {r['n']} rollouts in {r['wall']:.1f}s = {r['rps']:.2f}/s", flush=True)
            results.append(r)
        return results
    finally:
        if broker is not None:
            broker.down()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rollouts", type=int, nargs=3, default=[8, 24, 48], help="rollouts at 1, 4, 16")
    args = parser.parse_args()
    levels = list(zip((1, 4, 16), args.rollouts, strict=True))
    results = asyncio.run(main_async(levels))
    lines = [
        "# Rollout throughput and sandbox overhead (`bench/rollouts.py`)",
        "",
        f"Machine: {platform.platform()}, {os.cpu_count()} CPUs (shared), Python {platform.python_version()}. "
        "Harness: `agentloop` (a Python subprocess per rollout), 2 calls per rollout through the real proxy to an "
        "instant scripted engine; local sandboxes; graders in the sandbox; events and rewards acked by a local "
        "Kafka broker. Times are means per rollout in ms.",
        "",
        "| concurrent | rollouts | wall s | rollouts/s | create | create→harness start | harness run | grade | "
        "grade→destroy | mean reward | all clean |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['concurrency']} | {r['n']} | {r['wall']:.1f} | {r['rps']:.2f} | {r['create']:.0f} | "
            f"{r['create→harness start']:.0f} | {r['harness run']:.0f} | {r['grade']:.0f} | "
            f"{r['grade→destroy']:.0f} | {r['mean_reward']:.2f} | {r['clean']} |"
        )
    lines += [
        "",
        "The scripted policy writes the first quoted name with the second quoted text, so `write` tasks "
        "score 1 and `copy`/`sum` tasks get partial credit: the mean reward is a sanity check, not a score.",
    ]
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
