"""A proxy SIGKILLed during calls, through the real streams: every rollout the proxy lost is re-issued, no group
trains short, and ``clawstream audit`` says CLEAN.

Real broker; the stack's own launch code (``clawstream.stack.services``) starts a real proxy process, a sandbox
worker (the built-in ``agentloop`` harness on the CPU suite, bubblewrap), the Faust streams worker and the scheduler
(1 step: 2 tasks x groups of 2, ``max_attempts`` 2); the model is the scripted engine, in this process. The engine
holds every answer; once it holds a call of every rollout (its request list, not a sleep) the proxy is SIGKILLed by
the stack and restarted, and the held answers go to a closed connection: every attempt 0 is an INFRA_FAILURE,
re-issued, and attempt 1 (the last the scheduler allows) is answered at once. The streams must keep each group open
for its re-issues: both groups are sealed into a batch with both members (attempt 1's trajectories), no trajectory is
dead-lettered late, and the audit of the topics (the real command) is CLEAN with no short group.

The streams settle a rollout 2 s after its last record (``settle_interval_s``), so a re-issue's request is always
read before the attempt it replaces settles: a failed attempt's trajectory must carry its own attempt number, not
the re-issue's, or the grouper takes it for the last attempt, closes the group "complete" and dead-letters the
re-issue late. ``KILLS = 2`` (``max_attempts`` 3, the shipped limit) checks the same at twice the proxy restarts.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from clawbase.kafka.clients import bootstrap_servers
from clawbase.settings import KafkaSettings
from clawstream.stack.process import Service, Stack
from clawstream.stack.services import stack_for, start_rollout_side, start_scheduler, start_streams
from consumers.analytics.audit import format_report, read_run
from consumers.analytics.reconcile import RunLog, reconcile, request_of
from tests.support import proxy_helpers as H
from tests.support import sandbox_helpers as S
from tests.support.scripted_engine import ScriptedEngine

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

TASKS, GROUP_SIZE, KILLS = 2, 2, 1
MAX_ATTEMPTS = KILLS + 1  # the re-issue after the last kill is the rollout's last attempt
ROLLOUTS = TASKS * GROUP_SIZE
ROOT = Path(__file__).resolve().parents[2]


async def _until(predicate: Any, timeout: float, what: str, stack: Stack) -> Any:
    """Poll the system's state until ``predicate()`` is truthy; the stack must stay up meanwhile."""
    deadline = time.monotonic() + timeout
    while not (value := await asyncio.to_thread(predicate)):  # off the loop: the engine answers meanwhile
        for s in stack.services:
            assert s.proc is None or s.proc.poll() is None or s.may_finish, f"{s.name} died:\n{stack.tail(s)}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.2)
    return value


def _done(log: RunLog) -> str | None:
    """Why the run is over: every group sealed into a batch, or the grouper dead-lettered a trajectory; else None."""
    sealed = {e.group_id or (e.trajectory.group_id if e.trajectory else None) for e in log.batches}
    requested = {t.group_id for t in log.trajectories if t.group_id}
    if len(requested) == TASKS and requested <= sealed:
        return "every group batched"
    late = [d for d in log.dead_letters if d.source == "streams.grouper"]
    return f"grouper dead letters: {[d.reason[:200] for d in late]}" if late else None


async def test_proxy_kills_during_calls_reissue_every_lost_rollout_and_no_group_trains_short(
    kafka_settings: KafkaSettings, tmp_path: Path
) -> None:
    kafka, t0 = kafka_settings, time.monotonic()

    def mark(what: str) -> None:  # shown with a failure: where the time went
        print(f"{time.monotonic() - t0:6.1f} s  {what}", flush=True)

    async with ScriptedEngine(H.tiny_tokenizer(), S.agent_responder()) as engine:
        engine.hold = asyncio.Event()
        stack = stack_for(kafka, tmp_path / "logs")
        stack.env["CLAWSTREAM_SANDBOX_SEEN_DIR"] = str(tmp_path / "seen")
        stack.env["CLAWSTREAM_STREAMS_SETTLE_TIMEOUT_S"] = "30"
        try:
            await asyncio.to_thread(_start, stack, engine.url, tmp_path / "run")
            mark("stack up")
            proxy = next(s for s in stack.services if s.name == "proxy")
            for k in range(1, KILLS + 1):  # each time, the engine holds a call of every rollout's attempt k-1
                await _until(lambda k=k: len(engine.requests) >= k * ROLLOUTS, 120, f"round {k}'s calls", stack)
                assert len(engine.requests) == k * ROLLOUTS, [r.body for r in engine.requests]
                # The held calls keep waiting on their event; the next attempts' calls wait on a new one (or none).
                held, engine.hold = engine.hold, (asyncio.Event() if k < KILLS else None)
                assert held is not None
                mark(f"round {k}: the engine holds {ROLLOUTS} calls; SIGKILL the proxy")
                await asyncio.to_thread(stack.kill, proxy)
                await asyncio.to_thread(stack.restart, proxy)
                held.set()  # the killed proxy's calls find no one to answer
                mark(f"round {k}: proxy restarted")
            why = await _until(lambda: _done(read_run(kafka)), 150, "the groups in batches", stack)
            mark(why)
            log = await asyncio.to_thread(read_run, kafka)
        finally:
            await asyncio.to_thread(stack.stop)
            mark("stack stopped")
    report = reconcile(log)
    text = format_report(report, kafka.topic_prefix)
    assert why == "every group batched", f"{why}\n{text}"

    # Every attempt the proxy lost: an INFRA_FAILURE, re-issued as the next attempt (its request on the log).
    assert sorted((q.rollout_id, q.attempt) for q in log.requests) == sorted(
        (rollout, a) for rollout in {q.rollout_id for q in log.requests} for a in range(KILLS + 1)
    ), text
    attempts: dict[str, dict[int, str]] = defaultdict(dict)
    for r in log.rewards:
        attempts[r.rollout_id][int(request_of(r.rollout_id, r.attempt_id)[1])] = r.status
    assert len(attempts) == ROLLOUTS, attempts
    for rollout, by_attempt in attempts.items():
        assert by_attempt == {**dict.fromkeys(range(KILLS), "INFRA_FAILURE"), KILLS: "OK"}, (rollout, by_attempt, text)
    # Every group in the batches has all its members, the re-issues' trajectories: none short, none late.
    members: dict[str, set[str]] = defaultdict(set)
    for e in log.batches:
        if e.kind != "SEAL" and e.trajectory is not None:
            assert request_of(e.trajectory.rollout_id, e.trajectory.attempt_id)[1] == str(KILLS), (e.trajectory, text)
            members[e.trajectory.group_id or ""].add(e.trajectory.rollout_id)
    assert len(members) == TASKS and all(len(m) == GROUP_SIZE for m in members.values()), (members, text)
    assert report.clean and not report.short_groups, text
    assert not [d for d in log.dead_letters if d.source.startswith("streams")], text

    # The real command on the topics.
    env = {**os.environ, "CLAWSTREAM_STREAMS_APP_ID": f"{kafka.topic_prefix}streams"}
    cmd = [sys.executable, "-m", "clawstream", "audit", "--topic-prefix", kafka.topic_prefix]
    done = subprocess.run(  # noqa: S603 - our own command
        [*cmd, "--bootstrap", bootstrap_servers(kafka)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    mark("clawstream audit done")
    assert done.returncode == 0 and "CLEAN" in done.stdout, done.stdout + done.stderr
    assert "trained short" not in done.stdout, done.stdout


def _start(stack: Stack, engine_url: str, run_dir: Path) -> list[Service]:
    start_rollout_side(stack, H.tiny_model_dir(), engine_url=engine_url, concurrency=ROLLOUTS)
    # zero_variance "keep": the scripted engine solves every task alike, and every group must reach a batch
    start_streams(
        stack, run_dir, group_size=GROUP_SIZE, batch_groups=TASKS, settle_interval_s=2.0, zero_variance="keep"
    )
    settings: dict[str, object] = {
        "tasks_per_step": TASKS,
        "group_size": GROUP_SIZE,
        "max_attempts": MAX_ATTEMPTS,
        "max_policy_lag": 1,
        "zero_variance": "keep",  # as the streams: no refill group is issued
    }
    settings["drain_timeout_s"] = 240  # the scheduler stays for the re-issues after its one step
    start_scheduler(stack, 1, settings)
    return stack.services
