"""One registered rollout in the serving proxy, and each thing that happens to it, as a method.

Registered (:meth:`Rollout.register`) or put back from its registration record and replayed call events after a
restart or a takeover (:meth:`Rollout.from_record`, ``producers.proxy.restore``); written back as that record
(:meth:`Rollout.to_record`); its calls admitted past the quotas (:meth:`Rollout.calls_left`, :meth:`Rollout.admit`,
``producers.proxy.quota``), classified, numbered, counted in flight (:meth:`Rollout.track`) and recorded once their
call event is out (:meth:`Rollout.record_call`); flagged when the infrastructure failed it (:meth:`Rollout.fail`);
renewed, sealed (:meth:`Rollout.seal`) and reported (:meth:`Rollout.status`, :meth:`Rollout.seal_report`: the
transcript from the proxy's own turns, ``tampered`` for the calls whose request held a turn it never generated).
The admin API (``producers.proxy.admin``) and the model-call path (``producers.proxy.app``) change a rollout only
through these. No Kafka, no aiohttp.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, TypeVar

from producers.proxy.conversation import CallKindRules, Conversation, Message, classify_call, transcript_messages
from producers.proxy.quota import QUOTA_STATUS_NAME, Quotas, Usage
from producers.proxy.render import RenderResult, RolloutRenderer, TemplateRenderer
from producers.proxy.restore import Replayed, secret_matches, secret_sha256
from schemas.events import CallKind, ProxyRegistration, now_ms

log = logging.getLogger("clawstream.proxy")

T = TypeVar("T")


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
    # The last main-agent call's conversation, the answer it got and its turns' provenance (the forged turns'
    # indices, the proxy's reasoning per assistant turn): the run's transcript, reported at seal.
    last_main: tuple[Conversation, Message, tuple[int, ...], dict[int, str]] | None = None
    tampered: int = 0  # calls whose request held an assistant turn the proxy never generated for it
    secret_sha256: str = ""
    registered_at_ms: int = 0
    calls_offsets: dict[str, int] = field(default_factory=dict)  # where its call events start (registrations topic)
    restored: bool = False  # put back after a proxy restart
    refused: str | None = None  # its state could not be restored: calls get 401 with this reason
    usage: Usage = field(default_factory=Usage)  # what its quotas count (producers.proxy.quota)
    quota_exceeded: str | None = None  # the first call a quota refused: the policy's doing, graded as usual

    # --- registered, restored, recorded -----------------------------------------------------------------------

    @classmethod
    def register(
        cls,
        rollout_id: str,
        renderer: RolloutRenderer,
        *,
        ttl_s: float,
        sampling: tuple[float, float, int],
        max_tokens: int,
        seed: int | None,
        attempt_id: str | None,
        attempt: int | None,
        lease_s: float | None,
    ) -> Rollout:
        """A new registration with a fresh secret; ``sampling``: (temperature, top_p, top_k)."""
        secret = secrets.token_urlsafe(32)
        temperature, top_p, top_k = sampling
        return cls(
            rollout_id=rollout_id,
            secret=secret,
            secret_sha256=secret_sha256(secret),
            registered_at_ms=now_ms(),
            expires_at_ms=now_ms() + int(ttl_s * 1000),
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            max_tokens=max_tokens,
            seed=seed,
            renderer=renderer,
            attempt_id=attempt_id or None,
            attempt=attempt,
            lease_s=lease_s,
            lease_expires_at_ms=None if lease_s is None else now_ms() + int(lease_s * 1000),
        )

    @classmethod
    def from_record(cls, reg: ProxyRegistration, state: Replayed) -> Rollout:
        """The registration ``reg`` read back (after a restart or by a replica taking it over), with the state its
        call events replayed to (``producers.proxy.restore.replay_calls``) and a fresh lease of its length."""
        return cls(
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
            lease_expires_at_ms=None if reg.lease_s is None else now_ms() + int(reg.lease_s * 1000),
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
            tampered=state.tampered,
        )

    def starts_calls_at(self, offsets: dict[str, int]) -> None:
        """Its call events lie after these offsets of the calls topic (what a restore replays from)."""
        self.calls_offsets = dict(offsets)

    def to_record(self, *, proxy: str, replica: str, timestamp_ms: int) -> ProxyRegistration:
        """Its registrations-topic record (the secret's sha256, never the secret)."""
        return ProxyRegistration(
            rollout_id=self.rollout_id,
            timestamp_ms=timestamp_ms,
            proxy=proxy,
            replica=replica,
            expires_at_ms=self.expires_at_ms,
            attempt_id=self.attempt_id,
            attempt=self.attempt,
            secret_sha256=self.secret_sha256,
            registered_at_ms=self.registered_at_ms,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_tokens=self.max_tokens,
            seed=self.seed,
            lease_s=self.lease_s,
            sealed=self.sealed,
            calls_served=self.calls_served,
            infra_failure=self.infra_failure,
            calls_offsets=dict(self.calls_offsets),
        )

    # --- who may call it ----------------------------------------------------------------------------------------

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

    def renew(self, lease_s: float) -> None:
        """Extend the lease by ``lease_s`` from now, which becomes its length."""
        self.lease_s, self.lease_expires_at_ms = lease_s, now_ms() + int(lease_s * 1000)

    # --- its model calls ----------------------------------------------------------------------------------------

    def calls_left(self, quotas: Quotas) -> str | None:
        """Why the call quota refuses one more call (the rollout is flagged), or None."""
        return self._over_quota(self.usage.calls_left(quotas))

    def admit(self, quotas: Quotas, prompt_tokens: int) -> str | None:
        """Count a call of ``prompt_tokens`` against the quotas and return None, or return why it is refused (the
        rollout is flagged, nothing counted)."""
        return self._over_quota(self.usage.admit(quotas, prompt_tokens))

    def _over_quota(self, refused: str | None) -> str | None:
        if refused is not None and self.quota_exceeded is None:  # the first refusal is the one reported at seal
            self.quota_exceeded = refused
            log.warning("rollout %s: %s", self.rollout_id, refused)
        return refused

    def classify(self, conversation: Conversation, model: str, rules: CallKindRules) -> CallKind:
        """The call's kind; the first main-agent call fixes the fingerprint later calls are compared with."""
        kind, self.main_fingerprint = classify_call(conversation, model, self.main_fingerprint, rules)
        return kind

    def max_tokens_for(self, requested: int | None) -> int:
        """What a call may generate: what it asked for, capped by the registration's ``max_tokens``."""
        return min(requested or self.max_tokens, self.max_tokens)

    def engine_seed(self) -> int | None:
        """The engine's seed for the next call: the registration's seed moved on by the calls numbered so far."""
        return None if self.seed is None else self.seed + self.next_seq

    def track(self, task: asyncio.Future[T]) -> asyncio.Future[T]:
        """Count ``task`` (one call being served) in flight until it is done: a seal waits for it."""
        self.in_flight += 1
        task.add_done_callback(self._call_done)
        return task

    def _call_done(self, _task: asyncio.Future[Any]) -> None:
        self.in_flight -= 1

    def take_seq(self) -> int:
        """The next call's ``seq`` (taken once its answer is generated, so seqs follow the order answers came)."""
        seq = self.next_seq
        self.next_seq += 1
        return seq

    def record_call(
        self,
        call_id: str,
        seq: int,
        rendered: RenderResult,
        generated: list[int],
        answer: Message,
        kind: CallKind,
        conversation: Conversation,
    ) -> None:
        """A call whose event is published: its tokens go into the renderer (what the next call extends), a main
        call's conversation and answer become the transcript (its forged turns left out), a call with a forged turn
        counts as tampered, and it counts as served. Runs on the proxy's render thread, the one thread that touches
        renderers."""
        self.renderer.record(call_id, seq, rendered, generated, answer)
        if kind == CallKind.MAIN:
            self.last_main = (conversation, answer, rendered.forged, rendered.reasoning)
        if rendered.forged:
            self.tampered += 1
            log.warning(
                "rollout %s: call %d holds %d forged assistant turn(s)", self.rollout_id, seq, len(rendered.forged)
            )
        self.calls_served += 1

    def count_error(self, status: int) -> None:
        """A call answered with an error ``status`` (reported per status). One the rollout caused (a 4xx: bad JSON,
        a body past the limits, a prompt too long), unless a quota refused it, counts as a call toward the call quota:
        refusing costs the proxy work too, so a rollout that only sends refused calls is stopped like any other."""
        self.errors[status] = self.errors.get(status, 0) + 1
        if 400 <= status < 500 and self.quota_exceeded is None:
            self.usage.count_refused()

    def fail(self, reason: str) -> None:
        """The infrastructure failed it (the engine, Kafka): its seal reports ``infra_failure``, never the
        policy's zero."""
        self.infra_failure = reason

    # --- sealed -------------------------------------------------------------------------------------------------

    async def seal(self, wait_s: float, template: TemplateRenderer) -> None:
        """Revoke the secret, wait up to ``wait_s`` for calls in flight (still running: an infrastructure failure),
        then free the token state: the rollout is over."""
        self.sealed = True
        deadline = time.monotonic() + wait_s
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.in_flight and not self.infra_failure:
            self.infra_failure = f"{self.in_flight} call(s) still in flight at seal"
        self.renderer = RolloutRenderer(template)

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
            "tampered": self.tampered,
        }

    def seal_report(self) -> dict[str, Any]:
        """:meth:`status` and, after a main-agent call, its transcript ``messages`` (what the grader reads,
        ``producers.tasks.transcript``): that call's conversation and answer without the turns the proxy never
        generated, ``tampered`` counting the calls that held one."""
        body = self.status()
        if self.last_main is not None:
            body["messages"] = transcript_messages(*self.last_main)
        return body
