"""One rollout attempt, start to end: sandbox → proxy registration → harness → seal → grade → events → cleanup.

The sandbox worker calls :func:`execute` per request; this module has no Kafka import: events go to an
:class:`EventSink` (the worker's publishes to Kafka and waits for the acknowledgement; tests may collect them).

Statuses (docs/method.md#infrastructure-failures; every state change goes through ``schemas.lifecycle.transition``):

* harness exits by itself (any exit code) → HARNESS_EXITED(exit_code, calls_served), graded (a call refused by a
  proxy quota: graded too, its ``reason`` starts ``quota_exceeded:``); a sandbox over its disk quota
  (``max_workspace_bytes``) → the harness stopped at once, HARNESS_EXITED(exit_code -9), graded, its ``reason``
  ``quota_exceeded: rollout quota exceeded: max_workspace_bytes …``;
* harness killed at its wall-clock limit → TIMED_OUT(calls_served), graded;
* sandbox creation, proxy (register/seal, or the proxy flags the rollout infra_failure), grader crash, unknown
  task/harness → FAILED(reason) and a RewardEvent with status INFRA_FAILURE and reward null (never a 0).

Exactly one RewardEvent per attempt; the attempt id (``{rollout_id}.a{attempt}.{random}``) is new on every
execution, so a request re-run after a worker died is a different attempt. The sandbox is destroyed in every case.

The proxy registration is the attempt's claim on the rollout id: made before the sandbox, kept alive by a lease the
attempt renews while it runs, sealed and forgotten only under its own attempt id (``finished`` once its reward is
acknowledged). If another attempt holds the id and is live, or this request attempt already finished,
:func:`execute` returns with ``Outcome.held`` set and publishes nothing (the caller waits or skips); a holder that
stopped renewing (its worker died) is revoked, scoped to its attempt id.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp

from clawbase.errors import ClawstreamError
from producers.harnesses.base import HarnessAdapter, LaunchContext, launch_spec
from producers.sandbox.base import CleanupReport, Sandbox, SandboxBackend, SandboxError, SandboxSettings
from producers.sandbox.grade import grade
from producers.tasks.catalog import SuiteCatalog
from producers.tasks.grading import GraderFailure
from producers.tasks.model import TaskError
from schemas.events import RewardEvent, RewardStatus, RolloutEvent, RolloutRequest, RolloutState, now_ms
from schemas.lifecycle import transition

log = logging.getLogger("clawstream.rollout")


class ProxyError(ClawstreamError):
    """The serving proxy's admin API failed (registration or seal)."""


class RolloutHeld(ClawstreamError):
    """Another attempt holds the rollout id at the proxy and is live, or this request attempt already finished."""

    def __init__(self, rollout_id: str, attempt_id: str | None, *, finished: bool) -> None:
        self.rollout_id, self.attempt_id, self.finished = rollout_id, attempt_id, finished
        what = "already finished" if finished else "is running (its lease is live)"
        super().__init__(f"rollout {rollout_id}: attempt {attempt_id} {what}")


class EventSink(Protocol):
    async def event(self, event: RolloutEvent) -> None: ...

    async def reward(self, reward: RewardEvent) -> None: ...


class _BalancerError(Exception):
    """A 502/503/504 without the proxy's JSON body: the balancer in front of proxy replicas found none up."""


class ProxyAdmin:
    """Client of the proxy's admin API (``producers.proxy.admin``)."""

    def __init__(self, url: str, token: str, timeout_s: float = 90.0, connect_retries: int = 60) -> None:
        self.url, self.token, self.timeout_s = url.rstrip("/"), token, timeout_s
        self.connect_retries = connect_retries

    async def _call(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        query: dict[str, str] | None = None,
    ) -> tuple[int, dict]:
        """One admin call. Refused at connect (the proxy is restarting; nothing was sent), or answered 502/503/504 by
        a load balancer in front of proxy replicas (not the proxy's JSON: its replica was down), it is tried again,
        with capped backoff, ``connect_retries`` times: a proxy restart must not burn a request's attempts in
        seconds. Every admin call is safe to repeat (a repeated registration finds its own attempt: 409, handled)."""
        headers = {"Authorization": f"Bearer {self.token}"}
        pause = 0.2
        for retry in range(self.connect_retries + 1):
            try:
                async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as http:
                    async with http.request(method, self.url + path, json=body, params=query, headers=headers) as r:
                        raw = await r.read()
                        try:
                            data = json.loads(raw) if raw else {}
                        except ValueError:
                            if r.status not in (502, 503, 504):
                                raise
                            raise _BalancerError(f"{r.status} {raw[:200]!r}") from None
                        return r.status, data or {}
            except (aiohttp.ClientConnectorError, _BalancerError) as exc:
                if retry == self.connect_retries:
                    raise ProxyError(f"proxy admin {method} {path} at {self.url}: {exc!r}") from exc
                if retry % 10 == 0:
                    log.warning("proxy admin %s %s at %s unreachable (%s): retrying", method, path, self.url, exc)
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                raise ProxyError(f"proxy admin {method} {path} at {self.url}: {exc!r}") from exc
            await asyncio.sleep(pause)
            pause = min(2.0, pause * 2)
        raise AssertionError("unreachable")  # the loop returns or raises

    @staticmethod
    def _scope(attempt_id: str | None, **flags: str) -> dict[str, str]:
        return {**({"attempt_id": attempt_id} if attempt_id else {}), **flags}

    async def register(self, rollout_id: str, **params: Any) -> dict[str, Any]:
        """Register ``rollout_id`` for ``params["attempt_id"]``. Raises :class:`RolloutHeld` when another attempt
        holds it and is live, or its request attempt already finished. A holder that stopped renewing its lease (its
        worker died), or holds it without one, is revoked — sealed and forgotten under *its* attempt id only."""
        body = {"rollout_id": rollout_id, **params}
        own = params.get("attempt_id")
        for _ in range(4):  # a revoked holder may be replaced by another newcomer meanwhile: ask again
            # the id in the query too: a balancer in front of proxy replicas routes by it (compose/haproxy.cfg)
            status, data = await self._call("POST", "/admin/rollouts", body, {"rollout_id": rollout_id})
            if status != 409:
                break
            holder = data.get("attempt_id")
            if data.get("finished"):
                raise RolloutHeld(rollout_id, holder, finished=True)
            if data.get("live") and (holder is None or holder != own):
                raise RolloutHeld(rollout_id, holder, finished=False)
            log.warning("rollout %s: revoking attempt %s, its lease not renewed (its worker died)", rollout_id, holder)
            await self._revoke(rollout_id, holder)
        if status != 201:
            raise ProxyError(f"proxy refused to register {rollout_id}: {status} {data}")
        return data

    async def _revoke(self, rollout_id: str, attempt_id: str | None) -> None:
        path = f"/admin/rollouts/{rollout_id}"
        for method, url in (("POST", f"{path}/seal"), ("DELETE", path)):
            status, data = await self._call(method, url, query=self._scope(attempt_id))
            if status in (404, 409):  # gone, or another attempt holds it now: registering again tells
                return
            if status != 200:
                raise ProxyError(f"proxy could not revoke attempt {attempt_id} of {rollout_id}: {status} {data}")

    async def seal(self, rollout_id: str, attempt_id: str | None = None) -> dict[str, Any]:
        """Seal the registration (only if ``attempt_id`` holds it, when given); ProxyError otherwise."""
        status, data = await self._call("POST", f"/admin/rollouts/{rollout_id}/seal", query=self._scope(attempt_id))
        if status != 200:
            raise ProxyError(f"proxy could not seal {rollout_id} (attempt {attempt_id}): {status} {data}")
        return data

    async def renew(self, rollout_id: str, attempt_id: str, lease_s: float) -> bool:
        """Extend ``attempt_id``'s lease; False when it no longer holds the registration (revoked or forgotten)."""
        status, data = await self._call(
            "POST", f"/admin/rollouts/{rollout_id}/renew", {"lease_s": lease_s}, self._scope(attempt_id)
        )
        if status in (404, 409):
            return False
        if status != 200:
            raise ProxyError(f"proxy could not renew {rollout_id} (attempt {attempt_id}): {status} {data}")
        return True

    async def forget(self, rollout_id: str, attempt_id: str | None = None, *, finished: bool = False) -> None:
        """Forget the registration (only if ``attempt_id`` holds it, when given); ``finished``: the attempt's
        terminal events are acknowledged, so the proxy refuses to register this request attempt again."""
        query = self._scope(attempt_id, **({"finished": "1"} if finished else {}))
        status, data = await self._call("DELETE", f"/admin/rollouts/{rollout_id}", query=query)
        if status not in (200, 404):
            log.warning("rollout %s: forgetting attempt %s: %s %s", rollout_id, attempt_id, status, data)


ExeResolver = Callable[[HarnessAdapter], Awaitable[tuple[str, str]]]  # adapter → (executable, extra PATH dirs)


@dataclass
class RolloutContext:
    backend: SandboxBackend
    proxy: ProxyAdmin
    catalog: SuiteCatalog
    adapters: Mapping[str, HarnessAdapter]
    sink: EventSink
    settings: SandboxSettings
    resolve_exe: ExeResolver
    worker_id: str = field(default_factory=lambda: f"{os.uname().nodename}:{os.getpid()}")


@dataclass
class Outcome:
    attempt_id: str
    state: RolloutState | None
    reward: RewardEvent | None
    timings: dict[str, float] = field(default_factory=dict)
    cleanup: CleanupReport | None = None
    held: RolloutHeld | None = None  # not run: another attempt holds the rollout id (nothing was published)


def new_attempt_id(request: RolloutRequest) -> str:
    return f"{request.rollout_id}.a{request.attempt}.{uuid.uuid4().hex[:8]}"


def sandbox_id(attempt_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", attempt_id)[-80:]


class _Attempt:
    """Publishes the lifecycle of one attempt, enforcing the allowed transitions and the single reward."""

    def __init__(self, req: RolloutRequest, ctx: RolloutContext) -> None:
        self.req, self.ctx = req, ctx
        self.attempt_id = new_attempt_id(req)
        self.state: RolloutState | None = None
        self.reward: RewardEvent | None = None
        self.policy_version = req.policy_version

    async def move(self, new: RolloutState, **fields: Any) -> None:
        state = transition(self.state, new)
        await self.ctx.sink.event(
            RolloutEvent(
                rollout_id=self.req.rollout_id,
                policy_version=self.policy_version,
                timestamp_ms=now_ms(),
                attempt_id=self.attempt_id,
                state=state,
                group_id=self.req.group_id,
                harness=self.req.harness,
                attempt=self.req.attempt,
                worker_id=self.ctx.worker_id,
                **fields,
            )
        )
        self.state = state

    async def give_reward(
        self,
        status: RewardStatus,
        grader: str,
        reward: float | None = None,
        sub_scores: dict[str, float] | None = None,
        reason: str | None = None,
    ) -> None:
        if self.reward is not None:
            raise ClawstreamError(f"attempt {self.attempt_id} already has a reward")
        event = RewardEvent(
            rollout_id=self.req.rollout_id,
            policy_version=self.policy_version,
            timestamp_ms=now_ms(),
            attempt_id=self.attempt_id,
            status=status,
            grader=grader,
            reward=reward,
            sub_scores=sub_scores or {},
            reason=reason,
        )
        await self.ctx.sink.reward(event)
        self.reward = event

    async def fail(self, reason: str) -> None:
        log.warning("rollout %s attempt %s FAILED: %s", self.req.rollout_id, self.attempt_id, reason)
        await self.move(RolloutState.FAILED, reason=reason[:2000])
        await self.give_reward(RewardStatus.INFRA_FAILURE, "none", reason=reason[:2000])


async def _keep_lease(ctx: RolloutContext, rollout_id: str, attempt_id: str) -> None:
    """Renew the attempt's lease at the proxy every third of its length until cancelled or lost."""
    lease_s = ctx.settings.proxy_lease_s
    while True:
        await asyncio.sleep(lease_s / 3)
        try:
            if not await ctx.proxy.renew(rollout_id, attempt_id, lease_s):
                log.warning("rollout %s: attempt %s no longer holds its proxy registration", rollout_id, attempt_id)
                return
        except ProxyError as exc:
            log.warning("rollout %s: lease renewal failed (retrying): %s", rollout_id, exc)


async def _release(ctx: RolloutContext, req: RolloutRequest, a: _Attempt) -> None:
    """Seal (if the harness was not sealed yet) and forget this attempt's registration — never another attempt's of
    the same rollout id; ``finished`` once its reward is acknowledged (the request attempt is then done)."""
    try:
        if a.state == RolloutState.STARTED or a.state is None:
            await ctx.proxy.seal(req.rollout_id, a.attempt_id)
    except ProxyError as exc:
        log.warning("rollout %s: could not seal attempt %s: %s", req.rollout_id, a.attempt_id, exc)
    try:
        await ctx.proxy.forget(req.rollout_id, a.attempt_id, finished=a.reward is not None)
    except ProxyError as exc:
        log.warning("rollout %s: could not release attempt %s: %s", req.rollout_id, a.attempt_id, exc)


async def execute(req: RolloutRequest, ctx: RolloutContext) -> Outcome:
    """Run one attempt of ``req``; returns once its terminal events and reward are acknowledged by the sink, or at
    once with ``held`` set (nothing published) when another attempt holds the rollout id (see the module doc).

    Raises only when the sink itself fails (Kafka down): the request must then not be committed.
    """
    a = _Attempt(req, ctx)
    t: dict[str, float] = {"t0": time.monotonic()}
    out = Outcome(a.attempt_id, None, None, t)
    box: Sandbox | None = None
    registered = False
    lease: asyncio.Task[None] | None = None
    try:
        try:
            task = ctx.catalog.task(req.suite, req.task_id)
            adapter = ctx.adapters.get(req.harness)
            if adapter is None:
                raise TaskError(f"unknown harness {req.harness!r}; known: {', '.join(ctx.adapters)}")
            exe, extra_path = await ctx.resolve_exe(adapter)
            own = ctx.settings.task_timeout_s or task.timeout_s
            timeout = min(req.timeout_s or own, own, ctx.settings.max_timeout_s)
            if req.deadline_ms:
                timeout = max(1.0, min(timeout, (req.deadline_ms - now_ms()) / 1000))
            try:
                reg = await ctx.proxy.register(
                    req.rollout_id,
                    temperature=req.temperature,
                    top_p=req.top_p,
                    top_k=req.top_k,
                    seed=req.seed,
                    max_tokens=req.max_tokens,
                    ttl_s=timeout + 600,
                    attempt_id=a.attempt_id,
                    attempt=req.attempt,
                    lease_s=ctx.settings.proxy_lease_s,
                )
            except RolloutHeld as held:
                out.held = held
                return out
            registered = True
            lease = asyncio.create_task(_keep_lease(ctx, req.rollout_id, a.attempt_id))
            box = await ctx.backend.create(sandbox_id(a.attempt_id), task)
            t["created"] = time.monotonic()
            # Prompts may name the task's mount dir (ClawGym-Bench): point them at this sandbox's workspace.
            prompt = task.prompt.replace(task.mount_dir, box.workspace)
            spec = launch_spec(
                adapter,
                LaunchContext(
                    base_url=box.proxy_base_url(reg["base_url"]),
                    secret=reg["secret"],
                    workspace=box.workspace,
                    home=box.home,
                    prompt=prompt,
                    timeout_s=timeout,
                    python=box.python,
                    exe=exe,
                    clawstream_root=box.clawstream_root,
                    contained=box.contained,
                ),
            )
            for path, content in spec.files.items():
                box.write_text(path, content)
        except (TaskError, SandboxError, ProxyError, OSError, ValueError) as exc:
            await a.fail(f"setup: {exc}")
            return out
        await a.move(RolloutState.STARTED)
        t["harness_start"] = time.monotonic()
        try:
            result = await box.run(
                spec.argv,
                spec.env,
                box.workspace,
                timeout,
                extra_path=extra_path,
                max_bytes=ctx.settings.max_workspace_bytes,
            )
        except SandboxError as exc:
            await a.fail(f"harness launch: {exc}")
            return out
        t["harness_end"] = time.monotonic()
        try:
            sealed = await ctx.proxy.seal(req.rollout_id, a.attempt_id)
        except ProxyError as exc:
            await a.fail(f"seal: {exc}")
            return out
        if sealed.get("infra_failure"):
            await a.fail(f"proxy: {sealed['infra_failure']}")
            return out
        calls = int(sealed.get("calls_served", 0))
        # A proxy quota refused a call, or the sandbox outgrew its disk quota (the harness then stopped): the policy's
        # doing, graded as usual; the lifecycle event's reason says so.
        over = [q for q in (sealed.get("quota_exceeded"), result.quota_exceeded) if q]
        quota = f"quota_exceeded: {'; '.join(over)}" if over else None
        if result.timed_out:
            # The measured run time, not only the limit: a slow kill (a loaded Docker daemon) shows here.
            killed = f"killed after {result.duration_s:.1f}s, limit {timeout:g}s ({'+'.join(result.killed)})"
            await a.move(RolloutState.TIMED_OUT, calls_served=calls, reason="; ".join(filter(None, (quota, killed))))
        else:
            code = result.exit_code
            if code is None:  # stopped for its disk quota: reported as a process killed by SIGKILL (Popen's -9)
                code = -signal.SIGKILL
                exited: str | None = f"stopped ({'+'.join(result.killed)}): {result.stderr[-500:]}"
            else:
                exited = None if code == 0 else f"exit {code}: {result.stderr[-500:]}"
            reason = "; ".join(filter(None, (quota, exited))) or None
            await a.move(RolloutState.HARNESS_EXITED, exit_code=code, calls_served=calls, reason=reason)
        t["grade_start"] = time.monotonic()
        try:
            messages = sealed.get("messages")  # the conversation the proxy saw, when it reports it
            graded = await grade(
                task,
                box,
                result.stdout,
                ctx.settings,
                session_dir=adapter.session_dir,
                messages=messages if isinstance(messages, list) else None,
            )
        except (GraderFailure, SandboxError, OSError) as exc:
            await a.fail(f"grader: {exc}")
            return out
        t["grade_end"] = time.monotonic()
        await a.give_reward(graded.status, graded.grader, graded.reward, graded.sub_scores, graded.reason)
        return out
    finally:
        try:
            if box is not None:
                out.cleanup = cleanup = await box.destroy()
                t["destroyed"] = time.monotonic()
                if not cleanup.clean:
                    log.error(
                        "sandbox %s not clean after destroy: pids %s, paths %s",
                        box.sandbox_id,
                        cleanup.leftover_pids,
                        cleanup.leftover_paths,
                    )
        finally:
            out.state, out.reward = a.state, a.reward
            try:
                if registered:
                    await _release(ctx, req, a)
            finally:  # renewed until forgotten: a lapsed lease lets another worker take the rollout over
                if lease is not None:
                    lease.cancel()
