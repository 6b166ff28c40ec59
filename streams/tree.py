"""Prefix tree of one rollout: the proxy's delta-encoded model calls → a filtered tree of token segments.

Input: the rollout's calls as :class:`TreeCall` (any order; ``seq`` orders them). A call's prompt is
``(parent.prompt + parent.generated)[:shared_prefix_len] + new_tokens`` (:func:`rebuild_prompts`).

Output: :class:`TreeResult` — ``segments`` (the tree, topological order, the representation the tree packer and
``schemas/trajectory.avsc`` use), ``stats``, ``excluded_calls``, ``dropped_reason`` and, per kept main call, the
segment where its prompt + generation ends (``call_nodes``). Root-to-node concatenation of segment tokens gives the
accumulated tokens at that node; every root-to-leaf path is a candidate trajectory.

Build. Main calls are inserted in ``seq`` order. Each attaches at the node whose accumulated tokens are the longest
prefix of its prompt, matched by token content (not by the declared parent: OpenClaw re-orders a message every
call and compaction starts a new short prompt), splitting a segment where the prompt diverges inside it (both parts
keep their trainable flag and their share of the logprobs). The rest of the prompt becomes a context segment
(``trainable=False``) and the generation a trainable child of it. A generation that repeats an existing trainable
segment from the same node (a deterministic retry) is shared with it; it never merges into context tokens.

Filtering (docs/method.md#filtering; the rules in detail: docs/method.md#how-the-tree-applies-them): only ``main``
calls enter the tree (other kinds count in ``stats`` and ``excluded_calls``; their prompts still serve as delta
parents); per compaction segment the winner (longest valid accumulated path) and, with ``prune="carried"`` (the
default), the calls whose answers it carried forward are kept and every other branch is pruned (``"strict"``: winners
only; ``"none"``: every main call); a rollout with a ``tampered`` call (of any kind: its request held an assistant
turn the proxy never generated, so the recorded history is not the policy's), over ``max_leaves`` branch leaves, or
without trainable tokens, is dropped (``dropped_reason``, in that order; no segments). Pure: no Kafka.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from clawbase.errors import ClawstreamError
from policy.token_prefix import common_prefix_len

MAIN = "main"
COMPACTION = "compaction"
# A call that ended in an error produced no usable continuation, so it can never be the segment's winner.
INVALID_FINISH_REASONS: frozenset[str] = frozenset({"error"})
PruneMode = Literal["carried", "strict", "none"]
_PRUNE_MODES: frozenset[str] = frozenset({"carried", "strict", "none"})
# Key in ``excluded_calls`` for main calls removed as retry dead ends (schemas/trajectory.avsc documents it).
PRUNED_KEY = "pruned"
# Tokens a carried turn may sit after its branch point in the winner's prompt: the role header between where the
# re-laid-out history departs (OpenClaw's moved reminder message) and the answer now in its place.
CARRY_WINDOW = 16


class TreeError(ClawstreamError):
    """The calls of a rollout are inconsistent (unknown or later parent, bad prefix length, logprob count...)."""


@dataclass(frozen=True)
class TreeCall:
    """One model call as the proxy records it; the prompt is delta-encoded against an earlier call."""

    call_id: str
    seq: int  # order the proxy served them, 0-based
    parent_call_id: str | None  # earlier call whose prompt + generated tokens this prompt shares a prefix with
    shared_prefix_len: int  # leading prompt tokens equal to the parent's prompt + generated tokens
    new_tokens: Sequence[int]  # prompt tokens after the shared prefix
    generated_tokens: Sequence[int]
    logprobs: Sequence[float]  # one per generated token
    call_kind: str  # "main" | "side" | "subagent" | "compaction"
    policy_version: int
    finish_reason: str = "stop"  # "stop" | "length" | "tool_calls" | "error" ...
    tampered: bool = False  # its request held an assistant turn the proxy never generated: the rollout is dropped


@dataclass
class Segment:
    """A run of tokens in the tree; the concatenation along root→node is the accumulated context at the node."""

    index: int  # position in TreeResult.segments; parents come first
    parent: int  # index of the parent segment, -1 for a root segment
    tokens: list[int]
    trainable: bool  # True only for generated tokens of kept main calls
    logprobs: list[float]  # rollout logprobs, same length as tokens when trainable, else empty
    call_id: str | None  # the call whose prompt (context) or generation this segment comes from
    policy_version: int


@dataclass
class TreeStats:
    """Size and sharing of one rollout's tree (of the kept tree, also when the rollout is dropped)."""

    calls: int = 0  # all calls, excluded kinds included
    main_calls: int = 0
    kept_calls: int = 0  # main calls whose prompt + generation survives filtering
    compaction_segments: int = 0  # 1 + compaction calls when the rollout has main calls, else 0
    raw_leaves: int = 0  # leaves before dead-end pruning
    leaves: int = 0  # leaves kept (candidate trajectories)
    branch_leaves: int = 0  # kept leaves that are real branches (not carried calls): what the leaf cap counts
    unique_tokens: int = 0  # Σ len(segment.tokens): each shared prefix once
    path_tokens: int = 0  # Σ over root-to-leaf paths of their token count
    trainable_tokens: int = 0  # unique trainable tokens
    prefix_reuse_ratio: float = 1.0  # path_tokens / unique_tokens; 1.0 for an empty tree (nothing shared)
    min_policy_version: int | None = None  # oldest weight version behind any trainable token; None if none


@dataclass
class TreeResult:
    """The filtered tree of one rollout, or the reason it was dropped."""

    segments: list[Segment]
    stats: TreeStats
    dropped_reason: str | None = None
    excluded_calls: dict[str, int] = field(default_factory=dict)  # kind (or "pruned") → count; non-zero only
    kept_call_ids: list[str] = field(default_factory=list)  # in seq order
    pruned_call_ids: list[str] = field(default_factory=list)  # main calls removed as dead ends, in seq order
    call_nodes: dict[str, int] = field(default_factory=dict)  # kept call → segment where it ends (-1: no tokens)


class _Node:
    """Mutable tree node used while building; turned into :class:`Segment` at the end."""

    __slots__ = ("tokens", "logprobs", "trainable", "call_id", "policy_version", "parent", "children")

    def __init__(
        self,
        tokens: list[int],
        logprobs: list[float],
        trainable: bool,
        call_id: str | None,
        policy_version: int,
        parent: _Node | None,
    ) -> None:
        self.tokens = tokens
        self.logprobs = logprobs
        self.trainable = trainable
        self.call_id = call_id
        self.policy_version = policy_version
        self.parent = parent
        self.children: list[_Node] = []


def _kind(call: TreeCall) -> str:
    return call.call_kind.lower()


def _ordered(calls: Iterable[TreeCall]) -> list[TreeCall]:
    """Calls sorted by seq, with unique ids and seqs (the delta encoding and all filtering rely on both)."""
    ordered = sorted(calls, key=lambda c: c.seq)
    ids: set[str] = set()
    for i, call in enumerate(ordered):
        if call.call_id in ids:
            raise TreeError(f"duplicate call_id {call.call_id!r}")
        ids.add(call.call_id)
        if i and ordered[i - 1].seq == call.seq:
            raise TreeError(f"calls {ordered[i - 1].call_id!r} and {call.call_id!r} share seq {call.seq}")
    return ordered


def rebuild_prompts(calls: Iterable[TreeCall]) -> dict[str, list[int]]:
    """Full prompt token ids of every call, rebuilt from the delta encoding; raises TreeError if inconsistent."""
    prompts: dict[str, list[int]] = {}
    by_id: dict[str, TreeCall] = {}
    for call in _ordered(calls):
        if call.parent_call_id is None:
            if call.shared_prefix_len != 0:
                raise TreeError(
                    f"call {call.call_id!r} has no parent but shared_prefix_len={call.shared_prefix_len} (must be 0)"
                )
            prompts[call.call_id] = list(call.new_tokens)
        else:
            parent = by_id.get(call.parent_call_id)
            if parent is None:
                raise TreeError(
                    f"call {call.call_id!r} (seq {call.seq}) names parent {call.parent_call_id!r}, which is unknown "
                    "or was served later; a parent must be an earlier call of the same rollout"
                )
            parent_len = len(prompts[parent.call_id]) + len(parent.generated_tokens)
            if not 0 <= call.shared_prefix_len <= parent_len:
                raise TreeError(
                    f"call {call.call_id!r}: shared_prefix_len={call.shared_prefix_len} is outside 0..{parent_len}, "
                    f"the length of parent {parent.call_id!r}'s prompt + generated tokens"
                )
            full = prompts[parent.call_id] + list(parent.generated_tokens)
            prompts[call.call_id] = full[: call.shared_prefix_len] + list(call.new_tokens)
        by_id[call.call_id] = call
    return prompts


def _split(node: _Node, k: int) -> _Node:
    """Cut node after k tokens; returns the new head. The old node keeps the tail, so call ends stay valid."""
    assert node.parent is not None and 0 < k < len(node.tokens)
    head = _Node(node.tokens[:k], node.logprobs[:k], node.trainable, node.call_id, node.policy_version, node.parent)
    siblings = node.parent.children
    siblings[siblings.index(node)] = head
    head.children = [node]
    node.tokens, node.logprobs, node.parent = node.tokens[k:], node.logprobs[k:], head
    return head


def _descend(node: _Node, seq: list[int], *, trainable_only: bool) -> tuple[_Node, int]:
    """Follow seq down from node as far as the tree matches it; split where it diverges mid-segment.

    Returns the deepest node reached and how many tokens of seq it consumed. Only a generation that could not merge
    into a context sibling makes two siblings start with the same token, so full matches are preferred first.
    """
    pos = 0
    while pos < len(seq):
        best: _Node | None = None
        best_key = (False, 0)
        for child in node.children:
            if (trainable_only and not child.trainable) or child.tokens[0] != seq[pos]:
                continue
            k = common_prefix_len(seq, child.tokens, start=pos)
            key = (k == len(child.tokens), k)
            if key > best_key:
                best, best_key = child, key
        if best is None:
            break
        k = best_key[1]
        pos += k
        if k < len(best.tokens):
            return _split(best, k), pos  # diverged inside best: nothing below the new head matches further
        node = best
    return node, pos


def _insert(root: _Node, call: TreeCall, prompt: list[int]) -> _Node:
    """Add one main call's prompt and generation; returns the node where they end."""
    node, pos = _descend(root, prompt, trainable_only=False)
    gen, logprobs = list(call.generated_tokens), [float(x) for x in call.logprobs]
    gpos = 0
    if pos < len(prompt):
        context = _Node(prompt[pos:], [], False, call.call_id, call.policy_version, node)
        node.children.append(context)
        node = context
    else:
        # Same prompt as an earlier call: an identical (prefix of a) generation is stored once.
        node, gpos = _descend(node, gen, trainable_only=True)
    if gpos < len(gen):
        generated = _Node(gen[gpos:], logprobs[gpos:], True, call.call_id, call.policy_version, node)
        node.children.append(generated)
        node = generated
    return node


def _packed(tokens: Sequence[int]) -> bytes:
    return array("q", tokens).tobytes()


def _contains(haystack: bytes, needle: bytes, start: int = 0, end: int | None = None) -> bool:
    """True if needle occurs in haystack[start:end] (token offsets) at a whole-token offset (packed by
    :func:`_packed`)."""
    itemsize = array("q").itemsize
    lo, hi = start * itemsize, len(haystack) if end is None else end * itemsize
    i = haystack.find(needle, lo, hi)
    while i != -1:
        if i % itemsize == 0:
            return True
        i = haystack.find(needle, i + 1, hi)
    return False


def _chosen_calls(
    main: list[TreeCall], prompts: dict[str, list[int]], compaction_seqs: list[int], prune: PruneMode
) -> tuple[set[str], set[str]]:
    """Ids of the main calls the dead-end rule keeps (docs/method.md#how-the-tree-applies-them; their paths make the
    kept tree), and the subset kept only as carried turns (not winners)."""
    if prune == "none":
        return {c.call_id for c in main}, set()
    by_segment: dict[int, list[TreeCall]] = {}
    for call in main:
        by_segment.setdefault(bisect_left(compaction_seqs, call.seq), []).append(call)
    kept: set[str] = set()
    carried: set[str] = set()
    for calls in by_segment.values():
        valid = [c for c in calls if c.finish_reason.lower() not in INVALID_FINISH_REASONS]
        if not valid:
            continue
        winner = max(valid, key=lambda c: (len(prompts[c.call_id]) + len(c.generated_tokens), c.seq))
        kept.add(winner.call_id)
        if prune == "strict":
            continue
        winner_prompt = prompts[winner.call_id]
        history = _packed(winner_prompt)
        for call in valid:
            if call.seq >= winner.seq or not call.generated_tokens:
                continue
            branch = common_prefix_len(winner_prompt, prompts[call.call_id])
            end = branch + CARRY_WINDOW + len(call.generated_tokens)
            if _contains(history, _packed(call.generated_tokens), branch, end):
                carried.add(call.call_id)
    return kept | carried, carried


def _count_leaves(root: _Node) -> int:
    count, stack = 0, list(root.children)
    while stack:
        node = stack.pop()
        count += not node.children
        stack.extend(node.children)
    return count


def _prune_and_merge(root: _Node, ends: dict[str, _Node], chosen: set[str]) -> tuple[set[str], dict[int, list[str]]]:
    """Remove nodes on no chosen call's path, then re-join splits that only removed branches needed.

    Every main call whose whole prompt + generation survives counts as kept, chosen or not. A kept context
    segment first written by a removed call is credited to the earliest kept call whose prompt holds it (``ends``
    is in seq order), so context call ids name kept calls; generated tokens keep the call that generated them.
    Returns the kept call ids and id(node) → kept calls ending there (after merging).
    """
    live: set[int] = {id(root)}
    for call_id in chosen:
        cursor: _Node | None = ends[call_id]
        while cursor is not None and id(cursor) not in live:
            live.add(id(cursor))
            cursor = cursor.parent
    kept = {cid for cid, node in ends.items() if cid in chosen or (node is not root and id(node) in live)}
    end_of: dict[int, list[str]] = {}
    credited: set[int] = set()
    for call_id, node in ends.items():
        if call_id not in kept:
            continue
        end_of.setdefault(id(node), []).append(call_id)
        cursor = node
        while cursor is not None and id(cursor) not in credited:
            credited.add(id(cursor))
            if not cursor.trainable and cursor.call_id not in kept:
                cursor.call_id = call_id
            cursor = cursor.parent
    stack = [root]
    while stack:
        node = stack.pop()
        node.children = [c for c in node.children if id(c) in live]
        while node is not root and len(node.children) == 1 and id(node) not in end_of:
            child = node.children[0]
            if (child.trainable, child.call_id, child.policy_version) != (
                node.trainable,
                node.call_id,
                node.policy_version,
            ):
                break
            node.tokens += child.tokens
            node.logprobs += child.logprobs
            node.children = [c for c in child.children if id(c) in live]
            for grandchild in node.children:
                grandchild.parent = node
            if id(child) in end_of:
                end_of[id(node)] = end_of.pop(id(child))
        stack.extend(node.children)
    return kept, end_of


def _emit(root: _Node, end_of: dict[int, list[str]]) -> tuple[list[Segment], dict[str, int]]:
    """Number nodes in depth-first pre-order (parents first, each path's segments close together)."""
    segments: list[Segment] = []
    call_nodes = {call_id: -1 for call_id in end_of.get(id(root), [])}
    stack: list[tuple[_Node, int]] = [(child, -1) for child in reversed(root.children)]
    while stack:
        node, parent = stack.pop()
        index = len(segments)
        logprobs = list(node.logprobs) if node.trainable else []
        segments.append(
            Segment(index, parent, list(node.tokens), node.trainable, logprobs, node.call_id, node.policy_version)
        )
        for call_id in end_of.get(id(node), []):
            call_nodes[call_id] = index
        stack.extend((child, index) for child in reversed(node.children))
    return segments, call_nodes


def tree_stats(segments: Sequence[Segment], **counts: int) -> TreeStats:
    """Token statistics of a segment list; ``counts`` fills the call-count fields (calls, main_calls...)."""
    depth = [0] * len(segments)
    has_child = [False] * len(segments)
    for seg in segments:
        depth[seg.index] = (depth[seg.parent] if seg.parent >= 0 else 0) + len(seg.tokens)
        if seg.parent >= 0:
            has_child[seg.parent] = True
    leaf_depths = [depth[i] for i in range(len(segments)) if not has_child[i]]
    unique = sum(len(seg.tokens) for seg in segments)
    trainable = [seg for seg in segments if seg.trainable]
    return TreeStats(
        leaves=len(leaf_depths),
        unique_tokens=unique,
        path_tokens=sum(leaf_depths),
        trainable_tokens=sum(len(seg.tokens) for seg in trainable),
        prefix_reuse_ratio=sum(leaf_depths) / unique if unique else 1.0,
        min_policy_version=min((seg.policy_version for seg in trainable), default=None),
        **counts,
    )


def _branch_leaves(segments: Sequence[Segment], call_nodes: dict[str, int], carried: set[str]) -> int:
    """Kept leaves where some call other than a carried turn ends (what the leaf cap counts)."""
    has_child = {seg.parent for seg in segments}
    ending: dict[int, list[str]] = {}
    for call_id, index in call_nodes.items():
        ending.setdefault(index, []).append(call_id)
    leaves = [seg.index for seg in segments if seg.index not in has_child]
    return sum(not ending.get(i) or any(c not in carried for c in ending[i]) for i in leaves)


def build_tree(calls: Iterable[TreeCall], *, max_leaves: int | None = 64, prune: PruneMode = "carried") -> TreeResult:
    """Build the filtered prefix tree of one rollout (rules: docs/method.md#how-the-tree-applies-them); raises
    TreeError."""
    if prune not in _PRUNE_MODES:
        raise TreeError(f"prune={prune!r}: expected one of {sorted(_PRUNE_MODES)}")
    ordered = _ordered(calls)
    for call in ordered:
        if len(call.logprobs) != len(call.generated_tokens):
            raise TreeError(
                f"call {call.call_id!r}: {len(call.logprobs)} logprobs for {len(call.generated_tokens)} generated "
                "tokens (need one per token)"
            )
    prompts = rebuild_prompts(ordered)
    main = [c for c in ordered if _kind(c) == MAIN]
    compaction_seqs = [c.seq for c in ordered if _kind(c) == COMPACTION]

    root = _Node([], [], False, None, 0, None)
    ends = {call.call_id: _insert(root, call, prompts[call.call_id]) for call in main}
    raw_leaves = _count_leaves(root)
    chosen, carried = _chosen_calls(main, prompts, compaction_seqs, prune)
    kept, end_of = _prune_and_merge(root, ends, chosen)
    segments, call_nodes = _emit(root, end_of)

    excluded = Counter(_kind(c) for c in ordered if _kind(c) != MAIN)
    pruned_ids = [c.call_id for c in main if c.call_id not in kept]
    if pruned_ids:
        excluded[PRUNED_KEY] = len(pruned_ids)
    stats = tree_stats(
        segments,
        calls=len(ordered),
        main_calls=len(main),
        kept_calls=len(kept),
        compaction_segments=len(compaction_seqs) + 1 if main else 0,
        raw_leaves=raw_leaves,
        branch_leaves=_branch_leaves(segments, call_nodes, carried),
    )
    result = TreeResult(
        segments=segments,
        stats=stats,
        excluded_calls=dict(sorted(excluded.items())),
        kept_call_ids=[c.call_id for c in main if c.call_id in kept],
        pruned_call_ids=pruned_ids,
        call_nodes=call_nodes,
    )
    tampered = sum(c.tampered for c in ordered)
    if tampered:
        result.dropped_reason = f"tampered ({tampered} call(s))"
    elif max_leaves is not None and stats.branch_leaves > max_leaves:
        result.dropped_reason = f"branch leaf count {stats.branch_leaves} > cap {max_leaves} ({stats.leaves} leaves)"
    elif stats.trainable_tokens == 0:
        result.dropped_reason = f"no trainable tokens ({len(main)} main calls, {len(kept)} kept)"
    if result.dropped_reason is not None:
        result.segments, result.call_nodes = [], {}
    return result
