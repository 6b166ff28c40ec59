"""Gemini CLI (``@google/gemini-cli``, pinned in ``producers/harnesses/adapters/gemini-cli.toml``) through the real
sandbox worker and the Gemini dialect: it solves the ClawGym-Bench task ``task_0085`` and PinchBench's
``task_00_sanity``, and its trajectories assemble into prefix trees.

One stack as the harness matrix runs it (real Kafka broker, real serving proxy, the scripted engine as the model, one
sandbox worker with local sandboxes, two rollouts at once), with the matrix's scripted policy: it writes the solved
task's files with Gemini CLI's own ``write_file`` one call per turn, then answers; to the sanity prompt it answers
at once. Asserts per rollout: STARTED → HARNESS_EXITED with exit code 0, reward 1.0 (every ``check.py`` sub-score of
the ClawGym task), every call in the Gemini dialect, none ``tampered``, a clean sandbox root; and the call events of
each rollout build (``streams.tree.build_tree``, what the assembler runs) into one kept tree where every main call
extends the previous call's prompt and answer token for token (the ClawGym tree shares its prefix across 3 calls).
Skips with the reason when npm or the package is unavailable.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from schemas.events import CallKind, Dialect, RewardStatus, RolloutState
from streams.tree import TreeCall, build_tree, rebuild_prompts
from tests.integration.test_harness_matrix import responder
from tests.support import sandbox_helpers as S
from tests.support.harness_tasks import FILES, installed
from tests.support.proxy_server import consume_calls
from tests.support.sandbox_stack import assert_clean, by_rollout, run_requests, stack

pytestmark = [pytest.mark.integration, pytest.mark.serial]  # its leftover check is machine-wide
NAME = "gemini-cli"


def tree_call(e) -> TreeCall:  # noqa: ANN001
    return TreeCall(
        e.call_id,
        e.seq,
        e.parent_call_id,
        e.shared_prefix_len,
        e.new_tokens.tolist(),
        e.generated_tokens.tolist(),
        e.logprobs.tolist(),
        e.call_kind.value.lower(),
        e.policy_version,
        e.finish_reason,
        e.tampered,
    )


@pytest.mark.timeout(900)
async def test_gemini_cli_solves_clawgym_and_pinchbench_into_prefix_trees(kafka_settings, group_id, tmp_path) -> None:
    await asyncio.to_thread(installed, NAME)
    sandboxes = tmp_path / "sandboxes"
    suites = {"clawgym": str(S.FIXTURES / "clawgym"), "pinch": str(S.FIXTURES / "pinchbench")}
    seen: list[str] = []
    reqs = [
        S.request("task_0085", NAME, suite="clawgym", rollout_id=f"clawgym-{NAME}", timeout_s=300),
        S.request("task_00_sanity", NAME, suite="pinch", rollout_id=f"pinch-{NAME}", timeout_s=120),
    ]
    t0 = time.monotonic()
    async with stack(
        kafka_settings, group_id, tmp_path, responder(NAME, str(sandboxes), seen), suites=suites, concurrency=2
    ) as st:
        events, rewards = await run_requests(kafka_settings, reqs, timeout=420)
        served = len(st["engine"].requests)
    wall = time.monotonic() - t0
    ev, rw = by_rollout(events, rewards)
    log = f"{NAME}: {wall:.0f}s, {served} engine calls {seen}; events {ev}; rewards {rw}"
    for req in reqs:
        assert [e.state for e in ev.get(req.rollout_id, [])] == [RolloutState.STARTED, RolloutState.HARNESS_EXITED], log
        assert ev[req.rollout_id][-1].exit_code == 0, log
        (reward,) = rw[req.rollout_id]
        assert reward.status == RewardStatus.OK and reward.reward == 1.0, log
    clawgym = rw[reqs[0].rollout_id][0]
    assert clawgym.grader == "clawgym_reward_sh" and set(clawgym.sub_scores.values()) == {1.0}, log
    assert rw[reqs[1].rollout_id][0].sub_scores == {"agent_responded": 1.0}, log
    assert sum(s != "side" for s in seen) == len(FILES) + 2, log  # main-agent calls only
    calls = consume_calls(kafka_settings, {r.rollout_id for r in reqs}, served)
    assert len(calls) == served and all(c.dialect is Dialect.GEMINI and not c.tampered for c in calls), log
    for req, n_main in ((reqs[0], len(FILES) + 1), (reqs[1], 1)):
        mine = [tree_call(c) for c in calls if c.rollout_id == req.rollout_id and c.call_kind == CallKind.MAIN]
        assert len(mine) == n_main, (req.rollout_id, log)
        prompts = rebuild_prompts(mine)
        for prev, cur in zip(mine, mine[1:], strict=False):
            assert cur.parent_call_id == prev.call_id, (req.rollout_id, log)
            assert cur.shared_prefix_len == len(prompts[prev.call_id]) + len(prev.generated_tokens), log
            assert prompts[cur.call_id][: cur.shared_prefix_len] == prompts[prev.call_id] + list(prev.generated_tokens)
        tree = build_tree(mine)
        assert tree.dropped_reason is None and tree.stats.kept_calls == n_main, (tree.stats, log)
        assert tree.stats.trainable_tokens == sum(len(c.generated_tokens) for c in mine), (tree.stats, log)
        if n_main > 1:  # the shared prefixes are stored once in the tree, not once per call
            flat = sum(len(prompts[c.call_id]) + len(c.generated_tokens) for c in mine)
            assert tree.stats.unique_tokens < flat and tree.stats.leaves == 1, (tree.stats, flat, log)
    assert_clean(sandboxes)
    print(f"\n{NAME}: {wall:.1f}s wall, {served} engine calls {seen}")
