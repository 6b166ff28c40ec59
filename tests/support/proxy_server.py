"""A real serving proxy on a free local port (tiny tokenizer, Kafka publisher), its admin calls, and a calls reader.

For the integration tests and bench scripts that drive the proxy over HTTP: ``running_proxy`` yields the proxy and
its harness-facing URL (its admin listener, on another free port, is ``proxy.admin_url``, or ``admin_url(url)``),
``register`` / ``seal`` are the admin API a sandbox worker uses (given either URL), ``consume_calls`` reads a
rollout's call events back from the broker in ``seq`` order.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
from aiohttp import web

from clawbase.kafka.clients import make_consumer
from clawbase.kafka.publisher import KafkaPublisher
from clawbase.settings import KafkaSettings
from producers.proxy.app import Proxy, ProxySettings
from schemas.events import CallEvent
from schemas.topics import CALLS
from tests.support import proxy_helpers as H


@asynccontextmanager
async def running_proxy(
    kafka: KafkaSettings, engine_url: str, *, host: str = "127.0.0.1", port: int = 0, **overrides: Any
) -> AsyncIterator[tuple[Proxy, str]]:
    """A proxy on ``port`` (default a free one) of ``host`` (a docker test passes the docker bridge's address, where
    containers reach it through the sandbox worker's relay); yields it and its URL. Its admin listener is on a free
    port of 127.0.0.1 (``admin_port`` in ``overrides``: that one), ``proxy.admin_url``."""
    settings = ProxySettings(
        model=H.tiny_model_dir(),
        engine_url=engine_url,
        port=0,
        admin_token="admin",
        **{"keepalive_s": 0.2, "publish_timeout_s": 15, **overrides},
    )
    publisher = KafkaPublisher(kafka, settings.publish_timeout_s)
    proxy = Proxy(settings, publisher, kafka.topic(CALLS), tokenizer=H.tiny_tokenizer())
    runner, admin = web.AppRunner(proxy.app()), web.AppRunner(proxy.admin_app())
    await runner.setup()
    await admin.setup()
    url = ""
    try:
        await web.TCPSite(runner, host, port).start()
        await web.TCPSite(admin, "127.0.0.1", overrides.get("admin_port", 0)).start()
        url = f"http://{host}:{runner.addresses[0][1]}"
        proxy.public_url = url
        proxy.admin_url = _ADMIN_URLS[url] = f"http://127.0.0.1:{admin.addresses[0][1]}"
        yield proxy, url
    finally:
        _ADMIN_URLS.pop(url, None)
        await runner.cleanup()
        await admin.cleanup()
        publisher.close()


_ADMIN_URLS: dict[str, str] = {}  # harness-facing URL → admin URL of each running proxy of this process


def admin_url(url: str) -> str:
    """The admin listener of the running proxy whose harness-facing URL is ``url`` (an admin URL: itself)."""
    return _ADMIN_URLS.get(url, url)


async def register(http: aiohttp.ClientSession, url: str, **body: Any) -> dict[str, Any]:
    async with http.post(f"{admin_url(url)}/admin/rollouts", json=body, headers={"Authorization": "Bearer admin"}) as r:
        assert r.status == 201, await r.text()
        return await r.json()


async def seal(http: aiohttp.ClientSession, url: str, rid: str) -> dict[str, Any]:
    async with http.post(f"{admin_url(url)}/admin/rollouts/{rid}/seal", headers={"Authorization": "Bearer admin"}) as r:
        assert r.status == 200
        return await r.json()


def consume_calls(kafka: KafkaSettings, rollout_ids: set[str], n: int, timeout: float = 20.0) -> list[CallEvent]:
    consumer = make_consumer(kafka, f"g-{uuid.uuid4().hex[:8]}")
    consumer.subscribe([kafka.topic(CALLS)])
    out: list[CallEvent] = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and len(out) < n:
            msg = consumer.poll(0.3)
            if msg is None or msg.error():
                continue
            event = CallEvent.from_bytes(msg.value())
            assert msg.key().decode() == event.rollout_id
            if event.rollout_id in rollout_ids:
                out.append(event)
    finally:
        consumer.close()
    return sorted(out, key=lambda e: e.seq)
