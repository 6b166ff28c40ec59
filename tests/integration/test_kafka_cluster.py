"""A 3-node KRaft cluster on one host (``clawstream kafka up --brokers 3``, ``status``, ``down``: the real commands)
loses a broker to SIGKILL while data flows and gets it back on its data dir (``LocalKafka.up``, the same code, restarts
the dead node): nothing acknowledged is lost, nothing is doubled, writes go on.

Two real components write while the broker dies: an idempotent ``acks=all`` producer (clawbase's producer config)
numbering records over every partition of a catalog topic, read back live by a read_committed consumer, and a
streams worker (exactly-once Faust) turning synthetic rollouts into trajectories. The victim is the active controller
(the nodes' Raft state), which also leads partitions being written (describe_topics). The kill is placed by state
(records acknowledged, trajectories read back), never by a sleep. Printed: cluster start, the controller election,
the longest stall of a partition (reads, acknowledgements), the time until every partition takes writes again, the
restart, and the time until the restarted broker is back in every in-sync replica set. The cluster lives in a tmp
home; every node is stopped by its pid at the end (``clawstream kafka down``, then SIGKILL of any pid the test saw
that is still alive).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from confluent_kafka import Consumer, KafkaException, Producer, TopicCollection
from confluent_kafka.admin import AdminClient, ConfigResource

from clawbase.kafka.clients import (
    assign_from_beginning,
    create_topics,
    make_admin,
    make_consumer,
    producer_config,
    read_to_end,
)
from clawbase.kafka.local_state import pid_alive
from clawbase.settings import KafkaSettings
from clawstream.local_kafka import LocalKafka
from schemas.events import BatchRecord, BatchRecordKind, Metric, Trajectory
from schemas.topics import BATCHES, BY_NAME, CALLS, CATALOG, METRICS, ROLLOUT_PARTITIONS, TRAJECTORIES
from tests.support.fault_report import FaultRow, record, stall_after
from tests.support.stream_harness import Collector, Feeder, Worker
from tests.support.stream_load import interleave, make_groups

pytestmark = pytest.mark.integration

RATE = 100.0  # numbered records per second, spread evenly over the topic's partitions
KILL_AFTER_ACKS = 600  # the kill waits for this many acknowledged numbered records ...
KILL_AFTER_TRAJECTORIES = 8  # ... and this many trajectories committed by the streams worker
MORE_AFTER_RESTART = 300  # acknowledged records after the restarted broker is back in sync, before the end
HARNESSES = ("claude-code", "openclaw")
STREAMS = {
    "store": "memory://",
    "settle_interval_s": 1.0,
    # Longer than the outage: a rollout's calls may sit on the dead broker's partitions while its reward arrives.
    "settle_timeout_s": 90.0,
    "group_timeout_s": 90.0,
    "tick_interval_s": 0.5,
    "commit_interval_s": 0.2,
    # The default: no worker is killed here, and on a loaded 2-core host a 15 s session lapsed before the kill
    # (the worker, evicted while alive, exits 75 by design: test_streams_rebalance.py's zombie).
    "session_timeout_s": 30.0,
    "group_size": 8,
    "batch_groups": 2,
    "harness_mix": {"claude-code": 0.5, "openclaw": 0.5},
    "max_policy_lag": 1,
    "mix_seed": 11,
}


class Numbered(threading.Thread):
    """Produces records ``0, 1, 2, ...`` (value = the number, partition = number mod partitions) at ``rate``/s with
    clawbase's producer config (idempotent, acks=all) until stopped; records each acknowledgement's time."""

    def __init__(self, settings: KafkaSettings, topic: str, partitions: int, rate: float) -> None:
        super().__init__(daemon=True)
        self.producer = Producer(producer_config(settings))
        self.topic, self.partitions, self.rate = topic, partitions, rate
        self.acks: dict[int, list[float]] = {p: [] for p in range(partitions)}  # partition → ack times, in order
        self.errors: list[str] = []
        self.sent = 0
        self.unflushed = -1
        self.halt = threading.Event()

    def _delivered(self, err: object, msg: object) -> None:
        if err is not None:
            self.errors.append(str(err))
        else:
            self.acks[msg.partition()].append(time.monotonic())  # type: ignore[attr-defined]

    def run(self) -> None:
        start = time.monotonic()
        while not self.halt.is_set():
            n = self.sent
            self.producer.produce(
                self.topic, value=str(n).encode(), partition=n % self.partitions, on_delivery=self._delivered
            )
            self.sent += 1
            self.producer.poll(0)
            time.sleep(max(0.0, start + self.sent / self.rate - time.monotonic()))  # pacing only
        self.unflushed = self.producer.flush(120)

    def acked(self) -> int:
        return sum(len(times) for times in self.acks.values())

    def first_ack_after(self, partition: int, t: float) -> float | None:
        return next((a for a in self.acks[partition] if a > t), None)


class Reader(threading.Thread):
    """Reads the numbered topic live (read_committed); records when each record arrived, per partition."""

    def __init__(self, settings: KafkaSettings, topic: str) -> None:
        super().__init__(daemon=True)
        self.consumer = make_consumer(settings, f"reader-{uuid.uuid4().hex[:8]}")
        self.consumer.subscribe([topic])
        self.got: dict[int, list[float]] = {}
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            msg = self.consumer.poll(0.2)
            if msg is not None and msg.error() is None:
                self.got.setdefault(msg.partition(), []).append(time.monotonic())  # type: ignore[arg-type]
        self.consumer.close()

    def count(self) -> int:
        return sum(len(times) for times in self.got.values())


def partitions(admin: AdminClient, topic: str) -> tuple[dict[int, int], dict[int, set[int]]]:
    """Per partition of ``topic`` its leader and its in-sync replicas, as the cluster says (describe_topics)."""
    described = admin.describe_topics(TopicCollection([topic]), request_timeout=10)[topic].result()
    leaders = {p.id: p.leader.id for p in described.partitions if p.leader is not None}
    isr = {p.id: {n.id for n in p.isr} for p in described.partitions}
    return leaders, isr


def wait_until(
    done: Callable[[], bool], timeout: float, what: str, tick: Callable[[], object], ok: Callable[[], str]
) -> float:
    """Wait for ``done()`` (state, never a fixed sleep), calling ``tick()`` meanwhile; returns the seconds it took.
    ``ok()`` returns why waiting is pointless (a dead component), or ''."""
    start = time.monotonic()
    while not done():
        problem = ok()
        assert not problem, f"{problem} while waiting for {what}"
        assert time.monotonic() - start < timeout, f"no {what} within {timeout:.0f}s"
        tick()
    return time.monotonic() - start


def cli(*args: str, home: Path) -> subprocess.CompletedProcess[str]:
    """``clawstream kafka ARGS --home HOME``, the real command in a subprocess."""
    return subprocess.run(
        [sys.executable, "-m", "clawstream", "kafka", *args, "--home", str(home)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[LocalKafka, float, set[int]]]:
    """A fresh 3-node cluster in a tmp home, started, statused and stopped by ``clawstream kafka up --brokers 3``,
    ``status`` and ``down``; yields it, its start time and the pids the test saw (the test adds a restarted node's).
    At the end every pid seen that still lives is SIGKILLed."""
    home = tmp_path / "cluster"
    local = LocalKafka(home=home)
    seen: set[int] = set()
    try:
        started = time.monotonic()
        up = cli("up", "--brokers", "3", "--timeout", "180", home=home)
        start_s = time.monotonic() - started
        assert up.returncode == 0, up.stderr
        status = json.loads(cli("status", "--json", home=home).stdout)
        nodes = status["nodes"]
        seen.update(n["pid"] for n in nodes if n["pid"])
        assert status["running"] and status["brokers"] == 3 and status["bootstrap"] == up.stdout.strip()
        assert [n["node_id"] for n in nodes] == [1, 2, 3] and all(n["running"] for n in nodes)
        assert len({n["bootstrap"] for n in nodes}) == len({n["data_dir"] for n in nodes}) == 3
        yield local, start_s, seen
    finally:
        seen.update(n["pid"] for n in local.status().get("nodes", []) if n["pid"])  # type: ignore[union-attr]
        down = cli("down", home=home)
        for pid in seen:
            if pid_alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
        assert not [pid for pid in seen if pid_alive(pid)], f"broker processes left behind; down said {down}"
        assert down.stdout.strip() == "stopped", down
        assert cli("status", home=home).returncode == 3  # not running


def read_back(settings: KafkaSettings, topic: str) -> Counter[int]:
    """Every record of the numbered topic from the beginning (read_committed), counted by number."""
    consumer: Consumer = make_consumer(settings, f"check-{uuid.uuid4().hex[:8]}")
    try:
        ends = assign_from_beginning(consumer, topic)
        return Counter(int(msg.value()) for msg in read_to_end(consumer, topic, ends, timeout=60))
    finally:
        consumer.close()


def test_controller_and_leader_killed_mid_stream(cluster: tuple[LocalKafka, float, set[int]], tmp_path: Path) -> None:
    local, start_s, seen = cluster
    began = time.monotonic()
    bootstrap = local.running_bootstrap()
    assert bootstrap is not None and len(bootstrap.split(",")) == 3
    numbered = KafkaSettings(bootstrap_servers=bootstrap, topic_prefix=f"kc-{uuid.uuid4().hex[:8]}.")
    flow = KafkaSettings(bootstrap_servers=bootstrap, topic_prefix=f"ks-{uuid.uuid4().hex[:8]}.")
    create_topics(numbered, [BY_NAME[CALLS]])  # one topic: a restarted broker recovers every partition it holds
    create_topics(flow, CATALOG)
    topic = numbered.topic(CALLS)
    admin = make_admin(numbered)

    groups = make_groups(12, HARNESSES, group_size=8, seed=7, faults=False)
    rollouts = [r for members in groups for r in members]
    records = interleave(rollouts, seed=7, window=24)
    worker = Worker(flow, tmp_path, app_id=f"streams-{uuid.uuid4().hex[:8]}", **STREAMS)
    collector = Collector(flow, f"collect-{uuid.uuid4().hex[:8]}")
    # The first part of the rollouts before the kill, the rest during the outage and after the restart.
    feeder = Feeder(flow, records, rate=25.0, hold_at=len(records) * 2 // 5)
    producer, reader = Numbered(numbered, topic, ROLLOUT_PARTITIONS, RATE), Reader(numbered, topic)

    def tick() -> None:
        collector.poll(0.3)

    def ok() -> str:
        if not worker.alive():
            return f"the streams worker died:\n{worker.log_tail()}"
        if producer.errors:
            return f"delivery failed: {producer.errors[:3]}"
        return ""

    worker.start()
    try:
        for thread in (producer, reader, feeder):
            thread.start()
        wait_until(
            lambda: (
                producer.acked() >= KILL_AFTER_ACKS
                and reader.count() >= KILL_AFTER_ACKS // 2
                and collector.count(TRAJECTORIES) >= KILL_AFTER_TRAJECTORIES
            ),
            120,
            "records and trajectories before the kill",
            tick,
            ok,
        )
        # The active controller is the KRaft quorum's leader: describe_cluster cannot say (KRaft answers it with a
        # random live broker), the nodes' Raft state does (LocalKafka.active_controller).
        controller = local.active_controller()
        leaders, _ = partitions(admin, topic)
        led = sorted(p for p, leader in leaders.items() if leader == controller)
        assert led, f"the controller (node {controller}) leads no partition of {topic}: {leaders}"
        victim = next(n for n in local.status()["nodes"] if n["node_id"] == controller)  # type: ignore[union-attr]
        os.kill(victim["pid"], signal.SIGKILL)
        killed_at = time.monotonic()
        feeder.release()
        elected_s = wait_until(
            lambda: local.active_controller() not in (None, controller), 30, "a new active controller", tick, ok
        )

        # Writes go on without it: every partition, those it led included, takes acknowledged records again.
        wait_until(
            lambda: all(producer.first_ack_after(p, killed_at) for p in range(ROLLOUT_PARTITIONS)),
            60,
            f"acknowledged writes to partitions {led} (led by the killed broker {controller})",
            tick,
            ok,
        )
        resumed_s = max(producer.first_ack_after(p, killed_at) or 0.0 for p in led) - killed_at
        new_controller = local.active_controller()

        # `up` restarts the dead node on its data dir and ports; in a thread, so outputs are read (and timed) meanwhile.
        with ThreadPoolExecutor(1) as pool:
            restart = pool.submit(local.up, timeout=120, quiet=True)
            restart_s = wait_until(restart.done, 150, f"broker {controller} restarted", tick, ok)
            state = restart.result()
        seen.update(pid for pid in state.pids if pid is not None)

        def back_in_sync() -> bool:
            with contextlib.suppress(KafkaException):
                return all(controller in members for members in partitions(admin, topic)[1].values())
            return False

        in_sync_s = wait_until(back_in_sync, 90, f"broker {controller} back in every ISR of {topic}", tick, ok)
        target = producer.acked() + MORE_AFTER_RESTART
        wait_until(
            lambda: (
                producer.acked() >= target
                and collector.count(TRAJECTORIES) >= len(rollouts)
                and collector.count(METRICS) >= len(groups)
            ),
            150,
            "more records after the restart, and every trajectory and group",
            tick,
            ok,
        )
        producer.halt.set()
        producer.join(150)
        collector.poll(3.0)  # a duplicate output would show up now
    finally:
        producer.halt.set()
        feeder.release(all_holds=True)
        reader.halt.set()
        collector.close()
        worker.stop()
        for thread in (producer, reader, feeder):
            if thread.is_alive():
                thread.join(30)

    # Measured first and reported (bench/faults.py tabulates the rows), then checked: a failing run keeps its row.
    counts = read_back(numbered, topic)
    lost = sorted(set(range(producer.sent)) - set(counts))
    doubled = sorted(n for n, k in counts.items() if k > 1)
    trajectories = Counter(Trajectory.from_bytes(o.value).rollout_id for o in collector.got[TRAJECTORIES])
    read_stall, read_recover = max(stall_after(killed_at, times) for times in reader.got.values())
    ack_stall = max(stall_after(killed_at, times)[0] for times in producer.acks.values())
    out_stall, out_recover = stall_after(killed_at, [o.at for o in collector.got[TRAJECTORIES]])
    note = f"node {controller} (controller, leads {len(led)}/{ROLLOUT_PARTITIONS}); restart {restart_s:.0f} s"
    record(
        FaultRow(
            "broker SIGKILLed: idempotent acks=all producer",
            producer.sent,
            sum(counts.values()),
            len(lost),
            sum(counts.values()) - len(counts),
            read_stall,
            read_recover,
            f"{note}; acks stalled {ack_stall:.1f} s",
        )
    )
    unique = len(trajectories)
    record(
        FaultRow(
            "broker SIGKILLed: streams worker (trajectories)",
            len(rollouts),
            sum(trajectories.values()),
            len(rollouts) - len(set(trajectories) & {r.rollout_id for r in rollouts}),
            sum(trajectories.values()) - unique,
            out_stall,
            out_recover,
            note,
        )
    )
    print(
        f"3-node cluster up in {start_s:.1f}s; killed node {controller} (active controller, leader of partitions "
        f"{led} of {ROLLOUT_PARTITIONS}); node {new_controller} elected controller {elected_s:.1f}s after the kill; "
        f"every partition took writes again "
        f"{resumed_s:.1f}s after the kill; restart {restart_s:.1f}s, back in every ISR {in_sync_s:.1f}s after it; "
        f"kill {killed_at - began:.0f}s after the cluster was up, end {time.monotonic() - began:.0f}s"
    )

    # Numbered records: every one acknowledged, none failed, each read back exactly once.
    assert producer.unflushed == 0 and not producer.errors, (producer.unflushed, producer.errors[:5])
    assert producer.acked() == producer.sent
    assert not lost and not doubled and len(counts) == producer.sent, (len(lost), lost[:10], doubled[:10])

    # The streams worker: every trajectory and every group once, no rollout in two batches.
    assert set(trajectories) == {r.rollout_id for r in rollouts} and max(trajectories.values()) == 1
    metrics = Counter(Metric.from_bytes(o.value).labels["group_id"] for o in collector.got[METRICS])
    assert set(metrics) == {m[0].group_id for m in groups} and max(metrics.values()) == 1
    batched = Counter(
        r.rollout_id
        for r in (BatchRecord.from_bytes(o.value) for o in collector.got[BATCHES])
        if r.kind is BatchRecordKind.TRAJECTORY
    )
    assert not batched or max(batched.values()) == 1

    # Replication as the rule says: 3 replicas, 2 in sync, on the catalog, the streams app's and Kafka's own topics.
    meta = admin.list_topics(timeout=10).topics
    internal = [t for t in meta if t.startswith(flow.topic(""))] + ["__consumer_offsets", "__transaction_state"]
    for name in [topic, *internal]:
        assert name in meta, name
        assert {len(p.replicas) for p in meta[name].partitions.values()} == {3}, name
    configs = admin.describe_configs([ConfigResource(ConfigResource.Type.TOPIC, topic)])
    [described] = [f.result() for f in configs.values()]
    assert described["min.insync.replicas"].value == "2"
