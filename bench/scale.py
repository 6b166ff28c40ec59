"""Scale-out on one machine: 1 vs 2 sandbox workers and 1 vs 2 learner ranks, side by side in one run (#31).

(a) Rollouts/s as ``bench.rollouts`` counts them (first request published → last reward read; ``agentloop`` on the
CPU suite, 2 calls per rollout to the instant scripted engine ``bench.soak_engine``) with 1, then 2 sandbox-worker
processes (``python -m producers.sandbox.worker``, one consumer group, the same ``--concurrency`` each) behind one
serving proxy. (b) Learner tokens/s on the same batches read from the broker (``tests.support.learner_data``'s
scored trees, the shipped warm start, one torch thread per rank) with ``python -m learner.train_ranks --nproc 1``
and ``--nproc 2`` (gloo, data parallel): tokens between the first and the last published version, per second.

Each measured process is pinned with ``os.sched_setaffinity`` (every thread; children inherit it): worker or rank i
on core i. The broker, the engine and the proxy are not pinned. Per process: CPU time (user + system from
/proc/PID/stat, a worker's reaped harness and grader children included) over the timed window next to its wall
time, the time its threads waited for a core (schedstat), and peak RSS (VmHWM). Sides alternate 1, 2, 1, 2
(``--rounds``), each run on fresh topics of one broker.

On 2 cores two pinned processes share both cores with everything else (broker, engine, proxy, other users), so the
2-vs-1 ratio measures contention, not scale; the CPU seconds per rollout or per token are what carry over to a
machine with a core per process. Stream workers (1 vs 2) are not measured here.

Run: ``HF_HUB_OFFLINE=1 .venv/bin/python -m bench.scale [--rounds 2] [--rollouts 40] [--steps 6]``; writes
``bench/results/scale.md``. Default run ≈ 6 min on 2 cores at a load under 10; 11.6 min at 16–58.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from confluent_kafka import OFFSET_BEGINNING, ConsumerGroupState, KafkaException, Message, TopicPartition  # noqa: E402

from bench.rollouts import requests  # noqa: E402
from bench.soak import Watch, process_tree  # noqa: E402
from bench.streams import broker  # noqa: E402
from clawbase.kafka.clients import bootstrap_servers, create_topics, make_admin, make_consumer, make_producer  # noqa: E402
from clawbase.settings import KafkaSettings  # noqa: E402
from clawstream.stack.process import Service, Stack  # noqa: E402
from clawstream.stack.services import free_port, stack_for, start_rollout_side  # noqa: E402
from schemas.events import Trajectory, WeightVersion  # noqa: E402
from schemas.topics import BATCHES, CATALOG, WEIGHTS  # noqa: E402
from tests.support import sandbox_helpers as S  # noqa: E402
from tests.support.learner_data import batch_records  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "scale.md"


def pin(pid: int, cores: set[int], *, tree: bool = True) -> None:
    """Every thread of ``pid`` (and of its descendants) onto ``cores``: sched_setaffinity acts on one thread, and
    threads or processes started later inherit the mask of the thread that starts them."""
    for proc in process_tree(pid) if tree else [pid]:
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{proc}/task"):
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(int(tid), cores)


@dataclass
class Usage:
    cpu_s: float  # user + system of the process and of its reaped children
    peak_mb: float  # VmHWM of the process itself (0 once it is a zombie)
    wait_s: float  # time its live threads spent runnable but waiting for a core (schedstat): the contention


def usage(pid: int) -> Usage | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return None
    hwm = next((int(line.split()[1]) for line in status if line.startswith("VmHWM:")), 0)
    wait_ns = 0
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError, IndexError, ValueError):
                wait_ns += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[1])
    cpu = sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")  # utime, stime, cutime, cstime
    return Usage(cpu, hwm / 1024, wait_ns / 1e9)


class Adopted:
    """The sandboxes' CPU, which never reaches the worker's: bwrap leaves its pid namespace's first process (which
    reaped the harness and grader) to whoever adopts orphans: the bench, a child subreaper. Credited by its core."""

    def __init__(self) -> None:
        if ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) != 0:  # 36: PR_SET_CHILD_SUBREAPER
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
        self.cpu: dict[frozenset[int], float] = {}
        self.cores: dict[int, frozenset[int]] = {}  # adopted pid → its affinity, read while it is alive

    def reap(self, known: set[int]) -> None:
        """Reap what was adopted (children of the bench that it did not start: not in ``known``)."""
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError):
                for pid in map(int, Path(f"/proc/self/task/{tid}/children").read_text().split()):
                    if pid in known:
                        continue
                    with contextlib.suppress(OSError):
                        self.cores.setdefault(pid, frozenset(os.sched_getaffinity(pid)))
                    with contextlib.suppress(ChildProcessError):
                        done, _, ru = os.wait4(pid, os.WNOHANG)
                        if done:
                            cores = self.cores.pop(pid, frozenset())
                            self.cpu[cores] = self.cpu.get(cores, 0.0) + ru.ru_utime + ru.ru_stime

    def on(self, core: int) -> float:
        return self.cpu.get(frozenset({core}), 0.0)


def delta(before: list[Usage | None], after: list[Usage | None], what: str = "cpu_s") -> list[float]:
    return [
        getattr(a, what) - getattr(b, what) if a and b else float("nan") for b, a in zip(before, after, strict=True)
    ]


@dataclass
class Run:
    kind: str  # "rollouts" or "learner"
    n: int  # workers or ranks
    round: int
    done: float  # rollouts, or tokens, in the timed window
    wall: float  # the timed window, s
    cpu: list[float]  # each pinned process's CPU s in the window
    wait: list[float]  # each pinned process's run-queue wait s in the window
    peak_mb: list[float]
    load: float  # 1-minute load average when the window ended
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return self.done / self.wall


def wait_members(kafka: KafkaSettings, group: str, n: int, timeout: float = 90.0) -> None:
    """Until the group is stable with ``n`` members, each holding partitions (all of them joined before the clock)."""
    admin = make_admin(kafka)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(KafkaException, TimeoutError):  # not there yet; a slow answer on a busy machine
            desc = admin.describe_consumer_groups([group])[group].result(timeout=10)
            members = [m for m in desc.members if m.assignment and m.assignment.topic_partitions]
            if desc.state == ConsumerGroupState.STABLE and len(desc.members) == len(members) == n:
                return
        time.sleep(0.5)
    raise TimeoutError(f"{group} did not reach {n} members holding partitions within {timeout:.0f} s")


def wait_rewards(watch: Watch, ids: set[str], stack: Stack, pool: list[Service], adopted: Adopted) -> float:
    """When (time.time()) the last of ``ids`` got its reward; raises if a worker dies or time runs out."""
    deadline = time.monotonic() + 300
    known = {s.proc.pid for s in stack.services if s.proc is not None}
    while not ids <= watch.rewarded.keys():
        dead = [s.name for s in pool if s.proc is None or s.proc.poll() is not None]
        if dead or time.monotonic() > deadline:
            missing = len(ids - watch.rewarded.keys())
            raise RuntimeError(f"{missing} of {len(ids)} rollouts without a reward (dead: {dead or 'none'})")
        watch.poll(0.1)
        adopted.reap(known)
    time.sleep(0.3)  # the last sandbox's processes end as its reward goes out
    adopted.reap(known)
    return max(watch.rewarded[r] for r in ids)


def rollouts_run(
    bootstrap: str, model: Path, workers: int, rnd: int, args: argparse.Namespace, work: Path, adopted: Adopted
) -> Run:
    kafka = KafkaSettings(bootstrap_servers=bootstrap, topic_prefix=f"scale-{time.time_ns()}.")  # fresh topics
    create_topics(kafka, CATALOG)
    stack = stack_for(kafka, work / "logs")
    # sandboxes of their own: a worker's sweep must not touch another user's
    stack.env.update({"CLAWSTREAM_SANDBOX_ROOT": str(work / "sandboxes"), "OMP_NUM_THREADS": "1"})
    watch = Watch(kafka)
    try:
        cmd = ["bench.soak_engine", "--model", str(model), "--port", str(free_port())]
        engine = stack.start(Service("engine", cmd, ready_line=r"instant engine on (http://\S+:\d+)"))
        suites = {"cpu_builtin": "builtin:cpu"}
        start_rollout_side(stack, model, concurrency=args.concurrency, suites=suites, engine_url=str(engine.found))
        pool = [stack.services[-1]]
        for i in range(1, workers):  # the same service again: same flags and environment, one more group member
            pool.append(stack.start(dataclasses.replace(pool[0], name=f"sandbox-worker-{i + 1}", proc=None, log=None)))
        pids = [s.proc.pid for s in pool if s.proc is not None]
        for i, pid in enumerate(pids):
            pin(pid, {i})
        wait_members(kafka, f"{kafka.topic_prefix}sandbox-workers", workers)
        for i, pid in enumerate(pids):
            pin(pid, {i})  # threads the client started while joining
        warm = requests(workers * args.concurrency)  # one per slot, outside the clock
        S.publish(kafka, warm)
        wait_rewards(watch, {r.rollout_id for r in warm}, stack, pool, adopted)
        shared = [s for s in stack.services if s not in pool]
        reqs = requests(args.rollouts)
        before, shared_before = [usage(p) for p in pids], [usage(s.proc.pid) for s in shared if s.proc]
        sandboxes_before = [adopted.on(i) for i in range(workers)]
        t0 = time.time()
        S.publish(kafka, reqs)
        t1 = wait_rewards(watch, {r.rollout_id for r in reqs}, stack, pool, adopted)
        after, shared_after = [usage(p) for p in pids], [usage(s.proc.pid) for s in shared if s.proc]
        sandboxes = [adopted.on(i) - b for i, b in enumerate(sandboxes_before)]
        cpu = [w + sb for w, sb in zip(delta(before, after), sandboxes, strict=True)]
        extra = {"engine+proxy cpu": sum(delta(shared_before, shared_after)), "sandbox cpu": sum(sandboxes)}
        peaks = [a.peak_mb if a else float("nan") for a in after]
        load = os.getloadavg()[0]
        return Run(
            "rollouts", workers, rnd, len(reqs), t1 - t0, cpu, delta(before, after, "wait_s"), peaks, load, extra
        )
    finally:
        watch.close()
        stack.stop()  # SIGTERM, then SIGKILL, to each service's process group by its pid


def produce_batches(kafka: KafkaSettings, steps: int, trees: int) -> int:
    """The batches on the broker; returns the tokens of the largest tree."""
    producer, largest = make_producer(kafka), 0
    for step in range(1, steps + 1):
        for rec in batch_records(f"b-{step}", step, trees, seed=step):
            producer.produce(kafka.topic(BATCHES), key=rec.batch_id.encode(), value=rec.to_bytes())
            if rec.trajectory:
                largest = max(largest, sum(len(g.tokens) for g in Trajectory.from_bytes(rec.trajectory).segments))
    if producer.flush(30):
        raise RuntimeError("batches not acknowledged")
    return largest


def ranks_of(launcher: int) -> list[int]:
    """The launcher's rank processes (multiprocessing spawn children; not its resource tracker), in start order."""
    return sorted(pid for pid in process_tree(launcher)[1:] if b"spawn_main" in _cmdline(pid))


def _cmdline(pid: int) -> bytes:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    return b""


def learner_run(bootstrap: str, model: Path, ranks: int, rnd: int, args: argparse.Namespace, work: Path) -> Run:
    kafka = KafkaSettings(bootstrap_servers=bootstrap, topic_prefix=f"scale-{time.time_ns()}.")  # fresh topics
    create_topics(kafka, CATALOG)
    # Rows of half a batch on both sides: with the batch in one row on 1 rank, the dense tree mask (T × T) would
    # make 2 ranks' half-length rows faster per token than data parallelism makes them.
    budget = produce_batches(kafka, args.steps, args.trees) * -(-args.trees // 2)
    consumer = make_consumer(kafka, f"{kafka.topic_prefix}scale-watch")
    topic = kafka.topic(WEIGHTS)
    parts = consumer.list_topics(topic, timeout=30).topics[topic].partitions
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in sorted(parts)])
    env = {**os.environ, "CLAWSTREAM_LEARNER_TORCH_THREADS": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.update(
        CLAWSTREAM_KAFKA_BOOTSTRAP_SERVERS=bootstrap_servers(kafka), CLAWSTREAM_KAFKA_TOPIC_PREFIX=kafka.topic_prefix
    )
    work.mkdir(parents=True, exist_ok=True)
    store = work / f"store-{ranks}-{rnd}"
    cmd = [sys.executable, "-m", "learner.train_ranks", "--nproc", str(ranks), "--model-dir", str(model)]
    cmd += [
        "--weight-store",
        str(store),
        "--max-steps",
        str(args.steps),
        "--idle-exit",
        "30",
        "--hp",
        f"token_budget={budget}",
    ]
    log = work / f"learner-{ranks}-{rnd}.log"
    versions: list[tuple[float, dict[str, float], list[Usage | None]]] = []  # read at, metrics, ranks' usage then
    last: dict[int, Usage] = {}
    peak: dict[int, float] = {}
    pids: list[int] = []
    started = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    os.sched_setaffinity(proc.pid, set(range(ranks)))  # ranks start on these cores; each is moved to its own below
    exited, status, rusage = 0, 0, None

    def take(msg: Message | None) -> None:
        if msg is not None and not msg.error():
            metrics = dict(WeightVersion.from_bytes(msg.value()).metrics)
            versions.append((time.monotonic(), metrics, [last.get(p) for p in pids]))

    try:
        next_pin = 0.0
        while not exited:
            exited, status, rusage = os.wait4(proc.pid, os.WNOHANG)
            now = time.monotonic()
            if now - started > 300:
                raise TimeoutError(f"the learner did not finish within 300 s; log {log}")
            if now >= next_pin:  # scanning /proc costs CPU the ranks would otherwise have: twice a second
                next_pin = now + 0.5
                pids = pids if len(pids) == ranks else ranks_of(proc.pid)
                for i, pid in enumerate(pids if len(pids) == ranks else []):
                    pin(pid, {i}, tree=False)
            for pid in pids if len(pids) == ranks else []:
                if (u := usage(pid)) is not None:
                    last[pid] = u
                    peak[pid] = max(peak.get(pid, 0.0), u.peak_mb)
            take(consumer.poll(0.1))
        while len(versions) < args.steps and (msg := consumer.poll(5)) is not None:  # published just before exit
            take(msg)
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, by wait4 (for the tree's rusage)
    finally:
        consumer.close()
        if not exited:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the launcher's group: its ranks too
            os.wait4(proc.pid, 0)
        shutil.rmtree(store, ignore_errors=True)
    if os.waitstatus_to_exitcode(status) != 0 or len(versions) < 3 or rusage is None:
        raise RuntimeError(f"learner-ranks {ranks}: exit {status}, {len(versions)} versions; log {log}")
    (t_first, _, u_first), (t_last, _, u_last) = versions[0], versions[-1]
    timed = [m for _, m, _ in versions[1:]]  # the first step (warm-up, one-off allocations) is outside the window
    extra = {
        "steps": len(timed),
        "tokens/step": statistics.mean(m["tokens"] for m in timed),
        "step tokens/s": statistics.median(m["tokens_per_s"] for m in timed),
        "run wall": time.monotonic() - started,
        "run cpu": rusage.ru_utime + rusage.ru_stime,  # the launcher's whole tree, from wait4
        "run maxrss": rusage.ru_maxrss / 1024,
    }
    cpu, wait, peaks = delta(u_first, u_last), delta(u_first, u_last, "wait_s"), [peak[p] for p in pids if p in peak]
    tokens, load = sum(m["tokens"] for m in timed), os.getloadavg()[0]
    return Run("learner", ranks, rnd, tokens, t_last - t_first, cpu, wait, peaks, load, extra)


def _med(runs: list[Run], n: int, key: str) -> float:
    xs = [r.rate if key == "rate" else sum(r.cpu) / r.done for r in runs if r.n == n]
    return statistics.median(xs) if xs else float("nan")


def _util(runs: list[Run], n: int) -> float:
    """Mean share of its own core each pinned process used in the window."""
    return statistics.mean(c / r.wall for r in runs if r.n == n for c in r.cpu)


def _cost_sentence(what: str, c1: float, c2: float) -> str:
    q = c2 / c1
    why = (
        "the second process adds little work: the rate's distance from 2× is the shared cores"
        if 0.9 <= q < 1.15
        else f"{100 * abs(q - 1):.0f} % {'more' if q > 1 else 'less'} CPU for the same work"
    )
    return (
        f"CPU per {what}, summed over the pinned processes: {c1:.3g} s with one, {c2:.3g} s with two ({q:.2f}×): {why}."
    )


def _j(xs: list[float], fmt: str) -> str:
    return " / ".join(format(x, fmt) for x in xs)


def report(runs: list[Run], args: argparse.Namespace, started: float) -> str:
    roll, learn = [r for r in runs if r.kind == "rollouts"], [r for r in runs if r.kind == "learner"]
    cores = len(os.sched_getaffinity(0))
    lines = [
        "# Scale-out on one machine: 1 vs 2 sandbox workers, 1 vs 2 learner ranks (`bench/scale.py`)",
        "",
        f"**{cores} CPU cores: this measures contention, not scale.** Each measured process is pinned to its own "
        "core, but the unpinned broker, engine and proxy and everything else share the same two. **Other agents "
        "were running tests on this machine during the run** (load: the 1-minute load average as each window "
        "ended), so sides alternate 1, 2, 1, 2 and ratios are of medians. What carries over to a core per process "
        "is the CPU spent per rollout or per token. 'Waiting for a core': the time the process's threads were "
        "runnable but not running (run-queue wait, /proc/PID/task/*/schedstat), the contention measured.",
        "",
        f"Machine: {platform.platform()}, {os.cpu_count()} CPUs, Python {platform.python_version()}. Run: "
        f"`HF_HUB_OFFLINE=1 .venv/bin/python -m bench.scale --rounds {args.rounds} --rollouts {args.rollouts} "
        f"--concurrency {args.concurrency} --steps {args.steps} --trees {args.trees}` "
        f"({(time.monotonic() - started) / 60:.1f} min). CPU = user + system from /proc/PID/stat over the timed "
        "window; peak RSS = VmHWM.",
    ]
    if roll:
        r1, r2 = _med(roll, 1, "rate"), _med(roll, 2, "rate")
        c1, c2 = _med(roll, 1, "cpu"), _med(roll, 2, "cpu")
        shared = {n: statistics.median(r.extra["engine+proxy cpu"] / r.done for r in roll if r.n == n) for n in (1, 2)}
        lines += [
            "",
            "## (a) Rollouts/s: 1 vs 2 sandbox workers",
            "",
            f"`agentloop` on the CPU suite, 2 calls per rollout through the real proxy to the instant engine "
            f"(`bench.soak_engine`), local sandboxes; each worker a `producers.sandbox.worker` process with "
            f"`--concurrency {args.concurrency}`, worker i and its sandboxes pinned to core i. Once every worker holds "
            f"partitions and each slot ran a warm-up rollout, {args.rollouts} requests are published at once; the "
            "window runs to the last reward read (as `bench.rollouts`). A worker's CPU includes its sandboxes' "
            "(harness, grader), which bwrap leaves unaccounted to it: the bench, a child subreaper, reaps them "
            f"({sum(r.extra['sandbox cpu'] for r in roll):.1f} of the {sum(sum(r.cpu) for r in roll):.1f} CPU s).",
            "",
            "| workers | round | rollouts | wall s | rollouts/s | CPU s per worker | CPU ÷ wall per worker | "
            "waiting for a core, s | peak RSS per worker (MB) | engine + proxy CPU s | load |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in roll:
            lines.append(
                f"| {r.n} | {r.round} | {r.done:.0f} | {r.wall:.1f} | {r.rate:.2f} | "
                f"{_j(r.cpu, '.1f')} | {_j([c / r.wall for c in r.cpu], '.0%')} | {_j(r.wait, '.1f')} | "
                f"{_j(r.peak_mb, '.0f')} | {r.extra['engine+proxy cpu']:.1f} | {r.load:.1f} |"
            )
        lines += [
            "",
            f"**Median rollouts/s: {r1:.2f} with 1 worker, {r2:.2f} with 2 ({r2 / r1:.2f}×).** "
            f"Each worker used {_util(roll, 1):.0%} of its core alone, {_util(roll, 2):.0%} with two. "
            + _cost_sentence("rollout", c1, c2)
            + f" The unpinned engine and proxy spent {shared[1]:.3f} / {shared[2]:.3f} s per rollout.",
        ]
    if learn:
        t1, t2 = _med(learn, 1, "rate"), _med(learn, 2, "rate")
        c1, c2 = _med(learn, 1, "cpu") * 1000, _med(learn, 2, "cpu") * 1000
        lines += [
            "",
            "## (b) Learner tokens/s: 1 vs 2 data-parallel ranks",
            "",
            "`learner.train_ranks --nproc 1` / `--nproc 2` (`clawstream learner-ranks`; gloo), the shipped warm start, "
            f"one torch thread per rank, rank i on core i; {args.steps} batches of {args.trees} scored trees "
            "(`batch_records`, ~50 tokens each), the same on both sides; `token_budget` = half a batch, so both train "
            "equal rows (the tree mask is dense: rows halved by the split alone would flatter 2 ranks). Window: "
            "version 1 read → last read; tokens/s = its packed tokens ÷ window (Kafka, the batch's broadcast, save "
            "and publish included); 'step tokens/s': the step's own. 'Whole run': launch → exit (`wait4`).",
            "",
            "| ranks | round | steps timed | tokens/step | window s | tokens/s | step tokens/s | CPU s per rank | "
            "CPU ÷ wall per rank | waiting for a core, s | peak RSS per rank (MB) | whole run: wall s / CPU s / max "
            "RSS MB | load |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in learn:
            e = r.extra
            lines.append(
                f"| {r.n} | {r.round} | {e['steps']:.0f} | {e['tokens/step']:.0f} | {r.wall:.1f} | {r.rate:.0f} | "
                f"{e['step tokens/s']:.0f} | {_j(r.cpu, '.1f')} | {_j([c / r.wall for c in r.cpu], '.0%')} | "
                f"{_j(r.wait, '.1f')} | {_j(r.peak_mb, '.0f')} | "
                f"{e['run wall']:.0f} / {e['run cpu']:.0f} / {e['run maxrss']:.0f} | {r.load:.1f} |"
            )
        lines += [
            "",
            f"**Median tokens/s: {t1:.0f} with 1 rank, {t2:.0f} with 2 ({t2 / t1:.2f}×).** "
            f"Each rank used {_util(learn, 1):.0%} of its core alone, {_util(learn, 2):.0%} with two. "
            + _cost_sentence("1,000 tokens", c1, c2)
            + " Data parallel repeats per rank what does not split: the optimizer step over all weights, the "
            "batch's decode on rank 0 and its broadcast, the gradient all-reduce.",
        ]
    lines += [
        "",
        "Not measured: 1 vs 2 stream workers (a second Faust worker in the group needs a rebalance and its tables "
        "recovered before a fair window: more than this run's budget; `bench.streams` measures one).",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="rounds of 1 then 2 (interleaved)")
    parser.add_argument("--rollouts", type=int, default=40, help="timed rollouts per sandbox run")
    parser.add_argument("--concurrency", type=int, default=4, help="--concurrency of each sandbox worker")
    parser.add_argument("--steps", type=int, default=6, help="batches (learner steps) per learner run")
    parser.add_argument("--trees", type=int, default=32, help="scored trees per batch")
    parser.add_argument("--only", choices=("rollouts", "learner"), default=None)
    parser.add_argument("--bootstrap", default=None, help="a running broker (default: start one, stop it after)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    from warmstart import sft

    model, why = sft.shipped_warm_start()
    if model is None or len(os.sched_getaffinity(0)) < 2:
        sys.exit(why if model is None else "needs 2 cores to pin two processes apart")
    started = time.monotonic()
    runs: list[Run] = []
    tmp = Path(tempfile.mkdtemp(prefix="bench-scale-"))
    adopted = Adopted()
    with broker(args.bootstrap) as bootstrap:
        for rnd in range(1, args.rounds + 1):
            for kind, n in [(k, n) for k in ("rollouts", "learner") if args.only in (None, k) for n in (1, 2)]:
                work = tmp / f"{kind}-{n}-{rnd}"
                if kind == "rollouts":
                    runs.append(rollouts_run(bootstrap, model, n, rnd, args, work, adopted))
                else:
                    runs.append(learner_run(bootstrap, model, n, rnd, args, work))
                r = runs[-1]
                print(
                    f"round {rnd} {kind} ×{n}: {r.rate:.2f}/s, CPU {_j(r.cpu, '.1f')} s, load {r.load:.1f}", flush=True
                )
    shutil.rmtree(tmp, ignore_errors=True)  # kept when a run failed: its logs are there
    text = report(runs, args, started)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
