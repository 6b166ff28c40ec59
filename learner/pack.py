"""Tree packing: one rollout's prefix tree of token segments -> one packed sequence with a tree attention mask.

The streams stage emits each rollout as a list of token *segments* in topological order (``parent < index``); every
shared prefix is stored once, and packing runs the whole tree in ONE forward pass (docs/method.md#tree-packing):

- tokens: the segments concatenated in list order (every ancestor's tokens come before a node's tokens);
- attention: token ``i`` attends to token ``j`` iff ``j`` lies on ``i``'s root path at or before ``i``;
- position ids: a token's depth on its root path, so RoPE sees the positions of the plain root-to-leaf sequence;
- predictor: the index of the token whose logits predict this one (-1 for a root's first token).

With that, ``log_softmax(logits[predictor[t]])[token[t]]`` equals the logprob of the root-to-leaf path run as a plain
causal sequence (1e-5 in fp32, tests/unit/test_pack.py). Every token also carries its call's sampling settings
(``learner.segment_sampling``; unknown ones are refused with ``UnreproducibleSampling``).

``pack_trees`` fills micro-batches (one unpadded row each, block-diagonal mask) up to a token budget by first-fit
decreasing; with ``share_prefix_min`` the context the trees of a row begin with is stored once
(``learner.prefix_share``); a tree over the budget gets chain rows of its own (``learner.tree_split``). Running a
model on the rows: ``learner.forward``. Pure torch, no Kafka.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from clawbase.errors import ClawstreamError
from learner.prefix_share import fill_rows, shared_row
from learner.segment_sampling import PLAIN_SAMPLING, UnreproducibleSampling, segment_sampling
from learner.tree_split import is_chain, split_into_paths

__all__ = [
    "MicroBatch",
    "PackError",
    "PackedTree",
    "SegmentLike",
    "additive_mask",
    "pack_tree",
    "pack_trees",
]


class PackError(ClawstreamError):
    """A tree cannot be packed: malformed segments, or a tree larger than the micro-batch token budget."""


@runtime_checkable
class SegmentLike(Protocol):
    """What packing reads from a segment (``streams.tree.Segment`` satisfies it; ``index`` is checked if present)."""

    @property
    def parent(self) -> int: ...

    @property
    def tokens(self) -> Sequence[int]: ...

    @property
    def trainable(self) -> bool: ...

    @property
    def logprobs(self) -> Sequence[float]: ...


# A tree is its list of segments, or any object carrying that list as ``.segments`` (e.g. a Trajectory-like record).
TreeLike = Sequence[SegmentLike] | Any


def _segments_of(tree: TreeLike) -> Sequence[SegmentLike]:
    segments = getattr(tree, "segments", tree)
    if not isinstance(segments, Sequence):
        raise PackError(f"a tree must be a sequence of segments or have .segments, got {type(tree).__name__}")
    return segments


@dataclass(frozen=True)
class PackedTree:
    """One tree flattened to L tokens, plus what is needed to build its attention mask.

    ``segment_ancestors[a, b]`` is True iff segment ``b`` is ``a`` or an ancestor of ``a``; with segments concatenated
    in topological order this (plus causality inside a segment) is the whole tree mask, stored in O(S^2) not O(L^2).
    """

    input_ids: torch.Tensor  # (L,) long
    position_ids: torch.Tensor  # (L,) long: depth on the token's root path
    predictor: torch.Tensor  # (L,) long: index (in this tree) of the token whose logits predict it, -1 for none
    loss_mask: torch.Tensor  # (L,) bool: trainable token with a predictor
    rollout_logprobs: torch.Tensor  # (L,) float32: inference-engine logprobs, 0.0 where not trainable
    segment_ids: torch.Tensor  # (L,) long: segment of each token
    segment_ancestors: torch.Tensor  # (S, S) bool
    # Each token's sampling settings (its call's for trainable tokens; 1, 1, 0 = plain for context)
    temperature: torch.Tensor  # (L,) float32
    top_p: torch.Tensor  # (L,) float32
    top_k: torch.Tensor  # (L,) long

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def num_segments(self) -> int:
        return int(self.segment_ancestors.shape[0])

    def attention_allowed(self) -> torch.Tensor:
        """(L, L) bool: True where token i may attend to token j."""
        return _tree_allowed(self.segment_ids, self.segment_ancestors)


def _tree_allowed(segment_ids: torch.Tensor, segment_ancestors: torch.Tensor) -> torch.Tensor:
    # segment_ids: (L,), segment_ancestors: (S, S) -> (L, L). Ancestor segments precede in the packed order, so the
    # causal term only matters inside a token's own segment (it cuts off the segment's later tokens).
    n = segment_ids.numel()
    same_path = segment_ancestors[segment_ids][:, segment_ids]  # (L, L)
    causal = torch.ones(n, n, dtype=torch.bool, device=segment_ids.device).tril_()  # (L, L)
    return same_path & causal


def pack_tree(tree: TreeLike) -> PackedTree:
    """Flatten one tree (segments in topological order) into a packed sequence; see the module docstring."""
    segments = _segments_of(tree)
    num_segments = len(segments)
    ids: list[torch.Tensor] = []
    positions: list[torch.Tensor] = []
    predictors: list[torch.Tensor] = []
    masks: list[torch.Tensor] = []
    logprobs: list[torch.Tensor] = []
    seg_ids: list[torch.Tensor] = []
    sampling: list[tuple[int, tuple[float, float, int]]] = []  # (tokens, settings) per segment
    # Per segment: depth after its last token, and the packed index of the last token on its root path (-1: none yet).
    end_depth = [0] * num_segments
    last_token = [-1] * num_segments
    ancestors = torch.zeros(num_segments, num_segments, dtype=torch.bool)  # (S, S)
    offset = 0
    for i, seg in enumerate(segments):
        declared = getattr(seg, "index", i)
        if declared != i:
            raise PackError(f"segment at position {i} says index={declared}; segments must be listed by index")
        parent = int(seg.parent)
        if not -1 <= parent < i:
            raise PackError(
                f"segment {i} has parent {parent}; parents must come first (topological order, -1 for a root)"
            )
        if isinstance(seg.tokens, bytes | bytearray | memoryview):
            # The Avro record packs tokens as int32 bytes; list(bytes) would silently yield byte values instead.
            raise PackError(f"segment {i} tokens are raw bytes; decode the packed int32 token ids first")
        tokens = torch.as_tensor(list(seg.tokens), dtype=torch.long)  # (n,)
        n = int(tokens.numel())
        base_depth = end_depth[parent] if parent >= 0 else 0
        before = last_token[parent] if parent >= 0 else -1
        if parent >= 0:
            ancestors[i] = ancestors[parent]
        ancestors[i, i] = True

        local = torch.arange(n, dtype=torch.long)  # (n,)
        predictor = offset + local - 1  # (n,): the previous packed token for all but the first
        if n:
            predictor[0] = before
        if seg.trainable:
            lp = list(seg.logprobs)
            if len(lp) != n:
                raise PackError(f"trainable segment {i} has {n} tokens but {len(lp)} logprobs")
            seg_lp = torch.as_tensor(lp, dtype=torch.float32)  # (n,)
            # A root's first token has no predictor: nothing to train on, whatever the segment says.
            seg_mask = predictor >= 0  # (n,)
            sampling.append((n, segment_sampling(seg, i)))
        else:
            seg_lp = torch.zeros(n, dtype=torch.float32)
            seg_mask = torch.zeros(n, dtype=torch.bool)
            sampling.append((n, PLAIN_SAMPLING))

        ids.append(tokens)
        positions.append(base_depth + local)
        predictors.append(predictor)
        masks.append(seg_mask)
        logprobs.append(seg_lp)
        seg_ids.append(torch.full((n,), i, dtype=torch.long))
        end_depth[i] = base_depth + n
        # An empty segment passes its parent's last token on, so its children are predicted from the right place.
        last_token[i] = offset + n - 1 if n else before
        offset += n

    def cat(parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return torch.cat(parts) if parts else torch.zeros(0, dtype=dtype)

    return PackedTree(
        input_ids=cat(ids, torch.long),
        position_ids=cat(positions, torch.long),
        predictor=cat(predictors, torch.long),
        loss_mask=cat(masks, torch.bool),
        rollout_logprobs=cat(logprobs, torch.float32),
        segment_ids=cat(seg_ids, torch.long),
        segment_ancestors=ancestors,
        **_sampling_tensors(sampling),
    )


def _sampling_tensors(runs: list[tuple[int, tuple[float, float, int]]]) -> dict[str, torch.Tensor]:
    """Per-token temperature (L,), top_p (L,), top_k (L,) from (token count, settings) runs."""
    counts = torch.tensor([n for n, _ in runs], dtype=torch.long)  # (S,)
    return {
        "temperature": torch.tensor([v[0] for _, v in runs], dtype=torch.float32).repeat_interleave(counts),
        "top_p": torch.tensor([v[1] for _, v in runs], dtype=torch.float32).repeat_interleave(counts),
        "top_k": torch.tensor([v[2] for _, v in runs], dtype=torch.long).repeat_interleave(counts),
    }


@dataclass(frozen=True)
class MicroBatch:
    """Several packed trees in one row of T tokens; trees only see themselves (block-diagonal mask).

    ``rollout_index[t]`` is the position, in the sequence given to ``pack_trees``, of the tree token ``t`` belongs
    to (a context token several trees share: the first of them): it indexes per-rollout advantages / returns in
    ``learner.losses``. A tree within the token budget is never split across micro-batches; one over it may be (one
    row per path), so per-rollout token counts are taken over all the rows of a step (``learner.step``).
    """

    input_ids: torch.Tensor  # (T,) long
    position_ids: torch.Tensor  # (T,) long
    predictor: torch.Tensor  # (T,) long: index within this micro-batch, -1 for none
    loss_mask: torch.Tensor  # (T,) bool
    rollout_logprobs: torch.Tensor  # (T,) float32
    rollout_index: torch.Tensor  # (T,) long
    segment_ids: torch.Tensor  # (T,) long: segment ids made unique across the trees of the row
    segment_ancestors: torch.Tensor  # (S_total, S_total) bool, block-diagonal over trees
    temperature: torch.Tensor  # (T,) float32: each token's sampling temperature
    top_p: torch.Tensor  # (T,) float32 (1 = off)
    top_k: torch.Tensor  # (T,) long (0 = off)
    tree_indices: tuple[int, ...]  # the trees in this row, in row order
    # Known on the host when the row is built, so computing logprobs needs no device sync to skip the (K, V) sorts.
    uses_top_k: bool = False
    uses_top_p: bool = False
    shared_tokens: int = 0  # tokens of the virtual segments the row's trees share (learner.prefix_share)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def is_chain(self) -> bool:
        """One chain of segments (an append-only rollout alone in its row): its tree mask is the causal mask."""
        anc = self.segment_ancestors  # (S, S)
        return bool(torch.equal(anc, torch.ones_like(anc).tril()))

    @classmethod
    def from_trees(
        cls, trees: Sequence[PackedTree], tree_indices: Sequence[int], *, share_prefix_min: int = 0
    ) -> MicroBatch:
        """Concatenate packed trees into one row; ``tree_indices[k]`` is the rollout index of ``trees[k]``.

        ``share_prefix_min > 0``: root context the trees have in common (at least that many tokens) is stored once."""
        if len(trees) != len(tree_indices):
            raise PackError(f"{len(trees)} trees but {len(tree_indices)} tree indices")
        indices = tuple(int(i) for i in tree_indices)
        uses_top_k = any(bool((t.top_k > 0).any()) for t in trees)
        uses_top_p = any(bool((t.top_p < 1).any()) for t in trees)
        shared = shared_row(trees, tree_indices, share_prefix_min) if share_prefix_min > 0 else None
        if shared is not None:
            return cls(**shared, tree_indices=indices, uses_top_k=uses_top_k, uses_top_p=uses_top_p)
        token_offset = 0
        segment_offset = 0
        predictors: list[torch.Tensor] = []
        seg_ids: list[torch.Tensor] = []
        rollout: list[torch.Tensor] = []
        for tree, index in zip(trees, tree_indices, strict=True):
            predictors.append(torch.where(tree.predictor >= 0, tree.predictor + token_offset, tree.predictor))
            seg_ids.append(tree.segment_ids + segment_offset)
            rollout.append(torch.full((tree.num_tokens,), int(index), dtype=torch.long))
            token_offset += tree.num_tokens
            segment_offset += tree.num_segments
        ancestors = torch.zeros(segment_offset, segment_offset, dtype=torch.bool)  # (S_total, S_total)
        start = 0
        for tree in trees:
            s = tree.num_segments
            ancestors[start : start + s, start : start + s] = tree.segment_ancestors
            start += s

        def cat(parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
            return torch.cat(parts) if parts else torch.zeros(0, dtype=dtype)

        return cls(
            input_ids=cat([t.input_ids for t in trees], torch.long),
            position_ids=cat([t.position_ids for t in trees], torch.long),
            predictor=cat(predictors, torch.long),
            loss_mask=cat([t.loss_mask for t in trees], torch.bool),
            rollout_logprobs=cat([t.rollout_logprobs for t in trees], torch.float32),
            rollout_index=cat(rollout, torch.long),
            segment_ids=cat(seg_ids, torch.long),
            segment_ancestors=ancestors,
            temperature=cat([t.temperature for t in trees], torch.float32),
            top_p=cat([t.top_p for t in trees], torch.float32),
            top_k=cat([t.top_k for t in trees], torch.long),
            tree_indices=indices,
            uses_top_k=uses_top_k,
            uses_top_p=uses_top_p,
        )

    def attention_allowed(self) -> torch.Tensor:
        """(T, T) bool: True where token i may attend to token j (tree mask, block-diagonal over trees)."""
        return _tree_allowed(self.segment_ids, self.segment_ancestors)

    def attention_mask(
        self, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
    ) -> torch.Tensor:
        """(1, 1, T, T) additive float mask for a HF causal LM: 0 allowed, ``finfo(dtype).min`` disallowed."""
        return additive_mask(self.attention_allowed(), dtype=dtype, device=device)[None, None]

    def to(self, device: torch.device | str) -> MicroBatch:
        """The same micro-batch with every tensor on ``device``."""
        moved = {
            name: getattr(self, name).to(device)
            for name in (
                "input_ids",
                "position_ids",
                "predictor",
                "loss_mask",
                "rollout_logprobs",
                "rollout_index",
                "segment_ids",
                "segment_ancestors",
                "temperature",
                "top_p",
                "top_k",
            )
        }
        return MicroBatch(
            **moved,
            tree_indices=self.tree_indices,
            uses_top_k=self.uses_top_k,
            uses_top_p=self.uses_top_p,
            shared_tokens=self.shared_tokens,
        )


def additive_mask(
    allowed: torch.Tensor, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
) -> torch.Tensor:
    """Bool mask (..., T, T) -> additive float mask of the same shape: 0 where allowed, finfo(dtype).min elsewhere."""
    allowed = allowed.to(device) if device is not None else allowed
    out = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return out.masked_fill_(~allowed, torch.finfo(dtype).min)


def pack_trees(
    trees: Sequence[TreeLike], token_budget: int, max_path_tokens: int | None = None, *, share_prefix_min: int = 0
) -> list[MicroBatch]:
    """Pack trees into micro-batches of at most ``token_budget`` tokens each, by first-fit decreasing.

    Trees are taken longest first (ties by input order, so the result is deterministic) and each goes into the first
    micro-batch with room, else a new one. A tree longer than the budget gets rows of its own, without a dense mask:
    itself when it is a chain, else one chain per root-to-leaf path (``learner.tree_split``); a path longer than
    ``max_path_tokens`` (the model's context, or a memory bound) is an error, never silently dropped.
    ``share_prefix_min > 0``: the trees of a row store the root context they have in common once, and a tree goes
    to the row it adds the fewest tokens to after that (``learner.prefix_share.fill_rows``).
    """
    if token_budget <= 0:
        raise PackError(f"token_budget must be positive, got {token_budget}")
    packed: list[PackedTree] = []  # rows that share micro-batches, then rows that go alone
    owner: list[int] = []  # the input tree each packed entry belongs to (its rollout index)
    alone: list[int] = []
    for i, tree in enumerate(trees):
        try:
            whole = pack_tree(tree)
            if whole.num_tokens <= token_budget:
                packed.append(whole)
                owner.append(i)
                continue
            segments = _segments_of(tree)
            rows = [whole] if is_chain(segments) else [pack_tree(p) for p in split_into_paths(segments)]
            for row in rows:
                if max_path_tokens is not None and row.num_tokens > max_path_tokens:
                    raise PackError(
                        f"a root-to-leaf path of {row.num_tokens} tokens is longer than the "
                        f"{max_path_tokens} a row may hold (max_path_tokens, at most the model's context)"
                    )
                alone.append(len(packed))
                packed.append(row)
                owner.append(i)
        except (PackError, UnreproducibleSampling) as exc:  # say which tree of the batch
            raise type(exc)(f"tree {i}: {exc}") from exc
    on_own = set(alone)
    together = [k for k in range(len(packed)) if k not in on_own]
    order = sorted(together, key=lambda k: (-packed[k].num_tokens, k))
    bins: list[list[int]] = [[k] for k in sorted(alone, key=lambda k: (-packed[k].num_tokens, k))]
    if share_prefix_min > 0:  # rows of their own are chains without a dense mask: never shared
        bins += [
            [order[j] for j in row] for row in fill_rows([packed[k] for k in order], token_budget, share_prefix_min)
        ]
        return [
            MicroBatch.from_trees(
                [packed[k] for k in b],
                [owner[k] for k in b],
                share_prefix_min=share_prefix_min if len(b) > 1 or b[0] not in on_own else 0,
            )
            for b in bins
        ]
    loads: list[int] = [token_budget] * len(bins)  # full: nothing joins a row of its own
    for k in order:
        n = packed[k].num_tokens
        for b, load in enumerate(loads):
            if load + n <= token_budget:
                bins[b].append(k)
                loads[b] += n
                break
        else:
            bins.append([k])
            loads.append(n)
    return [MicroBatch.from_trees([packed[k] for k in b], [owner[k] for k in b]) for b in bins]
