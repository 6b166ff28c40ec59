"""Consumer lag of a real service while records flow: the streams worker's group, paused and resumed.

A real Faust streams worker reads a calls partition and commits (in its transactions); once its committed offset
reaches the partition's end it is paused (SIGSTOP) and N more records land there. ``clawstream lag --json`` (the
real CLI, a subprocess) and the dashboard's ``/metrics`` must both say lag == N on that partition, then 0 once the
resumed worker has read and committed them. Every wait is on the broker's state, never on a clock.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from confluent_kafka import Producer, TopicPartition
from prometheus_client.parser import text_string_to_metric_families

from clawbase.kafka.clients import bootstrap_servers, make_consumer, make_producer
from clawbase.settings import KafkaSettings
from consumers.analytics.dashboard.server import start_dashboard
from consumers.analytics.lag import LagError, read_lag
from schemas.topics import CALLS
from tests.support.stream_harness import ROOT, Worker

KEY = b"lag-probe"  # every record on one partition
N = 5  # records the paused worker has not read
M = 3  # records of a transaction still open: past the last stable offset, no read_committed consumer's lag


def produce_garbage(kafka: KafkaSettings, n: int, producer: Producer | None = None) -> tuple[int, int]:
    """``n`` undecodable records (the worker dead-letters and commits past them); (partition, last offset)."""
    producer, got = producer or make_producer(kafka), []
    for i in range(n):
        producer.produce(
            kafka.topic(CALLS), key=KEY, value=b"\x00not avro %d" % i, on_delivery=lambda e, m: got.append((e, m))
        )
    assert producer.flush(30) == 0
    assert all(err is None for err, _ in got), got
    return got[-1][1].partition(), got[-1][1].offset()


def partition_row(kafka: KafkaSettings, group: str, partition: int) -> dict[str, Any] | None:
    try:
        groups = read_lag(kafka, group=group)
    except LagError:  # the worker has not joined yet
        return None
    for g in groups:
        for p in g.partitions:
            if p.topic == kafka.topic(CALLS) and p.partition == partition:
                return {"committed": p.committed, "end": p.end, "lag": p.lag, "owner": p.owner}
    return None


def wait_until(what: str, worker: Worker, check: Callable[[], bool], timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert worker.alive(), f"worker died while waiting for {what}:\n{worker.log_tail()}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}\n{worker.log_tail()}"
        time.sleep(0.3)


def cli_lag(kafka: KafkaSettings, *args: str) -> Any:
    """``clawstream lag ARGS`` as a subprocess: its JSON document with ``--json``, else the table's lines."""
    out = subprocess.run(
        [sys.executable, "-m", "clawstream", "lag", "--bootstrap", bootstrap_servers(kafka), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout) if "--json" in args else out.stdout.splitlines()


def scraped_lag(url: str, group: str, topic: str, partition: int) -> float | None:
    with urllib.request.urlopen(url + "metrics", timeout=30) as resp:
        text = resp.read().decode()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "clawstream_consumer_lag" and s.labels == {
                "group": group,
                "topic": topic,
                "partition": str(partition),
            }:
                return s.value
    return None


def test_lag_of_a_paused_streams_worker(kafka_settings: KafkaSettings, group_id: str, tmp_path: Path) -> None:
    app_id = f"streams-{group_id}"
    group = kafka_settings.topic_prefix + app_id  # Faust's consumer group is its (prefixed) app id
    calls = kafka_settings.topic(CALLS)
    part, first = produce_garbage(kafka_settings, 1)
    worker = Worker(
        kafka_settings, tmp_path, app_id=app_id, store="memory://", commit_interval_s=0.5, session_timeout_s=30.0
    )
    worker.start()
    dashboard = start_dashboard(kafka_settings)
    try:
        row: dict[str, Any] | None = None

        def caught_up() -> bool:
            nonlocal row
            row = partition_row(kafka_settings, group, part)
            return row is not None and row["committed"] == first + 1 and row["owner"] is not None

        wait_until("the worker's commit past the first record", worker, caught_up)
        assert row is not None and row["lag"] == 0 and row["end"] == first + 1, row
        worker.pause()
        _, last = produce_garbage(kafka_settings, N)
        assert last == first + N  # the topic is written without transactions: no markers between the records
        open_txn = make_producer(kafka_settings, **{"transactional.id": f"lag-test-{group_id}"})
        open_txn.init_transactions(30)
        open_txn.begin_transaction()
        produce_garbage(kafka_settings, M, open_txn)  # high watermark: last + 1 + M; last stable offset: last + 1

        report = cli_lag(kafka_settings, "--prefix", kafka_settings.topic_prefix, "--group", group, "--json")
        assert report["prefix"] == kafka_settings.topic_prefix
        [g] = report["groups"]
        assert g["group"] == group
        rows = {(p["topic"], p["partition"]): p for p in g["partitions"]}
        assert rows[(calls, part)]["committed"] == first + 1
        assert rows[(calls, part)]["end"] == last + 1
        assert rows[(calls, part)]["lag"] == N
        assert sum(p["lag"] or 0 for (t, _), p in rows.items() if t == calls) == N
        assert scraped_lag(dashboard.url, group, calls, part) == N
        with urllib.request.urlopen(dashboard.url + "api/lag", timeout=30) as resp:  # the page's lag panel reads this
            [page] = [g for g in json.load(resp)["groups"] if g["group"] == group]
        assert {(p["topic"], p["partition"]): p["lag"] for p in page["partitions"]}[(calls, part)] == N

        open_txn.abort_transaction(30)  # its marker takes an offset: one plain record after it ends the partition
        _, last = produce_garbage(kafka_settings, 1)
        worker.resume()
        wait_until(
            "lag 0 after the resume",
            worker,
            lambda: (r := partition_row(kafka_settings, group, part)) is not None and r["lag"] == 0,
        )
        assert partition_row(kafka_settings, group, part)["end"] == last + 1  # type: ignore[index]
        assert scraped_lag(dashboard.url, group, calls, part) == 0
        table = cli_lag(kafka_settings, "--prefix", kafka_settings.topic_prefix)  # the table, every group
        assert [group, calls, str(part), str(last + 1), str(last + 1), "0"] in [line.split()[:6] for line in table]
        assert any(line.split()[:2] == [group, "total"] for line in table)
    finally:
        dashboard.stop()
        worker.stop()


def test_unknown_group_is_a_clear_error(kafka_settings: KafkaSettings) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "clawstream", "lag", "--bootstrap", bootstrap_servers(kafka_settings)]
        + ["--group", "no-such-group-anywhere"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1
    assert "no consumer group 'no-such-group-anywhere'" in out.stderr


def test_lag_counts_records_not_transaction_markers(kafka_settings: KafkaSettings, group_id: str) -> None:
    """A group that read a transactional topic to its end and committed the offset after its last record (as the
    learner commits its batches) has nothing left to read: lag 0, though the commit marker takes one more offset
    (the lag before the count: 1 for good). Two more committed records and an aborted one: lag 2, not the 6 offsets
    from the committed one (three markers, two records, the aborted one)."""
    calls = kafka_settings.topic(CALLS)
    txn = make_producer(kafka_settings, **{"transactional.id": f"lag-markers-{group_id}"})
    txn.init_transactions(30)
    txn.begin_transaction()
    part, last = produce_garbage(kafka_settings, 3, txn)
    txn.commit_transaction(30)
    reader = make_consumer(kafka_settings, group_id, **{"enable.auto.commit": False})
    try:
        reader.assign([TopicPartition(calls, part, last - 2)])
        got = [m for m in (reader.poll(10) for _ in range(3)) if m is not None and not m.error()]
        assert [m.offset() for m in got] == [last - 2, last - 1, last]
        reader.commit(offsets=[TopicPartition(calls, part, last + 1)], asynchronous=False)  # the learner's way
    finally:
        reader.close()
    dashboard = start_dashboard(kafka_settings)
    try:
        [g] = cli_lag(kafka_settings, "--prefix", kafka_settings.topic_prefix, "--group", group_id, "--json")["groups"]
        [row] = [p for p in g["partitions"] if (p["topic"], p["partition"]) == (calls, part)]
        assert (row["committed"], row["end"], row["lag"]) == (last + 1, last + 2, 0)  # the marker at last + 1
        assert scraped_lag(dashboard.url, group_id, calls, part) == 0

        txn.begin_transaction()
        produce_garbage(kafka_settings, 2, txn)
        txn.commit_transaction(30)
        txn.begin_transaction()
        produce_garbage(kafka_settings, 1, txn)
        txn.abort_transaction(30)
        [g] = cli_lag(kafka_settings, "--prefix", kafka_settings.topic_prefix, "--group", group_id, "--json")["groups"]
        [row] = [p for p in g["partitions"] if (p["topic"], p["partition"]) == (calls, part)]
        assert row["end"] - row["committed"] == 6 and row["lag"] == 2, row
        assert scraped_lag(dashboard.url, group_id, calls, part) == 2
    finally:
        dashboard.stop()
