"""Capture health of hand-built rollouts: each figure on a rollout where its count is known by construction."""

from __future__ import annotations

import random

import numpy as np
import pytest

from consumers.analytics.health import FULL_RENDER, rollout_health
from consumers.analytics.health_table import ALL, HealthAggregator, format_rows
from schemas.events import (
    CallEvent,
    CallKind,
    Dialect,
    RolloutEvent,
    RolloutRequest,
    RolloutState,
    Trajectory,
    TrajectoryStatus,
    TreeSegment,
)

SYS = [1, 2, 3, 4]  # a system prompt's ids
GEN_PROMPT = [5]  # the generation prompt


class Recorder:
    """Records calls the way the proxy delta-encodes them: against the earlier call (of the same attempt) whose
    prompt + generated ids share the longest prefix with the new prompt."""

    def __init__(self, rollout_id: str = "r-1", attempt_id: str | None = "a-1") -> None:
        self.rollout_id, self.attempt_id = rollout_id, attempt_id
        self.calls: list[CallEvent] = []
        self.full: dict[str, list[int]] = {}

    def call(
        self,
        prompt: list[int],
        gen: list[int],
        *,
        kind: CallKind = CallKind.MAIN,
        flags: tuple[str, ...] = (),
        cached: int | None = None,
        parent: str | None = "auto",
        ts: int = 0,
    ) -> CallEvent:
        best, best_len = None, 0
        for c in self.calls:
            full = self.full[c.call_id]
            n = 0
            while n < min(len(full), len(prompt)) and full[n] == prompt[n]:
                n += 1
            if n > best_len or (n == best_len and n > 0):
                best, best_len = c.call_id, n
        if parent != "auto":  # the proxy's conversation match may name another (shorter) parent
            best = parent
            best_len = len(self.full[parent]) if parent else 0
            assert prompt[:best_len] == self.full[parent][:best_len] if parent else True
        seq = len(self.calls)
        call = CallEvent(
            rollout_id=self.rollout_id,
            policy_version=0,
            timestamp_ms=1000 + seq + ts,
            call_id=f"{self.rollout_id}-c{seq}",
            seq=seq,
            dialect=Dialect.OPENAI_CHAT,
            requested_model="policy",
            call_kind=kind,
            new_tokens=np.array(prompt[best_len:], dtype=np.int32),
            prompt_len=len(prompt),
            generated_tokens=np.array(gen, dtype=np.int32),
            logprobs=np.full(len(gen), -0.5, dtype=np.float32),
            finish_reason="stop",
            parent_call_id=best,
            shared_prefix_len=best_len,
            flags=list(flags),
            cached_prompt_tokens=cached,
            attempt_id=self.attempt_id,
        )
        self.calls.append(call)
        self.full[call.call_id] = prompt + gen
        return call


def test_append_only_rollout_extends_exactly_every_time() -> None:
    rec = Recorder()
    prompt = SYS + [10, 11] + GEN_PROMPT
    for turn in range(4):
        gen = [100 + turn, 101 + turn, 99]
        rec.call(prompt, gen)
        prompt = prompt + gen + [7, 20 + turn, 21 + turn] + GEN_PROMPT
    h = rollout_health("r-1", rec.calls)
    assert (h.main_calls, h.follow_ups, h.extends, h.forks, h.roots, h.restarts) == (4, 3, 3, 0, 0, 0)
    assert (h.full_renders, h.retry_orphans, h.answer_forks, h.unresolved_calls) == (0, 0, 0, 0)
    assert h.generated_tokens == 12


def test_edited_history_is_a_fork_even_when_the_declared_parent_is_extended() -> None:
    """c2 drops c1's answer and edits a tool result: the proxy names c0 (whose conversation it extends) as parent,
    but the tree attaches it inside c1's prompt — a fork, and c1's answer is an orphan."""
    rec = Recorder()
    p0 = SYS + [10] + GEN_PROMPT
    rec.call(p0, [100, 99])
    p1 = p0 + [100, 99] + [7, 30, 31] + GEN_PROMPT  # tool result 30 31
    rec.call(p1, [101, 99])
    p2 = p0 + [100, 99] + [7, 30, 32] + GEN_PROMPT  # the tool result edited (31 → 32), c1's answer gone
    c2 = rec.call(p2, [102, 99], parent="r-1-c0")
    assert c2.parent_call_id == "r-1-c0" and c2.shared_prefix_len == len(p0) + 2
    h = rollout_health("r-1", rec.calls)
    assert (h.follow_ups, h.extends, h.forks, h.answer_forks, h.retry_orphans) == (2, 1, 1, 0, 1)


def test_answer_returned_as_other_token_ids_is_an_answer_fork() -> None:
    rec = Recorder()
    p0 = SYS + [10] + GEN_PROMPT
    rec.call(p0, [100, 101, 102, 99])
    # the harness echoes the same text, but it comes back re-encoded: 101 102 → 103
    p1 = p0 + [100, 103, 99] + [7, 30] + GEN_PROMPT
    rec.call(p1, [104, 99], flags=(FULL_RENDER,))
    h = rollout_health("r-1", rec.calls)
    assert (h.follow_ups, h.extends, h.forks, h.answer_forks, h.full_renders, h.retry_orphans) == (1, 0, 1, 1, 1, 1)


def test_reordered_history_with_the_answer_carried_is_a_fork_and_a_re_render_but_no_orphan() -> None:
    """OpenClaw: a context message moves to the end every call; the answer's ids stay verbatim (TITO)."""
    rec = Recorder()
    ctx = [7, 60, 61]
    p0 = SYS + [7, 10] + ctx + GEN_PROMPT
    rec.call(p0, [100, 99])
    p1 = SYS + [7, 10] + GEN_PROMPT + [100, 99] + [7, 30] + ctx + GEN_PROMPT
    rec.call(p1, [101, 99], flags=(FULL_RENDER,))
    h = rollout_health("r-1", rec.calls)
    assert (h.forks, h.answer_forks, h.full_renders, h.retry_orphans, h.extends) == (1, 0, 1, 0, 0)


def test_retried_prompt_orphans_the_first_answer() -> None:
    rec = Recorder()
    p0 = SYS + [10] + GEN_PROMPT
    rec.call(p0, [100, 99])
    p1 = p0 + [100, 99] + [7, 30] + GEN_PROMPT
    rec.call(p1, [101, 102])  # cut off: the harness retries the same prompt
    rec.call(p1, [103, 99])
    rec.call(p1 + [103, 99] + [7, 31] + GEN_PROMPT, [104, 99])
    h = rollout_health("r-1", rec.calls)
    assert (h.follow_ups, h.extends, h.forks, h.retry_orphans) == (3, 2, 1, 1)


def test_compaction_starts_a_new_segment_restart_not_fork() -> None:
    rec = Recorder()
    p0 = SYS + [10] + GEN_PROMPT
    rec.call(p0, [100, 99])
    p1 = p0 + [100, 99] + [7, 30] + GEN_PROMPT
    rec.call(p1, [101, 99])  # last main call before the compaction: its answer is summarised, not carried
    rec.call(p1 + [101, 99] + [7, 50] + GEN_PROMPT, [51, 52, 99], kind=CallKind.COMPACTION)
    p3 = SYS + [7, 51, 52] + GEN_PROMPT  # the summary replaces the history
    rec.call(p3, [105, 99], flags=(FULL_RENDER,))
    rec.call(p3 + [105, 99] + [7, 40] + GEN_PROMPT, [106, 99])
    h = rollout_health("r-1", rec.calls)
    assert (h.main_calls, h.restarts, h.follow_ups, h.extends, h.forks, h.full_renders) == (4, 1, 2, 2, 0, 0)
    assert h.retry_orphans == 0 and h.excluded == {"COMPACTION": 1}


def test_follow_up_sharing_nothing_is_a_root_and_side_calls_stay_out() -> None:
    rec = Recorder()
    rec.call(SYS + [10] + GEN_PROMPT, [100, 99])
    rec.call([8, 8, 8] + GEN_PROMPT, [77, 99], kind=CallKind.SIDE)  # a title call: not main
    rec.call([9, 9] + GEN_PROMPT, [101, 99])  # main, but shares no token with the first
    h = rollout_health("r-1", rec.calls)
    assert (h.main_calls, h.follow_ups, h.roots, h.extends, h.forks) == (2, 1, 1, 0, 0)
    assert h.excluded == {"SIDE": 1} and h.calls == 3
    assert h.generated_tokens == 4  # main calls only


def test_prefix_cache_hit_rate_counts_only_reporting_calls() -> None:
    rec = Recorder()
    p0 = SYS + [10] + GEN_PROMPT
    rec.call(p0, [100, 99], cached=0)
    p1 = p0 + [100, 99] + [7, 30] + GEN_PROMPT
    rec.call(p1, [101, 99], cached=len(p0) + 2)
    rec.call(p1 + [101, 99] + [7] + GEN_PROMPT, [102, 99], cached=None)  # not reported
    h = rollout_health("r-1", rec.calls)
    assert (h.cache_calls, h.cache_prompt_tokens, h.cached_tokens) == (2, len(p0) + len(p1), len(p0) + 2)


def test_stale_attempt_calls_and_unresolved_parents() -> None:
    old = Recorder(attempt_id="a-1")
    old.call(SYS + [10] + GEN_PROMPT, [100, 99])
    old.call(SYS + [10] + GEN_PROMPT + [100, 99] + [7] + GEN_PROMPT, [101, 99])
    new = Recorder(attempt_id="a-2")
    new.calls = []
    for call in (SYS + [10] + GEN_PROMPT, SYS + [10] + GEN_PROMPT + [102, 99] + [7] + GEN_PROMPT):
        new.call(call, [102, 99])
    for c in new.calls:  # same rollout, re-registered: ids of its own
        c.call_id = c.call_id.replace("-c", "-n")
        c.parent_call_id = c.parent_call_id.replace("-c", "-n") if c.parent_call_id else None
        c.timestamp_ms += 100
    old.calls[1].tampered = True  # a forged turn counts though its attempt was superseded
    h = rollout_health("r-1", old.calls + new.calls)  # the latest call names the final attempt
    assert h.attempt_id == "a-2" and h.stale_attempt_calls == 2 and (h.main_calls, h.extends) == (2, 1)
    assert h.tampered_calls == 1
    # a call whose parent was not read (range cut) is unresolved and enters no other figure
    h2 = rollout_health("r-1", old.calls[1:])
    assert (h2.unresolved_calls, h2.main_calls, h2.follow_ups) == (1, 1, 0)


def _trajectory(
    rollout_id: str,
    attempt_id: str,
    trained: int,
    harness: str = "agentloop",
    status: TrajectoryStatus = TrajectoryStatus.COMPLETE,
) -> Trajectory:
    segs = [
        TreeSegment(-1, np.arange(5), False, np.zeros(0), 0),
        TreeSegment(0, np.arange(trained), True, np.zeros(trained), 0),
    ]
    return Trajectory(
        rollout_id=rollout_id,
        policy_version=0,
        timestamp_ms=5000,
        attempt_id=attempt_id,
        group_id=f"t|{harness}|0",
        task_id="t",
        harness=harness,
        step=0,
        status=status,
        segments=segs,
        calls=1,
        leaves=1,
        unique_tokens=5 + trained,
        path_tokens=5 + trained,
        prefix_reuse_ratio=1.0,
        reward=1.0,
    )


def test_masked_token_fraction_from_the_trajectory() -> None:
    rec = Recorder()
    p0 = SYS + [10] + GEN_PROMPT
    rec.call(p0, [100, 101, 99])
    rec.call(p0 + [100, 101, 99] + [7] + GEN_PROMPT, [102, 103, 104, 99])
    h = rollout_health("r-1", rec.calls, trajectory=_trajectory("r-1", "a-1", trained=5))
    assert (h.generated_tokens, h.trained_tokens, h.masked_tokens) == (7, 5, 2)
    dropped = _trajectory("r-1", "a-1", trained=5, status=TrajectoryStatus.DROPPED)
    assert rollout_health("r-1", rec.calls, trajectory=dropped).masked_tokens is None


def _rollout_events(rollout_id: str, harness: str, attempt_id: str = "a-1") -> list:
    return [
        RolloutRequest(
            rollout_id=rollout_id,
            policy_version=0,
            timestamp_ms=900,
            suite="s",
            task_id="t",
            harness=harness,
            group_id=f"t|{harness}|0",
            step=0,
            timeout_s=60.0,
            metadata={"chat_template": "qwen3"} if harness == "claude-code" else {},
        ),
        RolloutEvent(
            rollout_id=rollout_id,
            policy_version=0,
            timestamp_ms=950,
            attempt_id=attempt_id,
            state=RolloutState.STARTED,
            group_id=f"t|{harness}|0",
            harness=harness,
        ),
    ]


def test_aggregator_groups_by_harness_and_template_whatever_the_order() -> None:
    events = []
    for i in range(3):  # agentloop: append-only
        rec = Recorder(f"a{i}")
        p = SYS + [10] + GEN_PROMPT
        rec.call(p, [100, 99])
        rec.call(p + [100, 99] + [7] + GEN_PROMPT, [101, 99])
        events += _rollout_events(f"a{i}", "agentloop") + rec.calls
    rec = Recorder("cc")  # claude-code: one fork with a re-render
    p0 = SYS + [10] + GEN_PROMPT
    rec.call(p0, [100, 99])
    rec.call(SYS + [11] + GEN_PROMPT, [101, 99], flags=(FULL_RENDER,))
    events += (
        _rollout_events("cc", "claude-code") + rec.calls + [_trajectory("cc", "a-1", trained=2, harness="claude-code")]
    )
    events.append(rec.calls[0])  # a duplicate call id: ignored
    tables = []
    for seed in range(3):
        shuffled = list(events)
        random.Random(seed).shuffle(shuffled)
        agg = HealthAggregator()
        for e in shuffled:
            agg.add(e)
        tables.append([r.to_dict() for r in agg.rows()])
    assert tables[0] == tables[1] == tables[2]
    rows = {(r["harness"], r["template"]): r for r in tables[0]}
    assert set(rows) == {("agentloop", "openai_chat"), ("claude-code", "qwen3"), (ALL, ALL)}
    loop, cc, everything = rows["agentloop", "openai_chat"], rows["claude-code", "qwen3"], rows[ALL, ALL]
    assert (loop["rollouts"], loop["extends_share"], loop["forks"], loop["masked_token_fraction"]) == (3, 1.0, 0, None)
    assert (cc["rollouts"], cc["extends_share"], cc["forks"], cc["full_renders"]) == (1, 0.0, 1, 1)
    assert cc["masked_token_fraction"] == pytest.approx(2 / 4) and cc["retry_orphans"] == 1
    assert (everything["rollouts"], everything["follow_ups"], everything["extends"]) == (4, 4, 3)


def test_aggregator_forgets_oldest_rollouts_beyond_its_bound_and_recomputes_on_new_records() -> None:
    agg = HealthAggregator(max_rollouts=2)
    for rid in ("x", "y", "z"):
        rec = Recorder(rid)
        rec.call(SYS + GEN_PROMPT, [100, 99])
        agg.add(rec.calls[0])
    assert [r.rollout_id for r in agg.rollouts()] == ["y", "z"]
    assert agg.rollout("z").main_calls == 1
    rec = Recorder("z")
    rec.call(SYS + GEN_PROMPT, [100, 99])
    second = rec.call(SYS + GEN_PROMPT + [100, 99] + [7] + GEN_PROMPT, [101, 99])
    agg.add(second)  # the cached result is stale now
    assert (agg.rollout("z").main_calls, agg.rollout("z").extends) == (2, 1)


def test_format_rows_prints_every_row_with_its_figures() -> None:
    agg = HealthAggregator()
    rec = Recorder("q")
    p0 = SYS + [10] + GEN_PROMPT
    rec.call(p0, [100, 99], cached=3)
    rec.call(p0 + [100, 99] + [7] + GEN_PROMPT, [101, 99], cached=len(p0) + 2)
    for e in _rollout_events("q", "qwen-code") + rec.calls:
        agg.add(e)
    text = format_rows(agg.rows())
    lines = text.splitlines()
    assert lines[0].startswith("harness") and "extend exactly" in lines[0]
    assert lines[2].split()[:4] == ["qwen-code", "openai_chat", "1", "2"]
    assert "100.0% (1/1)" in lines[2]
    expected_hit = 100 * (3 + len(p0) + 2) / (len(p0) + len(p0) + 2 + 2)
    assert f"{expected_hit:.1f}%" in lines[2]
    assert lines[0].endswith("tampered  grader error") and lines[2].split()[-3:] == ["0", "(0)", "0"]  # shown at 0
