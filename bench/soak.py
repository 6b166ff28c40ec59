"""Soak: many concurrent rollouts for minutes through the real services; memory, latency and the audit (issue #29).

Every service of the demo's stack runs as its own process (``clawstream.stack``): serving proxy, sandbox worker
(``--concurrency`` = the rollouts at once, the built-in ``agentloop`` harness on the CPU suite), the stream processors
(exactly-once, RocksDB), the learner (the shipped warm start, one thread) and the scheduler (steps of rollouts ÷ 8
tasks × 8 rollouts, policy lag 1), on a local Apache Kafka broker (or ``--bootstrap``). The one test double is the
model: ``bench.soak_engine`` answers each call at once, so the load is on the services. For ``--seconds`` the run
goes on; every 5 s the resident memory (VmRSS, /proc) of each service's main process and of its whole process tree
(a worker's harnesses and graders included) is sampled. Then the scheduler is stopped, what was issued drains
(rewards, trajectories, the sealed batches trained), everything is stopped, and the run's topics are audited
(``consumers.analytics.audit``: nothing lost, doubled or trained twice).

Reported per service: RSS after warm-up (median of the samples in the 10 % of the run from the later of 15 % in and
the first weight version: every service has then done its work once), at the end (median of the last 10 %; each
window ≥ 10 s), peak, growth; pass when every service's main process grows ≤ 10 %. Per rollout the end-to-end
latency from its request (the scheduler's ``timestamp_ms``) to its trajectory being readable (read_committed,
watched live), and to its reward; p50/p99; rollouts/min, concurrent rollouts (mean, max), weight versions trained.

Run: ``.venv/bin/python -m bench.soak [--seconds 600] [--rollouts 64] [--out bench/results/soak.md]``
(``make soak``; ``tests/e2e/test_soak.py`` runs 60 s of it). ``--leak MODULE:MB_PER_S[:AFTER_S]`` makes the service
run as ``python -m MODULE`` leak on purpose from AFTER_S after its start (a ``sitecustomize`` on its path).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from confluent_kafka import OFFSET_BEGINNING, TopicPartition  # noqa: E402

from clawbase.kafka.clients import create_topics, make_consumer  # noqa: E402
from clawbase.settings import KafkaSettings  # noqa: E402
from clawstream.stack.process import Service, Stack  # noqa: E402
from clawstream.stack.services import (  # noqa: E402
    free_port,
    stack_for,
    start_learner,
    start_rollout_side,
    start_scheduler,
    start_streams,
)
from consumers.analytics.audit import format_report, read_run  # noqa: E402
from consumers.analytics.reconcile import AuditReport, reconcile  # noqa: E402
from schemas.codec import default_codec  # noqa: E402
from schemas.events import RewardEvent, RewardStatus, RolloutEvent, RolloutRequest, RolloutState  # noqa: E402
from schemas.topics import BATCHES, CATALOG, REWARDS, ROLLOUT_EVENTS, ROLLOUT_REQUESTS, TRAJECTORIES, WEIGHTS  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "soak.md"
GROUP_SIZE = 8
SAMPLE_S, PROGRESS_S = 5.0, 10.0
GROWTH_LIMIT = 0.10  # the bound after warm-up (the 60-second test uses its own)
LEAK_CODE = """import os, threading, time
_module, _rate, _after = (os.environ.get("CLAWSTREAM_SOAK_LEAK", "") + "::").split(":")[:3]
_argv = open("/proc/self/cmdline", "rb").read().split(b"\\0")
if _module and b"-m" in _argv and _argv[_argv.index(b"-m") + 1].decode() == _module:
    _kept = []
    def _leak():
        time.sleep(float(_after or 0))
        while True:
            _kept.append(b"\\1" * int(float(_rate or 1) * 1024 * 1024))  # touched: resident
            time.sleep(1)
    threading.Thread(target=_leak, daemon=True).start()
"""


# --- memory ---------------------------------------------------------------------------------------------------------


def rss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def process_tree(root: int) -> list[int]:
    """``root`` and every live descendant of it (from /proc/*/stat)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


@dataclass
class Memory:
    """RSS samples of one service: (seconds into the run, main process kB, process tree kB)."""

    samples: list[tuple[float, int, int]] = field(default_factory=list)

    def window(self, lo: float, hi: float, col: int) -> float:
        xs = [s[col] for s in self.samples if lo <= s[0] <= hi and s[1] > 0]
        return float(statistics.median(xs)) if xs else float("nan")

    def figures(self, seconds: float, warm_at: float, col: int = 1) -> dict[str, float]:
        span = max(0.1 * seconds, 2 * SAMPLE_S)  # at least two samples per window in a short run
        warm = self.window(warm_at, warm_at + span, col)
        end = self.window(seconds - span, seconds + 1, col)
        peak = float(max((s[col] for s in self.samples), default=0))
        return {"warm_mb": warm / 1024, "end_mb": end / 1024, "peak_mb": peak / 1024, "growth": end / warm - 1}


# --- the run's records, watched live ------------------------------------------------------------------------------


class Watch:
    """Requests, lifecycle, rewards, trajectories, batch seals and weights of the run, with the time each was read."""

    def __init__(self, kafka: KafkaSettings) -> None:
        self.kafka = kafka
        self.consumer = make_consumer(kafka, f"{kafka.topic_prefix}soak-watch", log_level=2)
        parts = []
        for name in (ROLLOUT_REQUESTS, ROLLOUT_EVENTS, REWARDS, TRAJECTORIES, BATCHES, WEIGHTS):
            topic = kafka.topic(name)
            meta = self.consumer.list_topics(topic, timeout=30).topics[topic]
            parts += [TopicPartition(topic, p, OFFSET_BEGINNING) for p in sorted(meta.partitions)]
        self.consumer.assign(parts)
        self.requested: dict[str, float] = {}  # rollout id → its first request's timestamp (s)
        self.started: set[str] = set()  # attempt ids
        self.rewarded: dict[str, float] = {}  # rollout id → when its first graded reward was read
        self.rewarded_attempts: set[str] = set()
        self.settled: dict[str, float] = {}  # rollout id → when its first trajectory was read
        self.settled_attempts: set[str] = set()
        self.seals = 0
        self.versions: set[int] = set()
        self.first_version_at: float | None = None  # time.monotonic() when the first weight version was read

    def poll(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            msg = self.consumer.poll(min(left, 0.2))
            if msg is None or msg.error():
                continue
            now, topic, value = time.time(), msg.topic(), msg.value()
            if topic == self.kafka.topic(ROLLOUT_REQUESTS):
                req = RolloutRequest.from_bytes(value)
                self.requested.setdefault(req.rollout_id, req.timestamp_ms / 1000)
            elif topic == self.kafka.topic(ROLLOUT_EVENTS):
                ev = RolloutEvent.from_bytes(value)
                if ev.state == RolloutState.STARTED:
                    self.started.add(ev.attempt_id)
            elif topic == self.kafka.topic(REWARDS):
                reward = RewardEvent.from_bytes(value)
                self.rewarded_attempts.add(reward.attempt_id)
                if reward.status != RewardStatus.INFRA_FAILURE:
                    self.rewarded.setdefault(reward.rollout_id, now)
            elif topic == self.kafka.topic(TRAJECTORIES):
                _, traj = default_codec().decode(value, expected="Trajectory")
                self.settled_attempts.add(traj["attempt_id"])
                if traj["status"] != RewardStatus.INFRA_FAILURE.value:
                    self.settled.setdefault(traj["rollout_id"], now)
            elif topic == self.kafka.topic(BATCHES):
                _, rec = default_codec().decode(value, expected="BatchRecord")
                self.seals += rec["kind"] == "SEAL"
            else:
                _, rec = default_codec().decode(value, expected="WeightVersion")
                self.versions.add(rec["policy_version"])
                self.first_version_at = self.first_version_at or time.monotonic()

    @property
    def running(self) -> int:
        return len(self.started - self.rewarded_attempts - self.settled_attempts)

    def drained(self) -> bool:
        """Every request settled, every started attempt ended."""
        return set(self.requested) <= set(self.settled) and self.started <= (
            self.rewarded_attempts | self.settled_attempts
        )

    def close(self) -> None:
        self.consumer.close()


# --- the run --------------------------------------------------------------------------------------------------------


@dataclass
class SoakResult:
    seconds: float
    rollouts: int
    memory: dict[str, Memory]
    done: int  # rollouts settled into a trajectory within the measured window (not the warm-up's)
    settled_total: int
    requested: int
    latency_s: list[float]  # request → trajectory, per rollout
    reward_latency_s: list[float]  # request → reward
    concurrency: list[int]
    versions: int
    report: AuditReport
    audit_text: str
    drain_s: float
    warm_at: float  # seconds into the run where the warm-up window starts

    def growth(self, service: str) -> float:
        return self.memory[service].figures(self.seconds, self.warm_at)["growth"]

    @property
    def judged(self) -> list[str]:
        return [name for name in self.memory if name != "engine"]  # the double is reported, not judged


def _start(
    stack: Stack, model: Path, run_dir: Path, rollouts: int, leak: str | None, retention_s: float | None
) -> None:
    if retention_s is not None:  # how long the streams remember a settled rollout (default 3600 s)
        stack.env["CLAWSTREAM_STREAMS_LATE_RETENTION_S"] = str(retention_s)
    if leak:
        site = run_dir / "leak-site"
        site.mkdir(parents=True, exist_ok=True)
        (site / "sitecustomize.py").write_text(LEAK_CODE)
        stack.env.update({"PYTHONPATH": str(site), "CLAWSTREAM_SOAK_LEAK": leak})
    group = min(GROUP_SIZE, rollouts)
    tasks = max(1, rollouts // group)
    engine = stack.start(
        Service(
            "engine",
            ["bench.soak_engine", "--model", str(model), "--port", str(free_port())],
            ready_line=r"instant engine on (http://\S+:\d+)",
            restart=True,
        )
    )
    start_rollout_side(stack, model, concurrency=rollouts, engine_url=str(engine.found))
    # zero_variance "keep": the instant engine solves tasks alike; with "drop" most groups would wait on refills
    start_streams(
        stack,
        run_dir,
        group_size=group,
        batch_groups=tasks,
        settle_interval_s=0.0,
        zero_variance="keep",
        loglevel="info",
    )
    start_learner(stack, model, run_dir, {"lr": 2e-5, "seed": 0}, torch_threads=1)
    settings = {"tasks_per_step": tasks, "group_size": group, "max_tokens": 128, "max_policy_lag": 1}
    start_scheduler(stack, 1_000_000, {**settings, "zero_variance": "keep"})  # stopped by the clock, not its steps


def _sample(stack: Stack, memory: dict[str, Memory], at: float) -> None:
    for s in stack.services:
        if s.proc is not None and s.proc.poll() is None:
            tree = process_tree(s.proc.pid)
            memory[s.name].samples.append((at, rss_kb(s.proc.pid), sum(map(rss_kb, tree))))


def run_soak(
    kafka: KafkaSettings,
    work: Path,
    *,
    seconds: float,
    rollouts: int,
    leak: str | None = None,
    retention_s: float | None = None,
    warm_versions: int = 0,
    drain_timeout: float = 240.0,
    say=lambda line: print(line, flush=True),  # noqa: ANN001
) -> SoakResult:
    """Start the stack on ``kafka`` (topics under its prefix, created here), run ``seconds``, drain, stop, audit.

    ``warm_versions``: first run until that many weight versions are out, unmeasured (the clock starts after)."""
    from warmstart import sft

    model, why = sft.shipped_warm_start()
    if model is None:
        raise RuntimeError(why)
    create_topics(kafka, CATALOG)
    stack = stack_for(kafka, work / "logs")
    watch = Watch(kafka)
    memory: dict[str, Memory] = {}
    concurrency: list[int] = []
    try:
        _start(stack, model, work / "run", rollouts, leak, retention_s)
        say(f"stack up ({', '.join(s.name for s in stack.services)}); logs in {work / 'logs'}")
        memory = {s.name: Memory() for s in stack.services}
        t_warm = time.monotonic()
        while len(watch.versions) < warm_versions:  # a warm-up outside the measured window (the 60-second test)
            if time.monotonic() - t_warm > drain_timeout:
                raise TimeoutError(f"not {warm_versions} weight versions within {drain_timeout:.0f} s")
            stack.check()
            watch.poll(0.5)
        if warm_versions:
            say(
                f"warm: {len(watch.versions)} weight version(s) out after {time.monotonic() - t_warm:.0f} s; "
                "the clock starts"
            )
        t0, before = time.monotonic(), len(watch.settled)
        next_sample = next_progress = t0
        while (now := time.monotonic()) - t0 < seconds:
            stack.check()
            if now >= next_sample:
                _sample(stack, memory, now - t0)
                concurrency.append(watch.running)
                next_sample += SAMPLE_S
            if now >= next_progress:
                total = sum(m.samples[-1][2] for m in memory.values() if m.samples) / 1024
                say(
                    f"[{now - t0:5.0f} s] rollouts settled {len(watch.settled)}, running {watch.running}, "
                    f"weight versions {len(watch.versions)}, RSS of all services {total:.0f} MB"
                )
                next_progress += PROGRESS_S
            watch.poll(0.5)
        _sample(stack, memory, seconds)
        done = len(watch.settled) - before  # in the measured window
        # warm: 15 % into the run, and every service has done its work once (the first version trained)
        first = watch.first_version_at - t0 if watch.first_version_at else 0.0
        warm_at = min(max(0.15 * seconds, first), seconds - 2 * max(0.1 * seconds, 2 * SAMPLE_S))  # before the end's
        scheduler = next(s for s in stack.services if s.name == "scheduler")
        scheduler.restart = False
        stack.kill(scheduler)
        stack.services.remove(scheduler)  # stopped on purpose: not a death for the supervisor
        say(f"[{seconds:5.0f} s] scheduler stopped; {len(watch.requested) - len(watch.settled)} to drain")
        t_drain = time.monotonic()
        group = min(GROUP_SIZE, rollouts)
        per_batch = max(1, rollouts // group) * group  # batch_groups groups of `group` (_start)
        while not (
            watch.drained() and watch.seals >= len(watch.settled) // per_batch and len(watch.versions) >= watch.seals
        ):
            if time.monotonic() - t_drain > drain_timeout:
                say(f"drain not finished within {drain_timeout:.0f} s")
                break
            stack.check()
            watch.poll(0.5)
        drain_s = time.monotonic() - t_drain
        say(f"drained in {drain_s:.0f} s: {len(watch.settled)} rollouts settled, {len(watch.versions)} versions")
    finally:
        watch.close()
        stack.stop()
    lat = [watch.settled[r] - t for r, t in watch.requested.items() if r in watch.settled]
    rlat = [watch.rewarded[r] - t for r, t in watch.requested.items() if r in watch.rewarded]
    report = reconcile(read_run(kafka))
    return SoakResult(
        seconds,
        rollouts,
        memory,
        done,
        len(watch.settled),
        len(watch.requested),
        lat,
        rlat,
        concurrency,
        len(watch.versions),
        report,
        format_report(report, kafka.topic_prefix),
        drain_s,
        warm_at,
    )


# --- the results file -----------------------------------------------------------------------------------------------


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def render(r: SoakResult, command: str, limit: float = GROWTH_LIMIT) -> str:
    tally = r.report.tally()
    ok = all(r.growth(s) <= limit for s in r.judged)
    conc = r.concurrency[len(r.concurrency) // 5 :] or [0]
    lines = [
        f"# Soak: {r.rollouts} concurrent rollouts for {r.seconds / 60:.1f} min (`bench/soak.py`)",
        "",
        f"`{command}` on {platform.node()} ({os.cpu_count()} cores, shared), "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"Python {platform.python_version()}. Proxy, sandbox worker (`agentloop`, concurrency {r.rollouts}), streams, "
        "learner and scheduler as processes on a local Kafka broker; the model is `bench.soak_engine` (instant, "
        "2 calls per rollout). What is measured and how: docs/benchmarks.md#soak.",
        "",
        "## Memory (VmRSS, MB)",
        "",
        f"After warm-up = median of the samples in the 10 % of the run from {r.warm_at:.0f} s in (the later of 15 % "
        f"and the first weight version), end = median of the last 10 % (each window ≥ 10 s), sampled every "
        f"{SAMPLE_S:.0f} s. *Tree* adds the service's children (the worker's harnesses and graders). Judged: each "
        f"service's main process, growth ≤ {limit:.0%} (the engine is the test double: shown, not judged).",
        "",
        "| service | after warm-up | end | peak | growth | tree after warm-up | tree end | tree peak |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, mem in r.memory.items():
        main, tree = mem.figures(r.seconds, r.warm_at, 1), mem.figures(r.seconds, r.warm_at, 2)
        lines.append(
            f"| {name} | {main['warm_mb']:.0f} | {main['end_mb']:.0f} | {main['peak_mb']:.0f} | "
            f"{main['growth']:+.1%} | {tree['warm_mb']:.0f} | {tree['end_mb']:.0f} | {tree['peak_mb']:.0f} |"
        )
    step = 60.0 if r.seconds >= 300 else 10.0
    marks = [step * i for i in range(int(r.seconds // step) + 1)]
    lines += [
        "",
        f"Main-process RSS (MB) every {step:.0f} s (the sample nearest each mark):",
        "",
        "| service | " + " | ".join(f"{m:.0f} s" for m in marks) + " |",
        "|---|" + "---:|" * len(marks),
    ]
    for name, mem in r.memory.items():
        cells = [min(mem.samples, key=lambda x, m=m: abs(x[0] - m))[1] / 1024 if mem.samples else 0 for m in marks]
        lines.append(f"| {name} | " + " | ".join(f"{c:.0f}" for c in cells) + " |")
    lines += [
        "",
        f"**Growth ≤ {limit:.0%} after warm-up: {'PASS' if ok else 'FAIL'}.**",
        "",
        "## Throughput and latency",
        "",
        f"- rollouts settled in the {r.seconds:.0f} s: {r.done} (**{60 * r.done / r.seconds:.0f} rollouts/min**); "
        f"{r.settled_total} of {r.requested} issued after the drain ({r.drain_s:.0f} s)",
        f"- rollouts running at once (sampled every {SAMPLE_S:.0f} s after the first 20 %): mean "
        f"{statistics.mean(conc):.1f}, max {max(conc)}",
        f"- request → trajectory readable: **p50 {pct(r.latency_s, 0.5):.2f} s, p99 {pct(r.latency_s, 0.99):.2f} s** "
        f"(n = {len(r.latency_s)}); request → reward: p50 {pct(r.reward_latency_s, 0.5):.2f} s, "
        f"p99 {pct(r.reward_latency_s, 0.99):.2f} s",
        f"- weight versions trained: {r.versions}",
        "",
        "## Audit",
        "",
        f"**{'CLEAN' if r.report.clean else 'VIOLATIONS'}**: lost {tally['lost']}, duplicated {tally['duplicated']}, "
        f"trained twice {tally['trained twice']}, inconsistent {tally['inconsistent']}.",
        "",
        "```",
        r.audit_text,
        "```",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=600.0)
    parser.add_argument("--rollouts", type=int, default=64, help="rollouts at once (the sandbox worker's concurrency)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--streams-late-retention-s", type=float, default=None, help="the streams' late_retention_s (default 3600)"
    )
    parser.add_argument("--bootstrap", default=None, help="an existing broker (default: start one, then stop it)")
    parser.add_argument(
        "--leak", default=None, metavar="MODULE:MB_PER_S[:AFTER_S]", help="make one service leak on purpose"
    )
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the stack on SIGTERM too (finally blocks)
    work = Path(tempfile.mkdtemp(prefix="clawstream-soak-"))
    broker = None
    bootstrap = args.bootstrap
    if not bootstrap:
        from clawstream.local_kafka import LocalKafka

        broker = LocalKafka(home=work / "kafka")
        bootstrap = broker.up(timeout=120, quiet=True).bootstrap
    try:
        kafka = KafkaSettings(bootstrap_servers=bootstrap, topic_prefix=f"soak-{time.time_ns()}.")
        result = run_soak(
            kafka,
            work,
            seconds=args.seconds,
            rollouts=args.rollouts,
            leak=args.leak,
            retention_s=args.streams_late_retention_s,
        )
    finally:
        if broker is not None:
            broker.down()
        shutil.rmtree(work / "kafka", ignore_errors=True)  # the broker's data: 1-3 GB per run, left in /tmp before
    command = " ".join(["python -m bench.soak", *(argv if argv is not None else sys.argv[1:])])
    text = render(result, command)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    ok = result.report.clean and all(result.growth(s) <= GROWTH_LIMIT for s in result.judged)
    if ok:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"the services' logs and data are kept in {work}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
