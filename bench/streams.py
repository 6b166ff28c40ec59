"""Stream processors benchmark: call events/s through one worker, and settle → trajectory latency.

One real worker (``python -m streams.app worker``, exactly-once and RocksDB by default) on a local Apache Kafka
broker, fed synthetic rollouts (tests/support/stream_load.py: append-only call chains, one SIDE call in five,
groups of 8 over two harnesses, no faults). Two phases:

1. Throughput. A burst of rollouts is published as fast as the producer can; the clock runs from the first record
   sent until the worker's consumer group has committed every call event (its committed offsets on
   ``clawstream.calls`` reach the end offsets). Committed offsets move only with the worker's transactions, so this is
   "processed and committed". Reported: call events/s and all records/s (calls + lifecycle + rewards + requests).
2. Latency. Rollouts are published at a steady rate, ``--window`` in flight (like that many sandboxes); for each
   rollout, the time from flushing its last record (the one that makes it complete) to its trajectory being readable
   with ``isolation.level=read_committed``. That includes the quiet period (``settle_interval_s``) by design, plus up
   to one tick and one commit interval; p50/p99 are reported raw and minus the quiet period.

Run: ``.venv/bin/python -m bench.streams [--bootstrap host:port] [--burst 600] [--latency-s 30]``. Without
``--bootstrap`` a private broker is started (and stopped) in a temporary directory. Writes
``bench/results/streams.md`` and prints it. The default run takes about two minutes on 2 busy cores.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path

from confluent_kafka import Consumer, TopicPartition

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from clawstream.kafka.clients import consumer_config, create_topics, make_producer  # noqa: E402
from clawstream.kafka.local import LocalKafka  # noqa: E402
from clawstream.settings import KafkaSettings  # noqa: E402
from schemas.events import CallEvent, Trajectory  # noqa: E402
from schemas.topics import CALLS, TRAJECTORIES  # noqa: E402
from tests.support.stream_harness import Collector, Feeder, Worker, produce  # noqa: E402
from tests.support.stream_load import SynthRollout, interleave, make_groups  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "streams.md"


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
    groups = make_groups(n_groups, ("claude-code", "openclaw"), group_size=8, seed=seed, faults=False, calls=calls,
                         token_scale=token_scale)  # fmt: skip
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


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bootstrap", default=os.environ.get("CLAWSTREAM_KAFKA_BOOTSTRAP_SERVERS"))
    ap.add_argument("--burst", type=int, default=600, help="rollouts in the throughput burst (multiple of 8)")
    ap.add_argument("--calls", type=int, nargs=2, default=(4, 9), help="main calls per rollout: [low, high)")
    ap.add_argument("--token-scale", type=int, default=20, help="token length multiplier (1 = tiny test calls)")
    ap.add_argument("--latency-s", type=float, default=30.0, help="length of the paced latency phase")
    ap.add_argument("--rate", type=float, default=60.0, help="records/s in the latency phase")
    ap.add_argument("--window", type=int, default=16, help="rollouts in flight in the latency phase")
    ap.add_argument("--store", default="rocksdb://")
    ap.add_argument("--guarantee", default="exactly_once", choices=("exactly_once", "at_least_once"))
    ap.add_argument("--settle-interval", type=float, default=2.0)
    ap.add_argument("--tick", type=float, default=0.5)
    ap.add_argument("--commit", type=float, default=1.0)
    args = ap.parse_args()
    settings = {"store": args.store, "processing_guarantee": args.guarantee, "settle_interval_s": args.settle_interval,
                "tick_interval_s": args.tick, "commit_interval_s": args.commit, "settle_timeout_s": 60.0,
                "session_timeout_s": 6.0, "batch_groups": 4}  # fmt: skip
    started, load_before = time.monotonic(), os.getloadavg()[0]
    with broker(args.bootstrap) as bootstrap, tempfile.TemporaryDirectory(prefix="bench-worker-") as work:
        kafka = KafkaSettings(bootstrap_servers=bootstrap, topic_prefix=f"bench-{uuid.uuid4().hex[:8]}.")
        create_topics(kafka)
        app_id = "bench-streams"
        worker = Worker(kafka, Path(work), app_id=app_id, **settings)
        worker.start()
        collector = Collector(kafka, f"bench-{uuid.uuid4().hex[:8]}")
        try:
            probe = rollouts(1, seed=1, calls=(2, 3), token_scale=1)[:1]  # the worker is ready once this comes out
            produce(kafka, probe[0].records)
            wait_trajectories(collector, worker, {probe[0].rollout_id}, 180)
            ready_s = time.monotonic() - started

            # 1. Throughput: a burst, clocked until every call event is committed by the worker.
            burst = rollouts(max(1, args.burst // 8), seed=2, calls=tuple(args.calls), token_scale=args.token_scale)
            records = interleave(burst, seed=2, window=64)
            encoded = [(kafka.topic(t), str(ev.rollout_id).encode(), ev.to_bytes()) for t, ev in records]
            n_calls = sum(isinstance(ev, CallEvent) for _, ev in records)
            call_bytes = sum(len(v) for (t, _, v) in encoded if t == kafka.topic(CALLS))
            _, base_end = committed_calls(kafka, kafka.topic_prefix + app_id)
            producer = make_producer(kafka)
            t0 = time.monotonic()
            for topic, key, value in encoded:
                producer.produce(topic, key=key, value=value)
                producer.poll(0)
            producer.flush(60)
            produced_s = time.monotonic() - t0
            while True:
                committed, end = committed_calls(kafka, kafka.topic_prefix + app_id)
                if end >= base_end + n_calls and committed >= end:
                    break
                if not worker.alive() or time.monotonic() - t0 > 300:
                    raise SystemExit(f"worker stalled at {committed}/{end} call events\n{worker.log_tail()}")
                collector.poll(0.25)
            consumed_s = time.monotonic() - t0
            arrived = wait_trajectories(collector, worker, {r.rollout_id for r in burst}, 300)
            all_out_s = max(arrived.values()) - t0

            # 2. Latency: paced rollouts, last record flushed → trajectory readable (read_committed).
            n_lat = max(8, int(args.latency_s * args.rate / 12) // 8 * 8)
            paced = rollouts(n_lat // 8, seed=3, calls=tuple(args.calls), token_scale=args.token_scale)
            feed = Feeder(kafka, interleave(paced, seed=3, window=args.window), rate=args.rate, chunk=5)
            feed.start()
            arrived_lat = wait_trajectories(collector, worker, {r.rollout_id for r in paced}, args.latency_s * 4 + 120)
            feed.join()
            lat = [arrived_lat[r.rollout_id] - feed.sent_at[r.rollout_id] for r in paced]
            del producer  # before the broker goes away, or librdkafka keeps trying to reconnect
        finally:
            collector.close()
            worker.stop()
    total_s, load_after = time.monotonic() - started, os.getloadavg()[0]
    net = [x - args.settle_interval for x in lat]
    mean_calls = n_calls / len(burst)
    lines = [
        "# Stream processors benchmark (`bench/streams.py`)",
        "",
        f"One worker, `{args.guarantee}`, store `{args.store}`, settle interval {args.settle_interval} s, tick "
        f"{args.tick} s, commit interval {args.commit} s; assembler → grouper → batcher all running. "
        f"{os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), Python {platform.python_version()}, "
        f"faust-streaming {version('faust-streaming')}, aiokafka {version('aiokafka')}, local Apache Kafka 4.1 "
        f"(KRaft, single node). The machine is shared with other work (1-min load average {load_before:.1f} before, "
        f"{load_after:.1f} after the run, on {os.cpu_count()} CPUs): compare runs side by side only.",
        "",
        "## Throughput (burst)",
        "",
        f"- {len(burst)} rollouts, {n_calls} call events ({mean_calls:.1f} per rollout, "
        f"{call_bytes / n_calls / 1024:.1f} KiB each on the wire), {len(records)} records in all, published in "
        f"{produced_s:.1f} s.",
        f"- All call events processed and committed after {consumed_s:.1f} s: **{n_calls / consumed_s:.0f} call "
        f"events/s** ({len(records) / consumed_s:.0f} records/s of all four input topics).",
        f"- Last trajectory readable after {all_out_s:.1f} s (includes the {args.settle_interval} s quiet period).",
        "",
        "## Settle → trajectory latency (paced)",
        "",
        f"- {len(paced)} rollouts at {args.rate:.0f} records/s, {args.window} in flight; from flushing a rollout's "
        "last record to its trajectory being readable with read_committed.",
        f"- **p50 {statistics.median(lat):.2f} s, p99 {pct(lat, 99):.2f} s** (max {max(lat):.2f} s).",
        f"- Minus the {args.settle_interval} s quiet period (the part the design does not ask for): p50 "
        f"{statistics.median(net):.2f} s, p99 {pct(net, 99):.2f} s — tick ({args.tick} s), commit ({args.commit} s) "
        "and Kafka.",
        "",
        f"Worker ready (first trajectory of a probe rollout) {ready_s:.0f} s after start; whole run {total_s:.0f} s.",
        "",
    ]
    text = "\n".join(lines)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
