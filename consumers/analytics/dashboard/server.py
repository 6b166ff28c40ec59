"""The dashboard's HTTP server: one page, its JSON state, Prometheus ``/metrics``; fed live from the topics.

Routes: ``/`` the page (``static/index.html``: plain JavaScript drawing with plotly.js), ``/static/plotly.min.js``
(the file shipped inside the ``plotly`` Python package, served from the installed package: no CDN, nothing
vendored), ``/static/<file>`` the page's own script and style, ``/api/state`` the snapshot of
:class:`~consumers.analytics.dashboard.state.DashboardState` the page polls, ``/metrics`` the same figures in
Prometheus text (capture health per harness and template, rollout statuses, rewards, weight versions, lag), and
``/api/lag`` with ``clawstream_consumer_lag{group,topic,partition}`` in ``/metrics``: each consumer group's lag on
the run's topics, asked of the broker at each request (``consumers/analytics/lag.py``); ``/healthz``. Binds
127.0.0.1 unless told otherwise (the page shows every rollout's details).

Run: ``clawstream dashboard [--port 8200] [--topic-prefix P] [--since 1h]`` or ``python -m
consumers.analytics.dashboard``; it prints ``dashboard on http://HOST:PORT/`` once it listens (``--port 0``: any
free port). In-process (a test, the demo): :func:`start_dashboard` returns a handle with ``url`` and ``stop()``.
Settings: env ``CLAWSTREAM_DASHBOARD_*``; Kafka from ``CLAWSTREAM_KAFKA_*``.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import logging
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from clawbase.errors import ClawstreamError, ConfigError
from clawbase.kafka.clients import make_admin
from clawbase.settings import KafkaSettings, load_settings
from consumers.analytics.dashboard.feed import LiveFeed
from consumers.analytics.dashboard.settings import DashboardSettings
from consumers.analytics.dashboard.state import DashboardState
from consumers.analytics.lag import read_lag
from consumers.analytics.lag_report import GroupLag, report_json

log = logging.getLogger("clawstream.dashboard")
STATIC = Path(__file__).resolve().parent / "static"
PAGE_FILES = {"dashboard.js": "application/javascript", "dashboard.css": "text/css"}


def plotly_js() -> Path:
    """The plotly.js file shipped inside the installed ``plotly`` package (found without importing it)."""
    spec = importlib.util.find_spec("plotly")
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = Path(root) / "package_data" / "plotly.min.js"
        if path.is_file():
            return path
    raise ConfigError(
        "the dashboard draws with plotly.js from the `plotly` Python package, which is not installed "
        "(or ships no package_data/plotly.min.js): pip install plotly"
    )


# ---- Prometheus -----------------------------------------------------------------------------------------------------
class _SnapshotCollector(Collector):
    """Prometheus families built from a fresh snapshot at every scrape."""

    def __init__(self, snapshot: Any) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Any]:
        snap = self._snapshot()
        records = CounterMetricFamily("clawstream_dashboard_records", "Records read per topic", labels=["topic"])
        for topic, n in snap["records"].items():
            records.add_metric([topic], n)
        yield records
        errors = CounterMetricFamily("clawstream_dashboard_decode_errors", "Records that did not decode")
        errors.add_metric([], snap["errors"]["count"])
        yield errors
        status = GaugeMetricFamily(
            "clawstream_rollouts", "Rollouts by status of their latest attempt", labels=["status"]
        )
        for name, n in snap["status"].items():
            status.add_metric([name], n)
        yield status
        reward = GaugeMetricFamily(
            "clawstream_reward_mean", "Mean reward of the latest step with a reward", labels=["harness", "step"]
        )
        for series, data in snap["reward"].items():
            if data["steps"]:
                reward.add_metric([series, str(data["steps"][-1])], data["mean"][-1])
        yield reward
        published = snap["weights"]["latest_published"]
        weights = GaugeMetricFamily("clawstream_weights_published_version", "Newest weight version published")
        if published is not None:
            weights.add_metric([], published)
        yield weights
        applied = GaugeMetricFamily(
            "clawstream_weights_applied_version", "Newest weight version an engine applied", labels=["engine"]
        )
        for engine, data in snap["weights"]["applied"].items():
            if data["version"]:
                applied.add_metric([engine], max(data["version"]))
        yield applied
        lag = GaugeMetricFamily(
            "clawstream_policy_lag", "Policy lag of main calls in the latest bucket", labels=["stat"]
        )
        if snap["lag"]["t"]:
            lag.add_metric(["mean"], snap["lag"]["mean"][-1])
            lag.add_metric(["max"], snap["lag"]["max"][-1])
        yield lag
        yield from _health_families(snap["health"])


_HEALTH_COUNTS = (
    "rollouts",
    "main_calls",
    "follow_ups",
    "extends",
    "forks",
    "answer_forks",
    "full_renders",
    "retry_orphans",
    "stale_attempt_calls",
    "unresolved_calls",
    "tampered_rollouts",
    "tampered_calls",
    "grader_error_rollouts",
    "masked_tokens",
    "generated_tokens",
)
_HEALTH_RATES = (
    "extends_share",
    "full_renders_per_rollout",
    "forks_per_rollout",
    "masked_token_fraction",
    "prefix_cache_hit_rate",
)


def _health_families(rows: list[dict[str, Any]]) -> Iterator[Any]:
    labels = ["harness", "template"]
    for name in _HEALTH_COUNTS:
        family = CounterMetricFamily(
            f"clawstream_capture_{name}", f"Capture health: {name.replace('_', ' ')}", labels=labels
        )
        for row in rows:
            family.add_metric([row["harness"], row["template"]], row[name])
        yield family
    for name in _HEALTH_RATES:
        family = GaugeMetricFamily(
            f"clawstream_capture_{name}", f"Capture health: {name.replace('_', ' ')}", labels=labels
        )
        for row in rows:
            if row[name] is not None:
                family.add_metric([row["harness"], row["template"]], row[name])
        yield family


class _LagCollector(Collector):
    """``clawstream_consumer_lag``: each group's lag per partition of the run's topics, asked of the broker at every
    scrape (no sample where a group has committed nothing; none at all while the broker does not answer)."""

    def __init__(self, read: Any) -> None:
        self._read = read

    def collect(self) -> Iterator[Any]:
        family = GaugeMetricFamily(
            "clawstream_consumer_lag",
            "Consumer lag in offsets: last stable offset - the group's committed offset",
            labels=["group", "topic", "partition"],
        )
        try:
            groups: list[GroupLag] = self._read()
        except ClawstreamError as exc:
            log.warning("consumer lag not exported: %s", exc)
            groups = []
        for g in groups:
            for p in g.partitions:
                if p.lag is not None:
                    family.add_metric([g.group, p.topic, str(p.partition)], p.lag)
        yield family


# ---- the app --------------------------------------------------------------------------------------------------------
class Dashboard:
    """State + lock + feed + the aiohttp app around them."""

    def __init__(self, settings: DashboardSettings, kafka: KafkaSettings | None) -> None:
        self.settings = settings
        self.kafka = kafka
        self.state = DashboardState(bucket_s=settings.bucket_s)
        self.lock = threading.Lock()
        self.plotly = plotly_js()
        self.feed = LiveFeed(kafka, self.state, self.lock, since_ms=settings.since_ms) if kafka is not None else None
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_SnapshotCollector(self.snapshot))
        self._admin: Any = None
        if kafka is not None:
            self.registry.register(_LagCollector(self.read_lag))

    def read_lag(self) -> list[GroupLag]:
        """Every consumer group's lag on the run's topics, from the broker now (one admin client, reused)."""
        if self.kafka is None:
            return []
        if self._admin is None:
            self._admin = make_admin(self.kafka)
        return read_lag(self.kafka, admin=self._admin, timeout=10.0)

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            snap = self.state.snapshot()
        snap["feed"] = {
            "prefix": self.kafka.topic_prefix if self.kafka is not None else None,
            "assigned": sorted(self.feed.assigned) if self.feed is not None else [],
            "alive": self.feed.alive if self.feed is not None else False,
            "error": self.feed.error if self.feed is not None else None,
        }
        snap["refresh_ms"] = self.settings.refresh_ms
        return snap

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/", self._index)
        app.router.add_get("/static/plotly.min.js", self._plotly)
        app.router.add_get("/static/{name}", self._static)
        app.router.add_get("/api/state", self._state)
        app.router.add_get("/api/lag", self._lag)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        app.on_startup.append(self._startup)
        app.on_cleanup.append(self._cleanup)
        return app

    async def _startup(self, _app: web.Application) -> None:
        if self.feed is not None:
            self.feed.start()

    async def _cleanup(self, _app: web.Application) -> None:
        if self.feed is not None:
            await asyncio.to_thread(self.feed.stop)

    async def _index(self, _request: web.Request) -> web.FileResponse:
        return web.FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    async def _plotly(self, _request: web.Request) -> web.FileResponse:
        return web.FileResponse(
            self.plotly, headers={"Content-Type": "application/javascript", "Cache-Control": "max-age=86400"}
        )

    async def _static(self, request: web.Request) -> web.FileResponse:
        name = request.match_info["name"]
        if name not in PAGE_FILES:  # a fixed list: no path from the request ever reaches the file system
            raise web.HTTPNotFound(text=f"no static file {name}")
        return web.FileResponse(STATIC / name, headers={"Content-Type": PAGE_FILES[name], "Cache-Control": "no-cache"})

    async def _state(self, _request: web.Request) -> web.Response:
        snap = await asyncio.to_thread(self.snapshot)  # health rows are recomputed here: keep the loop free
        return web.Response(
            text=json.dumps(snap, allow_nan=False),
            content_type="application/json",
            headers={"Cache-Control": "no-store"},
        )

    async def _lag(self, _request: web.Request) -> web.Response:
        try:
            body: dict[str, Any] = report_json(await asyncio.to_thread(self.read_lag))
        except ClawstreamError as exc:
            body = {"groups": [], "error": str(exc)}
        return web.json_response(body, headers={"Cache-Control": "no-store"})

    async def _metrics(self, _request: web.Request) -> web.Response:
        body = await asyncio.to_thread(generate_latest, self.registry)
        return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def _healthz(self, _request: web.Request) -> web.Response:
        alive = self.feed is None or self.feed.alive
        return web.json_response(
            {"ok": alive, "error": self.feed.error if self.feed else None}, status=200 if alive else 503
        )


async def serve(dashboard: Dashboard, *, stop: asyncio.Event | None = None, on_listening: Any = None) -> None:
    """Serve until ``stop`` is set; ``on_listening(url)`` once the socket listens."""
    runner = web.AppRunner(dashboard.app(), access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, dashboard.settings.host, dashboard.settings.port)
        try:
            await site.start()
        except OSError as exc:
            raise ConfigError(
                f"cannot listen on {dashboard.settings.host}:{dashboard.settings.port}: {exc} "
                "(pick another --port, or 0 for any free one)"
            ) from exc
        host, port = runner.addresses[0][:2]
        url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}/"
        if on_listening is not None:
            on_listening(url)
        await (stop or asyncio.Event()).wait()
    finally:
        await runner.cleanup()


@dataclass
class DashboardHandle:
    """A dashboard running in a thread of this process (:func:`start_dashboard`)."""

    url: str
    dashboard: Dashboard
    _loop: asyncio.AbstractEventLoop
    _stop: asyncio.Event
    _thread: threading.Thread

    def stop(self, timeout: float = 15.0) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout)


def start_dashboard(
    kafka: KafkaSettings, *, host: str = "127.0.0.1", port: int = 0, since_ms: int | None = None, timeout: float = 30.0
) -> DashboardHandle:
    """Start a dashboard over ``kafka``'s topics (its prefix) in a background thread; returns once it listens."""
    dashboard = Dashboard(load_settings(DashboardSettings, host=host, port=port, since_ms=since_ms), kafka)
    ready: dict[str, Any] = {}
    started = threading.Event()

    def run() -> None:
        loop = asyncio.new_event_loop()
        stop = asyncio.Event()
        ready.update(loop=loop, stop=stop)

        def listening(url: str) -> None:
            ready["url"] = url
            started.set()

        try:
            loop.run_until_complete(serve(dashboard, stop=stop, on_listening=listening))
        except Exception as exc:  # noqa: BLE001 - handed to the caller below
            ready["error"] = exc
            started.set()
        finally:
            loop.close()

    thread = threading.Thread(target=run, name="dashboard", daemon=True)
    thread.start()
    if not started.wait(timeout) or "error" in ready:
        raise ClawstreamError(f"the dashboard did not start: {ready.get('error', f'not listening after {timeout}s')}")
    return DashboardHandle(ready["url"], dashboard, ready["loop"], ready["stop"], thread)


def main(argv: list[str] | None = None) -> int:
    from clawbase.kafka.clients import check_broker
    from clawbase.settings import add_kafka_arguments, kafka_settings
    from consumers.analytics.records import parse_time_ms

    parser = argparse.ArgumentParser(
        prog="clawstream dashboard",
        description=__doc__.split("\n\n")[0],
        epilog="Panels and figures: docs/dashboard.md",
    )
    parser.add_argument("--port", type=int, help="port to listen on (default 8200; 0: any free port)")
    parser.add_argument("--host", help="interface to listen on (default 127.0.0.1)")
    parser.add_argument(
        "--since",
        metavar="TIME",
        help="read the topics from TIME: epoch ms, ISO 8601 or an age such as 2h (default: from the beginning)",
    )
    parser.add_argument("--bucket-s", type=int, help="throughput / lag bucket width in seconds (default 10)")
    parser.add_argument("--refresh-ms", type=int, help="page refresh period (default 2000)")
    parser.add_argument("--prefix", dest="topic_prefix", metavar="PREFIX", default=None, help="same as --topic-prefix")
    add_kafka_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        overrides = {
            k: v
            for k, v in {
                "host": args.host,
                "port": args.port,
                "bucket_s": args.bucket_s,
                "refresh_ms": args.refresh_ms,
            }.items()
            if v is not None
        }
        if args.since:
            overrides["since_ms"] = parse_time_ms(args.since)
        settings = load_settings(DashboardSettings, **overrides)
        kafka = kafka_settings(args)
        log.info("Kafka at %s, topic prefix %r", check_broker(kafka), kafka.topic_prefix)
        dashboard = Dashboard(settings, kafka)
        started = time.monotonic()
        asyncio.run(
            serve(
                dashboard,
                on_listening=lambda url: print(
                    f"dashboard on {url} (ready in {time.monotonic() - started:.1f}s)", flush=True
                ),
            )
        )
    except ClawstreamError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        pass
    return 0
