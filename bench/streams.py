"""Stream processors benchmark: call events/s through one worker, and settle → trajectory latency, before vs after.

One real worker (``python -m streams.app worker``) on a local broker, fed synthetic rollouts. Phase 1 (throughput):
a burst, timed until the worker's group has committed every call event. Phase 2 (latency): rollouts at a steady
rate, the time from a rollout's last record to its committed trajectory. ``--before DIR`` runs an old checkout
alternately with the current code on the same broker. What each figure means: docs/benchmarks.md#streams.

Run: ``.venv/bin/python -m bench.streams [--before DIR] [--rounds 2] [--bootstrap host:port] [--burst 600]
[--latency-s 30]``. Writes ``bench/results/streams.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from clawbase.kafka.clients import consumer_config, create_topics, make_producer  # noqa: E402
from clawbase.settings import KafkaSettings  # noqa: E402
from clawstream.local_kafka import LocalKafka  # noqa: E402
from schemas.events import CallEvent, Trajectory  # noqa: E402
from schemas.topics import CALLS, CATALOG, TRAJECTORIES  # noqa: E402
from streams.settings import StreamsSettings  # noqa: E402
from tests.support.stream_harness import Collector, Feeder, Worker, produce  # noqa: E402
from tests.support.stream_load import SynthRollout, interleave, make_groups  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "streams.md"
OLD_TIMING = {"tick_interval_s": 0.5, "commit_interval_s": 1.0}  # the defaults before issue 16 part 6
NEW_TIMING = {name: StreamsSettings.model_fields[name].default for name in OLD_TIMING}


@dataclass
class Variant:
    label: str
    root: Path  # the code the worker runs
    timing: dict[str, float]  # tick_interval_s, commit_interval_s


@dataclass
class RunResult:
    rate: float  # call events/s, processed and committed
    records_rate: float
    cpu_us: float  # worker CPU per record (all four input topics) during the burst
    last_out_s: float
    call_share: float = 0.0  # call events / all input records in the burst
    changelog_per_record: float = 0.0  # table changelog records per input record (burst and probe)
    lat: list[float] = field(default_factory=list)  # settle → trajectory, seconds
    load: float = 0.0  # 1-min load average at the end of the run


class CodeWorker(Worker):
    """The harness's worker, running the code under ``root`` (a checkout of another commit) instead of this one."""

    def __init__(self, root: Path, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.root = root
        self.env["PYTHONPATH"] = str(root)

    def start(self, loglevel: str | None = None) -> None:
        self.starts += 1
        with open(self.log_path, "wb") as log:
            cmd = [sys.executable, "-m", "streams.app", "worker", "--loglevel", loglevel or "warn"]
            self.proc = subprocess.Popen(
                cmd, cwd=self.root, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )


@contextlib.contextmanager
def broker(bootstrap: str | None) -> Iterator[str]:
    if bootstrap:
        yield bootstrap
        return
    with tempfile.TemporaryDirectory(prefix="bench-streams-") as home:
        local = LocalKafka(home=Path(home) / "kafka")
        state = local.up(timeout=120, quiet=True)
        try:
            yield state.bootstrap
        finally:
            local.down()


def rollouts(n_groups: int, seed: int, calls: tuple[int, int], token_scale: int) -> list[SynthRollout]:
    groups = make_groups(
        n_groups,
        ("claude-code", "openclaw"),
        group_size=8,
        seed=seed,
        faults=False,
        calls=calls,
        token_scale=token_scale,
    )
    return [r for members in groups for r in members]


def committed_calls(kafka: KafkaSettings, group: str) -> tuple[int, int]:
    """(committed offsets summed over the calls partitions, end offsets summed) for the worker's group."""
    consumer = Consumer(consumer_config(kafka, group))
    try:
        topic = kafka.topic(CALLS)
        parts = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        tps = [TopicPartition(topic, p) for p in parts]
        committed = sum(max(tp.offset, 0) for tp in consumer.committed(tps, timeout=10))
        end = sum(consumer.get_watermark_offsets(tp, timeout=10)[1] for tp in tps)
        return committed, end
    finally:
        consumer.close()


def changelog_records(kafka: KafkaSettings, app_id: str) -> int:
    """Committed records in the worker's table changelogs (read_committed, from the beginning: markers not counted)."""
    consumer = Consumer(consumer_config(kafka, f"bench-count-{uuid.uuid4().hex[:8]}"))
    try:
        prefix = kafka.topic_prefix + app_id
        topics = consumer.list_topics(timeout=10).topics
        tps = [
            TopicPartition(t, p, OFFSET_BEGINNING)
            for t, meta in topics.items()
            if t.startswith(prefix) and t.endswith("-changelog")
            for p in meta.partitions
        ]
        ends = {(tp.topic, tp.partition): consumer.get_watermark_offsets(tp, timeout=10)[1] for tp in tps}
        consumer.assign(tps)
        n, deadline = 0, time.monotonic() + 120
        while time.monotonic() < deadline:
            msg = consumer.poll(0.2)
            if msg is not None and not msg.error():
                n += 1
            if all(tp.offset >= ends[(tp.topic, tp.partition)] for tp in consumer.position(tps)):
                return n
        raise SystemExit("could not read the changelogs to their end")
    finally:
        consumer.close()


def wait_trajectories(collector: Collector, worker: Worker, want: set[str], timeout: float) -> dict[str, float]:
    """rollout id → arrival time of its trajectory, for every id in ``want``."""
    arrived: dict[str, float] = {}
    seen = 0
    deadline = time.monotonic() + timeout
    while not want <= set(arrived):
        if not worker.alive() or time.monotonic() > deadline:
            raise SystemExit(f"worker stalled: {len(want - set(arrived))} trajectories missing\n{worker.log_tail()}")
        collector.poll(0.2)
        for out in collector.got[TRAJECTORIES][seen:]:
            arrived.setdefault(Trajectory.from_bytes(out.value).rollout_id, out.at)
        seen = len(collector.got[TRAJECTORIES])
    return arrived


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


# Where a worker's time goes, from py-spy's raw stacks: each sample goes to the first category (in this order) that one
# of its frames names. "µs/record" scales the shares by the run's worker CPU per record (py-spy also counts a thread
# that is runnable but waiting for a core, so on a loaded machine the shares are of the worker's busy time).
PROFILE_CATEGORIES: list[tuple[str, tuple[str, ...]]] = [
    ("table changelog publishing (buffer → Faust → aiokafka append)", ("ChangelogBuffer.flush",)),
    (
        "transaction protocol (AddPartitionsToTxn, AddOffsetsToTxn, TxnOffsetCommit, EndTxn)",
        ("_do_add_partitions_to_txn", "_do_txn_commit", "_do_txn_offset_commit", "_do_add_offsets_to_txn"),
    ),
    ("commit (gate, offsets)", ("force_commit", "commit_transactions", "TransactionManager.commit")),
    ("Avro decode of input records", ("decode_or_dead_letter",)),
    (
        "table writes (Faust table + RocksDB put/delete)",
        ("Table.__setitem__", "Table.__delitem__", "Store._set", "Store._del", "on_key_set", "on_key_del"),
    ),
    ("table reads", ("Table.get", "Store._get", "Store._contains", "Mapping.get")),
    (
        "settling: trajectory build (tree, call decode, encode), group close, batch form",
        ("_settle", "build_trajectory", "Grouper._close", "Batcher._form"),
    ),
    ("output sends (Avro encode, Faust/aiokafka append)", ("send_all", "send_dead_letter", "Topic.send")),
    (
        "domain core (state JSON, rules, due index)",
        ("on_record", "on_tick", "on_trajectory", "on_envelope", "on_weights"),
    ),
    (
        "aiokafka produce requests (batch build, zstd, socket write)",
        ("_send_produce_req", "SendProduceReqHandler", "Sender."),
    ),
    (
        "consumer: fetch, decompress, hand over (Faust's consumer thread + loop)",
        ("Fetcher", "AIOKafkaConsumerThread", "MethodQueue", "getmany", "_drain_messages", "zstd_decode"),
    ),
    (
        "Faust stream / agent machinery (events, acks, queues, gate)",
        ("Stream.", "Agent.", "Conductor", "on_message", "processing (streams/eos", "CommitGate"),
    ),
    (
        "aiokafka connection I/O (responses, metadata)",
        ("AIOKafkaConnection", "AIOKafkaClient", "_read_ready", "_SelectorSocketTransport"),
    ),
    ("event loop waiting in select (counted as busy by py-spy)", ("EpollSelector.select",)),
]
OTHER = "other (event loop, timers, GC, logging, truncated stacks)"


def breakdown(raw: Path) -> tuple[dict[str, float], int]:
    """category → share of the samples in py-spy's raw (collapsed) stacks, and the sample count."""
    counts = dict.fromkeys([name for name, _ in PROFILE_CATEGORIES] + [OTHER], 0)
    for line in raw.read_text().splitlines():
        if not line.strip():
            continue
        stack, n = line.rsplit(" ", 1)
        name = next((name for name, subs in PROFILE_CATEGORIES if any(s in stack for s in subs)), OTHER)
        counts[name] += int(n)
    total = sum(counts.values()) or 1
    return {k: v / total for k, v in counts.items()}, total


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def run_once(bootstrap: str, variant: Variant, args: argparse.Namespace, spy: str | None) -> RunResult:
    """One fresh worker (fresh topics) of ``variant``: probe, burst, paced latency phase."""
    settings = {
        "store": args.store,
        "processing_guarantee": args.guarantee,
        "settle_interval_s": args.settle_interval,
        "settle_timeout_s": 60.0,
        "session_timeout_s": 6.0,
        "batch_groups": 4,
        **variant.timing,
    }
    kafka = KafkaSettings(bootstrap_servers=bootstrap, topic_prefix=f"bench-{uuid.uuid4().hex[:8]}.")
    create_topics(kafka, CATALOG)
    app_id = "bench-streams"
    with tempfile.TemporaryDirectory(prefix="bench-worker-") as work:
        worker = CodeWorker(variant.root, kafka, Path(work), app_id=app_id, **settings)
        worker.start()
        collector = Collector(kafka, f"bench-{uuid.uuid4().hex[:8]}")
        try:
            probe = rollouts(1, seed=1, calls=(2, 3), token_scale=1)[:1]  # the worker is ready once this comes out
            produce(kafka, probe[0].records)
            wait_trajectories(collector, worker, {probe[0].rollout_id}, 180)

            # 1. Throughput: a burst, clocked until every call event is committed by the worker.
            burst = rollouts(max(1, args.burst // 8), seed=2, calls=tuple(args.calls), token_scale=args.token_scale)
            records = interleave(burst, seed=2, window=64)
            encoded = [(kafka.topic(t), str(ev.rollout_id).encode(), ev.to_bytes()) for t, ev in records]
            n_calls = sum(isinstance(ev, CallEvent) for _, ev in records)
            _, base_end = committed_calls(kafka, kafka.topic_prefix + app_id)
            assert worker.proc is not None
            recorder = None
            if spy:
                recorder = subprocess.Popen(
                    [
                        str(Path(sys.executable).parent / "py-spy"),
                        "record",
                        "--nonblocking",
                        "-r",
                        "100",
                        "--format",
                        "raw",
                        "-o",
                        spy,
                        "--pid",
                        str(worker.proc.pid),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            producer = make_producer(kafka)
            t0, cpu0 = time.monotonic(), cpu_seconds(worker.proc.pid)
            for topic, key, value in encoded:
                producer.produce(topic, key=key, value=value)
                producer.poll(0)
            producer.flush(60)
            while True:
                committed, end = committed_calls(kafka, kafka.topic_prefix + app_id)
                if end >= base_end + n_calls and committed >= end:
                    break
                if not worker.alive() or time.monotonic() - t0 > 300:
                    raise SystemExit(f"worker stalled at {committed}/{end} call events\n{worker.log_tail()}")
                collector.poll(0.25)
            consumed_s, cpu_s = time.monotonic() - t0, cpu_seconds(worker.proc.pid) - cpu0
            if recorder is not None:
                recorder.send_signal(2)  # SIGINT: py-spy writes its file and exits
                recorder.wait(30)
            arrived = wait_trajectories(collector, worker, {r.rollout_id for r in burst}, 300)
            result = RunResult(
                n_calls / consumed_s, len(records) / consumed_s, cpu_s / len(records) * 1e6, max(arrived.values()) - t0
            )
            result.call_share = n_calls / len(records)
            result.changelog_per_record = changelog_records(kafka, app_id) / (len(records) + len(probe[0].records))

            # 2. Latency: paced rollouts, last record flushed → trajectory readable (read_committed).
            n_lat = max(8, int(args.latency_s * args.rate / 12) // 8 * 8)
            paced = rollouts(n_lat // 8, seed=3, calls=tuple(args.calls), token_scale=args.token_scale)
            feed = Feeder(kafka, interleave(paced, seed=3, window=args.window), rate=args.rate, chunk=5)
            feed.start()
            arrived_lat = wait_trajectories(collector, worker, {r.rollout_id for r in paced}, args.latency_s * 4 + 120)
            feed.join()
            result.lat = [arrived_lat[r.rollout_id] - feed.sent_at[r.rollout_id] for r in paced]
            result.load = os.getloadavg()[0]
            del producer  # before the broker goes away, or librdkafka keeps trying to reconnect
            print(
                f"{variant.label}: {result.rate:.0f} call events/s, {result.cpu_us:.0f} us CPU/record, "
                f"{result.changelog_per_record:.2f} changelog records/record, latency p50 "
                f"{statistics.median(result.lat):.2f} s p99 {pct(result.lat, 99):.2f} s (load {result.load:.1f})",
                flush=True,
            )
            return result
        finally:
            collector.close()
            worker.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bootstrap", default=os.environ.get("CLAWSTREAM_KAFKA_BOOTSTRAP_SERVERS"))
    ap.add_argument("--before", type=Path, default=None, help="a checkout of the old code, run alternately with this")
    ap.add_argument("--rounds", type=int, default=1, help="runs of each variant (alternating)")
    ap.add_argument("--burst", type=int, default=600, help="rollouts in the throughput burst (multiple of 8)")
    ap.add_argument("--calls", type=int, nargs=2, default=(4, 9), help="main calls per rollout: [low, high)")
    ap.add_argument("--token-scale", type=int, default=20, help="token length multiplier (1 = tiny test calls)")
    ap.add_argument("--latency-s", type=float, default=30.0, help="length of the paced latency phase")
    ap.add_argument("--rate", type=float, default=60.0, help="records/s in the latency phase")
    ap.add_argument("--window", type=int, default=16, help="rollouts in flight in the latency phase")
    ap.add_argument("--store", default="rocksdb://")
    ap.add_argument("--guarantee", default="exactly_once", choices=("exactly_once", "at_least_once"))
    ap.add_argument("--settle-interval", type=float, default=2.0)
    ap.add_argument("--tick", type=float, default=None, help="override the tick interval of every variant")
    ap.add_argument("--commit", type=float, default=None, help="override the commit interval of every variant")
    ap.add_argument(
        "--also",
        action="append",
        default=[],
        metavar="TICK:COMMIT",
        help="also run the current code with this tick / commit interval (a settings trade-off)",
    )
    ap.add_argument("--py-spy", default=None, help="profile one more burst per variant to PREFIX-<variant>.raw")
    args = ap.parse_args()
    override = {k: v for k, v in (("tick_interval_s", args.tick), ("commit_interval_s", args.commit)) if v is not None}
    variants = [Variant("after", ROOT, NEW_TIMING | override)]
    for spec in args.also:
        tick, commit = (float(x) for x in spec.split(":"))
        variants.append(
            Variant(
                f"after, tick {tick:g} / commit {commit:g}",
                ROOT,
                {"tick_interval_s": tick, "commit_interval_s": commit},
            )
        )
    if args.before is not None:
        variants.insert(0, Variant("before", args.before.resolve(), OLD_TIMING | override))
    results: dict[str, list[RunResult]] = {v.label: [] for v in variants}
    profiles: dict[str, tuple[dict[str, float], int, float]] = {}
    started, load_before = time.monotonic(), os.getloadavg()[0]
    with broker(args.bootstrap) as bootstrap:
        for _ in range(args.rounds):
            for v in variants:
                results[v.label].append(run_once(bootstrap, v, args, None))
        for v in variants if args.py_spy else ():  # profiled runs come after, so py-spy never slows a measured one
            raw = Path(f"{args.py_spy}-{''.join(c if c.isalnum() else '-' for c in v.label)}.raw")
            profiled = run_once(bootstrap, v, args, str(raw))
            profiles[v.label] = (*breakdown(raw), profiled.cpu_us)
    text = (
        report(args, variants, results, load_before, time.monotonic() - started)
        + profile_report(profiles)
        + goal_report(results["after"], profiles.get("after"))
    )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(text)
    print(text)


def profile_report(profiles: dict[str, tuple[dict[str, float], int, float]]) -> str:
    if not profiles:
        return ""
    labels = list(profiles)
    lines = [
        "",
        "## Where a worker's time goes (py-spy, burst phase)",
        "",
        "One more run of each variant with py-spy recording the worker (100 Hz, non-blocking) from the first burst "
        "record until every call event is committed. Share of the samples per category (first match in the order "
        "below); µs/record = share × that run's worker CPU per input record. py-spy counts a runnable thread waiting "
        "for a core as busy, so on a loaded machine these are shares of the worker's busy time.",
        "",
        "| category | " + " | ".join(labels) + " |",
        "|---|" + "---|" * len(labels),
    ]
    for name in [n for n, _ in PROFILE_CATEGORIES] + [OTHER]:
        cells = [f"{profiles[k][0][name] * 100:.1f} % ({profiles[k][0][name] * profiles[k][2]:.0f} µs)" for k in labels]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append(
        "| **worker CPU per record (samples)** | "
        + " | ".join(f"**{profiles[k][2]:.0f} µs** ({profiles[k][1]})" for k in labels)
        + " |"
    )
    return "\n".join(lines) + "\n"


GOAL = 5000  # call events/s per worker, exactly-once (issue 16 part 6)
DOMAIN = (
    "Avro decode of input records",
    "table writes (Faust table + RocksDB put/delete)",
    "table reads",
    "settling: trajectory build (tree, call decode, encode), group close, batch form",
    "domain core (state JSON, rules, due index)",
)


def goal_report(after: list[RunResult], profile: tuple[dict[str, float], int, float] | None) -> str:
    """What the goal asks of one worker's CPU per record, against what the current code spends."""
    share = statistics.median(r.call_share for r in after)
    cpu = statistics.median(r.cpu_us for r in after)
    budget = 1e6 / (GOAL / share)
    lines = [
        "",
        f"## The {GOAL:,} call events/s goal",
        "",
        f"Call events are {share:.0%} of the input records, so {GOAL:,} call events/s is {GOAL / share:,.0f} "
        f"records/s: **{budget:.0f} µs per record** for everything a worker does (one Python process: the "
        f"asyncio loop and Faust's consumer thread share one interpreter lock, so about one core). The current "
        f"code spends **{cpu:.0f} µs** of worker CPU per record (median of the rounds above), a ceiling of "
        f"{1e6 / cpu * share:,.0f} call events/s with a core to itself.",
    ]
    if profile is not None:
        shares = profile[0]
        ours = sum(shares[k] for k in DOMAIN)
        faust_us = (1 - ours) * cpu  # the profiled run's shares, at the measured rounds' CPU per record
        verdict = (
            f"That part alone is {faust_us / budget:.1f}× the budget: the goal is out of reach for one Faust "
            "worker; it needs a client whose per-record path is not Python (Kafka Streams, or librdkafka with "
            "batch-level processing) or more workers (8 partitions: up to 8)."
            if faust_us > budget
            else "That part fits the budget."
        )
        lines += [
            "",
            f"By the profile, {ours:.0%} of it ({ours * cpu:.0f} µs) is this project's own "
            f"per-record work (decode, state, table writes and reads, settling) and {1 - ours:.0%} "
            f"({faust_us:.0f} µs) is Faust and aiokafka moving the record: consuming it, the stream machinery, "
            f"producing changelog records and outputs, the transactions. {verdict}",
        ]
    return "\n".join(lines) + "\n"


def report(
    args: argparse.Namespace,
    variants: list[Variant],
    results: dict[str, list[RunResult]],
    load_before: float,
    total_s: float,
) -> str:
    q = args.settle_interval
    cpus = os.cpu_count()
    lines = [
        "# Stream processors benchmark (`bench/streams.py`)",
        "",
        f"One worker, `{args.guarantee}`, store `{args.store}`, settle interval (quiet period) {q} s; assembler → "
        f"grouper → batcher all running. {cpus} CPUs ({platform.processor() or platform.machine()}), Python "
        f"{platform.python_version()}, faust-streaming {version('faust-streaming')}, aiokafka {version('aiokafka')}, "
        f"local Apache Kafka 4.1 (KRaft, single node) on the same machine. The machine is shared with other work "
        f"(1-min load average {load_before:.1f} at the start; per run below, on {cpus} CPUs): compare runs side by "
        f"side only. Variants ran alternately, {args.rounds} round(s), each run with a fresh worker and fresh topics.",
        "",
        f"Burst: {args.burst} rollouts ({args.calls[0]}–{args.calls[1] - 1} main calls each, a SIDE call in one of "
        f"five, token scale {args.token_scale}), published as fast as one producer can; rate = call events processed "
        "and committed per second of wall clock; CPU = the worker's user + system time per input record (all four "
        f"topics) in that window. Latency: {int(args.latency_s * args.rate / 12) // 8 * 8} rollouts at "
        f"{args.rate:.0f} records/s, {args.window} in flight; flushing a rollout's last record → its trajectory "
        'readable with read_committed; "beyond quiet" subtracts the quiet period.',
        "",
        "| variant | code | tick / commit | call events/s | records/s | worker CPU per record | changelog records "
        "per record | last trajectory after | latency p50 | p99 | p99 beyond quiet | load (1 min) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for v in variants:
        for r in results[v.label]:
            lines.append(
                f"| {v.label} | `{v.root}` | {v.timing['tick_interval_s']} s / {v.timing['commit_interval_s']} s | "
                f"{r.rate:.0f} | {r.records_rate:.0f} | {r.cpu_us:.0f} µs | {r.changelog_per_record:.2f} | "
                f"{r.last_out_s:.1f} s | "
                f"{statistics.median(r.lat):.2f} s | {pct(r.lat, 99):.2f} s | {pct(r.lat, 99) - q:.2f} s | "
                f"{r.load:.1f} |"
            )
    if args.before is not None:
        b, a = results["before"], results["after"]
        rate = statistics.median(r.rate for r in a) / statistics.median(r.rate for r in b)
        cpu = statistics.median(r.cpu_us for r in b) / statistics.median(r.cpu_us for r in a)
        lines += [
            "",
            f"Median of the rounds, after vs before: **{rate:.1f}× call events/s**, {cpu:.1f}× less worker "
            f"CPU per record; p99 beyond the quiet period {statistics.median(pct(r.lat, 99) for r in b) - q:.2f}"
            f" s → **{statistics.median(pct(r.lat, 99) for r in a) - q:.2f} s**.",
        ]
    lines += ["", f"Whole run {total_s:.0f} s.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
