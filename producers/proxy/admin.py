"""The proxy's rollouts and its admin API (``Authorization: Bearer <admin token>``).

``POST /admin/rollouts`` registers a rollout ({rollout_id?, ttl_s?, temperature?, top_p?, top_k?, max_tokens?,
seed?, attempt_id?, attempt?, lease_s?} → {rollout_id, secret, base_url, expires_at_ms}); ``GET /admin/rollouts/{id}``
shows its state; ``POST /admin/rollouts/{id}/seal`` revokes the secret, waits for calls in flight and returns
{calls_served, status: ok | infra_failure | quota_exceeded, infra_failure, quota_exceeded, usage, messages};
``POST .../renew`` extends the lease; ``DELETE`` forgets it (``?finished=1``: the attempt's terminal events are
out, so the same request attempt is not registered again). The sandbox worker is the client
(``producers.sandbox.rollout.ProxyAdmin``); the routes are served only on the admin listener (``Proxy.admin_app``).

One registration per rollout id, held by one attempt. A registration with ``lease_s`` is *live* while its holder
renews it; a second registration of the id gets 409 naming the holder and whether it is live (or finished), and the
client waits for a live one or revokes a dead one. ``?attempt_id=A`` scopes seal, renew and forget to attempt A:
another attempt's registration of the id is left alone (409). Details: docs/method.md#the-proxys-http-interface.

With a :class:`RegistrationStore` (``producers.proxy.registry``) each change of a rollout id's registration —
register, seal, forget, an infrastructure failure — writes its current state to the compacted registrations topic
(a tombstone once nothing is left to remember; renewals are not written), and :meth:`Admin.restore` puts back what a
restarted proxy read there (``producers.proxy.restore``): the secret's sha256 only, checked in constant time.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiohttp import web

from clawbase.errors import ClawstreamError
from clawbase.kafka.publisher import PublishError
from producers.proxy.conversation import Conversation, Message, transcript_messages
from producers.proxy.metrics import ProxyMetrics
from producers.proxy.quota import QUOTA_STATUS_NAME, Usage
from producers.proxy.render import RolloutRenderer, TemplateRenderer
from producers.proxy.restore import Replayed, secret_matches, secret_sha256
from schemas.events import ProxyRegistration, now_ms

log = logging.getLogger("clawstream.proxy")


@dataclass
class Rollout:
    rollout_id: str
    secret: str | None  # None: restored after a restart, known by ``secret_sha256`` only
    expires_at_ms: int
    temperature: float
    top_p: float
    top_k: int  # 0 = off
    max_tokens: int
    seed: int | None
    renderer: RolloutRenderer
    attempt_id: str | None = None  # the sandbox worker's attempt: every call event carries it
    attempt: int | None = None  # the request's attempt number (a re-issue after an infra failure has a higher one)
    lease_s: float | None = None  # None: no lease (an older client): a conflicting registration may revoke it
    lease_expires_at_ms: int | None = None
    main_fingerprint: str | None = None
    next_seq: int = 0
    calls_served: int = 0
    in_flight: int = 0
    sealed: bool = False
    infra_failure: str | None = None
    errors: dict[int, int] = field(default_factory=dict)
    # The last main-agent call's conversation and the answer it got: the run's transcript, reported at seal.
    last_main: tuple[Conversation, Message] | None = None
    secret_sha256: str = ""
    registered_at_ms: int = 0
    calls_offsets: dict[str, int] = field(default_factory=dict)  # where its call events start (registrations topic)
    restored: bool = False  # put back after a proxy restart
    refused: str | None = None  # its state could not be restored: calls get 401 with this reason
    usage: Usage = field(default_factory=Usage)  # what its quotas count (producers.proxy.quota)
    quota_exceeded: str | None = None  # the first call a quota refused: the policy's doing, graded as usual

    def accepts(self, key: str) -> bool:
        """Whether ``key`` is this rollout's secret (constant-time; a restored rollout compares sha256 digests)."""
        if not key:
            return False
        if self.secret is not None:
            return hmac.compare_digest(key.encode(), self.secret.encode())
        return secret_matches(key, self.secret_sha256)

    def live(self, now: int) -> bool:
        """Its holder renewed the lease in time (a registration without a lease is never presumed alive)."""
        return self.lease_expires_at_ms is not None and now < self.lease_expires_at_ms

    def holder(self) -> dict[str, Any]:
        return {
            "attempt_id": self.attempt_id,
            "attempt": self.attempt,
            "live": self.live(now_ms()),
            "lease_expires_at_ms": self.lease_expires_at_ms,
        }

    def status(self) -> dict[str, Any]:
        return {
            "rollout_id": self.rollout_id,
            **self.holder(),
            "calls_served": self.calls_served,
            "in_flight": self.in_flight,
            "sealed": self.sealed,
            "expires_at_ms": self.expires_at_ms,
            "status": "infra_failure" if self.infra_failure else QUOTA_STATUS_NAME if self.quota_exceeded else "ok",
            "infra_failure": self.infra_failure,
            "quota_exceeded": self.quota_exceeded,
            "usage": {"calls": self.usage.calls, "prompt_tokens": self.usage.prompt_tokens},
            "errors": {str(k): v for k, v in self.errors.items()},
            "restored": self.restored,
        }


@dataclass(frozen=True)
class Finished:
    """A forgotten registration whose attempt finished (its terminal events are out): that request attempt and any
    earlier one are done, a redelivery of them is not registered again (409 with ``finished``) until
    ``expires_at_ms``."""

    attempt_id: str | None
    attempt: int
    expires_at_ms: int


class RegistrationStore(Protocol):
    """Where the registrations are written (``producers.proxy.registry.RegistrationLog``)."""

    def calls_offsets(self) -> dict[str, int]:
        """Offsets of the calls topic per partition, taken before now: a new rollout's call events lie after them."""
        ...

    async def write(self, rollout_id: str, record: ProxyRegistration | None) -> None:
        """Publish (acks=all, awaited) the rollout id's record, or a tombstone; ``PublishError`` when it failed."""
        ...


@dataclass
class _KeyLock:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0


def _json_error(status: int, message: str, **fields: Any) -> web.HTTPException:
    cls = {404: web.HTTPNotFound, 409: web.HTTPConflict}[status]
    return cls(text=json.dumps({"error": message, **fields}), content_type="application/json")


def _optional_int(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    return value


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
        finished_retention_s: float = 7200.0,
        store: RegistrationStore | None = None,
        replica: str = "",
    ) -> None:
        self.template, self.metrics, self.token, self.public_url = template, metrics, token, public_url
        self.default_ttl_s, self.default_max_tokens, self.seal_wait_s = default_ttl_s, default_max_tokens, seal_wait_s
        self.finished_retention_s = finished_retention_s
        self.rollouts: dict[str, Rollout] = {}
        self.finished: dict[str, Finished] = {}  # rollout id → its last finished attempt (forgotten with finished=1)
        self.store, self.replica = store, replica
        # Replicas (producers.proxy.replicas): makes a rollout's state current before any request of it is handled.
        # Its second argument: the API key a harness call presented (None: an admin request, already authorized).
        self.before: Callable[[str, str | None], Awaitable[None]] | None = None
        self._locks: dict[str, _KeyLock] = {}  # one writer of a rollout id's record at a time
        self._background: set[asyncio.Task[None]] = set()

    def add_routes(self, router: web.UrlDispatcher) -> None:
        router.add_post("/admin/rollouts", self._register)
        router.add_get("/admin/rollouts/{rid}", self._status)
        router.add_post("/admin/rollouts/{rid}/seal", self._seal)
        router.add_post("/admin/rollouts/{rid}/renew", self._renew)
        router.add_delete("/admin/rollouts/{rid}", self._forget)

    def _check_admin(self, request: web.Request) -> None:
        given = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), self.token.encode()):
            raise web.HTTPUnauthorized(text=json.dumps({"error": "bad admin token"}), content_type="application/json")

    async def current(self, rid: str) -> None:
        """With replicas: this replica's state of ``rid`` made the latest (taken over if need be); 503 if not."""
        if self.before is not None:
            try:
                await self.before(rid, None)
            except ClawstreamError as exc:
                raise _json_error(503, f"rollout {rid}: {exc}; retry later") from exc

    async def _rollout_or_404(self, request: web.Request) -> Rollout:
        self._check_admin(request)
        await self.current(request.match_info["rid"])
        rollout = self.rollouts.get(request.match_info["rid"])
        if rollout is None:
            raise _json_error(404, "unknown rollout")
        return rollout

    async def _held_rollout(self, request: web.Request) -> Rollout:
        """The rollout, if the attempt the call names (``?attempt_id=``; none named: any) holds it; else 409."""
        rollout = await self._rollout_or_404(request)
        wanted = request.query.get("attempt_id")
        if wanted is not None and wanted != rollout.attempt_id:
            raise _json_error(
                409,
                f"rollout {rollout.rollout_id} is held by attempt {rollout.attempt_id}, not {wanted}",
                **rollout.holder(),
            )
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
            attempt = _optional_int(body, "attempt")
            lease_s = None if body.get("lease_s") is None else float(body["lease_s"])
            if lease_s is not None and not (math.isfinite(lease_s) and lease_s > 0):
                raise ValueError(f"lease_s must be a finite number > 0, got {lease_s}")
            temperature, top_p, top_k = sampling_settings(body)
            secret = secrets.token_urlsafe(32)
            rollout = Rollout(
                rollout_id=rid,
                secret=secret,
                secret_sha256=secret_sha256(secret),
                registered_at_ms=now_ms(),
                expires_at_ms=now_ms() + int(ttl * 1000),
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                max_tokens=int(body.get("max_tokens") or self.default_max_tokens),
                seed=None if seed is None else int(seed),
                renderer=RolloutRenderer(self.template),
                attempt_id=attempt_id or None,
                attempt=attempt,
                lease_s=lease_s,
                lease_expires_at_ms=None if lease_s is None else now_ms() + int(lease_s * 1000),
            )
        except (ValueError, TypeError, AttributeError) as exc:
            return web.json_response({"error": f"bad registration: {exc}"}, status=400)
        if not all(c.isalnum() or c in "-_." for c in rid):
            return web.json_response({"error": "rollout_id allows letters, digits, '-', '_', '.'"}, status=400)
        await self.current(rid)
        for swept in self._sweep():
            self.sync_later(swept)
        held = self.rollouts.get(rid)
        if held is not None:  # the client waits for a live holder, revokes a dead one (scoped to its attempt id)
            live = "live" if held.live(now_ms()) else "not renewed"
            return web.json_response(
                {"error": f"rollout {rid} is already registered (attempt {held.attempt_id}, {live})", **held.holder()},
                status=409,
            )
        done = self.finished.get(rid)
        if done is not None and attempt is not None and done.attempt >= attempt:  # this request attempt is done
            return web.json_response(
                {
                    "error": f"rollout {rid} attempt {done.attempt} already finished (attempt id {done.attempt_id})",
                    "attempt_id": done.attempt_id,
                    "attempt": done.attempt,
                    "live": False,
                    "finished": True,
                },
                status=409,
            )
        self.rollouts[rid] = rollout
        self.metrics.rollouts.set(len(self.rollouts))
        if self.store is not None:  # recorded before the secret is handed out, or not registered at all
            rollout.calls_offsets = self.store.calls_offsets()
            try:
                await self.sync(rid)
            except PublishError as exc:
                if self.rollouts.get(rid) is rollout:
                    del self.rollouts[rid]
                    self.metrics.rollouts.set(len(self.rollouts))
                self.sync_later(rid)
                log.error("rollout %s: registration not recorded: %s", rid, exc)
                return web.json_response(
                    {"error": f"the registration could not be recorded (Kafka unavailable); retry later: {exc}"},
                    status=503,
                )
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
        return web.json_response((await self._rollout_or_404(request)).status())

    async def _seal(self, request: web.Request) -> web.Response:
        rollout = await self._held_rollout(request)
        rollout.sealed = True
        deadline = time.monotonic() + self.seal_wait_s
        while rollout.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if rollout.in_flight and not rollout.infra_failure:
            rollout.infra_failure = f"{rollout.in_flight} call(s) still in flight at seal"
        rollout.renderer = RolloutRenderer(self.template)  # free the token state; the rollout is over
        await self._sync_quietly(rollout.rollout_id)
        body = rollout.status()
        if rollout.last_main is not None:  # what the grader's transcript is built from (producers.tasks.transcript)
            body["messages"] = transcript_messages(*rollout.last_main)
        return web.json_response(body)

    async def _renew(self, request: web.Request) -> web.Response:
        """Extend the lease by its length (or by ``lease_s`` of the body, which becomes its length)."""
        rollout = await self._held_rollout(request)
        try:
            body = await request.json() if request.can_read_body else {}
            lease_s = float(body.get("lease_s") or rollout.lease_s or self.default_ttl_s)
            if not (math.isfinite(lease_s) and lease_s > 0):
                raise ValueError(f"lease_s must be a finite number > 0, got {lease_s}")
        except (ValueError, TypeError, AttributeError) as exc:
            return web.json_response({"error": f"bad renewal: {exc}"}, status=400)
        rollout.lease_s, rollout.lease_expires_at_ms = lease_s, now_ms() + int(lease_s * 1000)
        return web.json_response(rollout.status())

    async def _forget(self, request: web.Request) -> web.Response:
        rollout = await self._held_rollout(request)
        self.rollouts.pop(rollout.rollout_id, None)
        self.metrics.rollouts.set(len(self.rollouts))
        if request.query.get("finished") in ("1", "true") and rollout.attempt is not None:
            expires = now_ms() + int(self.finished_retention_s * 1000)
            self.finished[rollout.rollout_id] = Finished(rollout.attempt_id, rollout.attempt, expires)
        await self._sync_quietly(rollout.rollout_id)
        return web.json_response(rollout.status())

    def _sweep(self) -> list[str]:
        """Drop expired registrations and finished attempts; their rollout ids."""
        now = now_ms()
        swept = [r for r, ro in self.rollouts.items() if ro.expires_at_ms < now and not ro.in_flight]
        for rid in swept:
            del self.rollouts[rid]
        done = [r for r, f in self.finished.items() if f.expires_at_ms < now]
        for rid in done:
            del self.finished[rid]
        return swept + done

    # --- the registrations topic ---------------------------------------------------------------------------------

    def record_of(self, rid: str) -> ProxyRegistration | None:
        """The current state of ``rid`` as a registrations-topic record (None: nothing to remember, a tombstone)."""
        now = now_ms()
        ro = self.rollouts.get(rid)
        if ro is not None:
            return ProxyRegistration(
                rollout_id=rid,
                timestamp_ms=now,
                proxy=self.public_url,
                replica=self.replica,
                expires_at_ms=ro.expires_at_ms,
                attempt_id=ro.attempt_id,
                attempt=ro.attempt,
                secret_sha256=ro.secret_sha256,
                registered_at_ms=ro.registered_at_ms,
                temperature=ro.temperature,
                top_p=ro.top_p,
                top_k=ro.top_k,
                max_tokens=ro.max_tokens,
                seed=ro.seed,
                lease_s=ro.lease_s,
                sealed=ro.sealed,
                calls_served=ro.calls_served,
                infra_failure=ro.infra_failure,
                calls_offsets=dict(ro.calls_offsets),
            )
        done = self.finished.get(rid)
        if done is not None and done.expires_at_ms >= now:
            return ProxyRegistration(
                rollout_id=rid,
                timestamp_ms=now,
                proxy=self.public_url,
                replica=self.replica,
                expires_at_ms=done.expires_at_ms,
                attempt_id=done.attempt_id,
                attempt=done.attempt,
                finished=True,
            )
        return None

    async def sync(self, rid: str) -> None:
        """Write ``rid``'s current state (one writer per id at a time, so the last write holds the last state)."""
        if self.store is None:
            return
        entry = self._locks.setdefault(rid, _KeyLock())
        entry.users += 1
        try:
            async with entry.lock:
                await self.store.write(rid, self.record_of(rid))
        finally:
            entry.users -= 1
            if not entry.users:
                self._locks.pop(rid, None)

    async def _sync_quietly(self, rid: str) -> None:
        """:meth:`sync`, a failure logged: the change holds in memory; a restart would bring back the state before."""
        try:
            await self.sync(rid)
        except PublishError as exc:
            log.error("rollout %s: registration change not recorded: %s", rid, exc)

    def sync_later(self, rid: str) -> None:
        """Write ``rid``'s state in the background (a call's infrastructure failure, expired entries)."""
        if self.store is None:
            return
        task = asyncio.ensure_future(self._sync_quietly(rid))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def restore(self, reg: ProxyRegistration, replayed: Replayed | None) -> Rollout:
        """Put back a registration read after a restart (``replayed``: its calls; None for a sealed one), with a
        fresh lease of its length."""
        now = now_ms()
        state = replayed or Replayed(RolloutRenderer(self.template), reg.calls_served, reg.calls_served)
        rollout = Rollout(
            rollout_id=reg.rollout_id,
            secret=None,
            secret_sha256=reg.secret_sha256,
            expires_at_ms=reg.expires_at_ms,
            temperature=reg.temperature,
            top_p=reg.top_p,
            top_k=reg.top_k,
            max_tokens=reg.max_tokens,
            seed=reg.seed,
            renderer=state.renderer,
            attempt_id=reg.attempt_id,
            attempt=reg.attempt,
            lease_s=reg.lease_s,
            lease_expires_at_ms=None if reg.lease_s is None else now + int(reg.lease_s * 1000),
            main_fingerprint=state.main_fingerprint,
            next_seq=state.next_seq,
            calls_served=state.calls_served,
            sealed=reg.sealed,
            infra_failure=reg.infra_failure or state.infra_failure,
            registered_at_ms=reg.registered_at_ms,
            calls_offsets=dict(reg.calls_offsets),
            restored=True,
            refused=state.infra_failure,
            usage=Usage(calls=state.calls_served, prompt_tokens=state.prompt_tokens),  # the replayed calls' counts
        )
        self.rollouts[reg.rollout_id] = rollout
        self.metrics.rollouts.set(len(self.rollouts))
        return rollout

    def restore_finished(self, reg: ProxyRegistration) -> None:
        if reg.attempt is not None:
            self.finished[reg.rollout_id] = Finished(reg.attempt_id, reg.attempt, reg.expires_at_ms)
