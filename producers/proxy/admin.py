"""The proxy's rollouts and its admin API (``Authorization: Bearer <admin token>``); each rollout's state, and what
may happen to it, is ``producers.proxy.rollout_state.Rollout``.

``POST /admin/rollouts`` registers a rollout ({rollout_id?, ttl_s?, temperature?, top_p?, top_k?, max_tokens?,
seed?, attempt_id?, attempt?, lease_s?} → {rollout_id, secret, base_url, expires_at_ms}); ``GET /admin/rollouts/{id}``
shows its state; ``POST /admin/rollouts/{id}/seal`` revokes the secret, waits for calls in flight and returns
{calls_served, status: ok | infra_failure | quota_exceeded, infra_failure, quota_exceeded, usage, messages};
``POST .../renew`` extends the lease; ``DELETE`` forgets it (``?finished=1``: the attempt's terminal events are
out, so the same request attempt is not registered again). The sandbox worker is the client
(``producers.sandbox.proxy_admin.ProxyAdmin``); the routes are served only on the admin listener (``Proxy.admin_app``).

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
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiohttp import web

from clawbase.errors import ClawstreamError
from clawbase.kafka.publisher import PublishError
from producers.proxy.metrics import ProxyMetrics
from producers.proxy.render import RolloutRenderer, TemplateRenderer
from producers.proxy.restore import Replayed
from producers.proxy.rollout_state import Rollout
from schemas.events import ProxyRegistration, now_ms

log = logging.getLogger("clawstream.proxy")


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
    cls = {404: web.HTTPNotFound, 409: web.HTTPConflict, 503: web.HTTPServiceUnavailable}[status]
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


class ReplicaSync(Protocol):
    """What makes this proxy's state of a rollout the latest before a request of it is handled: the replicas
    (``producers.proxy.replicas.Replicas``, handed over with :meth:`Admin.follow`). Without one, this proxy's own
    memory is the only state."""

    async def current(self, rid: str, key: str | None = None) -> None:
        """Bring ``rid`` up to date (taken over if need be); ``key``: a harness call's API key (None: an admin
        request, already authorized). ``ClawstreamError`` when it cannot: the request is answered 503."""
        ...


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
        self._replicas: ReplicaSync | None = None
        self._locks: dict[str, _KeyLock] = {}  # one writer of a rollout id's record at a time
        self._background: set[asyncio.Task[None]] = set()

    def follow(self, replicas: ReplicaSync) -> None:
        """From now on, make each rollout's state current through ``replicas`` before a request of it is handled."""
        self._replicas = replicas

    async def make_current(self, rid: str, key: str | None = None) -> None:
        """With replicas: this replica's state of ``rid`` made the latest (``ReplicaSync.current``); else nothing."""
        if self._replicas is not None:
            await self._replicas.current(rid, key)

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

    async def _current_or_503(self, rid: str) -> None:
        try:
            await self.make_current(rid)
        except ClawstreamError as exc:
            raise _json_error(503, f"rollout {rid}: {exc}; retry later") from exc

    async def _rollout_or_404(self, request: web.Request) -> Rollout:
        self._check_admin(request)
        await self._current_or_503(request.match_info["rid"])
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

    # --- the routes -----------------------------------------------------------------------------------------------

    async def _register(self, request: web.Request) -> web.Response:
        self._check_admin(request)
        try:
            body = await request.json() if request.can_read_body else {}
            rollout = self._new_rollout(body)
        except (ValueError, TypeError, AttributeError) as exc:
            return web.json_response({"error": f"bad registration: {exc}"}, status=400)
        rid = rollout.rollout_id
        if not all(c.isalnum() or c in "-_." for c in rid):
            return web.json_response({"error": "rollout_id allows letters, digits, '-', '_', '.'"}, status=400)
        await self._current_or_503(rid)
        for swept in self._sweep():
            self.sync_later(swept)
        refused = self._conflict(rid, rollout.attempt)
        if refused is None:
            self.rollouts[rid] = rollout
            self.metrics.rollouts.set(len(self.rollouts))
            refused = await self._record_registration(rollout)
        if refused is not None:
            return refused
        return web.json_response(
            {
                "rollout_id": rid,
                "secret": rollout.secret,
                "base_url": f"{self.public_url}/r/{rid}",
                "expires_at_ms": rollout.expires_at_ms,
            },
            status=201,
        )

    def _new_rollout(self, body: dict[str, Any]) -> Rollout:
        """The rollout a registration's body asks for; ValueError, TypeError or AttributeError name what is wrong."""
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
        sampling = sampling_settings(body)
        return Rollout.register(
            rid,
            RolloutRenderer(self.template),
            ttl_s=ttl,
            sampling=sampling,
            max_tokens=int(body.get("max_tokens") or self.default_max_tokens),
            seed=None if seed is None else int(seed),
            attempt_id=attempt_id,
            attempt=attempt,
            lease_s=lease_s,
        )

    def _conflict(self, rid: str, attempt: int | None) -> web.Response | None:
        """409 when ``rid`` is held (the client waits for a live holder, revokes a dead one, scoped to its attempt
        id) or this request attempt already finished; else None."""
        held = self.rollouts.get(rid)
        if held is not None:
            live = "live" if held.live(now_ms()) else "not renewed"
            return web.json_response(
                {"error": f"rollout {rid} is already registered (attempt {held.attempt_id}, {live})", **held.holder()},
                status=409,
            )
        done = self.finished.get(rid)
        if done is not None and attempt is not None and done.attempt >= attempt:
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
        return None

    async def _record_registration(self, rollout: Rollout) -> web.Response | None:
        """Write the new registration before its secret is handed out, or undo it: 503 (None: written, or no
        store)."""
        if self.store is None:
            return None
        rid = rollout.rollout_id
        rollout.starts_calls_at(self.store.calls_offsets())
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
        return None

    async def _status(self, request: web.Request) -> web.Response:
        return web.json_response((await self._rollout_or_404(request)).status())

    async def _seal(self, request: web.Request) -> web.Response:
        rollout = await self._held_rollout(request)
        await rollout.seal(self.seal_wait_s, self.template)
        await self._sync_quietly(rollout.rollout_id)
        return web.json_response(rollout.seal_report())

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
        rollout.renew(lease_s)
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
            return ro.to_record(proxy=self.public_url, replica=self.replica, timestamp_ms=now)
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

    def fail(self, rollout: Rollout, reason: str) -> None:
        """A call of ``rollout`` failed for the infrastructure's sake: flagged, logged, and recorded in the
        background (a restart must not forget it)."""
        rollout.fail(reason)
        log.error("rollout %s: %s", rollout.rollout_id, reason)
        self.sync_later(rollout.rollout_id)

    # --- rollouts put back, or dropped, from the registrations topic ---------------------------------------------

    def restore(self, reg: ProxyRegistration, replayed: Replayed | None) -> Rollout:
        """Put back a registration read after a restart (``replayed``: its calls; None for a sealed one), with a
        fresh lease of its length."""
        state = replayed or Replayed(RolloutRenderer(self.template), reg.calls_served, reg.calls_served)
        rollout = Rollout.from_record(reg, state)
        self.rollouts[reg.rollout_id] = rollout
        self.metrics.rollouts.set(len(self.rollouts))
        return rollout

    def restore_finished(self, reg: ProxyRegistration) -> None:
        """Remember the finished attempt ``reg`` names (a redelivery of it is refused)."""
        if reg.attempt is not None:
            self.finished[reg.rollout_id] = Finished(reg.attempt_id, reg.attempt, reg.expires_at_ms)

    def forget_finished(self, rid: str) -> None:
        self.finished.pop(rid, None)

    def drop(self, rid: str) -> None:
        """Forget ``rid``'s state held here (another replica's is newer), unless a call of it is in flight."""
        rollout = self.rollouts.get(rid)
        if rollout is not None and not rollout.in_flight:
            del self.rollouts[rid]
            self.metrics.rollouts.set(len(self.rollouts))
