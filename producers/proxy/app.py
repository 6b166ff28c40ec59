"""The serving proxy: real agent harnesses ↔ policy inference engine, recording every model call to Kafka.

HTTP in (harnesses, per rollout, base URL ``{public_url}/r/{rollout_id}`` or ``.../v1``):
``POST .../messages`` (Anthropic, also ``?beta=true``), ``.../chat/completions`` (OpenAI Chat), ``.../responses``
(OpenAI Responses), streaming or not; ``HEAD`` on the base answers 200. The harness sends its rollout's secret as
API key (``x-api-key`` or ``Authorization: Bearer``).
Admin (``Authorization: Bearer <admin token>``): ``POST /admin/rollouts`` registers a rollout ({rollout_id?, ttl_s?,
temperature?, top_p?, top_k?, max_tokens?, seed?, attempt_id?} → {rollout_id, secret, base_url, expires_at_ms};
every call event of the rollout carries ``attempt_id`` and the sampling settings); ``GET
/admin/rollouts/{id}`` shows its state; ``POST /admin/rollouts/{id}/seal`` revokes the secret, waits for calls in
flight and returns {calls_served, status: ok | infra_failure, infra_failure, messages} (``messages``: the last
main-agent call's conversation plus its answer, OpenAI Chat shaped); ``DELETE`` forgets it.
Sealing semantics: a call after the seal is rejected with **401** in the caller's dialect (the secret is revoked),
because the SDKs retry 409 but never 401, so the harness stops instead of hammering a finished rollout.
Out: engine ``POST {engine_url}/v1/completions`` (vLLM subset: token-id prompt, logprobs, return_token_ids) for
the model ``--engine-model`` (default ``policy``, the name ``clawstream infer`` serves by default), and one Avro
``CallEvent`` per served call to ``clawstream.calls`` keyed by rollout id, published (acks=all) *before* the
answer is released. From the engine's answer (:func:`engine_reply`) the proxy also takes the cached prompt tokens
(``usage.prompt_tokens_details.cached_tokens``: our CPU engine always reports it, vLLM when started with
``--enable-prompt-tokens-details``) and the engine's GPU readings (top-level ``engine_telemetry``, our CPU engine
on a GPU with NVML): both go onto the call event (``cached_prompt_tokens``, ``gpu_utilization``,
``gpu_memory_used_bytes``; null when the engine did not report them), and the cached count is reported to the
harness in its dialect's own usage field (``producers.proxy.emit``).
Errors in the dialect's format: 400 bad JSON/schema, 401 auth, 413 too large, 502 engine, 503 Kafka (the rollout
is flagged infrastructure failure). ``GET /metrics``: Prometheus.

Run: ``python -m producers.proxy --model DIR --engine-url URL --port N [--engine-model NAME]`` (env
``CLAWSTREAM_PROXY_*``, Kafka from ``CLAWSTREAM_KAFKA_*``).
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import math
import secrets
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from clawbase.errors import ConfigError
from clawbase.kafka.clients import check_broker
from clawbase.kafka.publisher import KafkaPublisher, Publisher, PublishError
from clawbase.settings import KafkaSettings, add_kafka_arguments, kafka_settings, load_settings
from policy import DEFAULT_MODEL_NAME
from producers.proxy import emit
from producers.proxy.conversation import (
    CallKindRules,
    Conversation,
    Message,
    ToolCall,
    classify_call,
    system_fingerprint,
    transcript_messages,
)
from producers.proxy.dialects import PARSERS, DialectError, ParsedRequest, custom_tool_names, error_body
from producers.proxy.metrics import ProxyMetrics
from producers.proxy.render import RenderError, RolloutRenderer, TemplateRenderer
from producers.proxy.tool_parse import parse_turn
from schemas.events import CallEvent, CallKind, Dialect, now_ms
from schemas.topics import CALLS

log = logging.getLogger("clawstream.proxy")


class ProxySettings(BaseSettings):
    """Serving-proxy configuration (env prefix ``CLAWSTREAM_PROXY_``)."""

    # validate_by_name: keyword arguments use the field names; the aliases only name the environment variables.
    model_config = SettingsConfigDict(
        env_prefix="CLAWSTREAM_PROXY_", frozen=True, extra="forbid", validate_by_name=True
    )

    model: Path = Field(description="Model directory whose tokenizer + chat template render prompts.")
    engine_url: str = Field(default="http://127.0.0.1:8000", description="Inference engine base URL (vLLM API).")
    engine_model: str = Field(
        default=DEFAULT_MODEL_NAME,
        # CLAWSTREAM_PROXY_SERVED_MODEL_NAME: the variable's earlier name, still read.
        validation_alias=AliasChoices("CLAWSTREAM_PROXY_ENGINE_MODEL", "CLAWSTREAM_PROXY_SERVED_MODEL_NAME"),
        description="'model' sent to the engine: its served model name (the engine's --served-model-name, "
        "default the same).",
    )
    host: str = Field(default="127.0.0.1", description="Interface to listen on.")
    port: int = Field(default=8100, description="Port to listen on (0: any free port).")
    public_url: str | None = Field(default=None, description="Base URL harnesses reach; default http://host:port.")
    admin_token: str | None = Field(default=None, description="Bearer token of the admin API; unset: random, logged.")
    max_request_bytes: int = Field(default=32 * 1024 * 1024, description="Larger request bodies get 413.")
    default_ttl_s: float = Field(default=6 * 3600, description="Lifetime of a rollout's secret unless registered.")
    default_max_tokens: int = Field(default=4096, description="Generation cap when the rollout sets none.")
    engine_timeout_s: float = Field(default=900.0, description="Longest wait for one engine answer (then 502).")
    keepalive_s: float = Field(default=5.0, description="SSE keep-alive period while the engine works.")
    publish_timeout_s: float = Field(default=30.0, description="Kafka delivery deadline per call (then 503).")
    seal_wait_s: float = Field(default=60.0, description="How long a seal waits for calls still in flight.")
    side_model_pattern: str = Field(default=CallKindRules.side_model_pattern, description="Regex: SIDE models.")
    compaction_pattern: str = Field(default=CallKindRules.compaction_pattern, description="Regex: COMPACTION.")
    short_system_chars: int = Field(default=4000, description="Tool-less calls with a shorter system prompt: SIDE.")


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


@dataclass
class Rollout:
    rollout_id: str
    secret: str
    expires_at_ms: int
    temperature: float
    top_p: float
    top_k: int  # 0 = off
    max_tokens: int
    seed: int | None
    renderer: RolloutRenderer
    attempt_id: str | None = None  # the sandbox worker's attempt: every call event carries it
    main_fingerprint: str | None = None
    next_seq: int = 0
    calls_served: int = 0
    in_flight: int = 0
    sealed: bool = False
    infra_failure: str | None = None
    errors: dict[int, int] = field(default_factory=dict)
    # The last main-agent call's conversation and the answer it got: the run's transcript, reported at seal.
    last_main: tuple[Conversation, Message] | None = None

    def status(self) -> dict[str, Any]:
        return {
            "rollout_id": self.rollout_id,
            "calls_served": self.calls_served,
            "in_flight": self.in_flight,
            "sealed": self.sealed,
            "expires_at_ms": self.expires_at_ms,
            "status": "infra_failure" if self.infra_failure else "ok",
            "infra_failure": self.infra_failure,
            "errors": {str(k): v for k, v in self.errors.items()},
        }


class Proxy:
    """One proxy process: rollouts, renderer, engine client, publisher, metrics."""

    def __init__(self, settings: ProxySettings, publisher: Publisher, topic: str, tokenizer: Any = None) -> None:
        self.s = settings
        self.publisher = publisher
        self.topic = topic
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(settings.model)
        self.template = TemplateRenderer(tokenizer)
        self.rules = CallKindRules(
            settings.side_model_pattern, settings.compaction_pattern, settings.short_system_chars
        )
        self.admin_token = settings.admin_token or secrets.token_urlsafe(24)
        self.rollouts: dict[str, Rollout] = {}
        self.metrics = ProxyMetrics()
        self.session: aiohttp.ClientSession | None = None
        self.public_url = (settings.public_url or f"http://{settings.host}:{settings.port}").rstrip("/")

    # --- app --------------------------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.s.max_request_bytes)
        for prefix in ("/r/{rid}/v1", "/r/{rid}"):
            app.router.add_post(prefix + "/messages", self._handler(Dialect.ANTHROPIC_MESSAGES))
            app.router.add_post(prefix + "/chat/completions", self._handler(Dialect.OPENAI_CHAT))
            app.router.add_post(prefix + "/responses", self._handler(Dialect.OPENAI_RESPONSES))
            app.router.add_route("HEAD", prefix, self._head)
            app.router.add_route("HEAD", prefix + "/", self._head)
        app.router.add_post("/admin/rollouts", self._register)
        app.router.add_get("/admin/rollouts/{rid}", self._status)
        app.router.add_post("/admin/rollouts/{rid}/seal", self._seal)
        app.router.add_delete("/admin/rollouts/{rid}", self._forget)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._head)
        app.on_startup.append(self._startup)
        app.on_cleanup.append(self._cleanup)
        return app

    async def _startup(self, _app: web.Application) -> None:
        timeout = aiohttp.ClientTimeout(total=self.s.engine_timeout_s, sock_connect=10)
        self.session = aiohttp.ClientSession(timeout=timeout)

    async def _cleanup(self, _app: web.Application) -> None:
        if self.session is not None:
            await self.session.close()

    async def _head(self, _request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _metrics(self, _request: web.Request) -> web.Response:
        body, content_type = self.metrics.exposition()
        return web.Response(body=body, headers={"Content-Type": content_type})

    # --- admin ------------------------------------------------------------------------------------------------

    def _check_admin(self, request: web.Request) -> None:
        given = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), self.admin_token.encode()):
            raise web.HTTPUnauthorized(text=json.dumps({"error": "bad admin token"}), content_type="application/json")

    def _rollout_or_404(self, request: web.Request) -> Rollout:
        self._check_admin(request)
        rollout = self.rollouts.get(request.match_info["rid"])
        if rollout is None:
            raise web.HTTPNotFound(text=json.dumps({"error": "unknown rollout"}), content_type="application/json")
        return rollout

    async def _register(self, request: web.Request) -> web.Response:
        self._check_admin(request)
        try:
            body = await request.json() if request.can_read_body else {}
            rid = str(body.get("rollout_id") or uuid.uuid4().hex)
            ttl = float(body.get("ttl_s") or self.s.default_ttl_s)
            seed = body.get("seed")
            attempt_id = body.get("attempt_id")
            if attempt_id is not None and not isinstance(attempt_id, str):
                raise TypeError(f"attempt_id must be a string, got {type(attempt_id).__name__}")
            temperature, top_p, top_k = sampling_settings(body)
            rollout = Rollout(
                rollout_id=rid,
                secret=secrets.token_urlsafe(32),
                expires_at_ms=now_ms() + int(ttl * 1000),
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                max_tokens=int(body.get("max_tokens") or self.s.default_max_tokens),
                seed=None if seed is None else int(seed),
                renderer=RolloutRenderer(self.template),
                attempt_id=attempt_id or None,
            )
        except (ValueError, TypeError, AttributeError) as exc:
            return web.json_response({"error": f"bad registration: {exc}"}, status=400)
        if not all(c.isalnum() or c in "-_." for c in rid):
            return web.json_response({"error": "rollout_id allows letters, digits, '-', '_', '.'"}, status=400)
        if rid in self.rollouts:
            return web.json_response({"error": f"rollout {rid} is already registered"}, status=409)
        self._sweep()
        self.rollouts[rid] = rollout
        self.metrics.rollouts.set(len(self.rollouts))
        return web.json_response(
            {
                "rollout_id": rid,
                "secret": rollout.secret,
                "base_url": f"{self.public_url}/r/{rid}",
                "expires_at_ms": rollout.expires_at_ms,
            },
            status=201,
        )

    async def _status(self, request: web.Request) -> web.Response:
        return web.json_response(self._rollout_or_404(request).status())

    async def _seal(self, request: web.Request) -> web.Response:
        rollout = self._rollout_or_404(request)
        rollout.sealed = True
        deadline = time.monotonic() + self.s.seal_wait_s
        while rollout.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if rollout.in_flight and not rollout.infra_failure:
            rollout.infra_failure = f"{rollout.in_flight} call(s) still in flight at seal"
        rollout.renderer = RolloutRenderer(self.template)  # free the token state; the rollout is over
        body = rollout.status()
        if rollout.last_main is not None:  # what the grader's transcript is built from (producers.tasks.transcript)
            body["messages"] = transcript_messages(*rollout.last_main)
        return web.json_response(body)

    async def _forget(self, request: web.Request) -> web.Response:
        rollout = self._rollout_or_404(request)
        self.rollouts.pop(rollout.rollout_id, None)
        self.metrics.rollouts.set(len(self.rollouts))
        return web.json_response(rollout.status())

    def _sweep(self) -> None:
        now = now_ms()
        for rid in [r for r, ro in self.rollouts.items() if ro.expires_at_ms < now and not ro.in_flight]:
            del self.rollouts[rid]

    # --- model calls ------------------------------------------------------------------------------------------

    def _handler(self, dialect: Dialect) -> Any:
        async def handle(request: web.Request) -> web.StreamResponse:
            t0 = time.perf_counter()
            try:
                return await self._call(request, dialect, t0)
            except ApiError as exc:
                self.metrics.errors.labels(dialect.value, str(exc.status)).inc()
                rollout = self.rollouts.get(request.match_info["rid"])
                if rollout is not None and exc.status != 401:
                    rollout.errors[exc.status] = rollout.errors.get(exc.status, 0) + 1
                return web.json_response(error_body(dialect, exc.status, exc.message), status=exc.status)
            finally:
                self.metrics.latency.labels(dialect.value).observe(time.perf_counter() - t0)

        return handle

    def _authenticate(self, request: web.Request) -> Rollout:
        rollout = self.rollouts.get(request.match_info["rid"])
        given = request.headers.get("x-api-key") or request.headers.get("Authorization", "").removeprefix("Bearer ")
        given = given.strip()
        # One message for every failure: a caller learns nothing about which rollouts exist.
        if rollout is None or not given or not hmac.compare_digest(given.encode(), rollout.secret.encode()):
            raise ApiError(401, "invalid API key for this rollout")
        if rollout.sealed:
            raise ApiError(401, "this rollout is sealed; its API key is revoked")
        if rollout.expires_at_ms < now_ms():
            raise ApiError(401, "this rollout's API key has expired")
        return rollout

    async def _read(self, request: web.Request, dialect: Dialect) -> tuple[ParsedRequest, dict[str, Any]]:
        if request.content_length is not None and request.content_length > self.s.max_request_bytes:
            raise ApiError(413, f"request body exceeds {self.s.max_request_bytes} bytes")
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge as exc:
            raise ApiError(413, f"request body exceeds {self.s.max_request_bytes} bytes") from exc
        try:
            body = json.loads(raw)
        except ValueError as exc:
            raise ApiError(400, f"request body is not valid JSON: {exc}") from exc
        try:
            return PARSERS[dialect](body), body
        except DialectError as exc:
            raise ApiError(400, str(exc)) from exc

    async def _call(self, request: web.Request, dialect: Dialect, t0: float) -> web.StreamResponse:
        received_ms = now_ms()
        rollout = self._authenticate(request)
        parsed, body = await self._read(request, dialect)
        t_parsed = time.perf_counter()
        try:
            rendered = rollout.renderer.render(parsed.conversation)
        except RenderError as exc:
            raise ApiError(400, f"cannot render the conversation: {exc}") from exc
        t_rendered = time.perf_counter()
        kind, rollout.main_fingerprint = classify_call(
            parsed.conversation, parsed.model, rollout.main_fingerprint, self.rules
        )
        prefix = {Dialect.ANTHROPIC_MESSAGES: "msg_", Dialect.OPENAI_CHAT: "chatcmpl-"}.get(dialect, "resp_")
        call_id = uuid.uuid4().hex
        response_id = prefix + call_id[:24]
        created = int(time.time())
        times = {"received_ms": (t_parsed - t0) * 1000, "render_ms": (t_rendered - t_parsed) * 1000}

        async def work() -> emit.Answer:
            max_tokens = min(parsed.max_tokens or rollout.max_tokens, rollout.max_tokens)
            t_engine = time.perf_counter()
            reply = await self._engine(rollout, rendered.prompt_ids, max_tokens)
            gen, finish = reply.token_ids, reply.finish
            times["engine_ms"] = (time.perf_counter() - t_engine) * 1000
            turn = parse_turn(self.template.decode(gen))
            id_prefix = "toolu_" if dialect == Dialect.ANTHROPIC_MESSAGES else "call_"
            ids = [f"{id_prefix}{uuid.uuid4().hex[:24]}" for _ in turn.tool_calls]
            calls = tuple(ToolCall(i, c.name, c.arguments) for i, c in zip(ids, turn.tool_calls, strict=True))
            answer_msg = Message("assistant", turn.text, turn.reasoning, calls)
            seq = rollout.next_seq
            rollout.next_seq += 1
            event = CallEvent(
                rollout_id=rollout.rollout_id,
                policy_version=reply.policy_version,
                timestamp_ms=received_ms,
                call_id=call_id,
                seq=seq,
                dialect=dialect,
                requested_model=parsed.model,
                call_kind=kind,
                new_tokens=rendered.new_tokens,
                prompt_len=len(rendered.prompt_ids),
                generated_tokens=gen,
                logprobs=reply.logprobs,
                finish_reason="tool_calls" if turn.tool_calls and finish == "stop" else finish,
                system_fingerprint=system_fingerprint(parsed.conversation.system),
                parent_call_id=rendered.parent_call_id,
                shared_prefix_len=rendered.shared_prefix_len,
                flags=rendered.flags + turn.flags,
                received_ms=times["received_ms"],
                render_ms=times["render_ms"],
                engine_ms=times["engine_ms"],
                total_ms=(time.perf_counter() - t0) * 1000,
                cached_prompt_tokens=reply.cached_tokens,
                gpu_utilization=reply.gpu_utilization,
                gpu_memory_used_bytes=reply.gpu_memory_used_bytes,
                attempt_id=rollout.attempt_id,
                temperature=rollout.temperature,
                top_p=rollout.top_p,
                top_k=rollout.top_k,
            )
            try:
                await self.publisher.publish(self.topic, rollout.rollout_id, event.to_bytes(), self.s.publish_timeout_s)
            except PublishError as exc:
                rollout.infra_failure = f"call {seq}: {exc}"
                log.error("rollout %s: %s", rollout.rollout_id, exc)
                raise ApiError(503, "the call could not be recorded (Kafka unavailable); retry later") from exc
            rollout.renderer.record(call_id, seq, rendered, gen, answer_msg)
            if kind == CallKind.MAIN:
                rollout.last_main = (parsed.conversation, answer_msg)
            rollout.calls_served += 1
            self.metrics.record_call(
                dialect.value,
                kind.value,
                len(rendered.prompt_ids),
                len(rendered.new_tokens),
                len(gen),
                rendered.rendered_tokens,
                times["render_ms"] / 1000,
                cached=reply.cached_tokens or 0,
            )
            return emit.Answer(
                turn,
                finish,
                len(rendered.prompt_ids),
                len(gen),
                parsed.model,
                response_id,
                created,
                ids,
                custom_tool_names(body),
                cached_tokens=min(reply.cached_tokens or 0, len(rendered.prompt_ids)),
            )

        rollout.in_flight += 1
        task = asyncio.ensure_future(work())
        task.add_done_callback(lambda _t: setattr(rollout, "in_flight", rollout.in_flight - 1))
        # Answer with a plain status if the outcome is known before a keep-alive is due (engine down → 502, ...).
        await asyncio.wait({task}, timeout=self.s.keepalive_s if parsed.stream else None)
        if task.done():
            answer = task.result()  # raises ApiError
            if not parsed.stream:
                return web.json_response(self._json_body(dialect, answer))
        return await self._stream(request, dialect, parsed, task, len(rendered.prompt_ids), response_id, created)

    def _json_body(self, dialect: Dialect, answer: emit.Answer) -> dict[str, Any]:
        if dialect == Dialect.ANTHROPIC_MESSAGES:
            return emit.anthropic_message(answer)
        if dialect == Dialect.OPENAI_CHAT:
            return emit.chat_completion(answer)
        return emit.responses_object(answer)

    async def _stream(
        self,
        request: web.Request,
        dialect: Dialect,
        parsed: ParsedRequest,
        task: asyncio.Future[emit.Answer],
        prompt_tokens: int,
        response_id: str,
        created: int,
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        responses = emit.ResponsesStream(response_id, parsed.model, created)
        if dialect == Dialect.ANTHROPIC_MESSAGES:
            preamble, keepalive = emit.anthropic_preamble(response_id, parsed.model, prompt_tokens), emit.ANTHROPIC_PING
        elif dialect == Dialect.OPENAI_CHAT:
            preamble = emit.chat_preamble(response_id, parsed.model, created, parsed.include_usage)
            keepalive = emit.KEEPALIVE_COMMENT
        else:
            preamble, keepalive = responses.preamble(), emit.KEEPALIVE_COMMENT
        await resp.write(preamble)
        while not task.done():
            await asyncio.wait({task}, timeout=self.s.keepalive_s)
            if not task.done():
                await resp.write(keepalive)
        try:
            answer = task.result()
        except ApiError as exc:
            self.metrics.errors.labels(dialect.value, str(exc.status)).inc()
            if dialect == Dialect.ANTHROPIC_MESSAGES:
                kind = error_body(dialect, exc.status, exc.message)["error"]["type"]
                await resp.write(emit.anthropic_stream_error(exc.message, kind))
            elif dialect == Dialect.OPENAI_CHAT:
                await resp.write(emit.chat_stream_error(error_body(dialect, exc.status, exc.message)))
            else:
                await resp.write(responses.error("server_error", exc.message))
            await resp.write_eof()
            return resp
        if dialect == Dialect.ANTHROPIC_MESSAGES:
            await resp.write(emit.anthropic_body(answer))
        elif dialect == Dialect.OPENAI_CHAT:
            await resp.write(emit.chat_body(answer, parsed.include_usage))
        else:
            await resp.write(responses.body(answer))
        await resp.write_eof()
        return resp

    async def _engine(self, rollout: Rollout, prompt: list[int], max_tokens: int) -> EngineReply:
        payload: dict[str, Any] = {
            "model": self.s.engine_model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": rollout.temperature,
            "top_p": rollout.top_p,
            "stop_token_ids": [self.template.im_end_id],
            "logprobs": 1,
            "return_token_ids": True,
            "skip_special_tokens": False,
        }
        if rollout.top_k > 0:
            payload["top_k"] = rollout.top_k
        if rollout.seed is not None:
            payload["seed"] = rollout.seed + rollout.next_seq
        assert self.session is not None
        url = self.s.engine_url.rstrip("/") + "/v1/completions"
        try:
            async with self.session.post(url, json=payload) as resp:
                text = await resp.text()
                if resp.status >= 400:
                    status = 400 if 400 <= resp.status < 500 else 502
                    raise ApiError(status, f"inference engine answered {resp.status}: {text[:300]}")
                data = json.loads(text)
                header_version = resp.headers.get("X-Policy-Version")
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise ApiError(502, f"inference engine unavailable at {self.s.engine_url}: {exc!r}") from exc
        return engine_reply(data, header_version)


@dataclass(frozen=True)
class EngineReply:
    """What the proxy takes from the engine's ``/v1/completions`` answer (its first choice)."""

    token_ids: list[int]
    logprobs: list[float]
    finish: str  # "stop" | "length"
    policy_version: int
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens; None: not reported
    gpu_utilization: float | None = None  # engine_telemetry.gpu_utilization (percent); None: not reported
    gpu_memory_used_bytes: int | None = None  # engine_telemetry.gpu_memory_used_bytes; None: not reported


def sampling_settings(body: dict[str, Any]) -> tuple[float, float, int]:
    """(temperature, top_p, top_k) of a registration (defaults 1.0, 1.0, 0 = off); ValueError names a bad one.

    They are the rollout's: every call is sampled with them whatever the harness asks for, and every call event
    records them, so the learner can recompute logprobs of the distribution each token was drawn from.
    """
    temperature, top_p = float(body.get("temperature", 1.0)), float(body.get("top_p", 1.0))
    top_k = body.get("top_k", 0)
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < -1:
        raise ValueError(f"top_k must be an integer >= 0 (0 or -1 = off), got {top_k!r}")
    return temperature, top_p, max(top_k, 0)


def _optional(value: Any, kind: type[int] | type[float]) -> Any:
    """A reported number as ``kind``, or ``None`` when absent, null or not a number (extras never fail a call)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
        return None
    return kind(value)


def engine_reply(data: Any, header_version: str | None = None) -> EngineReply:
    """Read the engine's answer: tokens, log-probs, finish reason and version (missing → :class:`ApiError` 502),
    plus the optional cached prompt tokens and GPU readings (missing or malformed → ``None``)."""
    try:
        choice = data["choices"][0]
        gen = [int(t) for t in choice["token_ids"]]
        logprobs = [float(x) for x in (choice.get("logprobs") or {}).get("token_logprobs") or []]
        finish = str(choice.get("finish_reason") or "stop")
        version = int(data.get("policy_version", header_version or 0))
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise ApiError(502, f"inference engine sent an unexpected answer: {exc!r}") from exc
    if len(logprobs) != len(gen):
        raise ApiError(502, f"inference engine sent {len(logprobs)} logprobs for {len(gen)} tokens")
    usage = data.get("usage")
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    telemetry = data.get("engine_telemetry")
    telemetry = telemetry if isinstance(telemetry, dict) else {}
    return EngineReply(
        gen,
        logprobs,
        "length" if finish == "length" else "stop",
        version,
        cached_tokens=_optional(details.get("cached_tokens"), int) if isinstance(details, dict) else None,
        gpu_utilization=_optional(telemetry.get("gpu_utilization"), float),
        gpu_memory_used_bytes=_optional(telemetry.get("gpu_memory_used_bytes"), int),
    )


async def serve(settings: ProxySettings, kafka: KafkaSettings) -> None:
    publisher = KafkaPublisher(kafka, settings.publish_timeout_s)
    proxy = Proxy(settings, publisher, kafka.topic(CALLS))
    runner = web.AppRunner(proxy.app())
    await runner.setup()
    await web.TCPSite(runner, settings.host, settings.port).start()
    log.info("proxy on http://%s:%s (engine %s)", settings.host, settings.port, settings.engine_url)
    if settings.admin_token is None:
        print(f"admin token: {proxy.admin_token}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
        publisher.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m producers.proxy.app", description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, help="model directory (tokenizer + chat template)")
    parser.add_argument("--engine-url", help="inference engine base URL")
    parser.add_argument("--engine-model", help=f"model name sent to the engine (default {DEFAULT_MODEL_NAME!r})")
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    parser.add_argument("--admin-token")
    add_kafka_arguments(parser)
    args = parser.parse_args(argv)
    overrides = {k: v for k, v in vars(args).items() if v is not None and k not in ("bootstrap", "topic_prefix")}
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        settings = load_settings(ProxySettings, **overrides)
        kafka = kafka_settings(args)
        log.info("Kafka at %s", check_broker(kafka))  # fail now, naming the address tried
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve(settings, kafka))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
