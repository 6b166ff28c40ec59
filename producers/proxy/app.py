"""The serving proxy: real agent harnesses ↔ policy inference engine, recording every model call to Kafka.

In: harness calls per rollout at ``{public_url}/r/{rollout_id}`` (or ``.../v1``) on the routes of each dialect's
row in ``emit.EMITTERS`` (``POST .../messages``, ``.../chat/completions``, ``.../responses``), streaming or not,
with the rollout's secret as API key (``x-api-key`` or ``Authorization: Bearer``); ``HEAD`` on the base answers
200; ``GET /healthz``. The admin API (``producers.proxy.admin``), ``GET /metrics`` (Prometheus) and ``GET /healthz``
are on a second listener (``admin_host:admin_port``, default loopback), which rollouts must not reach: the harness
listener answers 404 to an admin path. Per-rollout quotas on calls and prompt tokens (``producers.proxy.quota``).
Out: engine calls (``producers.proxy.engine_pool``: one engine, or several behind the router) and one ``CallEvent`` to
``clawstream.calls`` per served call (``producers.proxy.call_event``), published *before* the answer is released.
Errors come in the caller's dialect: 400 bad JSON/schema or past a request limit (nesting, messages), 401 auth
(also after the seal), 413 too large, 502 engine (after ``engine_retries`` while it is away), 503 Kafka; a 502 or
503 flags the rollout infrastructure failure.
Details: docs/method.md#the-proxys-http-interface.

Registrations (``persist_registrations``, on by default) are written to ``clawstream.proxy.registrations``; a
restarted proxy restores them before it opens its port (``producers.proxy.registry``); replicas behind one public URL
(``replica_id``) take rollouts over from each other on demand (``producers.proxy.replicas``).
Run: ``python -m producers.proxy --model DIR --engine-url URL [--engine-url URL ...] --port N --admin-port M`` (env
``CLAWSTREAM_PROXY_*``, Kafka from ``CLAWSTREAM_KAFKA_*``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
import secrets
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web
from confluent_kafka import KafkaException

from clawbase.errors import ClawstreamError, ConfigError
from clawbase.kafka.clients import check_broker, require_topics
from clawbase.kafka.publisher import KafkaPublisher, Publisher, PublishError
from clawbase.settings import KafkaSettings, add_kafka_arguments, kafka_settings, load_settings
from policy import DEFAULT_MODEL_NAME
from producers.proxy import emit
from producers.proxy.admin import Admin, RegistrationStore
from producers.proxy.call_event import call_event
from producers.proxy.conversation import CallKindRules, Message, ToolCall
from producers.proxy.dialects import (
    PARSERS,
    DialectError,
    ParsedRequest,
    RequestLimits,
    custom_tool_names,
    utf8_body,
)
from producers.proxy.emit import EMITTERS, ApiError
from producers.proxy.engine_client import EngineReply
from producers.proxy.engine_pool import EnginePool
from producers.proxy.metrics import ProxyMetrics
from producers.proxy.nesting import ECHO_DEPTH
from producers.proxy.quota import QUOTA_STATUS, Quotas
from producers.proxy.registry import RegistrationLog, restore_registrations
from producers.proxy.render import RenderError, RenderResult, TemplateRenderer
from producers.proxy.replicas import Replicas, start_replicas
from producers.proxy.rollout_state import Rollout
from producers.proxy.settings import ProxySettings
from producers.proxy.tool_parse import ParsedTurn, parse_turn
from schemas.events import CallKind, Dialect, now_ms
from schemas.topics import CALLS, PROXY_REGISTRATIONS

log = logging.getLogger("clawstream.proxy")


# A \uD800-\uDFFF escape in JSON text (paired ones decode to one character) or a surrogate's 3-byte form, which
# json.loads decodes with "surrogatepass": a lone one is a string UTF-8 cannot encode
# (the call event's encoding would fail after the engine had answered: a 500).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}|\xed[\xa0-\xbf]")


@dataclass
class _Call:
    """One admitted model call of a rollout, from its rendered prompt to its answer."""

    rollout: Rollout
    dialect: Dialect
    parsed: ParsedRequest
    body: dict[str, Any]  # the request as sent (its custom tools are named in the answer)
    rendered: RenderResult
    kind: CallKind
    call_id: str
    head: emit.StreamHead
    received_ms: int  # wall clock when it arrived: the call event's timestamp
    t0: float  # perf_counter when it arrived
    times: dict[str, float]  # received_ms, render_ms, engine_ms, total_ms (durations, as the call event has them)


class Proxy:
    """One proxy process: rollouts, renderer, engine client, publisher, metrics."""

    def __init__(
        self,
        settings: ProxySettings,
        publisher: Publisher,
        topic: str,
        tokenizer: Any = None,
        store: RegistrationStore | None = None,
    ) -> None:
        self.settings = settings
        self.publisher = publisher
        self.topic = topic
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(settings.model)
        self.template = TemplateRenderer(tokenizer)
        context = getattr(tokenizer, "model_max_length", None)
        self.max_prompt_tokens = settings.max_prompt_tokens or (
            context if isinstance(context, int) and context < 1 << 30 else None
        )
        # No token covers more characters than the vocabulary's longest entry, so a conversation with more than
        # max_prompt_tokens x that many characters cannot fit: refused before it is tokenized at all.
        self.max_token_chars = max((len(t) for t in tokenizer.get_vocab()), default=1)
        self.rules = CallKindRules(
            settings.side_model_pattern, settings.compaction_pattern, settings.short_system_chars
        )
        self.metrics = ProxyMetrics()
        self.engine = EnginePool(settings, self.template.end_of_turn_id, self.metrics, lambda: self.rollouts)
        self.admin = Admin(
            self.template,
            self.metrics,
            token=settings.admin_token or secrets.token_urlsafe(24),
            public_url=(settings.public_url or f"http://{settings.host}:{settings.port}").rstrip("/"),
            default_ttl_s=settings.default_ttl_s,
            default_max_tokens=settings.default_max_tokens,
            seal_wait_s=settings.seal_wait_s,
            store=store,
            replica=settings.replica_id,
        )
        self.rollouts = self.admin.rollouts
        self.admin_url = f"http://{settings.admin_host}:{settings.admin_port}"  # set by whoever learns a port 0
        self.quotas = Quotas(settings.max_calls_per_rollout, settings.max_prompt_tokens_per_rollout)
        self.limits = RequestLimits(settings.max_json_depth, settings.max_messages)
        # Parsing, rendering and recording run here, off the event loop, one job at a time in arrival order: a 4 MiB
        # request would hold every other rollout's calls, keep-alives and seals for seconds. One thread keeps the
        # renderers' state (per rollout, and the shared segment cache) touched by one thread only, as before.
        self.cpu = ThreadPoolExecutor(max_workers=1, thread_name_prefix="proxy-render")

    @property
    def public_url(self) -> str:
        return self.admin.public_url

    @public_url.setter
    def public_url(self, url: str) -> None:  # set by whoever learns the port only once the site is up
        self.admin.public_url = url

    # --- app --------------------------------------------------------------------------------------------------

    def app(self) -> web.Application:
        """The harness-facing API (``host:port``); no admin route (404): that is :meth:`admin_app`."""
        app = web.Application(client_max_size=self.settings.max_request_bytes)
        for prefix in ("/r/{rid}/v1", "/r/{rid}"):
            for dialect, emitter in EMITTERS.items():
                for path in emitter.paths:
                    app.router.add_post(prefix + path, self._handler(dialect))
            app.router.add_route("HEAD", prefix, self._head)
            app.router.add_route("HEAD", prefix + "/", self._head)
        app.router.add_get("/healthz", self._head)
        app.on_startup.append(self._startup)
        app.on_cleanup.append(self._cleanup)
        return app

    def admin_app(self) -> web.Application:
        """The admin listener (``admin_host:admin_port``): admin API, ``/metrics``, ``/healthz``."""
        app = web.Application()
        self.admin.add_routes(app.router)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._head)
        return app

    async def _startup(self, _app: web.Application) -> None:
        await self.engine.start()

    async def _cleanup(self, _app: web.Application) -> None:
        await self.engine.close()
        self.cpu.shutdown(wait=False, cancel_futures=True)

    async def _off_loop(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.cpu, fn, *args)

    async def _head(self, _request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _metrics(self, _request: web.Request) -> web.Response:
        body, content_type = self.metrics.exposition()
        return web.Response(body=body, headers={"Content-Type": content_type})

    # --- model calls ------------------------------------------------------------------------------------------

    def _handler(self, dialect: Dialect) -> Any:
        async def handle(request: web.Request) -> web.StreamResponse:
            t0 = time.perf_counter()
            try:
                return await self._call(request, dialect, t0)
            except ApiError as exc:
                self.metrics.errors.labels(dialect.value, str(exc.status)).inc()
                rollout = self.rollouts.get(request.match_info["rid"])
                if rollout is not None and exc.status != 401:  # a stranger's 401 is not the rollout's
                    rollout.count_error(exc.status)
                body = EMITTERS[dialect].error_body(exc.status, exc.message)
                return web.json_response(body, status=exc.status)
            finally:
                self.metrics.latency.labels(dialect.value).observe(time.perf_counter() - t0)

        return handle

    async def _authenticate(self, request: web.Request) -> Rollout:
        given = request.headers.get("x-api-key") or request.headers.get("Authorization", "").removeprefix("Bearer ")
        given = given.strip()
        try:  # replicas: this one's state of the rollout made current first
            await self.admin.make_current(request.match_info["rid"], given)
        except ClawstreamError as exc:
            raise ApiError(503, f"{exc}; retry later") from exc
        rollout = self.rollouts.get(request.match_info["rid"])
        # One message for every failure: a caller learns nothing about which rollouts exist.
        if rollout is None or not rollout.accepts(given):
            raise ApiError(401, "invalid API key for this rollout")
        if rollout.sealed:
            raise ApiError(401, "this rollout is sealed; its API key is revoked")
        if rollout.refused:
            raise ApiError(401, f"this rollout could not be restored after a proxy restart: {rollout.refused}")
        if rollout.expires_at_ms < now_ms():
            raise ApiError(401, "this rollout's API key has expired")
        return rollout

    async def _read(self, request: web.Request, dialect: Dialect) -> tuple[ParsedRequest, dict[str, Any]]:
        """The body, read on the loop, then decoded and parsed off it (:meth:`_parse`)."""
        if request.content_length is not None and request.content_length > self.settings.max_request_bytes:
            raise ApiError(413, f"request body exceeds {self.settings.max_request_bytes} bytes")
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge as exc:
            raise ApiError(413, f"request body exceeds {self.settings.max_request_bytes} bytes") from exc
        result: tuple[ParsedRequest, dict[str, Any]] = await self._off_loop(self._parse, raw, dialect)
        return result

    def _parse(self, raw: bytes, dialect: Dialect) -> tuple[ParsedRequest, dict[str, Any]]:
        """The body checked against the request limits (its nesting before it is decoded, its message count before
        the dialect's parser, the conversation before it is rendered), decoded and parsed: ``ApiError`` 400."""
        try:
            raw = utf8_body(raw)
            self.limits.check_text(raw)
            body = json.loads(raw)
            self.limits.check_body(body)
        except DialectError as exc:
            raise ApiError(400, str(exc)) from exc
        except ValueError as exc:
            raise ApiError(400, f"request body is not valid JSON: {exc}") from exc
        except RecursionError as exc:  # not past check_text; a client's error all the same, never a 500
            raise ApiError(400, "request body is nested too deeply") from exc
        if _SURROGATE_ESCAPE.search(raw):  # rare: only then check for a lone one (no UTF-8 for it: a 500 later)
            try:
                json.dumps(body, ensure_ascii=False).encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ApiError(
                    400, f"request body holds a lone UTF-16 surrogate escape (not a character): {exc}"
                ) from exc
        try:
            parsed = PARSERS[dialect](body)
            self.limits.check_parsed(parsed)
            return parsed, body
        except DialectError as exc:
            raise ApiError(400, str(exc)) from exc
        except (TypeError, ValueError, KeyError, AttributeError, RecursionError) as exc:
            # A shape no parser rule names yet: still the caller's mistake, answered in its dialect, never a 500
            # (SDKs retry 5xx). The parser's rule for it belongs in dialects.py; log so it gets one.
            log.warning("unparsed %s body shape (%s: %s): answered 400", dialect.value, type(exc).__name__, exc)
            raise ApiError(400, f"malformed request body ({type(exc).__name__}: {exc})"[:500]) from exc

    def _check_fits(self, parsed: ParsedRequest) -> None:
        """400 now for a conversation too long for the model by its characters alone (tokenizing 4 MiB took 5 s)."""
        if self.max_prompt_tokens is None:
            return
        chars = sum(len(m.content) + len(m.reasoning) for m in parsed.conversation.messages)
        at_least = chars // self.max_token_chars
        if at_least > self.max_prompt_tokens:
            raise ApiError(
                400,
                f"the prompt is at least {at_least} tokens ({chars} characters); the model's context is "
                f"{self.max_prompt_tokens}",
            )

    @staticmethod
    def _refuse(refused: str | None) -> None:
        """Refuse the call (no engine call, no call event) when a quota says so (the rollout flagged itself)."""
        if refused is not None:
            raise ApiError(QUOTA_STATUS, refused)

    async def _call(self, request: web.Request, dialect: Dialect, t0: float) -> web.StreamResponse:
        """Authenticate → quotas → read and parse → render → admit → serve in a task → its answer, or a stream of
        keep-alives while it runs."""
        received_ms = now_ms()
        rollout = await self._authenticate(request)
        self._refuse(rollout.calls_left(self.quotas))  # before the body is read
        parsed, body = await self._read(request, dialect)
        t_parsed = time.perf_counter()
        self._check_fits(parsed)
        rendered = await self._render(rollout, parsed)
        t_rendered = time.perf_counter()
        self._check_prompt(rendered)
        self._refuse(rollout.admit(self.quotas, len(rendered.prompt_ids)))  # counted from here
        kind = rollout.classify(parsed.conversation, parsed.model, self.rules)
        call_id = uuid.uuid4().hex
        head = emit.StreamHead(
            EMITTERS[dialect].response_id(call_id),
            parsed.model,
            int(time.time()),
            len(rendered.prompt_ids),
            parsed.include_usage,
        )
        times = {"received_ms": (t_parsed - t0) * 1000, "render_ms": (t_rendered - t_parsed) * 1000}
        call = _Call(rollout, dialect, parsed, body, rendered, kind, call_id, head, received_ms, t0, times)
        task = rollout.track(asyncio.ensure_future(self._serve(call)))
        # Answer with a plain status if the outcome is known before a keep-alive is due (engine down → 502, ...).
        await asyncio.wait({task}, timeout=self.settings.keepalive_s if parsed.stream else None)
        if task.done():
            answer = task.result()  # raises ApiError
            if not parsed.stream:
                return web.json_response(EMITTERS[dialect].body(answer))
        return await self._stream(request, dialect, EMITTERS[dialect].stream(head), task)

    async def _render(self, rollout: Rollout, parsed: ParsedRequest) -> RenderResult:
        try:
            rendered: RenderResult = await self._off_loop(rollout.renderer.render, parsed.conversation)
        except RenderError as exc:
            raise ApiError(400, f"cannot render the conversation: {exc}") from exc
        return rendered

    def _check_prompt(self, rendered: RenderResult) -> None:
        """400 for a rendered prompt that leaves the model no room to answer."""
        if self.max_prompt_tokens is not None and len(rendered.prompt_ids) >= self.max_prompt_tokens:
            raise ApiError(
                400,
                f"the prompt is {len(rendered.prompt_ids)} tokens; the model's context is {self.max_prompt_tokens}",
            )

    async def _serve(self, call: _Call) -> emit.Answer:
        """One admitted call: engine → parsed turn → call event published → the rollout records it → the answer
        (``ApiError`` for a failed engine call or publish)."""
        reply = await self._generate(call)
        gen = reply.token_ids
        turn = parse_turn(
            self.template.decode(gen),
            bare_json=self.template.tool_calls_bare_json,
            max_depth=self.settings.max_json_depth - ECHO_DEPTH,
        )
        ids = [f"{EMITTERS[call.dialect].tool_call_prefix}{uuid.uuid4().hex[:24]}" for _ in turn.tool_calls]
        calls = tuple(ToolCall(i, c.name, c.arguments) for i, c in zip(ids, turn.tool_calls, strict=True))
        answer_msg = Message("assistant", turn.text, turn.reasoning, calls)
        seq = await self._publish(call, reply, turn, answer_msg)
        rollout, rendered = call.rollout, call.rendered
        await self._off_loop(
            rollout.record_call, call.call_id, seq, rendered, gen, answer_msg, call.kind, call.parsed.conversation
        )
        prompt_len = len(rendered.prompt_ids)
        self.metrics.record_call(
            call.dialect.value,
            call.kind.value,
            prompt_len,
            len(rendered.new_tokens),
            len(gen),
            rendered.rendered_tokens,
            call.times["render_ms"] / 1000,
            cached=reply.cached_tokens or 0,
        )
        return emit.Answer(
            turn,
            reply.finish,
            prompt_len,
            len(gen),
            call.parsed.model,
            call.head.response_id,
            call.head.created,
            ids,
            custom_tool_names(call.body),
            cached_tokens=min(reply.cached_tokens or 0, prompt_len),
        )

    async def _generate(self, call: _Call) -> EngineReply:
        """The engine's answer, sampled with the rollout's settings; a 5xx (the engine failed, not the harness: never
        graded as the policy's zero) flags the rollout."""
        rollout = call.rollout
        max_tokens = rollout.max_tokens_for(call.parsed.max_tokens)
        t_engine = time.perf_counter()
        try:  # the client asks again, the same payload, while the engine is away (engine_retries)
            reply = await self.engine.complete(
                call.rendered.prompt_ids,
                max_tokens,
                temperature=rollout.temperature,
                top_p=rollout.top_p,
                top_k=rollout.top_k,
                seed=rollout.engine_seed(),
                rollout_id=rollout.rollout_id,
            )
        except ApiError as exc:
            if exc.status >= 500:
                self.admin.fail(rollout, f"engine call: {exc.message}")
            raise
        call.times["engine_ms"] = (time.perf_counter() - t_engine) * 1000
        return reply

    async def _publish(self, call: _Call, reply: EngineReply, turn: ParsedTurn, answer_msg: Message) -> int:
        """Number the call and publish its event (acks=all) before the answer is released; its seq. A failed
        publish is a 503 and flags the rollout."""
        rollout = call.rollout
        conversation = call.rendered.answered(answer_msg.key())  # what a follow-up extends (recorded on the event)
        seq = rollout.take_seq()
        call.times["total_ms"] = (time.perf_counter() - call.t0) * 1000
        event = call_event(
            rollout,
            call.parsed,
            call.rendered,
            reply,
            turn,
            call_id=call.call_id,
            seq=seq,
            kind=call.kind,
            timestamp_ms=call.received_ms,
            times_ms=call.times,
            conversation=conversation,
        )
        try:
            await self.publisher.publish(
                self.topic, rollout.rollout_id, event.to_bytes(), self.settings.publish_timeout_s
            )
        except PublishError as exc:
            self.admin.fail(rollout, f"call {seq}: {exc}")
            raise ApiError(503, "the call could not be recorded (Kafka unavailable); retry later") from exc
        return seq

    async def _stream(
        self, request: web.Request, dialect: Dialect, stream: emit.SseStream, task: asyncio.Future[emit.Answer]
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        await resp.write(stream.preamble())
        while not task.done():
            await asyncio.wait({task}, timeout=self.settings.keepalive_s)
            if not task.done():
                await resp.write(stream.keepalive)
        try:
            answer = task.result()
        except ApiError as exc:
            self.metrics.errors.labels(dialect.value, str(exc.status)).inc()
            await resp.write(stream.error(exc.status, exc.message))
        else:
            await resp.write(stream.body(answer))
        await resp.write_eof()
        return resp


async def serve(settings: ProxySettings, kafka: KafkaSettings) -> None:
    publisher = KafkaPublisher(kafka, settings.publish_timeout_s)
    store = RegistrationLog(kafka, publisher, settings.publish_timeout_s) if settings.persist_registrations else None
    proxy = Proxy(settings, publisher, kafka.topic(CALLS), store=store)
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m producers.proxy.app", description=__doc__.split("\n")[0])
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
        asyncio.run(serve(settings, kafka))
    except KeyboardInterrupt:
        pass
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
