"""The in-process sandbox stack for integration tests: scripted engine + real proxy + one sandbox worker.

Besides the catalog's harnesses the worker knows two fake ones: ``hang`` (ignores SIGTERM, leaves a background child
whose pid it writes to the stack's ``pidfile``) and ``crash`` (writes the answer, then exits 3). ``run_requests``
publishes rollout requests and collects their lifecycle events and rewards; ``assert_clean`` checks that no sandbox
directory or process survived.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from producers.harnesses.catalog import ADAPTERS
from producers.sandbox.base import SandboxSettings
from producers.sandbox.worker import SandboxWorker
from tests.support import proxy_helpers as H
from tests.support import sandbox_helpers as S
from tests.support.proxy_server import running_proxy
from tests.support.scripted_engine import ScriptedEngine

HANG = """
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # ignore the polite kill: SIGKILL must follow
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(os.environ["PIDFILE"], "w").write(str(child.pid))
time.sleep(600)
"""
CRASH = "open('hello.txt', 'w').write('hi'); raise SystemExit(3)"


@asynccontextmanager
async def stack(
    kafka, group_id: str, tmp: Path, responder=None, *, policy_version: int = 7, **overrides: Any
) -> AsyncIterator[dict]:
    """Scripted engine (reporting ``policy_version``) + proxy + one in-process sandbox worker; yields handles."""
    pidfile = tmp / "child.pid"
    adapters = {**ADAPTERS, "hang": S.python_adapter("hang", HANG), "crash": S.python_adapter("crash", CRASH)}
    adapters["hang"] = type(adapters["hang"])(**{**adapters["hang"].__dict__, "env": {"PIDFILE": str(pidfile)}})
    async with (
        ScriptedEngine(H.tiny_tokenizer(), responder or S.agent_responder(), policy_version=policy_version) as engine,
        running_proxy(kafka, engine.url, keepalive_s=1.0) as (_proxy, url),
    ):
        settings = SandboxSettings(
            proxy_url=url,
            proxy_admin_token="admin",
            group_id=group_id,
            root=tmp / "sandboxes",
            session_timeout_ms=6000,
            publish_timeout_s=15,
            **{"concurrency": 4, "suites": {"native": str(S.NATIVE_SUITE)}, **overrides},
        )
        worker = SandboxWorker(settings, kafka, adapters=adapters)
        stop = asyncio.Event()
        task = asyncio.create_task(worker.run(stop))
        try:
            yield {"worker": worker, "engine": engine, "root": tmp / "sandboxes", "pidfile": pidfile}
        finally:
            stop.set()
            assert await asyncio.wait_for(task, 60) == 0


async def run_requests(kafka, reqs, timeout: float = 90.0):
    S.publish(kafka, reqs)
    return await asyncio.to_thread(S.collect, kafka, {r.rollout_id for r in reqs}, timeout, settle_s=1.0)


def assert_clean(root: Path) -> None:
    assert not root.exists() or not any(root.iterdir()), f"sandbox dirs left: {list(root.iterdir())}"
    assert S.leftover_processes() == [], "sandbox processes survived"


def by_rollout(events, rewards):
    ev: dict[str, list] = {}
    for e in events:
        ev.setdefault(e.rollout_id, []).append(e)
    rw: dict[str, list] = {}
    for r in rewards:
        rw.setdefault(r.rollout_id, []).append(r)
    return ev, rw


def assert_solved_by_harness(events, rewards, rollout_id: str) -> None:
    """The rollout's harness exited by itself (exit 0, at least 2 model calls) and the grader gave it 1.0."""
    from schemas.events import RewardStatus, RolloutState

    ev, rw = by_rollout(events, rewards)
    assert [e.state for e in ev[rollout_id]] == [RolloutState.STARTED, RolloutState.HARNESS_EXITED], ev[rollout_id]
    exited = ev[rollout_id][-1]
    assert exited.exit_code == 0 and exited.calls_served >= 2, exited
    (reward,) = rw[rollout_id]
    assert reward.status == RewardStatus.OK and reward.reward == 1.0, reward
