"""Drive the real streams worker (``python -m streams.app worker``) as a subprocess, feed it, read its outputs.

Used by ``tests/integration/test_streams.py`` and ``bench/streams.py``. The worker gets its settings through the
environment exactly as in production (``CLAWSTREAM_STREAMS_*``, ``CLAWSTREAM_KAFKA_*``). Debugging knobs:
``CLAWSTREAM_TEST_WORKER_LOGLEVEL`` (default warn) and ``STREAMS_WORKER_CMD`` (what follows the interpreter instead
of ``-m streams.app``, e.g. a script that runs ``streams.app.main`` under cProfile).
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
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from confluent_kafka import Producer

from clawbase.kafka.clients import bootstrap_servers, make_consumer, make_producer
from clawbase.settings import KafkaSettings
from schemas.events import Event
from schemas.topics import BATCHES, DEADLETTER, METRICS, TRAJECTORIES

ROOT = Path(__file__).resolve().parents[2]
OUTPUTS = (TRAJECTORIES, BATCHES, DEADLETTER, METRICS)


class Worker:
    """One streams worker process; ``start`` / ``stop`` (SIGTERM) / ``kill`` (SIGKILL, no goodbye)."""

    def __init__(self, kafka: KafkaSettings, workdir: Path, **settings: Any) -> None:
        self.kafka, self.workdir = kafka, workdir
        self.env = dict(
            os.environ,
            PYTHONPATH=str(ROOT),
            CLAWSTREAM_KAFKA_BOOTSTRAP_SERVERS=bootstrap_servers(kafka),
            CLAWSTREAM_KAFKA_TOPIC_PREFIX=kafka.topic_prefix,
            CLAWSTREAM_STREAMS_DATA_DIR=str(workdir / "streams-data"),
        )
        for name, value in settings.items():
            text = json.dumps(value) if isinstance(value, dict) else str(value)
            self.env[f"CLAWSTREAM_STREAMS_{name.upper()}"] = text
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def log_path(self) -> Path:
        return self.workdir / f"worker-{self.starts}.log"

    def start(self, loglevel: str | None = None) -> None:
        """Start a worker; its log level: ``loglevel``, else $CLAWSTREAM_TEST_WORKER_LOGLEVEL, else warn."""
        loglevel = loglevel or os.environ.get("CLAWSTREAM_TEST_WORKER_LOGLEVEL", "warn")
        self.starts += 1
        log = open(self.log_path, "wb")  # noqa: SIM115 - handed to the child, closed by the OS with it
        self.proc = subprocess.Popen(
            [
                sys.executable,
                *os.environ.get("STREAMS_WORKER_CMD", "-m streams.app").split(),
                "worker",
                "--loglevel",
                loglevel,
            ],
            cwd=ROOT,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 4000) -> str:
        return "\n".join(p.read_text(errors="replace")[-n:] for p in sorted(self.workdir.glob("worker-*.log")))

    def kill(self) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def pause(self) -> None:
        """SIGSTOP the worker: heartbeats lapse and the group evicts it, but it keeps its state (a zombie)."""
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGCONT)

    def stop(self, timeout: float = 40.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
            os.killpg(self.proc.pid, signal.SIGCONT)  # a paused worker acts on the SIGTERM only once resumed
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()


def produce(
    kafka: KafkaSettings, records: Iterable[tuple[str, Event]], *, flush: bool = True, producer: Producer | None = None
) -> int:
    """Publish (catalog topic, event) pairs keyed by rollout id, like the proxy and sandbox workers do."""
    producer = producer or make_producer(kafka)
    n = 0
    for topic, event in records:
        key = (event.rollout_id or "").encode()  # type: ignore[attr-defined]
        producer.produce(kafka.topic(topic), key=key, value=event.to_bytes())
        n += 1
        producer.poll(0)
    if flush:
        assert producer.flush(30) == 0
    return n


class Feeder(threading.Thread):
    """Publishes records in the background at about ``rate`` records/s (one producer), recording send times.

    ``hold_at``: publish only the first ``hold_at`` records, then wait until :meth:`release` before the rest (a fault
    test places its kill by the stream's state while the feeder holds the remainder, never by wall-clock). Several
    hold points: ``holding`` is set at each, and each :meth:`release` lets the feeder go on to the next.
    """

    def __init__(
        self,
        kafka: KafkaSettings,
        records: list[tuple[str, Event]],
        rate: float,
        chunk: int = 20,
        hold_at: int | Sequence[int] | None = None,
    ) -> None:
        super().__init__(daemon=True)
        self.kafka, self.records, self.rate, self.chunk = kafka, records, rate, chunk
        holds = [len(records)] if hold_at is None else [hold_at] if isinstance(hold_at, int) else list(hold_at)
        self.bounds = [0, *sorted(h for h in holds if 0 < h < len(records)), len(records)]
        self.sent_at: dict[str, float] = {}  # rollout id → monotonic time its last record was flushed
        self.holding = threading.Event()  # set once the records up to the next hold point are flushed
        self._released = threading.Semaphore(0)
        self.sent = 0  # records flushed so far

    def release(self, all_holds: bool = False) -> None:
        for _ in range(len(self.bounds) if all_holds else 1):
            self._released.release()

    def run(self) -> None:
        producer = make_producer(self.kafka)
        start = time.monotonic()
        for lo, hi in zip(self.bounds, self.bounds[1:], strict=False):
            if lo > 0:
                self.holding.set()
                self._released.acquire()
                self.holding.clear()
                start = time.monotonic() - lo / self.rate
            for i in range(lo, hi, self.chunk):
                part = self.records[i : min(i + self.chunk, hi)]
                produce(self.kafka, part, producer=producer)
                self.sent = i + len(part)
                now = time.monotonic()
                for _, event in part:
                    self.sent_at[event.rollout_id] = now  # type: ignore[attr-defined]
                time.sleep(max(0.0, start + (i + len(part)) / self.rate - now))
        self.holding.set()


def produce_raw(kafka: KafkaSettings, topic: str, key: bytes, value: bytes) -> None:
    producer = make_producer(kafka)
    producer.produce(kafka.topic(topic), key=key, value=value)
    assert producer.flush(30) == 0


@dataclass
class Output:
    value: bytes
    at: float  # monotonic arrival time
    where: str


@dataclass
class Collector:
    """Reads the worker's output topics with ``isolation.level=read_committed`` (make_consumer's default)."""

    kafka: KafkaSettings
    group_id: str
    got: dict[str, list[Output]] = field(default_factory=lambda: defaultdict(list))

    def __post_init__(self) -> None:
        self.consumer = make_consumer(self.kafka, self.group_id)
        self.consumer.subscribe([self.kafka.topic(t) for t in OUTPUTS])
        self.names = {self.kafka.topic(t): t for t in OUTPUTS}

    def poll(self, seconds: float) -> int:
        """Read for up to ``seconds``; returns how many records arrived."""
        n, deadline = 0, time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            msg = self.consumer.poll(min(left, 0.2))
            if msg is None or msg.error():
                continue
            self.got[self.names[msg.topic()]].append(
                Output(msg.value(), time.monotonic(), f"{msg.topic()}[{msg.partition()}]@{msg.offset()}")
            )
            n += 1
        return n

    def count(self, topic: str) -> int:
        return len(self.got[topic])

    def close(self) -> None:
        self.consumer.close()
