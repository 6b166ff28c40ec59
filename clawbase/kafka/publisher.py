"""Publish records to Kafka from asyncio, waiting for each delivery (never dropping a record).

Used by every asyncio service: the proxy (call events, registrations), the sandbox worker (lifecycle, rewards,
dead letters) and the scheduler (rollout requests).

``KafkaPublisher.publish`` produces one record (idempotent producer, ``acks=all``, zstd: see
``clawbase.kafka.clients``; a None value is a tombstone) and awaits its delivery report. A full local queue
(``BufferError``) makes the caller wait and retry while the poll thread drains it; if the delivery is not confirmed
within ``timeout`` seconds (broker unreachable, topic missing...) :class:`PublishError` is raised (the proxy then
answers 503). librdkafka's own ``message.timeout.ms`` is set to the same deadline so a record the proxy gave up on
is not delivered much later.
A daemon thread calls ``producer.poll`` so delivery callbacks run while the event loop serves requests.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, Protocol

from clawbase.errors import ClawstreamError
from clawbase.kafka.clients import make_producer, produce_reliably
from clawbase.settings import KafkaSettings


class PublishError(ClawstreamError):
    """A record could not be delivered to Kafka in time."""


class Publisher(Protocol):
    async def publish(self, topic: str, key: str, value: bytes | None, timeout: float) -> None: ...

    def close(self) -> None: ...


class KafkaPublisher:
    def __init__(self, settings: KafkaSettings, delivery_timeout_s: float = 30.0, **overrides: Any) -> None:
        conf = {"message.timeout.ms": max(1000, int(delivery_timeout_s * 1000)), **overrides}
        self._producer = make_producer(settings, **conf)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll_loop, name="proxy-kafka-poll", daemon=True)
        self._thread.start()

    def _poll_loop(self) -> None:
        while not self._stop.is_set():
            self._producer.poll(0.05)

    async def publish(self, topic: str, key: str, value: bytes | None, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()

        def on_delivery(err: Any, _msg: Any) -> None:  # runs on the poll thread
            def settle() -> None:
                if fut.done():
                    return
                if err is not None:
                    fut.set_exception(PublishError(f"delivery to {topic} failed: {err}"))
                else:
                    fut.set_result(None)

            loop.call_soon_threadsafe(settle)

        deadline = time.monotonic() + timeout
        try:
            self._producer.produce(topic, key=key.encode(), value=value, on_delivery=on_delivery)
        except BufferError:
            # Local queue full (rare: it holds 100k records): wait in a thread while the poll thread drains it, so
            # the event loop keeps serving (SSE keep-alives, other calls) meanwhile; never drop the record.
            try:
                await asyncio.to_thread(
                    produce_reliably,
                    self._producer,
                    topic,
                    key.encode(),
                    value,
                    on_delivery=on_delivery,
                    timeout=timeout,
                    wait=time.sleep,
                )
            except ClawstreamError as exc:
                raise PublishError(str(exc)) from exc
        try:
            await asyncio.wait_for(fut, max(0.0, deadline - time.monotonic()))
        except TimeoutError as exc:
            raise PublishError(f"delivery to {topic} not confirmed within {timeout:.1f}s") from exc

    def close(self, flush_timeout: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._producer.flush(flush_timeout)
        self._producer = None  # type: ignore[assignment]  # let librdkafka tear the client down now
