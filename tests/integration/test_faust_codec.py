"""A minimal real Faust worker consumes an Avro topic through the project's codec and produces Avro back."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from clawbase.kafka.clients import bootstrap_servers, make_consumer, make_producer
from clawbase.settings import KafkaSettings
from schemas.events import Metric, RewardEvent, RewardStatus

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def test_faust_agent_reads_and_writes_avro(kafka_settings: KafkaSettings, group_id: str, tmp_path: Path) -> None:
    src, dst = kafka_settings.topic("clawstream.rewards"), kafka_settings.topic("clawstream.metrics")
    rewards = [
        RewardEvent(
            rollout_id=f"r-{i}",
            policy_version=i,
            timestamp_ms=i,
            attempt_id=f"a-{i}",
            status=RewardStatus.OK if i % 3 else RewardStatus.INFRA_FAILURE,
            grader="native",
            reward=None if i % 3 == 0 else i / 10,
        )
        for i in range(12)
    ]
    producer = make_producer(kafka_settings)
    for r in rewards:
        producer.produce(src, key=r.rollout_id.encode(), value=r.to_bytes())
    assert producer.flush(30) == 0

    env = dict(
        os.environ,
        ECHO_BOOTSTRAP=bootstrap_servers(kafka_settings),
        ECHO_IN=src,
        ECHO_OUT=dst,
        ECHO_APP_ID=f"echo-{uuid.uuid4().hex[:8]}",
        PYTHONPATH=str(ROOT),
    )
    log = open(tmp_path / "faust.log", "wb")  # noqa: SIM115
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.integration.apps.faust_echo",
            "--datadir",
            str(tmp_path / "faust-data"),
            "worker",
            "--loglevel",
            "warn",
            "--without-web",
        ],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    got: dict[str, Metric] = {}
    consumer = make_consumer(kafka_settings, group_id)
    consumer.subscribe([dst])
    try:
        deadline = time.monotonic() + 90
        while len(got) < len(rewards) and time.monotonic() < deadline:
            assert worker.poll() is None, (tmp_path / "faust.log").read_text()[-3000:]
            msg = consumer.poll(0.5)
            if msg is None or msg.error():
                continue
            metric = Metric.from_bytes(msg.value())
            got[metric.rollout_id] = metric
    finally:
        consumer.close()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(worker.pid, signal.SIGTERM)
        try:
            worker.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait(10)
        log.close()
    assert len(got) == len(rewards), (tmp_path / "faust.log").read_text()[-3000:]
    for r in rewards:
        m = got[r.rollout_id]
        assert m.source == "faust-echo" and m.policy_version == r.policy_version
        assert m.values["reward"] == (r.reward if r.reward is not None else -1.0)
        assert m.labels["status"] == r.status.value
