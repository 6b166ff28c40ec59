"""Sandbox worker end to end: real Kafka broker, real serving proxy, scripted engine, local sandboxes.

The built-in agent loops (``agentloop`` over OpenAI Chat, ``agentloop-anthropic`` over Anthropic Messages) solve
native tasks: right work → reward 1, wrong work → reward < 1 (partial credit). Fake harnesses hang (killed at the
timeout: TIMED_OUT within timeout + 5 s, its background child dies too) and crash (HARNESS_EXITED with the exit code,
still graded); a crashing grader gives FAILED + INFRA_FAILURE with a null reward. After every case: no sandbox
directory and no sandbox process survive. Every attempt has exactly one reward.
"""

from __future__ import annotations

import time
from collections import Counter

import pytest

from schemas.events import RewardStatus, RolloutState
from tests.support import sandbox_helpers as S
from tests.support.sandbox_stack import assert_clean, by_rollout, run_requests, stack

pytestmark = [pytest.mark.integration, pytest.mark.serial]  # its leftover check is machine-wide


def one_reward_per_attempt(rewards) -> None:
    counts = Counter(r.attempt_id for r in rewards)
    assert all(n == 1 for n in counts.values()), counts


@pytest.mark.timeout(240)
async def test_agent_loops_right_and_wrong_work(kafka_settings, group_id, tmp_path) -> None:
    wrong = {"hello.txt": "bye", "sum.txt": "8"}
    reqs = [S.request("hello", h, rollout_id=f"ok-{h}") for h in ("agentloop", "agentloop-anthropic")]
    reqs += [S.request("sum_numbers", h, rollout_id=f"sum-{h}") for h in ("agentloop", "agentloop-anthropic")]
    async with stack(kafka_settings, group_id, tmp_path, S.agent_responder({"sum.txt": "9"})) as st:
        events, rewards = await run_requests(kafka_settings, reqs)
        ev, rw = by_rollout(events, rewards)
        for r in reqs:
            assert [e.state for e in ev[r.rollout_id]] == [RolloutState.STARTED, RolloutState.HARNESS_EXITED], r
            exited = ev[r.rollout_id][-1]
            assert exited.exit_code == 0 and exited.calls_served == 2, exited
            (reward,) = rw[r.rollout_id]
            assert reward.status == RewardStatus.OK and reward.reward == 1.0, reward
            assert reward.attempt_id == exited.attempt_id
        # wrong work: the engine writes wrong contents (sub-scores give partial credit)
        st["engine"].script = S.agent_responder(wrong)
        bad = [S.request("hello", h, rollout_id=f"bad-{h}") for h in ("agentloop", "agentloop-anthropic")]
        bad.append(S.request("sum_numbers", "agentloop", rollout_id="bad-sum"))
        events, rewards = await run_requests(kafka_settings, bad)
        _, rw = by_rollout(events, rewards)
        for r in bad:
            (reward,) = rw[r.rollout_id]
            assert reward.status == RewardStatus.OK and 0 < reward.reward < 1, reward
        assert rw["bad-sum"][0].sub_scores == {"exists": 1.0, "correct": 0.0, "input_kept": 1.0}
        one_reward_per_attempt(rewards)
    assert_clean(tmp_path / "sandboxes")


@pytest.mark.timeout(240)
async def test_hang_crash_and_grader_failure(kafka_settings, group_id, tmp_path) -> None:
    reqs = [
        S.request("hello", "hang", rollout_id="hang", timeout_s=3),
        S.request("hello", "crash", rollout_id="crash"),
        S.request("bad_grader", "agentloop", rollout_id="badgrader"),
        S.request("no_such_task", "agentloop", rollout_id="notask"),
    ]
    async with stack(kafka_settings, group_id, tmp_path) as st:
        t0 = time.monotonic()
        events, rewards = await run_requests(kafka_settings, reqs)
        ev, rw = by_rollout(events, rewards)
        # hung harness: killed at 3 s (SIGTERM ignored → SIGKILL), reported TIMED_OUT within timeout + 5 s, graded
        started, timed_out = ev["hang"]
        assert timed_out.state == RolloutState.TIMED_OUT and "SIGKILL" in timed_out.reason
        assert (timed_out.timestamp_ms - started.timestamp_ms) / 1000 < 3 + 5
        assert rw["hang"][0].status == RewardStatus.OK and rw["hang"][0].reward == 0.0
        assert S.processes_with_arg(st["hang_tag"]) == [], "the hung harness's background child survived"
        # crash: exit code 3 is reported, and the work it did is still graded
        assert [e.state for e in ev["crash"]] == [RolloutState.STARTED, RolloutState.HARNESS_EXITED]
        assert ev["crash"][-1].exit_code == 3 and rw["crash"][0].reward == 1.0
        # grader crash: FAILED after HARNESS_EXITED, INFRA_FAILURE with a null reward (never 0)
        assert [e.state for e in ev["badgrader"]] == [
            RolloutState.STARTED,
            RolloutState.HARNESS_EXITED,
            RolloutState.FAILED,
        ]
        assert "grader" in ev["badgrader"][-1].reason
        assert rw["badgrader"][0].status == RewardStatus.INFRA_FAILURE and rw["badgrader"][0].reward is None
        # unknown task: FAILED before STARTED
        assert [e.state for e in ev["notask"]] == [RolloutState.FAILED]
        assert rw["notask"][0].status == RewardStatus.INFRA_FAILURE
        one_reward_per_attempt(rewards)
        assert time.monotonic() - t0 < 60
    assert_clean(tmp_path / "sandboxes")
