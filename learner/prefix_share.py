"""Cross-rollout prefix sharing: the context that the trees of one micro-batch row begin with is packed once.

Tree packing (``learner.pack``) stores a prefix once *within* a rollout's tree, but every rollout of a batch repeats
its chat dialect's system prompt and tool schemas, and a group's rollouts the task's user prompt too. Here an *item*
is a root segment of a tree in the row; its *shareable* tokens are its leading run of pure context (out of the loss,
rollout logprob 0, plain sampling). The distinct common prefixes of at least ``min_tokens`` form a radix tree whose
nodes become *virtual* context segments at the start of the row; each item's root hangs under the node it matches,
those tokens removed. Positions, attention, predictors and the loss are exactly those of unshared packing (1e-5 in
fp32, tests/unit/test_pack_prefix_share.py; why: docs/method.md#prefix-sharing-across-rollouts).

``shared_row`` builds a row's tensor fields; ``fill_rows`` is the first-fit decreasing of ``learner.pack.pack_trees``
made aware of sharing (a tree goes to the row it adds the fewest tokens to after sharing). Rows of their own (trees
over the token budget, ``learner.tree_split``) are never shared here: ``learner.kv_share``
shares their common prefix's keys and values instead. Measured by ``bench/prefix_share.py``.

Pure: no Kafka. Trees are read through the fields of ``learner.pack.PackedTree`` (duck-typed: pack imports this).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from policy.token_prefix import common_prefix_len, leading_run

__all__ = ["DEFAULT_MIN_TOKENS", "fill_rows", "root_prefixes", "shared_lengths", "shared_row", "shared_savings"]

# Below this many common tokens two roots keep their own copies (a shared segment for a chat-template header of a
# few tokens saves nothing worth a segment). The learner's default (``Hyperparams.share_prefix_min``).
DEFAULT_MIN_TOKENS = 16

Prefix = tuple[int, ...]


def _plain_context(tree: Any) -> torch.Tensor:
    """(L,) bool: tokens that are pure context (out of the loss, logprob 0, plain sampling): the shareable kind."""
    return (
        ~tree.loss_mask & (tree.rollout_logprobs == 0) & (tree.temperature == 1) & (tree.top_p == 1) & (tree.top_k == 0)
    )


def _roots(tree: Any) -> list[tuple[int, int, int]]:
    """(segment, first token, token count) of each root segment of a packed tree, in segment order."""
    counts = torch.bincount(tree.segment_ids, minlength=tree.num_segments)  # (S,)
    starts = torch.cumsum(counts, 0) - counts  # (S,): segments are concatenated in order
    is_root = tree.segment_ancestors.sum(1) == 1  # (S,): a root is its own only ancestor
    return [(int(s), int(starts[s]), int(counts[s])) for s in is_root.nonzero(as_tuple=True)[0]]


def root_prefixes(tree: Any) -> list[Prefix]:
    """The shareable tokens of each root segment of a packed tree (its leading run of pure context)."""
    plain = _plain_context(tree)
    out = []
    for _, start, n in _roots(tree):
        stop = leading_run(plain[start : start + n].cpu().numpy())
        out.append(tuple(tree.input_ids[start : start + stop].tolist()))
    return out


def shared_lengths(prefixes: Sequence[Prefix], min_tokens: int) -> list[int]:
    """Per item, its longest common prefix with any other item (0 when shorter than ``min_tokens``).

    In lexicographic order the longest common prefix with any other string is reached at a neighbour."""
    order = sorted(range(len(prefixes)), key=lambda i: prefixes[i])
    out = [0] * len(prefixes)
    for a, b in zip(order, order[1:], strict=False):
        common = common_prefix_len(prefixes[a], prefixes[b])
        if common >= max(min_tokens, 1):
            out[a], out[b] = max(out[a], common), max(out[b], common)
    return out


def _shared_strings(prefixes: Sequence[Prefix], min_tokens: int) -> tuple[list[int], list[Prefix]]:
    lengths = shared_lengths(prefixes, min_tokens)
    return lengths, sorted({p[:n] for p, n in zip(prefixes, lengths, strict=True) if n})


def shared_savings(prefixes: Sequence[Prefix], min_tokens: int) -> int:
    """Tokens that sharing removes from a row with these items (Σ P minus the tokens of the radix tree)."""
    ordered = sorted(prefixes)
    return _sorted_savings([common_prefix_len(a, b) for a, b in zip(ordered, ordered[1:], strict=False)], min_tokens)


def _sorted_savings(adjacent: Sequence[int], min_tokens: int) -> int:
    """``shared_savings`` from the common prefix lengths of neighbours in sorted order (``adjacent[k]`` of items k and
    k + 1): O(items) integer work, so rows can be filled incrementally.

    Walking the items in sorted order, an item's shared tokens t = s[:P] add to the radix tree only what no earlier
    item's t' spells: P - max lcp(t, t'). That maximum is reached at the nearest earlier item with P > 0 (lcp with
    earlier items only shrinks with distance, and a nearer one with P = 0 shares less than min_tokens with it), so
    the saving Σ P - radix tokens is Σ min(P, lcp with that item)."""
    floor = max(min_tokens, 1)
    lengths = [0] * (len(adjacent) + 1)
    for k, common in enumerate(adjacent):
        if common >= floor:
            lengths[k], lengths[k + 1] = max(lengths[k], common), max(lengths[k + 1], common)
    saved = 0
    run = -1  # lcp of the current item with the nearest earlier item that shares (-1: none yet)
    for k, length in enumerate(lengths):
        if k:
            run = adjacent[k - 1] if lengths[k - 1] else (min(run, adjacent[k - 1]) if run >= 0 else -1)
        if length and run >= 0:
            saved += min(length, run)
    return saved


@dataclass
class _Node:
    """A radix node: the tokens at depths [start, end) of the strings through it, under ``parent`` (-1: none)."""

    parent: int
    start: int
    end: int
    string: int  # a string (index into the sorted strings) that spells it


def _radix_tree(strings: Sequence[Prefix]) -> tuple[list[_Node], list[int]]:
    """Radix tree of sorted, distinct, non-empty strings: its nodes, and the node each string ends at.

    One pass with the path of the previous string on a stack (the lcp-interval construction): pop what lies deeper
    than the common prefix h with the previous string, split the node that straddles h, hang the new rest below."""
    nodes: list[_Node] = []
    ends: list[int] = []
    stack: list[int] = []  # nodes along the previous string's path, shallowest first
    for k, s in enumerate(strings):
        # h < len(s): the strings are sorted and distinct, so s is no prefix of its predecessor.
        h = common_prefix_len(strings[k - 1], s) if k else 0
        while stack and nodes[stack[-1]].start >= h:
            stack.pop()
        if stack and nodes[stack[-1]].end > h:
            # Split x = [a, c) at h: a new node [a, h) takes x's place, x keeps [h, c) and its subtree and ends.
            x = nodes[stack[-1]]
            nodes.append(_Node(x.parent, x.start, h, x.string))
            x.parent, x.start = len(nodes) - 1, h
            stack[-1] = len(nodes) - 1
        nodes.append(_Node(stack[-1] if stack else -1, h, len(s), k))
        stack.append(len(nodes) - 1)
        ends.append(len(nodes) - 1)
    return nodes, ends


def shared_row(trees: Sequence[Any], tree_indices: Sequence[int], min_tokens: int) -> dict[str, Any] | None:
    """The tensor fields of a ``learner.pack.MicroBatch`` holding ``trees`` with their common context stored once
    (see the module docstring), plus ``shared_tokens`` (tokens of the virtual segments); None if nothing is shared."""
    items, prefixes = _items(trees)
    lengths, strings = _shared_strings(prefixes, min_tokens)
    if not strings:
        return None
    virtual = _Virtual.of(strings)
    owners = {v: int(tree_indices[k]) for v, k in _node_owners(virtual, items, prefixes, lengths).items()}
    head = _virtual_fields(virtual, owners)
    parts = {name: [head[name]] for name in _TOKEN_FIELDS}
    cuts = _cuts(virtual, items, prefixes, lengths)
    n_virtual = len(virtual.nodes)
    n_segments = n_virtual + sum(t.num_segments for t in trees)
    ancestors = torch.zeros(n_segments, n_segments, dtype=torch.bool)  # (S_total, S_total)
    ancestors[:n_virtual, :n_virtual] = virtual.ancestors
    token_offset, segment_offset = virtual.tokens, n_virtual
    for k, (tree, index) in enumerate(zip(trees, tree_indices, strict=True)):
        placed = _Placed(tree, int(index), token_offset, segment_offset)
        token_offset += _append_tree(parts, ancestors, placed, cuts.get(k, []), virtual)
        segment_offset += tree.num_segments
    out: dict[str, Any] = {name: torch.cat(p) for name, p in parts.items()}
    out["segment_ancestors"] = ancestors
    out["shared_tokens"] = virtual.tokens
    return out


def _items(trees: Sequence[Any]) -> tuple[list[tuple[int, int, int]], list[Prefix]]:
    """Every root segment of the row's trees as (tree, root segment, first token of the root in its tree), and its
    shareable tokens (``root_prefixes``)."""
    items: list[tuple[int, int, int]] = []
    prefixes: list[Prefix] = []
    for k, tree in enumerate(trees):
        items += [(k, seg, start) for seg, start, _ in _roots(tree)]
        prefixes += root_prefixes(tree)
    return items, prefixes


@dataclass
class _Virtual:
    """The radix tree of a row's shared strings laid out as the row's first segments: node ``order[i]`` is virtual
    segment i, its tokens at packed indices [offset[v], offset[v] + length(v))."""

    strings: list[Prefix]  # sorted, distinct
    nodes: list[_Node]
    ends: list[int]  # string -> the node it ends at
    order: list[int]  # the nodes by depth (parents start shallower: topological)
    seg_of: dict[int, int]  # node -> its virtual segment id
    offset: dict[int, int]  # node -> packed index of its first token
    tokens: int  # tokens of all the virtual segments
    ancestors: torch.Tensor  # (V, V) bool, by virtual segment id

    @classmethod
    def of(cls, strings: list[Prefix]) -> _Virtual:
        nodes, ends = _radix_tree(strings)
        order = sorted(range(len(nodes)), key=lambda v: nodes[v].start)
        seg_of = {v: i for i, v in enumerate(order)}
        offset: dict[int, int] = {}
        tokens = 0
        for v in order:
            offset[v] = tokens
            tokens += nodes[v].end - nodes[v].start
        ancestors = torch.zeros(len(nodes), len(nodes), dtype=torch.bool)  # (V, V)
        for v in order:
            ancestors[seg_of[v], seg_of[v]] = True
            if nodes[v].parent >= 0:
                ancestors[seg_of[v]] |= ancestors[seg_of[nodes[v].parent]]
        return cls(strings, nodes, ends, order, seg_of, offset, tokens, ancestors)

    def length(self, v: int) -> int:
        return self.nodes[v].end - self.nodes[v].start

    def path_index(self, v: int) -> torch.Tensor:
        """(P,) packed indices of the radix path ending at node v, by depth: the shared copy of an item's P tokens."""
        parts = []
        while v != -1:
            parts.append(torch.arange(self.offset[v], self.offset[v] + self.length(v)))
            v = self.nodes[v].parent
        return torch.cat(parts[::-1])


def _node_owners(
    virtual: _Virtual, items: Sequence[tuple[int, int, int]], prefixes: Sequence[Prefix], lengths: Sequence[int]
) -> dict[int, int]:
    """Radix node -> the tree (position in the row) that owns its tokens: the first tree with an item through it."""
    first_item: dict[Prefix, int] = {}  # string -> the first item whose shared prefix it is
    for i, n in enumerate(lengths):
        if n:
            first_item.setdefault(prefixes[i][:n], i)
    owner: dict[int, int] = {}
    for s, v in enumerate(virtual.ends):
        tree_k = items[first_item[virtual.strings[s]]][0]
        while v != -1:
            owner[v] = min(owner.get(v, tree_k), tree_k)
            v = virtual.nodes[v].parent
    return owner


def _virtual_fields(virtual: _Virtual, owners: dict[int, int]) -> dict[str, torch.Tensor]:
    """The per-token fields of the virtual segments: their tokens, depths as positions, predictors (the previous
    token on the radix path), the owning rollout (``owners``: node -> rollout index); out of the loss, plain
    sampling."""
    ids: list[int] = []
    pred: list[int] = []
    owner: list[int] = []
    segment: list[int] = []
    for v in virtual.order:
        node, length = virtual.nodes[v], virtual.length(v)
        ids += virtual.strings[node.string][node.start : node.end]
        before = virtual.offset[node.parent] + virtual.length(node.parent) - 1 if node.parent >= 0 else -1
        pred += [before] + list(range(virtual.offset[v], virtual.offset[v] + length - 1))
        owner += [owners[v]] * length
        segment += [virtual.seg_of[v]] * length
    n = virtual.tokens
    return {
        "input_ids": torch.tensor(ids, dtype=torch.long),
        "position_ids": torch.cat([torch.arange(virtual.nodes[v].start, virtual.nodes[v].end) for v in virtual.order]),
        "predictor": torch.tensor(pred, dtype=torch.long),
        "loss_mask": torch.zeros(n, dtype=torch.bool),
        "rollout_logprobs": torch.zeros(n, dtype=torch.float32),
        "rollout_index": torch.tensor(owner, dtype=torch.long),
        "segment_ids": torch.tensor(segment, dtype=torch.long),
        "temperature": torch.ones(n, dtype=torch.float32),
        "top_p": torch.ones(n, dtype=torch.float32),
        "top_k": torch.zeros(n, dtype=torch.long),
    }


def _cuts(
    virtual: _Virtual, items: Sequence[tuple[int, int, int]], prefixes: Sequence[Prefix], lengths: Sequence[int]
) -> dict[int, list[tuple[int, int, int, int]]]:
    """Tree (position in the row) -> its shared roots as (root segment, first token, P, the radix node P ends at)."""
    string_of = {s: j for j, s in enumerate(virtual.strings)}
    cut: dict[int, list[tuple[int, int, int, int]]] = {}
    for (k, seg, start), p, n in zip(items, prefixes, lengths, strict=True):
        if n:
            cut.setdefault(k, []).append((seg, start, n, virtual.ends[string_of[p[:n]]]))
    return cut


@dataclass(frozen=True)
class _Placed:
    """A tree as it goes into the row: its rollout index, and where its tokens and segments start."""

    tree: Any
    index: int
    token_offset: int
    segment_offset: int


def _append_tree(
    parts: dict[str, list[torch.Tensor]],
    ancestors: torch.Tensor,
    placed: _Placed,
    cuts: Sequence[tuple[int, int, int, int]],
    virtual: _Virtual,
) -> int:
    """Append a tree's tokens less its shared roots' first P to ``parts``, its segments' ancestry (the virtual path
    above each shared root included) to ``ancestors`` (S_total, S_total); returns the tokens it kept."""
    tree, s0, n_virtual = placed.tree, placed.segment_offset, len(virtual.nodes)
    keep = torch.ones(tree.num_tokens, dtype=torch.bool)  # (L,)
    shared_copy = torch.full((tree.num_tokens,), -1, dtype=torch.long)  # (L,): packed index of a removed token
    ancestors[s0 : s0 + tree.num_segments, s0 : s0 + tree.num_segments] = tree.segment_ancestors
    for seg, start, n, end_node in cuts:
        keep[start : start + n] = False
        shared_copy[start : start + n] = virtual.path_index(end_node)
        under = tree.segment_ancestors[:, seg].nonzero(as_tuple=True)[0] + s0  # the root's subtree
        ancestors[under, :n_virtual] |= virtual.ancestors[virtual.seg_of[end_node]]
    # Where each token of the tree is now: its own new index if kept, else its shared copy's.
    moved = torch.where(keep, placed.token_offset + torch.cumsum(keep, 0) - 1, shared_copy)  # (L,)
    old_pred = tree.predictor[keep]  # (L_kept,)
    parts["predictor"].append(torch.where(old_pred >= 0, moved[old_pred.clamp(min=0)], old_pred))
    for name in ("input_ids", "position_ids", "loss_mask", "rollout_logprobs", "temperature", "top_p", "top_k"):
        parts[name].append(getattr(tree, name)[keep])
    parts["segment_ids"].append(tree.segment_ids[keep] + s0)
    kept = int(keep.sum())
    parts["rollout_index"].append(torch.full((kept,), placed.index, dtype=torch.long))
    return kept


# The per-token (T,) fields of a micro-batch row.
_TOKEN_FIELDS = (
    "input_ids",
    "position_ids",
    "predictor",
    "loss_mask",
    "rollout_logprobs",
    "rollout_index",
    "segment_ids",
    "temperature",
    "top_p",
    "top_k",
)


class _Row:
    """A row being filled: its items' shareable prefixes in sorted order and their neighbours' common prefixes."""

    def __init__(self) -> None:
        self.trees: list[int] = []
        self.ordered: list[Prefix] = []
        self.adjacent: list[int] = []
        self.raw = 0  # Σ tokens of its trees
        self.cost = 0  # its packed tokens after sharing

    def with_tree(self, prefixes: Sequence[Prefix]) -> tuple[list[Prefix], list[int]]:
        """(ordered, adjacent) once a tree with these root prefixes joins."""
        ordered, adjacent = list(self.ordered), list(self.adjacent)
        for p in prefixes:
            at = bisect.bisect_right(ordered, p)
            left = [common_prefix_len(ordered[at - 1], p)] if at else []
            right = [common_prefix_len(p, ordered[at])] if at < len(ordered) else []
            if left and right:  # between two items: their pair (adjacent[at - 1]) becomes two
                adjacent[at - 1 : at] = left + right
            else:  # first (a pair in front) or last (a pair at the end) or alone (none)
                adjacent[max(at - 1, 0) : max(at - 1, 0)] = left + right
            ordered.insert(at, p)
        return ordered, adjacent


def fill_rows(trees: Sequence[Any], token_budget: int, min_tokens: int) -> list[list[int]]:
    """Rows (lists of positions in ``trees``) for trees given longest first, each row's packed tokens after sharing
    within ``token_budget``: a tree goes to the row it adds the fewest tokens to (ties: the first), else a new row."""
    rows: list[_Row] = []
    for k, tree in enumerate(trees):
        n = int(tree.num_tokens)
        prefixes = root_prefixes(tree)
        best: tuple[int, _Row, list[Prefix], list[int], int] | None = None  # (tokens added, row, its new state)
        for row in [*rows, _Row()]:  # the existing rows, then a new one
            ordered, adjacent = row.with_tree(prefixes)
            cost = row.raw + n - _sorted_savings(adjacent, min_tokens)
            if (cost <= token_budget or not row.trees) and (best is None or cost - row.cost < best[0]):
                best = (cost - row.cost, row, ordered, adjacent, cost)
        assert best is not None  # a new row always takes the tree
        _, row, row.ordered, row.adjacent, row.cost = best
        if not row.trees:
            rows.append(row)
        row.trees.append(k)
        row.raw += n
    return [row.trees for row in rows]
