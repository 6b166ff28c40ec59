"""A sandbox worker SIGKILLed mid-rollout: another worker of the group re-runs the request under a new attempt id.

Worker A (a real ``python -m producers.sandbox.worker`` subprocess) starts the rollout (STARTED is on the broker, the
policy is slow), then is SIGKILLed. Worker B (same consumer group) gets the partition after A's session times out,
re-registers the rollout at the proxy once A's lease lapsed (revoking A's registration, scoped to A's attempt id) and
completes it. Asserts: A's attempt has no reward, B's attempt exactly one (reward 1), no attempt has two; A's harness
died with A (PDEATHSIG), and B's periodic sweep removed A's sandbox directory.
"""

from __future__ import annotations

import asyncio
import signal
from collections import Counter

import pytest

from schemas.events import RewardStatus, RolloutState
from tests.support import proxy_helpers as H
from tests.support import sandbox_helpers as S
from tests.support.proxy_server import running_proxy
from tests.support.sandbox_stack import wait_for
from tests.support.sandbox_stack import worker_process as start_worker
from tests.support.scripted_engine import ScriptedEngine

pytestmark = [pytest.mark.integration, pytest.mark.serial]  # its leftover check is machine-wide


@pytest.mark.timeout(240)
async def test_killed_worker_request_is_rerun_once(kafka_settings, group_id, tmp_path) -> None:
    sandboxes = tmp_path / "sandboxes"
    req = S.request("hello", "agentloop", rollout_id="victim")
    async with (
        ScriptedEngine(H.tiny_tokenizer(), S.agent_responder(), delay_s=4.0) as engine,
        running_proxy(kafka_settings, engine.url, keepalive_s=1.0) as (_proxy, url),
    ):
        a = start_worker(kafka_settings, url, group_id, sandboxes, tmp_path / "a.log")
        b = None
        try:
            S.publish(kafka_settings, [req])
            # A picks it up: STARTED on the broker and the harness waiting for the (slow) policy
            events, _ = await asyncio.to_thread(S.collect, kafka_settings, {req.rollout_id}, 60, until_rewards=0)
            await wait_for(lambda: len(engine.requests) >= 1, 60, "A's harness to call the policy")
            harness_pids = S.leftover_processes()
            assert harness_pids, "A's harness should be running"
            a.send_signal(signal.SIGKILL)
            a.wait(10)
            engine.delay_s = 0.0
            b = start_worker(kafka_settings, url, group_id, sandboxes, tmp_path / "b.log")
            events, rewards = await asyncio.to_thread(S.collect, kafka_settings, {req.rollout_id}, 90, settle_s=3)
            # B's sweep (every 1 s) removes A's sandbox directory
            await wait_for(lambda: not any(sandboxes.iterdir()), 20, "A's sandbox dir to be swept")
        finally:
            for proc in (a, b):
                if proc is not None and proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
                    proc.wait(60)
    log = (tmp_path / "a.log").read_text()[-2000:] + "\n---\n" + (tmp_path / "b.log").read_text()[-3000:]
    started = [e for e in events if e.state == RolloutState.STARTED]
    assert len(started) == 2 and started[0].attempt_id != started[1].attempt_id, log
    assert started[0].worker_id != started[1].worker_id
    assert Counter(r.attempt_id for r in rewards) == {started[1].attempt_id: 1}, log
    (reward,) = rewards
    assert reward.status == RewardStatus.OK and reward.reward == 1.0
    ended = [e for e in events if e.state == RolloutState.HARNESS_EXITED]
    assert [e.attempt_id for e in ended] == [started[1].attempt_id]
    assert not any(S.pid_alive(p) for p in harness_pids), "A's harness survived A"
    assert S.leftover_processes() == []
