"""Faust's commit-livelock check on an exactly-once worker: silent while the worker commits, a report when it cannot.

Faust (faust-streaming 0.15) judges a partition stuck when the broker holds records past where the worker fetched,
the stream processed a record recently, and the partition has not committed for ``broker_commit_livelock_soft_timeout``;
it learns of commits only on its non-transactional path, so every exactly-once worker logged
``Has not committed TP(...) at all since worker start`` once that timeout passed (``streams.eos.EosConsumer``
records each finished transactional commit round where the check looks).

Two probe workers (``tests/support/eos_probe.py``, the check after 3 s, run every 2.5 commit intervals: 1 s) read a
partition whose end holds an open transaction of another producer (records past the fetch position, for as long as
the test runs: the check's first condition). The healthy one processes two records and commits; the stuck one
processes a record it never finishes (``STALL``: no commit can follow it). After several runs of the check (the
probe prints a line after each), the healthy log has no such error and the stuck one has it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clawbase import faults
from clawbase.kafka.clients import bootstrap_servers, create_topics, make_consumer, make_producer
from clawbase.settings import KafkaSettings
from schemas.topics import TopicSpec
from tests.support.eos_probe import LIVELOCK_CHECK, STALL, STALLED
from tests.support.stream_harness import ROOT, produce_raw

pytestmark = pytest.mark.integration

CHECKS = 6  # runs of the check (one a second) after the records were processed; it reports after 3 s


def start_probe(kafka: KafkaSettings, name: str, workdir: Path) -> tuple[subprocess.Popen, Path]:
    app_id = kafka.topic_prefix + name
    unprefixed = kafka.model_copy(update={"topic_prefix": ""})
    create_topics(kafka, [TopicSpec(f"{name}.in", "key", "bytes", 1), TopicSpec(f"{name}.out", "key", "bytes", 1)])
    create_topics(
        unprefixed, [TopicSpec(f"{app_id}-counts-changelog", "key", "bytes", 1, {"cleanup.policy": "compact"})]
    )
    log = workdir / f"{name}.log"
    cmd = [sys.executable, "-m", "tests.support.eos_probe", "--bootstrap", bootstrap_servers(kafka)]
    cmd += ["--app-id", app_id, "--source", kafka.topic(f"{name}.in"), "--sink", kafka.topic(f"{name}.out")]
    cmd += ["--datadir", str(workdir / name), "--commit-interval", "0.4", "--livelock-timeout", "3"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop(faults.ENV, None)
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, log


def open_transaction(kafka: KafkaSettings, topic: str, name: str):  # noqa: ANN201 - confluent_kafka.Producer
    """A record in a transaction left open: the partition ends past what a read_committed consumer can fetch."""
    producer = make_producer(
        kafka, **{"transactional.id": f"{kafka.topic_prefix}{name}-open", "transaction.timeout.ms": 600_000}
    )
    producer.init_transactions(30)
    producer.begin_transaction()
    producer.produce(kafka.topic(topic), key=b"open", value=b"x")
    assert producer.flush(30) == 0
    return producer


def checks_since(log: Path, start: int) -> int:
    """Runs of the check the probe reported in its log from byte ``start`` on."""
    return log.read_bytes()[start:].decode(errors="replace").count(LIVELOCK_CHECK)


def committed_output(kafka: KafkaSettings, group_id: str, topic: str, last: bytes, proc: subprocess.Popen) -> None:
    consumer = make_consumer(kafka, group_id)
    consumer.subscribe([kafka.topic(topic)])
    deadline = time.monotonic() + 120
    try:
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, f"no committed {last!r} on {topic}"
            msg = consumer.poll(0.5)
            if msg is not None and not msg.error() and msg.value() == last:
                return
    finally:
        consumer.close()


def wait_for(condition, procs: list[tuple[subprocess.Popen, Path]]) -> None:  # noqa: ANN001 - () -> bool
    deadline = time.monotonic() + 120
    while not condition():
        for proc, log in procs:
            assert proc.poll() is None, f"probe exited {proc.returncode}:\n{log.read_text(errors='replace')[-3000:]}"
        assert time.monotonic() < deadline, "\n\n".join(log.read_text(errors="replace")[-3000:] for _, log in procs)
        time.sleep(0.2)


def test_commit_check_silent_while_committing_reports_a_stuck_partition(
    kafka_settings: KafkaSettings, group_id: str, tmp_path: Path
) -> None:
    healthy, healthy_log = start_probe(kafka_settings, "healthy", tmp_path)
    stuck, stuck_log = start_probe(kafka_settings, "stuck", tmp_path)
    produce_raw(kafka_settings, "healthy.in", b"a", b"x")
    produce_raw(kafka_settings, "healthy.in", b"b", b"x")
    produce_raw(kafka_settings, "stuck.in", b"a", b"x")
    produce_raw(kafka_settings, "stuck.in", b"s", STALL)
    held = [open_transaction(kafka_settings, f"{name}.in", name) for name in ("healthy", "stuck")]
    procs = [(healthy, healthy_log), (stuck, stuck_log)]
    try:
        committed_output(kafka_settings, group_id, "healthy.out", b"b:1", healthy)  # processed and committed
        healthy_from = healthy_log.stat().st_size
        wait_for(lambda: STALLED in stuck_log.read_text(errors="replace"), procs)
        stuck_from = stuck_log.stat().st_size
        wait_for(
            lambda: min(checks_since(healthy_log, healthy_from), checks_since(stuck_log, stuck_from)) >= CHECKS, procs
        )
    finally:
        for proc in (healthy, stuck):
            proc.kill()
            proc.wait(30)
        for producer in held:
            producer.abort_transaction(30)
    not_committed = re.compile(r"Has not committed TP\(topic='([^']+)', partition=0\)")
    healthy_text, stuck_text = healthy_log.read_text(errors="replace"), stuck_log.read_text(errors="replace")
    assert not not_committed.search(healthy_text), healthy_text[-3000:]
    assert kafka_settings.topic("stuck.in") in not_committed.findall(stuck_text), stuck_text[-3000:]
