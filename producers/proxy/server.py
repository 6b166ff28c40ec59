"""The serving proxy as a process: restore its registrations, open its two listeners, run until stopped.

``serve`` builds the proxy (``producers.proxy.app.Proxy``, passed in: that module's ``main`` calls this one's) with
a Kafka publisher, restores the registrations a previous run left (``producers.proxy.registry``; or, with
``replica_id``, follows the other replicas: ``producers.proxy.replicas``) before the harness port opens, then serves
the harness listener and the admin listener.
``main`` is the command line (``python -m producers.proxy.app`` / ``python -m producers.proxy``): flags over
``CLAWSTREAM_PROXY_*``, Kafka from ``CLAWSTREAM_KAFKA_*``; exit status 2 with the setting to fix on a config error.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from pathlib import Path
from typing import Any

from aiohttp import web
from confluent_kafka import KafkaException

from clawbase.errors import ClawstreamError, ConfigError
from clawbase.kafka.clients import check_broker, require_topics
from clawbase.kafka.publisher import KafkaPublisher
from clawbase.settings import KafkaSettings, add_kafka_arguments, kafka_settings, load_settings
from policy import DEFAULT_MODEL_NAME
from producers.proxy.registry import RegistrationLog, restore_registrations
from producers.proxy.replicas import Replicas, start_replicas
from producers.proxy.settings import ProxySettings
from schemas.topics import CALLS, PROXY_REGISTRATIONS

log = logging.getLogger("clawstream.proxy")
DESCRIPTION = "The serving proxy: real agent harnesses ↔ policy inference engine, recording every model call to Kafka."


async def serve(settings: ProxySettings, kafka: KafkaSettings, proxy_type: Any) -> None:
    """Run a ``proxy_type`` (``producers.proxy.app.Proxy``) until cancelled."""
    publisher = KafkaPublisher(kafka, settings.publish_timeout_s)
    store = RegistrationLog(kafka, publisher, settings.publish_timeout_s) if settings.persist_registrations else None
    proxy = proxy_type(settings, publisher, kafka.topic(CALLS), store=store)
    refresh: asyncio.Task[None] | None = None
    replicas: Replicas | None = None
    try:
        if store is not None and settings.replica_id:  # rollouts taken over on their first request instead
            replicas = await start_replicas(proxy.admin, store, kafka, settings.replica_id, settings.replica_wait_s)
            refresh = asyncio.ensure_future(store.refresh_offsets())
        elif store is not None:  # before the port opens: no call reaches a rollout that is not back yet
            t0 = time.perf_counter()
            try:
                live, finished, calls = await restore_registrations(store, proxy.admin)
            except (ClawstreamError, KafkaException) as exc:
                raise ConfigError(
                    f"cannot restore the proxy's registrations from {store.topic}: {exc} (persist_registrations, "
                    "CLAWSTREAM_PROXY_PERSIST_REGISTRATIONS=false: start without them)"
                ) from exc
            took = time.perf_counter() - t0
            log.info(
                "restored %d registrations (%d calls replayed) in %.2f s; %d finished", live, calls, took, finished
            )
            refresh = asyncio.ensure_future(store.refresh_offsets())
        runners = [web.AppRunner(proxy.app()), web.AppRunner(proxy.admin_app())]
        sites = ((settings.host, settings.port), (settings.admin_host, settings.admin_port))
        try:
            for runner, (host, port) in zip(runners, sites, strict=True):
                await runner.setup()
                await web.TCPSite(runner, host, port).start()
            log.info(
                "proxy on http://%s:%s, admin on http://%s:%s (engine %s)",
                *sites[0],
                *sites[1],
                settings.engine_url,
            )
            if settings.admin_token is None:
                print(f"admin token: {proxy.admin.token}", flush=True)
            await asyncio.Event().wait()
        finally:
            for runner in runners:
                await runner.cleanup()
    finally:
        if refresh is not None:
            refresh.cancel()
        if replicas is not None:
            await replicas.close()
        if store is not None:
            store.close()
        publisher.close()


def main(argv: list[str] | None, proxy_type: Any) -> int:
    """The command line: settings from flags and env, the broker checked, :func:`serve`; 2 on a config error."""
    parser = argparse.ArgumentParser(prog="python -m producers.proxy.app", description=DESCRIPTION)
    parser.add_argument("--model", type=Path, help="model directory (tokenizer + chat template)")
    parser.add_argument(
        "--engine-url", action="append", help="inference engine base URL; repeat it for a pool of engines"
    )
    parser.add_argument("--engine-model", help=f"model name sent to the engine (default {DEFAULT_MODEL_NAME!r})")
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    parser.add_argument("--admin-host")
    parser.add_argument("--admin-port", type=int)
    parser.add_argument("--admin-token")
    add_kafka_arguments(parser)
    args = parser.parse_args(argv)
    overrides = {k: v for k, v in vars(args).items() if v is not None and k not in ("bootstrap", "topic_prefix")}
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        settings = load_settings(ProxySettings, **overrides)
        kafka = kafka_settings(args)
        log.info("Kafka at %s", check_broker(kafka))  # fail now, naming the address tried
        if settings.persist_registrations:
            try:
                require_topics(kafka, [PROXY_REGISTRATIONS])
            except ConfigError as exc:
                raise ConfigError(
                    f"{exc} (persist_registrations, CLAWSTREAM_PROXY_PERSIST_REGISTRATIONS=false: run without "
                    "restoring registrations after a restart)"
                ) from exc
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve(settings, kafka, proxy_type))
    except KeyboardInterrupt:
        pass
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
