"""Record demonstrations through a real harness (``clawstream model demos``): the scripted teacher solves built-in CPU
tasks, every call captured by the path RL uses.

One process runs the stack around the teacher: the teacher's engine (``warmstart.teacher`` served by
``warmstart.scripted_engine``, reporting a prefix cache's cached tokens), the real serving proxy, one sandbox worker
(local sandboxes) running the real harness binary, and a streams worker subprocess (``python -m streams.app worker``)
that assembles the trajectories. It creates the prefix's topics, publishes one rollout request per task (the first
``--tasks`` training tasks of the CPU suite, ``warmstart.demos.train_tasks``: ``builtin:cpu``'s 96 train tasks, then
more of the same templates, never a held-out prompt; written as a native suite the sandbox worker loads), waits for
every trajectory, then prints and writes (``--out``) a summary: solved, mean reward, per rollout calls / prompt
tokens / cached tokens / seconds, and the harness version installed next to the one the teacher was recorded with
(:data:`warmstart.teacher.RECORDED_WITH`).

Topics: ``PREFIX.clawstream.rollout.requests`` out; ``calls``, ``rollout.events``, ``rewards``, ``trajectories`` in
(written by the stack it runs). Run (a broker: ``clawstream kafka up``)::

    clawstream model demos --harness opencode --tasks 8 --prefix demos1 [--out demos1.json --concurrency 2]
    clawstream model sft --from-topics demos1. --model-dir models/warmstart --out models/from-demos
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from aiohttp import web

from clawbase.kafka.clients import bootstrap_servers, create_topics, make_consumer, make_producer
from clawbase.kafka.publisher import KafkaPublisher
from clawbase.settings import KafkaSettings, add_kafka_arguments, kafka_settings
from clawbase.signals import sigterm_interrupts
from producers.harnesses.install import install_harness
from producers.proxy.app import Proxy, ProxySettings
from producers.sandbox.settings import SandboxSettings
from producers.sandbox.worker import SandboxWorker
from producers.tasks.native import write_native_task
from schemas.events import CallEvent, RewardEvent, RolloutRequest, Trajectory
from schemas.topics import CALLS, CATALOG, REWARDS, ROLLOUT_REQUESTS, TRAJECTORIES
from warmstart.demos import TRAIN_CHUNK, train_tasks
from warmstart.scripted_engine import ScriptedEngine
from warmstart.sft import SHIPPED_DIR
from warmstart.teacher import RECORDED_WITH, TOOLS, Teacher, installed_versions

ROOT = Path(__file__).resolve().parents[1]


ROLLOUT_TIMEOUT_S = (
    180.0  # each demonstration's bound (the teacher answers at once; the harness and grading take the time)
)


def _streams(kafka: KafkaSettings, workdir: Path) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "CLAWSTREAM_KAFKA_BOOTSTRAP_SERVERS": bootstrap_servers(kafka),
        "CLAWSTREAM_KAFKA_TOPIC_PREFIX": kafka.topic_prefix,
        "CLAWSTREAM_STREAMS_APP_ID": f"demos-{kafka.topic_prefix}{secrets.token_hex(3)}",
        "CLAWSTREAM_STREAMS_STORE": "memory://",
        "CLAWSTREAM_STREAMS_DATA_DIR": str(workdir / "streams-data"),
    }
    log = open(workdir / "streams.log", "wb")  # noqa: SIM115 - the child's output
    return subprocess.Popen(
        [sys.executable, "-m", "streams.app", "worker", "--loglevel", "warn"],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _collect(
    kafka: KafkaSettings, ids: set[str], timeout: float, cancelled: threading.Event | None = None
) -> dict[str, list[Any]]:
    """Calls, rewards and trajectories of ``ids`` until every id has a trajectory with a reward (or ``timeout``, or
    ``cancelled`` is set: Ctrl-C cancels the coroutine awaiting this thread, and asyncio.run's shutdown then waits
    for the thread, which polled on to its deadline — an hour for 400 demonstrations)."""
    cancelled = cancelled or threading.Event()
    decode = {CALLS: CallEvent.from_bytes, REWARDS: RewardEvent.from_bytes, TRAJECTORIES: Trajectory.from_bytes}
    names = {kafka.topic(t): t for t in decode}
    consumer = make_consumer(kafka, f"demos-{secrets.token_hex(4)}", **{"auto.offset.reset": "earliest"})
    consumer.subscribe(list(names))
    got: dict[str, list[Any]] = {t: [] for t in decode}
    start = time.monotonic()
    deadline, shown = start + timeout, 0
    try:
        while time.monotonic() < deadline and not cancelled.is_set():
            done = {t.rollout_id for t in got[TRAJECTORIES] if t.reward is not None} & ids
            if len(done) > shown:  # one line per finished demonstration: a long recording shows where it is
                shown = len(done)
                print(f"[demos] {shown}/{len(ids)} trajectories ({time.monotonic() - start:.0f} s)", flush=True)
            if done >= ids:
                break
            msg = consumer.poll(0.5)
            if msg is not None and not msg.error():
                record = decode[names[msg.topic()]](msg.value())
                if record.rollout_id in ids:
                    got[names[msg.topic()]].append(record)
    finally:
        consumer.close()
    return got


def summarize(harness: str, ids: dict[str, str], got: dict[str, list[Any]], wall_s: float) -> dict[str, Any]:
    """Per rollout: reward, calls, prompt and cached tokens, seconds (request published → reward); totals."""
    rows = []
    for rid, task_id in ids.items():
        calls = [c for c in got[CALLS] if c.rollout_id == rid]
        rewards = [r for r in got[REWARDS] if r.rollout_id == rid]
        reward = rewards[-1].reward if rewards else None
        rows.append(
            {
                "rollout_id": rid,
                "task_id": task_id,
                "reward": reward,
                "calls": len(calls),
                "prompt_tokens": sum(c.prompt_len for c in calls),
                "cached_tokens": sum(c.cached_prompt_tokens or 0 for c in calls),
                "seconds": round((rewards[-1].timestamp_ms - min(c.timestamp_ms for c in calls)) / 1000, 1)
                if rewards and calls
                else None,
            }
        )
    n = len(rows)
    return {
        "harness": harness,
        "versions": {"recorded_with": RECORDED_WITH.get(harness), "installed": installed_versions([harness])[harness]},
        "tasks": n,
        "solved": sum(r["reward"] == 1.0 for r in rows),
        "mean_reward": sum(r["reward"] or 0.0 for r in rows) / max(n, 1),
        "on_trajectories": len({t.rollout_id for t in got[TRAJECTORIES]}),
        "per_rollout_mean": {
            k: round(sum(r[k] or 0 for r in rows) / max(n, 1), 1)
            for k in ("calls", "prompt_tokens", "cached_tokens", "seconds")
        },
        "wall_s": round(wall_s, 1),
        "rollouts": rows,
    }


async def record(
    harness: str, n_tasks: int, kafka: KafkaSettings, *, model_dir: Path, concurrency: int, timeout_s: float
) -> dict[str, Any]:
    install_harness(harness)
    create_topics(kafka, CATALOG)
    # One chunk of distinct prompts: the teacher finds a task by its prompt (later chunks repeat prompts).
    if not 1 <= n_tasks <= TRAIN_CHUNK:
        raise ValueError(f"tasks: 1 to {TRAIN_CHUNK} training tasks of the CPU suite, got {n_tasks} (pass --tasks N)")
    tasks = train_tasks(n_tasks)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    work = Path(tempfile.mkdtemp(prefix="clawstream-demos-"))
    for task in tasks:
        write_native_task(task, work / "tasks" / task.task_id)
    teacher = Teacher(harness, tasks, work / "sandboxes")
    token = secrets.token_hex(16)
    streams = _streams(kafka, work)
    publisher = None
    try:
        async with ScriptedEngine(tokenizer, teacher.respond, policy_version=0, prefix_cache=True) as engine:
            settings = ProxySettings(model=model_dir, engine_url=engine.url, port=0, admin_token=token)
            publisher = KafkaPublisher(kafka, settings.publish_timeout_s)
            proxy = Proxy(settings, publisher, kafka.topic(CALLS), tokenizer=tokenizer)
            runner, admin = web.AppRunner(proxy.app()), web.AppRunner(proxy.admin_app())
            await runner.setup()
            await admin.setup()
            try:
                await web.TCPSite(runner, "127.0.0.1", 0).start()
                await web.TCPSite(admin, "127.0.0.1", 0).start()
                proxy.public_url = f"http://127.0.0.1:{runner.addresses[0][1]}"
                proxy.admin_url = admin_url = f"http://127.0.0.1:{admin.addresses[0][1]}"
                sandbox = SandboxSettings(
                    proxy_url=admin_url,
                    proxy_admin_token=token,
                    group_id=f"demos-{secrets.token_hex(4)}",
                    root=work / "sandboxes",
                    concurrency=concurrency,
                    suites={"cpu": f"native:{work / 'tasks'}"},
                )
                stop = asyncio.Event()
                worker = asyncio.create_task(SandboxWorker(sandbox, kafka).run(stop))
                ids = {f"demo-{harness}-{t.task_id}-{secrets.token_hex(3)}": t.task_id for t in tasks}
                producer = make_producer(kafka)
                now = int(time.time() * 1000)
                for rid, task_id in ids.items():
                    req = RolloutRequest(
                        rollout_id=rid,
                        policy_version=0,
                        timestamp_ms=now,
                        suite="cpu",
                        task_id=task_id,
                        harness=harness,
                        group_id=f"cpu/{task_id}|{harness}|0",
                        step=0,
                        timeout_s=ROLLOUT_TIMEOUT_S,
                    )
                    producer.produce(kafka.topic(ROLLOUT_REQUESTS), key=rid.encode(), value=req.to_bytes())
                if producer.flush(30) != 0:
                    raise RuntimeError("could not publish the rollout requests (is the broker up?)")
                t0 = time.monotonic()
                cancelled = threading.Event()
                try:
                    got = await asyncio.to_thread(_collect, kafka, set(ids), timeout_s, cancelled)
                except asyncio.CancelledError:  # Ctrl-C: the rollouts in flight are ended, not waited for
                    worker.cancel()
                    await asyncio.wait({worker}, timeout=30)
                    raise
                finally:
                    cancelled.set()
                wall = time.monotonic() - t0
                stop.set()
                await asyncio.wait_for(worker, 60)
            finally:
                await runner.cleanup()
                await admin.cleanup()
    finally:
        if publisher is not None:
            publisher.close()
        streams.terminate()
        streams.wait(40)
    summary = summarize(harness, ids, got, wall)
    summary["prefix"] = kafka.topic_prefix
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="clawstream model demos", description=__doc__.split("\n")[0])
    p.add_argument("--harness", choices=sorted(TOOLS), default="opencode", help="the real harness (%(default)s)")
    p.add_argument(
        "--tasks",
        type=int,
        default=8,
        help=f"the first N training tasks of the CPU suite, up to {TRAIN_CHUNK} (builtin:cpu's 96 first; %(default)s)",
    )
    p.add_argument("--prefix", required=True, help="topic prefix the demonstrations go to (e.g. 'demos1.')")
    p.add_argument("--model-dir", type=Path, default=SHIPPED_DIR, help="tokenizer + chat template (%(default)s)")
    p.add_argument("--concurrency", type=int, default=2, help="rollouts at once (%(default)s)")
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds to wait for every trajectory (default: every rollout's own 180 s bound, --concurrency at a "
        "time, + 120 s)",
    )
    p.add_argument("--out", type=Path, help="also write the summary JSON here")
    add_kafka_arguments(p)
    a = p.parse_args(argv)
    kafka = kafka_settings(a).model_copy(update={"topic_prefix": a.prefix})
    # Bounded by the rollouts' own timeouts, not a fixed wall-clock (900 s cut 64 tasks at 36 on loaded cores).
    timeout = a.timeout if a.timeout is not None else ROLLOUT_TIMEOUT_S * -(-a.tasks // max(a.concurrency, 1)) + 120
    sigterm_interrupts()  # `kill` stops the proxy, worker and streams worker too (record's finally), as Ctrl-C does
    try:
        summary = asyncio.run(
            record(a.harness, a.tasks, kafka, model_dir=a.model_dir, concurrency=a.concurrency, timeout_s=timeout)
        )
    except ValueError as exc:
        p.error(str(exc))
    except KeyboardInterrupt:
        print(f"interrupted: what finished is on the topics under {a.prefix!r}", file=sys.stderr)
        return 130
    text = json.dumps(summary, indent=2)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")
    return 0 if summary["solved"] == summary["tasks"] else 1


if __name__ == "__main__":
    sys.exit(main())
