"""The sandbox worker's ``task_timeout_s`` replaces every task's own timeout (``clawstream demo --rollout-timeout``,
#32: a real harness on 2 busy cores outlives builtin:cpu's 60 s), and a request may still ask for less.

Real Kafka broker, real serving proxy, scripted engine, local sandboxes; the fake ``hang`` harness never exits.
The native ``hello`` task's own timeout is 60 s: with ``task_timeout_s=3`` a request asking 60 s is killed at 3 s
(TIMED_OUT, graded), far below 60 s; one asking 2 s at 2 s.
"""

from __future__ import annotations

import pytest

from schemas.events import RewardStatus, RolloutState
from tests.support import sandbox_helpers as S
from tests.support.sandbox_stack import assert_clean, by_rollout, run_requests, stack

pytestmark = [pytest.mark.integration, pytest.mark.serial]  # its leftover check is machine-wide


@pytest.mark.timeout(240)
async def test_task_timeout_replaces_the_tasks_own(kafka_settings, group_id, tmp_path) -> None:
    reqs = [
        S.request("hello", "hang", rollout_id="asks-60", timeout_s=60),
        S.request("hello", "hang", rollout_id="asks-2", timeout_s=2),
    ]
    async with stack(kafka_settings, group_id, tmp_path, task_timeout_s=3.0):
        events, rewards = await run_requests(kafka_settings, reqs)
    ev, rw = by_rollout(events, rewards)
    for rid, limit in (("asks-60", 3), ("asks-2", 2)):
        started, timed_out = ev[rid]
        assert timed_out.state == RolloutState.TIMED_OUT, timed_out
        took = (timed_out.timestamp_ms - started.timestamp_ms) / 1000
        assert limit - 0.5 < took < limit + 20, (rid, took)  # the task's own 60 s is far off; 2 busy cores are slow
        assert rw[rid][0].status == RewardStatus.OK and rw[rid][0].reward == 0.0
    assert_clean(tmp_path / "sandboxes")
