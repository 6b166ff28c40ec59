"""The proxy's rollouts and its admin API (``Authorization: Bearer <admin token>``).

``POST /admin/rollouts`` registers a rollout ({rollout_id?, ttl_s?, temperature?, top_p?, top_k?, max_tokens?,
seed?, attempt_id?} → {rollout_id, secret, base_url, expires_at_ms}); ``GET /admin/rollouts/{id}`` shows its
state; ``POST /admin/rollouts/{id}/seal`` revokes the secret, waits for calls in flight and returns
{calls_served, status: ok | infra_failure, infra_failure, messages}; ``DELETE`` forgets it. The sandbox worker is
the client (``producers.sandbox.rollout.ProxyAdmin``); details: docs/method.md#the-proxys-http-interface.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import math
import secrets
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from producers.proxy.conversation import Conversation, Message, transcript_messages
from producers.proxy.metrics import ProxyMetrics
from producers.proxy.render import RolloutRenderer, TemplateRenderer
from schemas.events import now_ms


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


class Admin:
    """The registered rollouts (shared with the model-call handlers) and the admin routes over them."""

    def __init__(
        self,
        template: TemplateRenderer,
        metrics: ProxyMetrics,
        *,
        token: str,
        public_url: str,
        default_ttl_s: float,
        default_max_tokens: int,
        seal_wait_s: float,
    ) -> None:
        self.template, self.metrics, self.token, self.public_url = template, metrics, token, public_url
        self.default_ttl_s, self.default_max_tokens, self.seal_wait_s = default_ttl_s, default_max_tokens, seal_wait_s
        self.rollouts: dict[str, Rollout] = {}

    def add_routes(self, router: web.UrlDispatcher) -> None:
        router.add_post("/admin/rollouts", self._register)
        router.add_get("/admin/rollouts/{rid}", self._status)
        router.add_post("/admin/rollouts/{rid}/seal", self._seal)
        router.add_delete("/admin/rollouts/{rid}", self._forget)

    def _check_admin(self, request: web.Request) -> None:
        given = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), self.token.encode()):
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
            ttl = float(body.get("ttl_s") or self.default_ttl_s)
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
                max_tokens=int(body.get("max_tokens") or self.default_max_tokens),
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
        deadline = time.monotonic() + self.seal_wait_s
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
