"""One rollout attempt, start to end: sandbox → proxy registration → harness → seal → grade → events → cleanup.

The sandbox worker calls :func:`execute` per request; no Kafka import: events go to an :class:`EventSink`.
Statuses (docs/method.md#infrastructure-failures; every change through ``schemas.lifecycle.transition``):

* harness exits by itself → HARNESS_EXITED(exit_code, calls_served), graded (a proxy quota's refusal or the disk
  quota, ``max_workspace_bytes``, too: its ``reason`` starts ``quota_exceeded:``; the latter stops it, exit -9);
* harness killed at its wall-clock limit → TIMED_OUT(calls_served), graded;
* a grader failing on what the rollout left (not on the task's untouched workspace) → graded 0, flagged
  ``grader_error_by_rollout``; sandbox creation, proxy (register/seal, or its infra_failure flag), a grader failing
  on the untouched workspace too, the judge, unknown task/harness → FAILED(reason), INFRA_FAILURE, reward null;
* the proxy restarted during the rollout (seal ``restored``) and the sandbox's relay saw it lose a call
  (``Sandbox.proxy_failures``), or it recorded no main-agent call since → FAILED, INFRA_FAILURE: re-issued, never
  graded as it stands (the infrastructure's records: a rollout cannot restart the proxy). Once the proxy served the
  rollout the grader reads its record, never the harness's stdout (``producers.tasks.transcript.proxy_conversation``).

Exactly one RewardEvent per attempt; the attempt id (``{rollout_id}.a{attempt}.{random}``) is new on every
execution. The sandbox is destroyed in every case. The proxy registration is the attempt's claim on the rollout id:
made before the sandbox, kept alive by a lease the attempt renews, sealed and forgotten only under its own attempt id
(``finished`` once its reward is acknowledged). If another attempt holds the id and is live, or this request attempt
already finished, :func:`execute` returns with ``Outcome.held`` set and publishes nothing; a holder that stopped
renewing (its worker died) is revoked, scoped to its attempt id.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import signal
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from clawbase.errors import ClawstreamError
from producers.harnesses.base import HarnessAdapter, LaunchContext, LaunchSpec, launch_spec
from producers.sandbox.base import CleanupReport, RunResult, Sandbox, SandboxBackend, SandboxError
from producers.sandbox.proxy_admin import ProxyAdmin, ProxyError, RolloutHeld
from producers.sandbox.run_grader import blame, grade
from producers.sandbox.settings import SandboxSettings
from producers.tasks.catalog import SuiteCatalog
from producers.tasks.grading_rules import GraderRunFailure
from producers.tasks.model import Task, TaskError
from producers.tasks.transcript import TranscriptLost, proxy_conversation
from schemas.events import RewardEvent, RewardStatus, RolloutEvent, RolloutRequest, RolloutState, now_ms
from schemas.lifecycle import transition

log = logging.getLogger("clawstream.rollout")


class EventSink(Protocol):
    async def event(self, event: RolloutEvent) -> None: ...

    async def reward(self, reward: RewardEvent) -> None: ...


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
        *,
        by_rollout: bool = False,
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
            grader_error_by_rollout=by_rollout,
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


class _AttemptFailed(ClawstreamError):
    """A step of the attempt failed (its message the reason): the attempt ends FAILED, reward INFRA_FAILURE."""


# What may fail while preparing an attempt (unknown task or harness, proxy, sandbox creation, launch files).
_SETUP_ERRORS = (TaskError, SandboxError, ProxyError, OSError, ValueError)


@dataclass
class _Launch:
    """What the prepared attempt runs: in which sandbox, the harness's command line, and for how long."""

    task: Task
    adapter: HarnessAdapter
    box: Sandbox
    spec: LaunchSpec
    timeout_s: float
    extra_path: str
    prompt: str  # the task's prompt as the harness got it


async def execute(req: RolloutRequest, ctx: RolloutContext) -> Outcome:
    """Run one attempt of ``req``; returns once its terminal events and reward are acknowledged by the sink, or at
    once with ``held`` set (nothing published) when another attempt holds the rollout id (see the module doc).

    Raises only when the sink itself fails (Kafka down): the request must then not be committed.
    """
    a = _Attempt(req, ctx)
    out = Outcome(a.attempt_id, None, None, {"t0": time.monotonic()})
    # Whatever was acquired is undone in reverse, whichever way the steps end: the sandbox destroyed, then the proxy
    # registration sealed (if not yet) and forgotten, then its lease no longer renewed.
    async with contextlib.AsyncExitStack() as cleanup:
        try:
            run = await _prepare(a, cleanup, out)
            result = await _run_harness(a, run, out.timings)
            conversation = await _seal(a, run, result)
            await _grade(a, run, result, conversation, out.timings)
        except RolloutHeld as held:
            out.held = held
        except _AttemptFailed as failed:
            await a.fail(str(failed))
    out.state, out.reward = a.state, a.reward
    return out


async def _prepare(a: _Attempt, cleanup: contextlib.AsyncExitStack, out: Outcome) -> _Launch:
    """Resolve task and harness, claim the rollout id at the proxy, create the sandbox, write the harness's files.

    Raises :class:`RolloutHeld` (another attempt holds the id) or :class:`_AttemptFailed` (``setup: …``)."""
    req, ctx = a.req, a.ctx
    try:
        task = ctx.catalog.task(req.suite, req.task_id)
        adapter = ctx.adapters.get(req.harness)
        if adapter is None:
            raise TaskError(f"unknown harness {req.harness!r}; known: {', '.join(ctx.adapters)}")
        exe, extra_path = await ctx.resolve_exe(adapter)
        timeout = _timeout_s(req, ctx.settings, task)
        reg = await _claim(a, timeout, cleanup)
        box = await ctx.backend.create(sandbox_id(a.attempt_id), task)
        cleanup.push_async_callback(_destroy, box, out)
        out.timings["created"] = time.monotonic()
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
    except _SETUP_ERRORS as exc:
        raise _AttemptFailed(f"setup: {exc}") from exc
    return _Launch(task, adapter, box, spec, timeout, extra_path, prompt)


def _timeout_s(req: RolloutRequest, settings: SandboxSettings, task: Task) -> float:
    """The harness's wall-clock limit: the request's, the task's (or the worker's override), the cap, the deadline."""
    own = settings.task_timeout_s or task.timeout_s
    timeout = min(req.timeout_s or own, own, settings.max_timeout_s)
    if req.deadline_ms:
        timeout = max(1.0, min(timeout, (req.deadline_ms - now_ms()) / 1000))
    return timeout


async def _claim(a: _Attempt, timeout_s: float, cleanup: contextlib.AsyncExitStack) -> dict[str, Any]:
    """Register the attempt at the proxy (its claim on the rollout id) and keep its lease renewed; ``cleanup``
    releases both. Returns the registration (base URL, secret); raises :class:`RolloutHeld`."""
    req, ctx = a.req, a.ctx
    reg = await ctx.proxy.register(
        req.rollout_id,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        seed=req.seed,
        max_tokens=req.max_tokens,
        ttl_s=timeout_s + 600,
        attempt_id=a.attempt_id,
        attempt=req.attempt,
        lease_s=ctx.settings.proxy_lease_s,
    )
    lease = asyncio.create_task(_keep_lease(ctx, req.rollout_id, a.attempt_id))
    cleanup.push_async_callback(_release, a, lease)
    return reg


async def _release(a: _Attempt, lease: asyncio.Task[None]) -> None:
    """Seal (if the harness was not sealed yet) and forget this attempt's registration — never another attempt's of
    the same rollout id; ``finished`` once its reward is acknowledged (the request attempt is then done). The lease
    is renewed until then: a lapsed one lets another worker take the rollout over."""
    req, ctx = a.req, a.ctx
    try:
        try:
            if a.state == RolloutState.STARTED or a.state is None:
                await ctx.proxy.seal(req.rollout_id, a.attempt_id)
        except ProxyError as exc:
            log.warning("rollout %s: could not seal attempt %s: %s", req.rollout_id, a.attempt_id, exc)
        try:
            await ctx.proxy.forget(req.rollout_id, a.attempt_id, finished=a.reward is not None)
        except ProxyError as exc:
            log.warning("rollout %s: could not release attempt %s: %s", req.rollout_id, a.attempt_id, exc)
    finally:
        lease.cancel()


async def _destroy(box: Sandbox, out: Outcome) -> None:
    out.cleanup = cleanup = await box.destroy()
    out.timings["destroyed"] = time.monotonic()
    if not cleanup.clean:
        log.error(
            "sandbox %s not clean after destroy: pids %s, paths %s",
            box.sandbox_id,
            cleanup.leftover_pids,
            cleanup.leftover_paths,
        )


async def _run_harness(a: _Attempt, run: _Launch, t: dict[str, float]) -> RunResult:
    """STARTED, then the harness in its sandbox until it exits, is killed at its limit or outgrows the disk quota."""
    await a.move(RolloutState.STARTED)
    t["harness_start"] = time.monotonic()
    try:
        result = await run.box.run(
            run.spec.argv,
            run.spec.env,
            run.box.workspace,
            run.timeout_s,
            extra_path=run.extra_path,
            max_bytes=a.ctx.settings.max_workspace_bytes,
        )
    except SandboxError as exc:
        raise _AttemptFailed(f"harness launch: {exc}") from exc
    t["harness_end"] = time.monotonic()
    return result


async def _seal(a: _Attempt, run: _Launch, result: RunResult) -> list[dict[str, Any]] | None:
    """Seal the registration (no model call after this), check the proxy can vouch for the rollout, then publish how
    the harness ended; returns the conversation the grader reads (None: the proxy served nothing)."""
    try:
        sealed = await a.ctx.proxy.seal(a.req.rollout_id, a.attempt_id)
    except ProxyError as exc:
        raise _AttemptFailed(f"seal: {exc}") from exc
    if sealed.get("infra_failure"):
        raise _AttemptFailed(f"proxy: {sealed['infra_failure']}")
    conversation = await _vouched(run, sealed)
    calls = int(sealed.get("calls_served", 0))
    # A proxy quota refused a call, or the sandbox outgrew its disk quota (the harness then stopped): the policy's
    # doing, graded as usual; the lifecycle event's reason says so.
    over = [q for q in (sealed.get("quota_exceeded"), result.quota_exceeded) if q]
    quota = f"quota_exceeded: {'; '.join(over)}" if over else None
    if result.timed_out:
        # The measured run time, not only the limit: a slow kill (a loaded Docker daemon) shows here.
        killed = f"killed after {result.duration_s:.1f}s, limit {run.timeout_s:g}s ({'+'.join(result.killed)})"
        await a.move(RolloutState.TIMED_OUT, calls_served=calls, reason="; ".join(filter(None, (quota, killed))))
        return conversation
    code = result.exit_code
    if code is None:  # stopped for its disk quota: reported as a process killed by SIGKILL (Popen's -9)
        code = -signal.SIGKILL
        exited: str | None = f"stopped ({'+'.join(result.killed)}): {result.stderr[-500:]}"
    else:
        exited = None if code == 0 else f"exit {code}: {result.stderr[-500:]}"
    reason = "; ".join(filter(None, (quota, exited))) or None
    await a.move(RolloutState.HARNESS_EXITED, exit_code=code, calls_served=calls, reason=reason)
    return conversation


async def _vouched(run: _Launch, sealed: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The conversation the grader reads (``proxy_conversation``); raises :class:`_AttemptFailed` when the proxy
    restarted during the rollout and lost a call (what the sandbox's relay saw) or recorded no main-agent call since."""
    if sealed.get("restored"):
        try:
            lost = await run.box.proxy_failures()
        except Exception as exc:  # the docker relay's log unreadable: the lost calls cannot be ruled out
            raise _AttemptFailed(f"proxy: restarted during the rollout; its relay's records unreadable: {exc}") from exc
        if lost:
            seen = "; ".join(lost)
            raise _AttemptFailed(f"proxy: restarted during the rollout and lost a call in flight (relay: {seen})")
    try:
        return proxy_conversation(sealed, run.prompt)
    except TranscriptLost as exc:
        raise _AttemptFailed(f"proxy: {exc}") from exc


async def _grade(
    a: _Attempt, run: _Launch, result: RunResult, conversation: list[dict[str, Any]] | None, t: dict[str, float]
) -> None:
    """Grade the rollout in its sandbox and publish the reward. A grader that fails on the rollout's workspace but
    grades the task's untouched one: a graded 0 flagged ``grader_error_by_rollout``; any other failure of grading
    (whatever it raises) is an :class:`_AttemptFailed`, never the worker's end."""
    t["grade_start"] = time.monotonic()
    try:
        graded = await grade(
            run.task, run.box, result.stdout, a.ctx.settings, session_dir=run.adapter.session_dir, messages=conversation
        )
    except GraderRunFailure as failed:
        try:
            graded = await blame(run.task, a.ctx.backend, a.ctx.settings, failed)
        except Exception as exc:
            raise _AttemptFailed(f"grader: {exc}") from exc
    except Exception as exc:  # the judge, the sandbox, or a bug: this attempt's infrastructure failure
        raise _AttemptFailed(f"grader: {exc}") from exc
    t["grade_end"] = time.monotonic()
    await a.give_reward(
        graded.status, graded.grader, graded.reward, graded.sub_scores, graded.reason, by_rollout=graded.by_rollout
    )
