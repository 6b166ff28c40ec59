"""Exactly-once at the record boundary (``streams.eos.CommitGate``), on the real broker with a real Faust worker.

The probe app (``tests/support/eos_probe.py``) starts a commit while it is in the middle of a record, finishes the
record and dies right after the commit (fault point ``eos_probe.after_commit`` set to ``crash`` through
``CLAWSTREAM_FAULTS``: exit 86). Its restart must not replay the record: its outputs, table write and offset were
committed together. Before commits waited for records, the commit took the offsets first and the record's outputs
joined the committing transaction without its offset: the restart replayed it and the committed output held it twice
(``trigger:1``, ``trigger:1:after``, then ``trigger:2``, ``trigger:2:after``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clawbase import faults
from clawbase.kafka.clients import bootstrap_servers, create_topics, make_consumer
from clawbase.settings import KafkaSettings
from schemas.topics import TopicSpec
from tests.support.eos_probe import AFTER_COMMIT, COMMIT_MID_RECORD
from tests.support.stream_harness import ROOT, produce_raw

pytestmark = pytest.mark.integration


def run_probe(
    kafka: KafkaSettings, app_id: str, workdir: Path, log: Path, *, crash_after_commit: bool = False
) -> subprocess.Popen:
    """The probe app; ``crash_after_commit``: it dies once the commit of its ``COMMIT_MID_RECORD`` record is done,
    and it commits nothing else (the commit interval outlasts the run)."""
    cmd = [
        sys.executable,
        "-m",
        "tests.support.eos_probe",
        "--bootstrap",
        bootstrap_servers(kafka),
        "--app-id",
        app_id,
        "--source",
        kafka.topic("probe.in"),
        "--sink",
        kafka.topic("probe.out"),
        "--datadir",
        str(workdir),
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop(faults.ENV, None)
    if crash_after_commit:
        cmd += ["--commit-interval", "3600"]
        env |= faults.fault_env(workdir.parent / "faults", **{AFTER_COMMIT: "crash"})
    with open(log, "wb") as out:
        return subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def read_until(kafka: KafkaSettings, group_id: str, last: bytes, proc: subprocess.Popen, log: Path) -> list[bytes]:
    """The committed output (read_committed) up to and including ``last``."""
    consumer = make_consumer(kafka, group_id)
    consumer.subscribe([kafka.topic("probe.out")])
    got: list[bytes] = []
    deadline = time.monotonic() + 120
    try:
        while last not in got:
            assert proc.poll() is None, f"probe exited {proc.returncode}:\n{log.read_text(errors='replace')[-3000:]}"
            assert time.monotonic() < deadline, f"no {last!r} after 120 s; got {got}\n{log.read_text()[-3000:]}"
            msg = consumer.poll(0.5)
            if msg is not None and not msg.error():
                got.append(msg.value())
    finally:
        consumer.close()
    return got


def test_commit_waits_for_the_record_in_progress(kafka_settings: KafkaSettings, group_id: str, tmp_path: Path) -> None:
    app_id = kafka_settings.topic_prefix + "probe"
    create_topics(kafka_settings, [TopicSpec("probe.in", "key", "bytes", 1), TopicSpec("probe.out", "key", "bytes", 1)])
    unprefixed = kafka_settings.model_copy(update={"topic_prefix": ""})
    create_topics(
        unprefixed, [TopicSpec(f"{app_id}-counts-changelog", "key", "bytes", 1, {"cleanup.policy": "compact"})]
    )
    for key, value in ((b"a", b"x"), (b"b", b"x"), (b"trigger", COMMIT_MID_RECORD)):
        produce_raw(kafka_settings, "probe.in", key, value)

    first = run_probe(kafka_settings, app_id, tmp_path / "data", tmp_path / "probe-1.log", crash_after_commit=True)
    try:
        assert first.wait(120) == faults.CRASH_STATUS, (tmp_path / "probe-1.log").read_text(errors="replace")[-3000:]
    finally:
        if first.poll() is None:
            first.kill()

    second = run_probe(kafka_settings, app_id, tmp_path / "data", tmp_path / "probe-2.log")
    try:
        produce_raw(kafka_settings, "probe.in", b"c", b"x")  # processed after anything replayed: marks the end
        got = read_until(kafka_settings, group_id, b"c:1", second, tmp_path / "probe-2.log")
    finally:
        second.terminate()
        second.wait(60)
    assert got == [b"a:1", b"b:1", b"trigger:1", b"trigger:1:after", b"c:1"]


def test_changelog_buffer_sends_each_keys_last_write_once() -> None:
    """A transaction's changelog holds one message per (changelog, partition, key): the last write, after the others
    (no broker needed: the buffer is handed fake messages and records what it publishes)."""
    import asyncio
    from types import SimpleNamespace

    from streams.eos import ChangelogBuffer

    sent: list[tuple[str, int, str, bytes | None]] = []

    class Channel:
        def __init__(self, name: str) -> None:
            self.name = name

        def get_topic_name(self) -> str:
            return self.name

        async def publish_message(self, fut: SimpleNamespace, wait: bool = False) -> None:
            m = fut.message
            sent.append((self.name, m.partition, m.key, m.value))

    state, calls = Channel("state-changelog"), Channel("calls-changelog")

    def fut(channel: Channel, partition: int, key: str, value: bytes | None) -> SimpleNamespace:
        return SimpleNamespace(message=SimpleNamespace(channel=channel, partition=partition, key=key, value=value))

    buf = ChangelogBuffer()
    for f in (
        fut(state, 1, "r", b"v1"),
        fut(calls, 1, "r\x00c1", b"c"),
        fut(state, 2, "r", b"other"),
        fut(state, 1, "r", b"v2"),
        fut(calls, 1, "r\x00c1", None),
    ):
        buf.put(f)  # type: ignore[arg-type]
    asyncio.run(buf.flush())
    assert sent == [
        ("state-changelog", 2, "r", b"other"),
        ("state-changelog", 1, "r", b"v2"),
        ("calls-changelog", 1, "r\x00c1", None),
    ]
    assert buf.puts == 5 and not buf.pending


async def test_recovery_reads_where_changelogs_end_from_the_broker(kafka_settings: KafkaSettings) -> None:
    """Where a changelog ends, for recovery, comes from the broker, not from aiokafka's fetch-time cache (eos, 7).

    Faust's exactly-once recovery took ``last_stable_offset``, which aiokafka only knows after a fetch: right after an
    assignment it is None, Faust read every changelog as empty (highwater -1) and the restarted worker began with
    empty tables (the kill test lost 20-36 rollouts in about 1 restart in 5). Here: 3 committed records (offsets
    0-2, commit marker 3) and 2 in a transaction still open, read by a fresh read_committed consumer that has fetched
    nothing: the cache knows nothing, the broker says 4 (the open transaction's records are not readable yet).
    """
    import faust
    from aiokafka import AIOKafkaConsumer, TopicPartition
    from confluent_kafka import Producer

    from streams import eos

    create_topics(kafka_settings, [TopicSpec("eos.ends", "key", "bytes", 1)])
    topic = kafka_settings.topic("eos.ends")
    producer = Producer({"bootstrap.servers": bootstrap_servers(kafka_settings), "transactional.id": f"{topic}-writer"})
    producer.init_transactions(30)
    producer.begin_transaction()
    for i in range(3):
        producer.produce(topic, key=b"k", value=str(i).encode())
    producer.commit_transaction(30)
    producer.begin_transaction()
    for _ in range(2):
        producer.produce(topic, key=b"k", value=b"open")
    producer.flush(30)  # written, not committed: the partition's last stable offset stays at 4
    tp = TopicPartition(topic, 0)
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap_servers(kafka_settings), isolation_level="read_committed", enable_auto_commit=False
    )
    await consumer.start()
    try:
        consumer.assign([tp])
        assert consumer.last_stable_offset(tp) is None  # what Faust's recovery read: "empty"
        assert await eos.committed_end_offsets(consumer, [tp]) == {tp: 4}
        assert (await consumer.end_offsets([tp]))[tp] == 4
    finally:
        await consumer.stop()
        producer.abort_transaction(30)
    # The exactly-once app's consumer uses it (building the app connects to nothing).
    app = faust.App(
        kafka_settings.topic_prefix + "ends", broker="kafka://127.0.0.1:1", processing_guarantee="exactly_once"
    )
    eos.install(app)
    assert isinstance(app.consumer._thread, eos.EosConsumerThread)
