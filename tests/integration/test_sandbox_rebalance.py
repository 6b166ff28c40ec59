"""Sandbox workers through rebalances: real broker, real proxy, real worker processes, the policy held by the test.

Worker A (concurrency 8) runs one ``hello`` request per partition of the requests topic; the scripted policy answers
nothing until the test releases it, so the eight attempts stay running. Once their eight STARTED events are on the
broker, worker B joins the group (cooperative-sticky: some partitions move to B, the rest stay with A and keep their
in-flight offsets). Read back from the topics, in both tests: every request started exactly one attempt, which
finished (HARNESS_EXITED) with exactly one reward, OK and 1.0; nothing FAILED; and the group's committed offsets reach
the end of every partition once the workers stopped — no request lost, none run twice, no finished rollout
superseded by a second attempt.

* ``test_a_joining_worker_waits_for_the_running_attempts_of_its_partitions``: a second request per partition waits
  behind the first. B reads its partitions' requests again (A had not committed them) and the policy is released
  only then. A's attempts there finish and publish, but A no longer commits them; B runs none of them (their proxy
  leases are live: it waits, then commits them once they finished) and runs the waiting requests of its partitions.
* ``test_a_partition_that_comes_back_keeps_its_running_attempt``: B reads its partitions' requests, then stops before
  the policy is released; its partitions go back to A (concurrency 16: not full, so it reads them at once), which
  reads its own running requests again and starts none of them; their offsets are committed once they finished.
"""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import TopicPartition

from clawbase.kafka.clients import make_consumer, make_producer
from clawbase.settings import KafkaSettings
from schemas.events import RewardStatus, RolloutEvent, RolloutRequest, RolloutState
from schemas.topics import ROLLOUT_EVENTS, ROLLOUT_PARTITIONS, ROLLOUT_REQUESTS
from tests.support import proxy_helpers as H
from tests.support import sandbox_helpers as S
from tests.support.proxy_server import running_proxy
from tests.support.sandbox_stack import wait_for, worker_process
from tests.support.scripted_engine import ScriptedEngine

pytestmark = [pytest.mark.integration, pytest.mark.serial]  # its leftover check is machine-wide
PARTITIONS = range(ROLLOUT_PARTITIONS)


def publish_per_partition(kafka: KafkaSettings, reqs: dict[int, RolloutRequest]) -> None:
    producer = make_producer(kafka)
    for partition, req in reqs.items():
        producer.produce(
            kafka.topic(ROLLOUT_REQUESTS), key=req.rollout_id.encode(), value=req.to_bytes(), partition=partition
        )
    assert producer.flush(30) == 0


def wait_started(kafka: KafkaSettings, rollout_ids: set[str], timeout: float) -> dict[str, RolloutEvent]:
    """The STARTED events of ``rollout_ids``, once every one of them is on the broker."""
    consumer = make_consumer(kafka, f"c-{uuid.uuid4().hex[:8]}")
    consumer.subscribe([kafka.topic(ROLLOUT_EVENTS)])
    started: dict[str, RolloutEvent] = {}
    deadline = time.monotonic() + timeout
    try:
        while set(started) != rollout_ids:
            assert time.monotonic() < deadline, f"started: {sorted(started)} of {sorted(rollout_ids)}"
            msg = consumer.poll(0.2)
            if msg is not None and not msg.error():
                event = RolloutEvent.from_bytes(msg.value())
                if event.rollout_id in rollout_ids and event.state is RolloutState.STARTED:
                    started[event.rollout_id] = event
    finally:
        consumer.close()
    return started


def assigned(log: Path) -> set[int]:
    """The request partitions a worker's log says it was assigned (cooperative: only the new ones per line)."""
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if " assigned [" in ln]
    return {int(p) for ln in lines for p in re.findall(r"rollout\.requests\[(\d+)\]", ln)}


def read_count(log: Path, rollout_id: str) -> int:
    """How often the worker read ``rollout_id``'s request (it logs every request it reads, before anything else)."""
    return log.read_text(errors="replace").count(f": rollout {rollout_id} (")


async def reached(predicate: Callable[[], Any], timeout: float) -> bool:
    """Whether ``predicate`` became true within ``timeout`` seconds (polled)."""
    try:
        await wait_for(predicate, timeout, "")
    except AssertionError:
        return False
    return True


def committed(kafka: KafkaSettings, group_id: str) -> dict[int, int]:
    consumer = make_consumer(kafka, group_id)  # asks the coordinator; joins nothing
    try:
        tps = consumer.committed([TopicPartition(kafka.topic(ROLLOUT_REQUESTS), p) for p in PARTITIONS], timeout=15)
    finally:
        consumer.close()
    return {tp.partition: tp.offset for tp in tps}


def stop(*procs: subprocess.Popen | None) -> None:
    for proc in procs:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        if proc is not None:
            proc.wait(60)


def logs(tmp_path: Path) -> str:
    return "\n".join(f"--- {n}\n" + (tmp_path / n).read_text()[-4000:] for n in ("a.log", "b.log"))


def assert_once_each(events, rewards, rollout_ids: set[str], context: str) -> dict[str, RolloutEvent]:
    """Every request: one attempt started, it finished and has one OK reward of 1.0; returns its STARTED event."""
    started = [e for e in events if e.state is RolloutState.STARTED]
    per_request = Counter(e.rollout_id for e in started)
    assert per_request == Counter(rollout_ids), f"attempts started per request: {per_request}\n{context}"
    failed = [(e.rollout_id, e.attempt_id, e.reason) for e in events if e.state is RolloutState.FAILED]
    assert failed == [], context
    exited = {e.attempt_id for e in events if e.state is RolloutState.HARNESS_EXITED}
    assert exited == {e.attempt_id for e in started}, context
    assert Counter(r.attempt_id for r in rewards) == Counter(exited), context
    assert all(r.status is RewardStatus.OK and r.reward == 1.0 for r in rewards), rewards
    return {e.rollout_id: e for e in started}


@pytest.mark.timeout(300)
async def test_a_joining_worker_waits_for_the_running_attempts_of_its_partitions(
    kafka_settings, group_id, tmp_path
) -> None:
    sandboxes, a_log, b_log = tmp_path / "sandboxes", tmp_path / "a.log", tmp_path / "b.log"
    first = {p: S.request("hello", "agentloop", rollout_id=f"first-{p}", timeout_s=120) for p in PARTITIONS}
    second = {p: S.request("hello", "agentloop", rollout_id=f"second-{p}", timeout_s=120) for p in PARTITIONS}
    ids = {r.rollout_id for r in (*first.values(), *second.values())}
    async with (
        ScriptedEngine(H.tiny_tokenizer(), S.agent_responder()) as engine,
        running_proxy(kafka_settings, engine.url, keepalive_s=1.0) as (_proxy, url),
    ):
        engine.hold = asyncio.Event()
        a = worker_process(kafka_settings, url, group_id, sandboxes, a_log, CONCURRENCY="8", WORKER_ID="A")
        b = None
        try:
            publish_per_partition(kafka_settings, first)
            # A runs the eight first requests (STARTED is on the broker; the policy answers nothing yet)
            await asyncio.to_thread(wait_started, kafka_settings, {r.rollout_id for r in first.values()}, 90)
            publish_per_partition(kafka_settings, second)  # waiting behind them
            # (B has room for all eight requests of its partitions, so it reads them all, whatever it makes of them)
            b = worker_process(kafka_settings, url, group_id, sandboxes, b_log, CONCURRENCY="8", WORKER_ID="B")
            # B got partitions and read their requests again, the running ones too; only then the policy answers
            await wait_for(
                lambda: assigned(b_log) and all(read_count(b_log, first[p].rollout_id) for p in assigned(b_log)),
                90,
                "B to be assigned partitions and read their requests",
            )
            moved = assigned(b_log)
            engine.hold.set()
            events, rewards = await asyncio.to_thread(S.collect, kafka_settings, ids, 120, settle_s=4)
        finally:  # (off the loop: the proxy and the policy run on it)
            engine.hold.set()
            await asyncio.to_thread(stop, a, b)
    context = logs(tmp_path)
    started = assert_once_each(events, rewards, ids, context)
    # The partitions that moved: A's running attempts finished there (B waited for them), B ran the waiting requests.
    assert 0 < len(moved) < len(PARTITIONS), moved
    assert {started[first[p].rollout_id].worker_id for p in PARTITIONS} == {"A"}, context
    assert {started[second[p].rollout_id].worker_id for p in moved} == {"B"}, context
    assert committed(kafka_settings, group_id) == {p: 2 for p in PARTITIONS}, context
    assert S.leftover_processes() == []


@pytest.mark.timeout(300)
async def test_a_partition_that_comes_back_keeps_its_running_attempt(kafka_settings, group_id, tmp_path) -> None:
    sandboxes, a_log, b_log = tmp_path / "sandboxes", tmp_path / "a.log", tmp_path / "b.log"
    first = {p: S.request("hello", "agentloop", rollout_id=f"back-{p}", timeout_s=120) for p in PARTITIONS}
    ids = {r.rollout_id for r in first.values()}
    async with (
        ScriptedEngine(H.tiny_tokenizer(), S.agent_responder()) as engine,
        running_proxy(kafka_settings, engine.url, keepalive_s=1.0) as (_proxy, url),
    ):
        engine.hold = asyncio.Event()
        # room for more than its eight rollouts: A reads the partitions that come back while those still run
        a = worker_process(kafka_settings, url, group_id, sandboxes, a_log, CONCURRENCY="16", WORKER_ID="A")
        b = None
        try:
            publish_per_partition(kafka_settings, first)
            await asyncio.to_thread(wait_started, kafka_settings, ids, 90)
            b = worker_process(kafka_settings, url, group_id, sandboxes, b_log, WORKER_ID="B")
            await wait_for(
                lambda: assigned(b_log) and all(read_count(b_log, first[p].rollout_id) for p in assigned(b_log)),
                90,
                "B to be assigned partitions and read their requests",
            )
            moved = assigned(b_log)
            b.send_signal(signal.SIGTERM)  # B leaves the group (once nothing runs there): its partitions go back to A
            came_back = await reached(lambda: all(read_count(a_log, first[p].rollout_id) >= 2 for p in moved), 60)
            engine.hold.set()  # (also when they did not come back: what the topics hold then is the better report)
            events, rewards = await asyncio.to_thread(S.collect, kafka_settings, ids, 120, settle_s=4)
        finally:  # (off the loop: the proxy and the policy run on it)
            engine.hold.set()
            await asyncio.to_thread(stop, a, b)
    context = logs(tmp_path)
    started = assert_once_each(events, rewards, ids, context)
    assert 0 < len(moved) < len(PARTITIONS), moved
    assert came_back, f"A never read the requests of partitions {sorted(moved)} again\n{context}"
    assert {e.worker_id for e in started.values()} == {"A"}, context
    assert committed(kafka_settings, group_id) == {p: 1 for p in PARTITIONS}, context
    assert S.leftover_processes() == []
