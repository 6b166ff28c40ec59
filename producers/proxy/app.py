"""The serving proxy: real agent harnesses ↔ policy inference engine, recording every model call to Kafka.

In: harness calls per rollout at ``{public_url}/r/{rollout_id}`` (or ``.../v1``) on the routes of each dialect's
row in ``emit.EMITTERS`` (``POST .../messages``, ``.../chat/completions``, ``.../responses``,
``.../v1beta/models/{model}:generateContent``), streaming or not, with the rollout's secret as API key (``x-api-key``,
``x-goog-api-key`` or ``Authorization: Bearer``); ``HEAD`` on the base answers
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

import asyncio
import logging
import secrets
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from clawbase.errors import ClawstreamError
from clawbase.kafka.publisher import Publisher, PublishError
from producers.proxy import emit, server
from producers.proxy.admin import Admin, RegistrationStore
from producers.proxy.body_precheck import BodyPrecheck
from producers.proxy.call_event import call_event
from producers.proxy.conversation import CallKindRules, Message, ToolCall
from producers.proxy.dialects import ParsedRequest, RequestLimits, custom_tool_names
from producers.proxy.emit import EMITTERS, ApiError
from producers.proxy.engine_client import EngineReply
from producers.proxy.engine_pool import EnginePool
from producers.proxy.intake import PARSE_THREADS, Intake, check_fits, parse_body
from producers.proxy.metrics import ProxyMetrics
from producers.proxy.nesting import ECHO_DEPTH
from producers.proxy.quota import QUOTA_STATUS, Quotas
from producers.proxy.render import RenderError, RenderResult, TemplateRenderer
from producers.proxy.rollout_state import Rollout
from producers.proxy.settings import ProxySettings
from producers.proxy.tool_parse import ParsedTurn, parse_turn
from schemas.events import CallKind, Dialect, now_ms

log = logging.getLogger("clawstream.proxy")


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
        # Rendering and recording run here, off the event loop, one job at a time in arrival order: a 4 MiB
        # request would hold every other rollout's calls, keep-alives and seals for seconds. One thread keeps the
        # renderers' state (per rollout, and the shared segment cache) touched by one thread only. Bodies are parsed
        # on a pool of their own, and each rollout has one request at a time in intake (producers.proxy.intake).
        self.cpu = ThreadPoolExecutor(max_workers=1, thread_name_prefix="proxy-render")
        self.parsing = ThreadPoolExecutor(max_workers=PARSE_THREADS, thread_name_prefix="proxy-parse")
        self.intake = Intake()
        self.metrics.watch_intake(self.intake)
        # Large bodies are decoded and checked in processes of their own (producers.proxy.body_precheck).
        self.precheck = BodyPrecheck(settings.precheck_bytes, settings.max_json_values, settings.precheck_processes)

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
        asyncio.get_running_loop().run_in_executor(self.parsing, self.precheck.warm)  # not awaited: a while

    async def _cleanup(self, _app: web.Application) -> None:
        await self.engine.close()
        self.cpu.shutdown(wait=False, cancel_futures=True)
        self.parsing.shutdown(wait=False, cancel_futures=True)
        self.precheck.close()

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
        given = (
            request.headers.get("x-api-key")
            or request.headers.get("x-goog-api-key")  # Gemini
            or request.headers.get("Authorization", "").removeprefix("Bearer ")
        )
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

    async def _read(
        self, request: web.Request, dialect: Dialect, rollout_id: str
    ) -> tuple[ParsedRequest, dict[str, Any]]:
        """The body, read on the loop (in the rollout's turn), then decoded and parsed off it (:meth:`_parse`)."""
        if request.content_length is not None and request.content_length > self.settings.max_request_bytes:
            raise ApiError(413, f"request body exceeds {self.settings.max_request_bytes} bytes")
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge as exc:
            raise ApiError(413, f"request body exceeds {self.settings.max_request_bytes} bytes") from exc
        return await self.intake.run(rollout_id, self.parsing, self._parse, raw, dialect)

    def _parse(self, raw: bytes, dialect: Dialect) -> tuple[ParsedRequest, dict[str, Any]]:
        """The body decoded and parsed within the request limits (``producers.proxy.intake.parse_body``), a large
        one in a precheck process."""
        if self.precheck.applies(raw):
            return self.precheck.parse(raw, dialect, self.limits, (self.max_prompt_tokens, self.max_token_chars))
        return parse_body(raw, dialect, self.limits)

    def _check_fits(self, parsed: ParsedRequest) -> None:
        """400 now for a conversation too long for the model by its characters alone (tokenizing 4 MiB took 5 s)."""
        check_fits(parsed, self.max_prompt_tokens, self.max_token_chars)

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
        async with self.intake.turn(rollout.rollout_id):  # the rollout's earlier requests first; others beside it
            self._refuse(rollout.calls_left(self.quotas))  # its queued requests may have used the quota up
            parsed, body = await self._read(request, dialect, rollout.rollout_id)
            parsed = EMITTERS[dialect].route(parsed, request.match_info, request.path)
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
            rendered: RenderResult = await self.intake.run(
                rollout.rollout_id, self.cpu, rollout.renderer.render, parsed.conversation
            )
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


def main(argv: list[str] | None = None) -> int:
    """``python -m producers.proxy.app``: the proxy process (``producers.proxy.server``)."""
    return server.main(argv, Proxy)


if __name__ == "__main__":
    sys.exit(main())
