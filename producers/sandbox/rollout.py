"""One rollout attempt, start to end: sandbox → proxy registration → harness → seal → grade → events → cleanup.

The sandbox worker calls :func:`execute` per request; this module has no Kafka import: events go to an
:class:`EventSink` (the worker's publishes to Kafka and waits for the acknowledgement; tests may collect them).

Statuses (docs/method.md#infrastructure-failures; every state change goes through ``schemas.lifecycle.transition``):

* harness exits by itself (any exit code) → HARNESS_EXITED(exit_code, calls_served), graded;
* harness killed at its wall-clock limit → TIMED_OUT(calls_served), graded;
* sandbox creation, proxy (register/seal, or the proxy flags the rollout infra_failure), grader crash, unknown
  task/harness → FAILED(reason) and a RewardEvent with status INFRA_FAILURE and reward null (never a 0).

Exactly one RewardEvent per attempt; the attempt id (``{rollout_id}.a{attempt}.{random}``) is new on every
execution, so a request re-run after a worker died is a different attempt. The sandbox is destroyed in every case.
"""

from __future__ import annotations

import logging
import os
import re
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


class EventSink(Protocol):
    async def event(self, event: RolloutEvent) -> None: ...

    async def reward(self, reward: RewardEvent) -> None: ...


class ProxyAdmin:
    """Client of the proxy's admin API (``producers.proxy.admin``)."""

    def __init__(self, url: str, token: str, timeout_s: float = 90.0) -> None:
        self.url, self.token, self.timeout_s = url.rstrip("/"), token, timeout_s

    async def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, dict]:
        headers = {"Authorization": f"Bearer {self.token}"}
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as http:
                async with http.request(method, self.url + path, json=body, headers=headers) as resp:
                    data = await resp.json(content_type=None) if resp.content_length != 0 else {}
                    return resp.status, data or {}
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise ProxyError(f"proxy admin {method} {path} at {self.url}: {exc!r}") from exc

    async def register(self, rollout_id: str, **params: Any) -> dict[str, Any]:
        body = {"rollout_id": rollout_id, **params}
        status, data = await self._call("POST", "/admin/rollouts", body)
        if status == 409:  # an earlier attempt (its worker died) is still registered: revoke it, forget it
            await self.seal(rollout_id)
            await self.forget(rollout_id)
            status, data = await self._call("POST", "/admin/rollouts", body)
        if status != 201:
            raise ProxyError(f"proxy refused to register {rollout_id}: {status} {data}")
        return data

    async def seal(self, rollout_id: str) -> dict[str, Any]:
        status, data = await self._call("POST", f"/admin/rollouts/{rollout_id}/seal")
        if status != 200:
            raise ProxyError(f"proxy could not seal {rollout_id}: {status} {data}")
        return data

    async def forget(self, rollout_id: str) -> None:
        await self._call("DELETE", f"/admin/rollouts/{rollout_id}")


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


async def execute(req: RolloutRequest, ctx: RolloutContext) -> Outcome:
    """Run one attempt of ``req``; returns once its terminal events and reward are acknowledged by the sink.

    Raises only when the sink itself fails (Kafka down): the request must then not be committed.
    """
    a = _Attempt(req, ctx)
    t: dict[str, float] = {"t0": time.monotonic()}
    out = Outcome(a.attempt_id, None, None, t)
    box: Sandbox | None = None
    registered = False
    try:
        try:
            task = ctx.catalog.task(req.suite, req.task_id)
            adapter = ctx.adapters.get(req.harness)
            if adapter is None:
                raise TaskError(f"unknown harness {req.harness!r}; known: {', '.join(ctx.adapters)}")
            exe, extra_path = await ctx.resolve_exe(adapter)
            box = await ctx.backend.create(sandbox_id(a.attempt_id), task)
            t["created"] = time.monotonic()
            timeout = min(req.timeout_s or task.timeout_s, task.timeout_s, ctx.settings.max_timeout_s)
            if req.deadline_ms:
                timeout = max(1.0, min(timeout, (req.deadline_ms - now_ms()) / 1000))
            reg = await ctx.proxy.register(
                req.rollout_id,
                temperature=req.temperature,
                top_p=req.top_p,
                top_k=req.top_k,
                max_tokens=req.max_tokens,
                ttl_s=timeout + 600,
                attempt_id=a.attempt_id,
            )
            registered = True
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
            result = await box.run(spec.argv, spec.env, box.workspace, timeout, extra_path=extra_path)
        except SandboxError as exc:
            await a.fail(f"harness launch: {exc}")
            return out
        t["harness_end"] = time.monotonic()
        try:
            sealed = await ctx.proxy.seal(req.rollout_id)
        except ProxyError as exc:
            await a.fail(f"seal: {exc}")
            return out
        if sealed.get("infra_failure"):
            await a.fail(f"proxy: {sealed['infra_failure']}")
            return out
        calls = int(sealed.get("calls_served", 0))
        if result.timed_out:
            await a.move(
                RolloutState.TIMED_OUT,
                calls_served=calls,
                reason=f"killed after {timeout:.0f}s ({'+'.join(result.killed)})",
            )
        else:
            reason = None if result.exit_code == 0 else f"exit {result.exit_code}: {result.stderr[-500:]}"
            await a.move(RolloutState.HARNESS_EXITED, exit_code=result.exit_code, calls_served=calls, reason=reason)
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
        if registered:
            try:
                if a.state == RolloutState.STARTED or a.state is None:
                    await ctx.proxy.seal(req.rollout_id)
                await ctx.proxy.forget(req.rollout_id)
            except ProxyError as exc:
                log.warning("rollout %s: could not release it at the proxy: %s", req.rollout_id, exc)
        out.state, out.reward = a.state, a.reward
