"""The in-process sandbox stack for integration tests: scripted engine + real proxy + one sandbox worker.

Besides the catalog's harnesses the worker knows two fake ones: ``hang`` (ignores SIGTERM, leaves a background child
with the stack's ``hang_tag`` in its argv) and ``crash`` (writes the answer, then exits 3). ``run_requests``
publishes rollout requests and collects their lifecycle events and rewards; ``assert_clean`` checks that no sandbox
directory or process survived. ``worker_process`` starts a real ``python -m producers.sandbox.worker`` process (the
fault tests kill one, or add one to the group), ``wait_for`` polls a condition.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from producers.harnesses.catalog import all_adapters
from producers.sandbox.settings import SandboxSettings
from producers.sandbox.worker import SandboxWorker
from tests.support import proxy_helpers as H
from tests.support import sandbox_helpers as S
from tests.support.proxy_server import admin_url, running_proxy
from tests.support.scripted_engine import ScriptedEngine

ROOT = Path(__file__).resolve().parents[2]

HANG = """
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # ignore the polite kill: SIGKILL must follow
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", os.environ["HANG_TAG"]])
time.sleep(600)
"""
CRASH = "open('hello.txt', 'w').write('hi'); raise SystemExit(3)"


@asynccontextmanager
async def stack(
    kafka,
    group_id: str,
    tmp: Path,
    responder=None,
    *,
    policy_version: int = 7,
    proxy_overrides: dict[str, Any] | None = None,
    **overrides: Any,
) -> AsyncIterator[dict]:
    """Scripted engine (reporting ``policy_version``) + proxy (``proxy_overrides``: its settings) + one in-process
    sandbox worker (``overrides``: its settings); yields handles."""
    hang_tag = f"hang-child-{uuid.uuid4().hex}"  # the hung harness's child carries it in argv (pids differ inside)
    extra = all_adapters(extra_files=overrides.get("harness_files", ()))  # the catalog + a user's adapter files
    adapters = {**extra, "hang": S.python_adapter("hang", HANG), "crash": S.python_adapter("crash", CRASH)}
    adapters["hang"] = type(adapters["hang"])(**{**adapters["hang"].__dict__, "env": {"HANG_TAG": hang_tag}})
    async with (
        ScriptedEngine(H.tiny_tokenizer(), responder or S.agent_responder(), policy_version=policy_version) as engine,
        running_proxy(kafka, engine.url, **{"keepalive_s": 1.0, **(proxy_overrides or {})}) as (_proxy, url),
    ):
        settings = SandboxSettings(
            proxy_url=admin_url(url),
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
            yield {"worker": worker, "engine": engine, "root": tmp / "sandboxes", "hang_tag": hang_tag}
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


def worker_process(kafka, proxy_url: str, group_id: str, sandboxes: Path, log: Path, **env: str) -> subprocess.Popen:
    """A sandbox worker process on the native test suite (6 s session timeout, 3 s proxy lease, 1 s sweeps); ``env``:
    more ``CLAWSTREAM_SANDBOX_*`` settings, by name without the prefix (``CONCURRENCY="8"``)."""
    environ = {
        **os.environ,
        "CLAWSTREAM_KAFKA_BOOTSTRAP_SERVERS": kafka.bootstrap_servers,
        "CLAWSTREAM_KAFKA_TOPIC_PREFIX": kafka.topic_prefix,
        "CLAWSTREAM_SANDBOX_PROXY_URL": admin_url(proxy_url),  # its admin listener (either URL given)
        "CLAWSTREAM_SANDBOX_PROXY_ADMIN_TOKEN": "admin",
        "CLAWSTREAM_SANDBOX_GROUP_ID": group_id,
        "CLAWSTREAM_SANDBOX_SUITES": json.dumps({"native": str(S.NATIVE_SUITE)}),
        "CLAWSTREAM_SANDBOX_ROOT": str(sandboxes),
        "CLAWSTREAM_SANDBOX_SESSION_TIMEOUT_MS": "6000",
        "CLAWSTREAM_SANDBOX_PROXY_LEASE_S": "3",
        "CLAWSTREAM_SANDBOX_SWEEP_INTERVAL_S": "1",
        "CLAWSTREAM_SANDBOX_PUBLISH_TIMEOUT_S": "15",
        **{f"CLAWSTREAM_SANDBOX_{k}": v for k, v in env.items()},
    }
    out = open(log, "wb")  # noqa: SIM115 - the child owns it
    return subprocess.Popen(
        [sys.executable, "-m", "producers.sandbox.worker"], cwd=ROOT, env=environ, stdout=out, stderr=subprocess.STDOUT
    )


async def wait_for(predicate: Callable[[], Any], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.2)
