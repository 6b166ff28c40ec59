"""Unit tests of streams.tree: prefix-tree building, filtering and stats on hand-made and random rollouts.

Readable token ids: system prompt 1..5, user 10..12, re-ordered reminder 30..31, compaction instruction 40..41,
side system prompt 50..51, subagent system prompt 60..62, generated 100.., tool results 200.., summaries 300..,
side generations 400... Rollout logprob of a generated token t is -t/1000 unless a test says otherwise.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import replace

import pytest

from schemas.tree_paths import path_to, path_tokens, path_trainable_mask, paths
from streams.tree import (
    Segment,
    TreeCall,
    TreeError,
    build_tree,
    rebuild_prompts,
)

S = [1, 2, 3, 4, 5]
U = [10, 11, 12]
M = [30, 31]


def lp(tokens: Sequence[int]) -> list[float]:
    return [-t / 1000 for t in tokens]


class Rollout:
    """Builds delta-encoded TreeCalls from full prompts, the way the proxy would (declared parent + common prefix)."""

    def __init__(self, logprob: Callable[[int, int], float] | None = None) -> None:
        self.calls: list[TreeCall] = []
        self.full: dict[str, list[int]] = {}
        self.prompts: dict[str, list[int]] = {}
        self.logprob = logprob  # (absolute position, token) → logprob; None: -token/1000

    def add(
        self,
        cid: str,
        prompt: list[int],
        gen: list[int],
        *,
        parent: str | None = None,
        kind: str = "main",
        finish: str = "stop",
        version: int = 1,
    ) -> TreeCall:
        spl = 0
        if parent is not None:
            base = self.full[parent]
            while spl < min(len(base), len(prompt)) and base[spl] == prompt[spl]:
                spl += 1
        if self.logprob is None:
            logprobs = lp(gen)
        else:
            logprobs = [self.logprob(len(prompt) + i, t) for i, t in enumerate(gen)]
        call = TreeCall(cid, len(self.calls), parent, spl, prompt[spl:], gen, logprobs, kind, version, finish)
        self.calls.append(call)
        self.full[cid] = prompt + gen
        self.prompts[cid] = prompt
        return call


def seg(index: int, parent: int, tokens: list[int], trainable: bool, call_id: str, version: int = 1) -> Segment:
    return Segment(index, parent, tokens, trainable, lp(tokens) if trainable else [], call_id, version)


def chain() -> Rollout:
    r = Rollout()
    r.add("c0", S + U, [100, 101])
    r.add("c1", S + U + [100, 101, 200, 201], [102, 103], parent="c0")
    r.add("c2", S + U + [100, 101, 200, 201, 102, 103, 202], [104], parent="c1")
    return r


def test_append_only_chain_is_one_path() -> None:
    result = build_tree(chain().calls)
    assert result.dropped_reason is None
    assert result.segments == [
        seg(0, -1, S + U, False, "c0"),
        seg(1, 0, [100, 101], True, "c0"),
        seg(2, 1, [200, 201], False, "c1"),
        seg(3, 2, [102, 103], True, "c1"),
        seg(4, 3, [202], False, "c2"),
        seg(5, 4, [104], True, "c2"),
    ]
    assert paths(result.segments) == [[0, 1, 2, 3, 4, 5]]
    assert path_tokens(result.segments, [0, 1, 2, 3, 4, 5]) == S + U + [100, 101, 200, 201, 102, 103, 202, 104]
    assert path_trainable_mask(result.segments, [0, 1, 2, 3, 4, 5]) == [False] * 8 + [True] * 2 + [False] * 2 + [
        True
    ] * 2 + [False, True]
    assert result.call_nodes == {"c0": 1, "c1": 3, "c2": 5}
    assert result.kept_call_ids == ["c0", "c1", "c2"] and result.pruned_call_ids == []
    assert result.excluded_calls == {}
    st = result.stats
    assert (st.calls, st.main_calls, st.kept_calls, st.compaction_segments) == (3, 3, 3, 1)
    assert (st.raw_leaves, st.leaves, st.unique_tokens, st.path_tokens, st.trainable_tokens) == (1, 1, 16, 16, 5)
    assert st.prefix_reuse_ratio == 1.0 and st.min_policy_version == 1


def test_calls_in_any_order_and_upper_case_kinds() -> None:
    calls = chain().calls
    shuffled = [calls[2], calls[0], calls[1]]
    shuffled = [replace(c, call_kind="MAIN") for c in shuffled]
    assert build_tree(shuffled).segments == build_tree(calls).segments


def test_retry_dead_end_branch_is_pruned() -> None:
    r = Rollout()
    r.add("c1", S + U, [100, 101])
    r.add("c2", S + U + [100, 101, 200], [102], parent="c1")  # dead end: the harness goes back to c1's prompt
    r.add("c3", S + U, [110, 111, 112], parent="c1")  # retry from c1's prompt
    r.add("c4", S + U + [110, 111, 112, 210], [113], parent="c3")
    unpruned = build_tree(r.calls, prune="none")
    assert unpruned.stats.leaves == unpruned.stats.raw_leaves == 2
    assert unpruned.stats.unique_tokens == 8 + 2 + 1 + 1 + 3 + 1 + 1

    result = build_tree(r.calls)
    # The S+U context was first written by pruned c1; it is credited to c3, the earliest kept call holding it.
    assert result.segments == [
        seg(0, -1, S + U, False, "c3"),
        seg(1, 0, [110, 111, 112], True, "c3"),
        seg(2, 1, [210], False, "c4"),
        seg(3, 2, [113], True, "c4"),
    ]
    assert result.kept_call_ids == ["c3", "c4"] and result.pruned_call_ids == ["c1", "c2"]
    assert result.excluded_calls == {"pruned": 2}
    st = result.stats
    assert (st.raw_leaves, st.leaves, st.unique_tokens, st.path_tokens, st.trainable_tokens) == (2, 1, 13, 13, 4)


def test_error_call_never_wins_and_ties_go_to_later_seq() -> None:
    r = Rollout()
    r.add("c0", S + U, [100])
    r.add("c1", S + U + [100, 200], [101, 102, 103, 104], parent="c0", finish="error")  # longest, but an error
    r.add("c2", S + U + [100, 200], [105], parent="c0")
    r.add("c3", S + U + [100, 200], [106], parent="c0")  # same length as c2, served later: the winner
    result = build_tree(r.calls)
    assert result.segments == [
        seg(0, -1, S + U, False, "c0"),
        seg(1, 0, [100], True, "c0"),
        seg(2, 1, [200], False, "c3"),  # written by pruned c1, credited to kept c3
        seg(3, 2, [106], True, "c3"),
    ]
    assert result.pruned_call_ids == ["c1", "c2"]


def test_failed_call_without_tokens_counts_as_kept_when_retried() -> None:
    r = Rollout()
    r.add("c0", S + U, [100])
    r.add("c1", S + U + [100, 200], [], parent="c0", finish="error")  # HTTP failure, retried with the same prompt
    r.add("c2", S + U + [100, 200], [101], parent="c0")
    result = build_tree(r.calls)
    assert [s.tokens for s in result.segments] == [S + U, [100], [200], [101]]
    assert result.kept_call_ids == ["c0", "c1", "c2"] and result.call_nodes == {"c0": 1, "c1": 2, "c2": 3}


def test_long_prompts_split_at_the_exact_divergence() -> None:
    long_prompt = list(range(1000, 1700))
    r = Rollout()
    r.add("c0", long_prompt, [100])
    r.add("c1", long_prompt[:613] + [201], [101], parent="c0")
    result = build_tree(r.calls, prune="none")
    assert [(s.parent, len(s.tokens), s.tokens[0]) for s in result.segments] == [
        (-1, 613, 1000),
        (0, 87, 1613),
        (1, 1, 100),
        (0, 1, 201),
        (3, 1, 101),
    ]


def test_split_inside_generation_keeps_both_parts_trainable() -> None:
    r = Rollout()
    r.add("c0", S + U, [100, 101, 102, 103])
    r.add("c1", S + U + [100, 101, 250], [104], parent="c0")  # the harness kept only part of c0's generation
    unpruned = build_tree(r.calls, prune="none")
    assert unpruned.segments == [
        seg(0, -1, S + U, False, "c0"),
        seg(1, 0, [100, 101], True, "c0"),
        seg(2, 1, [102, 103], True, "c0"),
        seg(3, 1, [250], False, "c1"),
        seg(4, 3, [104], True, "c1"),
    ]
    # c1 wins the tie (same path length, later seq); c0's tail is a dead end, its shared head stays trainable.
    result = build_tree(r.calls)
    assert result.segments == [
        seg(0, -1, S + U, False, "c1"),
        seg(1, 0, [100, 101], True, "c0"),
        seg(2, 1, [250], False, "c1"),
        seg(3, 2, [104], True, "c1"),
    ]
    assert result.pruned_call_ids == ["c0"] and result.stats.trainable_tokens == 3


def test_identical_generation_prefix_is_shared() -> None:
    r = Rollout()
    r.add("c0", S + U, [100, 101])
    r.add("c1", S + U, [100, 102], parent="c0")  # resampled from the same prompt, same first token
    result = build_tree(r.calls, prune="none")
    assert result.segments == [
        seg(0, -1, S + U, False, "c0"),
        seg(1, 0, [100], True, "c0"),
        seg(2, 1, [101], True, "c0"),
        seg(3, 1, [102], True, "c1"),
    ]
    assert result.stats.path_tokens == 20 and result.stats.unique_tokens == 11


def test_subagent_calls_are_excluded() -> None:
    sub = [60, 61, 62]
    r = Rollout()
    r.add("c0", S + U, [100])  # spawns a subagent
    r.add("s0", sub + [20, 21], [120], kind="subagent")
    r.add("s1", sub + [20, 21, 120, 220], [121], parent="s0", kind="subagent")
    r.add("c1", S + U + [100, 230], [101], parent="c0")  # 230: the subagent's report as a tool result
    result = build_tree(r.calls)
    assert result.segments == [
        seg(0, -1, S + U, False, "c0"),
        seg(1, 0, [100], True, "c0"),
        seg(2, 1, [230], False, "c1"),
        seg(3, 2, [101], True, "c1"),
    ]
    assert result.excluded_calls == {"subagent": 2}
    assert (result.stats.calls, result.stats.main_calls, result.stats.leaves) == (4, 2, 1)


def test_side_call_is_excluded_but_counted() -> None:
    r = Rollout()
    r.add("c0", S + U, [100])
    r.add("title", [50, 51] + U, [400], kind="side")
    r.add("c1", S + U + [100, 200], [101], parent="c0")
    result = build_tree(r.calls)
    assert [s.tokens for s in result.segments] == [S + U, [100], [200], [101]]
    assert all(400 not in s.tokens and 50 not in s.tokens for s in result.segments)
    assert result.excluded_calls == {"side": 1}
    assert (result.stats.calls, result.stats.main_calls, result.stats.kept_calls) == (3, 2, 2)


def compaction_rollout() -> Rollout:
    r = Rollout()
    r.add("c0", S + U, [100])
    r.add("c1", S + U + [100, 200], [101, 102], parent="c0", finish="error")  # dead end of segment 1
    r.add("c2", S + U + [100, 200], [103], parent="c0")
    r.add("k", S + U + [100, 200, 103, 40], [300, 301], parent="c2", kind="compaction")
    r.add("c4", S + [41, 300, 301], [104], parent="k", version=2)  # shares only the system prompt
    r.add("c5", S + [41, 300, 301, 104, 202], [105], parent="c4", version=2)
    return r


def test_compaction_segments_each_keep_one_leaf() -> None:
    result = build_tree(compaction_rollout().calls)
    assert result.segments == [
        seg(0, -1, S, False, "c0"),
        seg(1, 0, U, False, "c0"),
        seg(2, 1, [100], True, "c0"),
        seg(3, 2, [200], False, "c2"),
        seg(4, 3, [103], True, "c2"),
        seg(5, 0, [41, 300, 301], False, "c4", version=2),
        seg(6, 5, [104], True, "c4", version=2),
        seg(7, 6, [202], False, "c5", version=2),
        seg(8, 7, [105], True, "c5", version=2),
    ]
    assert paths(result.segments) == [[0, 1, 2, 3, 4], [0, 5, 6, 7, 8]]
    assert result.excluded_calls == {"compaction": 1, "pruned": 1}
    assert result.pruned_call_ids == ["c1"]
    st = result.stats
    assert (st.calls, st.main_calls, st.kept_calls, st.compaction_segments) == (6, 5, 4, 2)
    assert (st.raw_leaves, st.leaves, st.unique_tokens, st.path_tokens, st.trainable_tokens) == (3, 2, 17, 22, 4)
    assert st.prefix_reuse_ratio == pytest.approx(22 / 17)
    assert st.min_policy_version == 1
    # Strict mode agrees: each segment's history is append-only.
    assert build_tree(compaction_rollout().calls, prune="strict").segments == result.segments


def test_compaction_winner_is_per_segment_not_global() -> None:
    r = compaction_rollout()
    # Were the summary call a side call, all main calls would form one segment: the longest (c5) wins, c0..c2 go.
    one_segment = [replace(c, call_kind="side") if c.call_id == "k" else c for c in r.calls]
    assert build_tree(one_segment).kept_call_ids == ["c4", "c5"]
    assert build_tree(r.calls).kept_call_ids == ["c0", "c2", "c4", "c5"]


def openclaw() -> Rollout:
    """Each call removes the reminder M from its place and re-appends it at the end of the prompt."""
    r = Rollout()
    r.add("c0", S + U + M, [100])
    r.add("c1", S + U + [100, 200] + M, [101], parent="c0")
    r.add("c2", S + U + [100, 200, 101, 201] + M, [102], parent="c1")
    return r


def test_openclaw_reordered_message_keeps_every_carried_turn() -> None:
    result = build_tree(openclaw().calls)
    assert result.segments == [
        seg(0, -1, S + U, False, "c0"),
        seg(1, 0, M, False, "c0"),
        seg(2, 1, [100], True, "c0"),
        seg(3, 0, [100, 200], False, "c1"),
        seg(4, 3, M, False, "c1"),
        seg(5, 4, [101], True, "c1"),
        seg(6, 3, [101, 201] + M, False, "c2"),
        seg(7, 6, [102], True, "c2"),
    ]
    assert paths(result.segments) == [[0, 1, 2], [0, 3, 4, 5], [0, 3, 6, 7]]
    # Each generation is trained once, under its real prompt; in later prompts it is context.
    assert path_trainable_mask(result.segments, [0, 3, 6, 7]) == [False] * 14 + [True]
    assert result.kept_call_ids == ["c0", "c1", "c2"] and result.excluded_calls == {}
    st = result.stats
    assert (st.raw_leaves, st.leaves, st.unique_tokens, st.path_tokens, st.trainable_tokens) == (3, 3, 21, 39, 3)


def test_openclaw_strict_keeps_one_path_and_merges_splits() -> None:
    result = build_tree(openclaw().calls, prune="strict")
    assert result.segments == [
        seg(0, -1, S + U + [100, 200, 101, 201] + M, False, "c2"),
        seg(1, 0, [102], True, "c2"),
    ]
    assert result.pruned_call_ids == ["c0", "c1"] and result.excluded_calls == {"pruned": 2}
    assert (result.stats.leaves, result.stats.trainable_tokens) == (1, 1)


def test_openclaw_retry_is_still_a_dead_end() -> None:
    r = openclaw()
    r.add("c3", S + U + [100, 200, 101, 201] + M, [103, 104], parent="c2")  # retry of c2: c2's turn is dropped
    r.add("c4", S + U + [100, 200, 101, 201, 103, 104, 203] + M, [105], parent="c3")
    result = build_tree(r.calls)
    assert result.kept_call_ids == ["c0", "c1", "c3", "c4"] and result.pruned_call_ids == ["c2"]
    assert all(102 not in s.tokens for s in result.segments)


def long_openclaw(turns: int, header: Sequence[int] = ()) -> Rollout:
    """OpenClaw over ``turns`` calls: each removes the reminder M and re-appends it at the end; ``header``: role
    tokens the template puts before an answer in history."""
    r = Rollout()
    history = S + U
    for i in range(turns):
        r.add(f"c{i}", history + M, [1000 + i], parent=f"c{i - 1}" if i else None)
        history = history + list(header) + [1000 + i, 2000 + i]  # the answer, then its tool result
    return r


def test_leaf_cap_counts_branches_not_openclaw_rewrites() -> None:
    """70 OpenClaw calls make 70 leaves, one per carried turn, but one path of history: kept under the cap of 64."""
    for header in ((), (7, 8, 9)):
        result = build_tree(long_openclaw(70, header).calls)
        assert result.dropped_reason is None, result.dropped_reason
        assert (result.stats.leaves, result.stats.branch_leaves) == (70, 1)
        assert len(result.kept_call_ids) == 70 and result.stats.trainable_tokens == 70


def retries(n: int) -> Rollout:
    """n retries of the first turn from the same prompt (real branching), then the turn that continues."""
    r = Rollout()
    for i in range(n):
        r.add(f"t{i}", S + U, [500 + i], parent=None)
    r.add("w", S + U + [500 + n - 1, 600], [700], parent=f"t{n - 1}")
    return r


def test_leaf_cap_drops_real_branching() -> None:
    dropped = build_tree(retries(4).calls, max_leaves=3, prune="none")
    assert dropped.dropped_reason == "branch leaf count 4 > cap 3 (4 leaves)"
    assert dropped.segments == [] and dropped.call_nodes == {}
    assert dropped.stats.leaves == dropped.stats.branch_leaves == 4  # stats describe the dropped tree
    assert build_tree(retries(4).calls, max_leaves=4, prune="none").dropped_reason is None
    assert build_tree(retries(4).calls, max_leaves=None, prune="none").dropped_reason is None
    kept = build_tree(retries(4).calls, max_leaves=1)  # the default rule prunes the dead retries: one branch left
    assert kept.dropped_reason is None and kept.pruned_call_ids == ["t0", "t1", "t2"]


def test_compaction_segments_count_for_the_leaf_cap() -> None:
    r = compaction_rollout()
    assert build_tree(r.calls).stats.branch_leaves == 2
    assert build_tree(r.calls, max_leaves=1).dropped_reason == "branch leaf count 2 > cap 1 (2 leaves)"


def test_dead_retry_repeated_later_is_still_a_dead_end() -> None:
    """The dead attempt's text reappears verbatim later in the winner's prompt, far from where the winner's history
    left the dead call's prompt: the attempt is not carried and must not be trained with the rollout's reward."""
    tool = list(range(300, 330))  # a tool result (30 tokens): the repeat is past the carried-turn window
    r = Rollout()
    r.add("c1", S + U, [100, 101])  # dead: the harness retries from the same prompt
    r.add("c2", S + U, [110, 111], parent="c1")  # the retry that is carried on
    r.add("c3", S + U + [110, 111] + tool, [100, 101], parent="c2")  # the model now says what c1 said
    r.add("c4", S + U + [110, 111] + tool + [100, 101, 211], [120], parent="c3")
    result = build_tree(r.calls)
    assert result.pruned_call_ids == ["c1"] and result.kept_call_ids == ["c2", "c3", "c4"]
    assert result.stats.leaves == 1


def test_nothing_trainable_is_dropped() -> None:
    empty = build_tree([])
    assert empty.dropped_reason is not None and empty.segments == []
    assert (empty.stats.calls, empty.stats.unique_tokens, empty.stats.prefix_reuse_ratio) == (0, 0, 1.0)
    r = Rollout()
    r.add("title", [50, 51] + U, [400], kind="side")
    r.add("c0", S + U, [], finish="error")
    only_excluded = build_tree(r.calls)
    assert only_excluded.dropped_reason == "no trainable tokens (1 main calls, 0 kept)"
    assert only_excluded.excluded_calls == {"pruned": 1, "side": 1}


def test_rebuild_prompts() -> None:
    r = compaction_rollout()
    assert rebuild_prompts(reversed(r.calls)) == r.prompts


def call(cid: str, seq: int, parent: str | None, spl: int, gen: Sequence[int] = (100,), **kw: object) -> TreeCall:
    logprobs = kw.pop("logprobs", lp(gen))
    return TreeCall(cid, seq, parent, spl, [1, 2, 3], gen, logprobs, "main", 1, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("calls", "message"),
    [
        ([call("a", 0, None, 0), call("b", 1, "x", 2)], "unknown"),
        ([call("a", 0, "b", 1), call("b", 1, None, 0)], "served later"),
        ([call("a", 0, None, 0), call("b", 1, "a", 5)], "outside 0..4"),
        ([call("a", 0, None, 0), call("b", 1, "a", -1)], "outside 0..4"),
        ([call("a", 0, None, 2)], "no parent"),
        ([call("a", 0, None, 0, logprobs=[-0.1, -0.2])], "2 logprobs for 1 generated"),
        ([call("a", 0, None, 0), call("a", 1, None, 0)], "duplicate call_id"),
        ([call("a", 0, None, 0), call("b", 0, None, 0)], "share seq 0"),
    ],
)
def test_inconsistent_calls_raise(calls: list[TreeCall], message: str) -> None:
    with pytest.raises(TreeError, match=message):
        build_tree(calls)


def test_unknown_prune_mode_raises() -> None:
    with pytest.raises(TreeError, match="prune="):
        build_tree([], prune="all")  # type: ignore[arg-type]


def position_logprob(pos: int, token: int) -> float:
    """A logprob that depends only on (position, token), so shared tokens agree whichever call wrote them."""
    return -((pos * 31 + token) % 97) / 100 - 0.01


def random_rollout(rng: random.Random) -> Rollout:
    """Append-only steps, retries, early branches and compaction-like restarts over a tiny vocabulary."""
    r = Rollout(position_logprob)
    for i in range(rng.randint(1, 14)):
        kind = rng.choices(["main", "side", "compaction"], weights=[8, 1, 1])[0]
        finish = "error" if rng.random() < 0.1 else "stop"
        gen = [rng.randint(1, 6) for _ in range(rng.randint(0, 4))]
        new = [rng.randint(1, 6) for _ in range(rng.randint(0, 4))]
        if not r.calls or rng.random() < 0.15:
            r.add(f"c{i}", new, gen, kind=kind, finish=finish)
            continue
        parent = rng.choice(r.calls).call_id
        base = r.full[parent]
        cut = len(base) if rng.random() < 0.5 else rng.randint(0, len(base))  # append-only half of the time
        r.add(f"c{i}", base[:cut] + new, gen, parent=parent, kind=kind, finish=finish)
    return r


def check_structure(segments: list[Segment]) -> None:
    for i, s in enumerate(segments):
        assert s.index == i and -1 <= s.parent < i and s.tokens
        assert len(s.logprobs) == (len(s.tokens) if s.trainable else 0)
    # Context segments never share a first token with a sibling: a prompt always follows the longest match.
    firsts: dict[tuple[int, int], list[Segment]] = {}
    for s in segments:
        firsts.setdefault((s.parent, s.tokens[0]), []).append(s)
    for group in firsts.values():
        assert sum(not s.trainable for s in group) <= 1 and (len(group) == 1 or any(not s.trainable for s in group))


@pytest.mark.parametrize("seed", range(60))
def test_random_rollouts_property(seed: int) -> None:
    rng = random.Random(seed)
    r = random_rollout(rng)
    main = [c for c in r.calls if c.call_kind == "main"]
    total = sum(len(r.full[c.call_id]) for c in main)
    results = {mode: build_tree(r.calls, max_leaves=None, prune=mode) for mode in ("none", "carried", "strict")}
    for mode, result in results.items():
        if result.dropped_reason is not None:
            assert result.stats.trainable_tokens == 0 and result.segments == []
            continue
        segs = result.segments
        check_structure(segs)
        st = result.stats
        assert st.unique_tokens <= total
        assert st.unique_tokens == sum(len(s.tokens) for s in segs)
        assert st.path_tokens == sum(len(path_tokens(segs, p)) for p in paths(segs))
        assert st.leaves == len(paths(segs))
        assert set(result.kept_call_ids) | set(result.pruned_call_ids) == {c.call_id for c in main}
        on_kept_paths: set[int] = set()
        for cid in result.kept_call_ids:
            node = result.call_nodes[cid]
            if node < 0:
                assert r.full[cid] == []
                continue
            path = path_to(segs, node)
            on_kept_paths.update(path)
            tokens = path_tokens(segs, path)
            assert tokens == r.full[cid]
            mask = path_trainable_mask(segs, path)
            assert all(mask[len(r.prompts[cid]) :])  # the call's own generation is trained
            logprobs = [x for i in path for x in segs[i].logprobs]
            expected = [position_logprob(p, t) for p, (t, m) in enumerate(zip(tokens, mask, strict=True)) if m]
            assert logprobs == pytest.approx(expected)
        assert on_kept_paths == set(range(len(segs)))  # nothing survives that no kept call needs
        if mode == "none":
            assert st.leaves == st.raw_leaves and not result.pruned_call_ids
        if mode == "strict":
            assert st.leaves <= st.compaction_segments
    none, carried, strict = (results[m] for m in ("none", "carried", "strict"))
    assert set(strict.kept_call_ids) <= set(carried.kept_call_ids) <= set(none.kept_call_ids)
    assert strict.stats.unique_tokens <= carried.stats.unique_tokens <= none.stats.unique_tokens
