"""Cross-rollout prefix sharing (learner.prefix_share): exact layout on readable trees, the same logprobs, loss and
gradients as without sharing, fewer packed tokens, and trainable tokens never shared."""

from __future__ import annotations

import copy
import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch", reason="learner tests need torch (the 'ml' extra)")
transformers = pytest.importorskip("transformers", reason="learner tests need transformers (the 'ml' extra)")

from learner.forward import packed_logprobs  # noqa: E402
from learner.hparams import Hyperparams  # noqa: E402
from learner.pack import MicroBatch, pack_tree, pack_trees  # noqa: E402
from learner.prefix_share import (  # noqa: E402
    DEFAULT_MIN_TOKENS,
    fill_rows,
    root_prefixes,
    shared_lengths,
    shared_row,
    shared_savings,
)
from learner.step import ScoredTree, train_step  # noqa: E402
from learner.value import ValueHead  # noqa: E402
from tests.support.segments import Seg  # noqa: E402
from tests.support.tiny_model import tiny_model  # noqa: E402

VOCAB = 64
# As in tests/unit/test_pack.py: an untied head and a large init, so a wrong mask or position visibly moves logprobs.
PACK_MODEL = {
    "vocab_size": VOCAB,
    "initializer_range": 0.5,
    "tie_word_embeddings": False,
    "pad_token_id": None,
    "eos_token_id": None,
    "max_position_embeddings": 256,
}


def seg(index: int, parent: int, tokens: list[int], trainable: bool) -> Seg:
    lp = [-0.1 * (k + 1) for k in range(len(tokens))] if trainable else []
    return Seg(index, parent, tokens, trainable, lp)


@dataclass
class SampledSeg(Seg):
    """A segment with its call's sampling settings, as the assembler writes it."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0


def row(trees: list[list[Seg]], share: int) -> MicroBatch:
    return MicroBatch.from_trees([pack_tree(t) for t in trees], list(range(len(trees))), share_prefix_min=share)


# ---------------------------------------------------------------- layout on readable trees

SYS = [1, 2, 3, 4, 5, 6]  # a "system prompt" every tree starts with


def test_two_trees_share_their_common_root_prefix_once() -> None:
    a = [seg(0, -1, [*SYS, 7, 8], False), seg(1, 0, [20, 21], True)]
    b = [seg(0, -1, [*SYS, 9], False), seg(1, 0, [30, 31], True)]
    c = [seg(0, -1, SYS, False), seg(1, 0, [40], True)]  # the root is entirely the shared prefix
    mb = row([a, b, c], share=4)
    #                          virtual           | a: rest of root, gen | b: rest, gen | c: gen
    assert mb.input_ids.tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 20, 21, 9, 30, 31, 40]
    assert mb.position_ids.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 6, 7, 8, 6]
    assert mb.predictor.tolist() == [-1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 5, 10, 11, 5]
    assert mb.loss_mask.tolist() == [False] * 8 + [True, True, False, True, True, True]
    assert mb.rollout_logprobs.tolist() == pytest.approx([0] * 8 + [-0.1, -0.2, 0, -0.1, -0.2, -0.1])
    assert mb.rollout_index.tolist() == [0] * 10 + [1, 1, 1, 2]  # the virtual tokens: the first tree under them
    assert mb.tree_indices == (0, 1, 2) and mb.shared_tokens == 6
    v, a_, b_, c_ = [1] * 6, [1] * 6, [1] * 6, [1] * 6
    assert mb.attention_allowed().int().tolist() == [
        [1, 0, 0, 0, 0, 0] + [0] * 8,
        [1, 1, 0, 0, 0, 0] + [0] * 8,
        [1, 1, 1, 0, 0, 0] + [0] * 8,
        [1, 1, 1, 1, 0, 0] + [0] * 8,
        [1, 1, 1, 1, 1, 0] + [0] * 8,
        v + [0] * 8,
        a_ + [1, 0, 0, 0] + [0] * 4,  # 7
        a_ + [1, 1, 0, 0] + [0] * 4,  # 8
        a_ + [1, 1, 1, 0] + [0] * 4,  # 20
        a_ + [1, 1, 1, 1] + [0] * 4,  # 21
        b_ + [0] * 4 + [1, 0, 0, 0],  # 9: the shared copy and its own root, never tree a
        b_ + [0] * 4 + [1, 1, 0, 0],  # 30
        b_ + [0] * 4 + [1, 1, 1, 0],  # 31
        c_ + [0] * 4 + [0, 0, 0, 1],  # 40: its root is all shared (an empty segment now)
    ]
    # Without sharing, or below the minimum, or alone in the row: exactly the plain concatenation.
    plain = row([a, b, c], share=0)
    assert plain.num_tokens == mb.num_tokens + 6 * 2 and plain.shared_tokens == 0
    for share in (7, 0):
        same = row([a, b, c], share=share)
        assert same.input_ids.tolist() == plain.input_ids.tolist()
        assert same.predictor.tolist() == plain.predictor.tolist()
    assert shared_row([pack_tree(a)], [0], 4) is None


def test_dialects_and_groups_make_a_radix_tree_of_shared_segments() -> None:
    # Two dialects start with the same 2-token header; each has its system prompt; two groups of dialect A add their
    # user prompts. Readable ids: 1x header, 2x/3x system prompts, 4x/5x user prompts, 9x generated.
    head, sys_a, sys_b = [10, 11], [20, 21, 22, 23], [30, 31, 32, 33]
    user_1, user_2 = [40, 41, 42], [50, 51, 52]
    roots = [head + sys_a + user_1, head + sys_a + user_1, head + sys_a + user_2, head + sys_b + [60], head + sys_b]
    trees = [[seg(0, -1, r, False), seg(1, 0, [90 + k], True)] for k, r in enumerate(roots)]
    mb = row(trees, share=4)
    # Virtual segments by depth: header | A's system prompt, B's system prompt | group 1's user prompt.
    assert mb.input_ids.tolist()[: mb.shared_tokens] == [10, 11, 20, 21, 22, 23, 30, 31, 32, 33, 40, 41, 42]
    assert mb.position_ids.tolist()[: mb.shared_tokens] == [0, 1, 2, 3, 4, 5, 2, 3, 4, 5, 6, 7, 8]
    assert mb.predictor.tolist()[: mb.shared_tokens] == [-1, 0, 1, 2, 3, 4, 1, 6, 7, 8, 5, 10, 11]
    # Then each tree's unshared rest: (group 1 root: nothing) 90 | 91 | user_2 92 | 60 93 | 94
    assert mb.input_ids.tolist()[mb.shared_tokens :] == [90, 91, 50, 51, 52, 92, 60, 93, 94]
    assert mb.position_ids.tolist()[mb.shared_tokens :] == [9, 9, 6, 7, 8, 9, 6, 7, 6]
    assert mb.predictor.tolist()[mb.shared_tokens :] == [12, 12, 5, 15, 16, 17, 9, 19, 9]
    # Σ P - radix tokens: P = 9, 9, 6, 6, 6 (user_2's tree shares A's system prompt only); radix = 2 + 4 + 4 + 3
    plain = sum(len(r) + 1 for r in roots)
    assert mb.num_tokens == plain - (36 - 13) == plain - shared_savings([tuple(r) for r in roots], 4)
    assert shared_lengths([tuple(r) for r in roots], 4) == [9, 9, 6, 6, 6]
    assert shared_lengths([tuple(r) for r in roots], 7) == [9, 9, 0, 0, 0]


def test_trainable_tokens_are_never_shared() -> None:
    # A trainable root (a rollout whose first call had no prompt of its own) equal to the others' context keeps its
    # own copy: even its first token (no predictor, out of the loss) carries a rollout logprob.
    ctx = [seg(0, -1, [*SYS, 7], False), seg(1, 0, [20], True)]
    ctx2 = [seg(0, -1, [*SYS, 8], False), seg(1, 0, [21], True)]
    trainable_root = [seg(0, -1, [*SYS, 7], True)]
    assert root_prefixes(pack_tree(trainable_root)) == [()]
    mb = row([ctx, trainable_root, ctx2], share=4)
    assert mb.shared_tokens == 6 and mb.num_tokens == 2 + 7 + 2 + 6
    shared = torch.arange(mb.num_tokens) < mb.shared_tokens
    assert not bool(mb.loss_mask[shared].any())
    # Every trainable token of the plain row is still there, once, with its logprob and its own context.
    plain = row([ctx, trainable_root, ctx2], share=0)
    assert int(mb.loss_mask.sum()) == int(plain.loss_mask.sum()) == 1 + 6 + 1
    assert mb.input_ids[mb.loss_mask].tolist() == plain.input_ids[plain.loss_mask].tolist()
    assert mb.rollout_logprobs[mb.loss_mask].tolist() == plain.rollout_logprobs[plain.loss_mask].tolist()
    assert mb.rollout_index[mb.loss_mask].tolist() == plain.rollout_index[plain.loss_mask].tolist()
    # A context root is shareable whole; its trainable child is not part of it.
    mixed = pack_tree([seg(0, -1, [*SYS, 7], False), seg(1, 0, [8, 9], True)])
    assert root_prefixes(mixed) == [(*SYS, 7)]


def test_a_forest_tree_shares_between_its_own_roots_and_with_others() -> None:
    # A tree whose history was split at a compaction point: both roots start with the system prompt.
    forest = [seg(0, -1, [*SYS, 7], False), seg(1, 0, [20], True), seg(2, -1, [*SYS, 8], False), seg(3, 2, [21], True)]
    mb = row([forest], share=4)
    assert mb.input_ids.tolist() == [*SYS, 7, 20, 8, 21]
    assert mb.predictor.tolist() == [-1, 0, 1, 2, 3, 4, 5, 6, 5, 8]
    assert mb.position_ids.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 6, 7]
    allowed = mb.attention_allowed()
    assert not bool(allowed[8, 6]) and not bool(allowed[9, 7]) and bool(allowed[9, :6].all())


def test_savings_match_a_brute_force_trie_and_the_rows_built_on_random_roots() -> None:
    g = torch.Generator().manual_seed(11)
    for case in range(60):
        # Roots over a 3-letter alphabet from a few stems, so prefixes of every length are shared.
        stems = [
            torch.randint(1, 4, (int(torch.randint(0, 12, (1,), generator=g)),), generator=g).tolist() for _ in range(3)
        ]
        roots = [
            stems[int(torch.randint(0, 3, (1,), generator=g))]
            + torch.randint(1, 4, (int(torch.randint(0, 6, (1,), generator=g)),), generator=g).tolist()
            for _ in range(int(torch.randint(1, 7, (1,), generator=g)))
        ]
        min_tokens = case % 5
        prefixes = [tuple(r) for r in roots]
        lengths = shared_lengths(prefixes, min_tokens)
        for i, (p, n) in enumerate(zip(prefixes, lengths, strict=True)):  # the longest prefix shared with another
            others = [q for j, q in enumerate(prefixes) if j != i]
            best = max((k for k in range(len(p) + 1) for q in others if q[:k] == p[:k]), default=0)
            assert n == (best if best >= max(min_tokens, 1) else 0)
        trie = {p[:k] for p, n in zip(prefixes, lengths, strict=True) for k in range(1, n + 1)}
        assert shared_savings(prefixes, min_tokens) == sum(lengths) - len(trie), (roots, min_tokens)
        trees = [[seg(0, -1, r, False), seg(1, 0, [9], True)] for r in roots]
        plain = row(trees, share=0).num_tokens
        shared = row(trees, share=min_tokens) if min_tokens else row(trees, share=1)
        expected = shared_savings(prefixes, max(min_tokens, 1))
        assert plain - shared.num_tokens == expected and shared.shared_tokens == len(
            {
                p[:k]
                for p, n in zip(prefixes, shared_lengths(prefixes, max(min_tokens, 1)), strict=True)
                for k in range(1, n + 1)
            }
        )


# ---------------------------------------------------------------- bin packing


def chain(root: list[int], gen: list[int]) -> list[Seg]:
    return [seg(0, -1, root, False), seg(1, 0, gen, True)]


def test_rows_fill_by_tokens_after_sharing() -> None:
    sys_a, sys_b = list(range(1, 21)), list(range(21, 41))  # two 20-token system prompts
    trees = [chain(sys_a + [50 + k], [60 + k]) for k in range(4)] + [chain(sys_b + [70 + k], [80]) for k in range(3)]
    # 22 tokens each: without sharing 2 fit a 60-token row; with it a dialect's trees add 2 tokens each after one.
    off = pack_trees(trees, token_budget=60)
    on = pack_trees(trees, token_budget=60, share_prefix_min=DEFAULT_MIN_TOKENS)
    assert [mb.num_tokens for mb in off] == [44, 44, 44, 22]
    assert [(mb.tree_indices, mb.num_tokens) for mb in on] == [((0, 1, 2, 3, 4, 5, 6), 20 + 4 * 2 + 20 + 3 * 2)]
    # Budget 30: dialect a's four trees fill 28; the first of b (22 more) opens a row, which the rest of b join.
    on_small = pack_trees(trees, token_budget=30, share_prefix_min=DEFAULT_MIN_TOKENS)
    assert [(mb.tree_indices, mb.num_tokens) for mb in on_small] == [((0, 1, 2, 3), 28), ((4, 5, 6), 26)]
    # Trees that share nothing: first-fit decreasing exactly as without sharing.
    distinct = [chain(list(range(100 * k, 100 * k + 20)), [1]) for k in range(1, 6)]
    assert [mb.tree_indices for mb in pack_trees(distinct, 50, share_prefix_min=16)] == [
        mb.tree_indices for mb in pack_trees(distinct, 50)
    ]
    # fill_rows' bookkeeping matches the rows actually built.
    packed = [pack_tree(t) for t in trees]
    for rows in (fill_rows(packed, 30, 16), fill_rows(packed, 1000, 16)):
        for r in rows:
            mb = MicroBatch.from_trees([packed[k] for k in r], r, share_prefix_min=16)
            assert mb.num_tokens == sum(packed[k].num_tokens for k in r) - shared_savings(
                [p for k in r for p in root_prefixes(packed[k])], 16
            )


def test_trees_over_the_budget_keep_rows_of_their_own() -> None:
    sys_a = list(range(1, 21))
    long_chain = chain(sys_a + list(range(21, 45)), [60, 61])  # 46 tokens > budget: its own row, unshared
    branching = [seg(0, -1, sys_a + list(range(21, 40)), False), seg(1, 0, [62, 63], True), seg(2, 0, [64, 65], True)]
    small = [chain(sys_a + [50 + k], [70 + k]) for k in range(3)]
    trees = [long_chain, branching, *small]
    on = pack_trees(trees, token_budget=40, share_prefix_min=16)
    off = pack_trees(trees, token_budget=40)
    alone = [mb for mb in off if mb.tree_indices in ((0,), (1,))]
    assert len(alone) == 3  # the chain, and one row per path of the branching tree
    for a, b in zip(alone, on[:3], strict=True):
        assert a.input_ids.tolist() == b.input_ids.tolist() and b.shared_tokens == 0
    assert on[3].tree_indices == (2, 3, 4) and on[3].num_tokens == 20 + 3 * 2
    assert sum(mb.num_tokens for mb in off) - sum(mb.num_tokens for mb in on) == 20 * 2


# ---------------------------------------------------------------- against the model


def rand(g: torch.Generator, n: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


def model_trees(sampled: bool = False) -> list[list[Seg]]:
    """Rollouts of two dialects (common 2-token header, 24-token system prompts) in groups with their user prompts:
    chains, branches at the root and inside a turn, a root that is all shared, a compaction forest, a trainable
    root, and a sibling whose shared context ends inside another's user prompt."""
    g = torch.Generator().manual_seed(99)
    head = rand(g, 2)
    sys = {"a": head + rand(g, 24), "b": head + rand(g, 24)}
    user = [rand(g, 5) for _ in range(3)]
    make = SampledSeg if sampled else Seg
    settings = iter([{"temperature": 0.7}, {"top_p": 0.8}, {"top_k": 5}, {"temperature": 1.3, "top_p": 0.9}] * 20)

    def s(i: int, parent: int, tokens: list[int], trainable: bool) -> Seg:
        lp = [-0.5] * len(tokens) if trainable else []
        extra = next(settings) if sampled and trainable else {}
        return make(i, parent, tokens, trainable, lp, **extra)

    return [
        [
            s(0, -1, sys["a"] + user[0], False),
            s(1, 0, rand(g, 4), True),
            s(2, 1, rand(g, 3), False),
            s(3, 2, rand(g, 3), True),
        ],
        [s(0, -1, sys["a"] + user[0], False), s(1, 0, rand(g, 3), True), s(2, 0, rand(g, 5), True)],
        [
            s(0, -1, sys["a"] + user[1] + rand(g, 2), False),
            s(1, 0, rand(g, 3), True),
            s(2, 1, rand(g, 2), True),
            s(3, 1, rand(g, 2), False),
            s(4, 3, rand(g, 3), True),
        ],
        [s(0, -1, sys["b"] + user[2], False), s(1, 0, rand(g, 4), True)],
        [s(0, -1, sys["b"], False), s(1, 0, user[2][:3] + rand(g, 2), False), s(2, 1, rand(g, 3), True)],
        [
            s(0, -1, sys["b"] + user[2][:2], False),
            s(1, 0, rand(g, 3), True),
            s(2, -1, sys["b"] + rand(g, 3), False),
            s(3, 2, rand(g, 2), True),
        ],
        [s(0, -1, sys["a"][:20], True), s(1, 0, rand(g, 3), False), s(2, 1, rand(g, 2), True)],
        [s(0, -1, rand(g, 30), False), s(1, 0, rand(g, 3), True)],  # shares nothing
    ]


def trainable_by_rollout(rows: list[MicroBatch], logps: list[torch.Tensor]) -> dict[int, tuple[list[int], Any]]:
    """Per rollout: its trainable token ids and their logprobs, in row order (a tree's own order is kept)."""
    ids: dict[int, list[int]] = defaultdict(list)
    lps: dict[int, list[torch.Tensor]] = defaultdict(list)
    for mb, lp in zip(rows, logps, strict=True):
        for r in sorted(set(mb.rollout_index[mb.loss_mask].tolist())):
            sel = mb.loss_mask & (mb.rollout_index == r)
            ids[r] += mb.input_ids[sel].tolist()
            lps[r].append(lp[sel])
    return {r: (ids[r], torch.cat(lps[r])) for r in ids}


def per_path_reference(model: torch.nn.Module, tree: list[Seg]) -> tuple[list[int], torch.Tensor]:
    """Each trainable token (with a predictor) of a tree in segment order, logprob from a plain causal run of a
    root-to-leaf path through it."""
    children: dict[int, list[int]] = defaultdict(list)
    for x in tree:
        children[x.parent].append(x.index)
    found: dict[tuple[int, int], float] = {}

    def walk(i: int, path: list[int]) -> None:
        path = [*path, i]
        if not children.get(i):
            ids = torch.tensor([t for j in path for t in tree[j].tokens])[None]  # (1, n)
            with torch.no_grad():
                lp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)  # (n, V)
            k = 0
            for j in path:
                for m, token in enumerate(tree[j].tokens):
                    if tree[j].trainable and k > 0:
                        found[(j, m)] = float(lp[k - 1, token])
                    k += 1
        for c in children.get(i, []):
            walk(c, path)

    for root in children[-1]:
        walk(root, [])
    keys = sorted(found)
    return [tree[j].tokens[m] for j, m in keys], torch.tensor([found[key] for key in keys])


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_logprobs_with_sharing_equal_without_and_per_path(attn_implementation: str) -> None:
    model = tiny_model(0, attn_implementation, **PACK_MODEL)
    trees = model_trees()
    on = pack_trees(trees, token_budget=400, share_prefix_min=8)
    off = pack_trees(trees, token_budget=400)
    assert len(on) == len(off) == 1
    assert on[0].shared_tokens == 2 + 24 + 24 + 5 + 2  # header, both system prompts, user[0], user[2][:2]
    with torch.no_grad():
        got_on = trainable_by_rollout(on, [packed_logprobs(model, mb) for mb in on])
        got_off = trainable_by_rollout(off, [packed_logprobs(model, mb) for mb in off])
    assert sorted(got_on) == sorted(got_off) == list(range(len(trees)))
    for r, tree in enumerate(trees):
        ids_ref, lp_ref = per_path_reference(model, tree)
        assert got_on[r][0] == got_off[r][0] == ids_ref
        torch.testing.assert_close(got_on[r][1], lp_ref, atol=1e-5, rtol=0)
        torch.testing.assert_close(got_on[r][1], got_off[r][1], atol=1e-5, rtol=0)


def test_logprobs_under_sampling_settings_and_power_check() -> None:
    model = tiny_model(1, "eager", **PACK_MODEL)
    trees = model_trees(sampled=True)
    on = pack_trees(trees, token_budget=400, share_prefix_min=8)
    off = pack_trees(trees, token_budget=400)
    assert on[0].uses_top_k and on[0].uses_top_p and on[0].shared_tokens > 0
    with torch.no_grad():
        lp_on = [packed_logprobs(model, mb, only_trainable=True) for mb in on]
        lp_off = [packed_logprobs(model, mb, only_trainable=True) for mb in off]
        got_on, got_off = trainable_by_rollout(on, lp_on), trainable_by_rollout(off, lp_off)
        for r in got_off:
            assert got_on[r][0] == got_off[r][0]
            torch.testing.assert_close(got_on[r][1], got_off[r][1], atol=1e-5, rtol=0)
        # Power: shift the virtual tokens' positions by one and the trainable logprobs move.
        wrong = copy.copy(on[0])
        object.__setattr__(wrong, "position_ids", on[0].position_ids + (torch.arange(on[0].num_tokens) < 10))
        moved = packed_logprobs(model, wrong, only_trainable=True)
    assert float((moved - lp_on[0]).abs().max()) > 1e-3


def scored(trees: list[list[Seg]]) -> list[ScoredTree]:
    advantages = [1.0, -0.5, 0.7, -1.2, 0.3, -0.8, 0.9, 0.0]
    return [ScoredTree(t, advantages[k % 8], float(k % 2), "agentloop") for k, t in enumerate(trees)]


def step_on_copy(
    model: torch.nn.Module, trees: list[ScoredTree], config: Hyperparams, ppo: bool = False
) -> tuple[dict[str, float], list[torch.Tensor]]:
    """One train_step with SGD(lr=1) and no clipping on a copy of the model: (metrics, -gradient of every param)."""
    m = copy.deepcopy(model)
    head = ValueHead.for_model(m) if ppo else None
    if head is not None:
        with torch.no_grad():
            head.proj.weight.normal_(0, 0.1, generator=torch.Generator().manual_seed(3))  # the same head both ways
    params = list(m.parameters()) + (list(head.parameters()) if head is not None else [])
    before = [p.detach().clone() for p in params]
    metrics = train_step(m, torch.optim.SGD(params, lr=1.0), trees, config, head)
    return metrics, [p.detach() - b for p, b in zip(params, before, strict=True)]


@pytest.mark.parametrize(
    ("algorithm", "mini_batches", "aggregation"),
    [("grpo", 1, "seq_mean_token_mean"), ("grpo", 2, "token_mean"), ("ppo", 1, "seq_mean_token_mean")],
)
def test_learner_step_loss_and_gradients_equal_with_and_without_sharing(
    algorithm: str, mini_batches: int, aggregation: str
) -> None:
    model = tiny_model(2, "sdpa", **PACK_MODEL)
    trees = scored(model_trees(sampled=True))
    common = {
        "algorithm": algorithm,
        "mini_batches": mini_batches,
        "aggregation": aggregation,
        "max_grad_norm": 0.0,
        "token_budget": 400,
    }
    m_on, g_on = step_on_copy(model, trees, Hyperparams(**common, share_prefix_min=8), ppo=algorithm == "ppo")
    m_off, g_off = step_on_copy(model, trees, Hyperparams(**common, share_prefix_min=0), ppo=algorithm == "ppo")
    assert Hyperparams().share_prefix_min == DEFAULT_MIN_TOKENS > 0  # on by default
    assert m_on["trainable_tokens"] == m_off["trainable_tokens"] > 0
    assert m_on["tokens"] < m_off["tokens"]
    for key in ("loss", "policy_loss", "value_loss", "grad_norm", "update_kl", "entropy", "update_adv_dot"):
        if key in m_off:
            assert m_on[key] == pytest.approx(m_off[key], rel=1e-4, abs=1e-6), key
    assert any(float(g.abs().max()) > 1e-4 for g in g_off)  # the step did move the weights
    for a, b in zip(g_on, g_off, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_packed_tokens_drop_by_the_shared_length_times_trees_minus_one() -> None:
    g = torch.Generator().manual_seed(5)
    shared = rand(g, 40)
    trees = [chain(shared + [k] + rand(g, 2 + k), rand(g, 4)) for k in range(6)]  # [k]: they part right after it
    model = tiny_model(0, "sdpa", **PACK_MODEL)
    on = pack_trees(trees, token_budget=1000, share_prefix_min=16)
    off = pack_trees(trees, token_budget=1000)
    assert len(on) == len(off) == 1
    assert off[0].num_tokens - on[0].num_tokens == 40 * (6 - 1) and on[0].shared_tokens == 40
    with torch.no_grad():
        a = trainable_by_rollout(on, [packed_logprobs(model, on[0])])
        b = trainable_by_rollout(off, [packed_logprobs(model, off[0])])
    for r in range(6):
        torch.testing.assert_close(a[r][1], b[r][1], atol=1e-5, rtol=0)


# ---------------------------------------------------------------- real tokenizer, real agent-loop rollouts


@pytest.fixture(scope="module")
def real_rollouts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list]]:
    from transformers import AutoTokenizer

    from streams.tree import TreeCall, build_tree
    from tests.support.learner_data import small_model
    from warmstart.demos import build_episodes, train_tasks

    model_dir = small_model(tmp_path_factory.mktemp("tiny"))
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    trees = []
    for ep in build_episodes(tokenizer, train_tasks(2)):  # 2 tasks x 2 dialects, the real built-in loop
        calls = [
            TreeCall(
                call_id=f"c{i}",
                seq=i,
                parent_call_id=None,
                shared_prefix_len=0,
                new_tokens=p,
                generated_tokens=gen,
                logprobs=[-0.3] * len(gen),
                call_kind="main",
                policy_version=0,
            )
            for i, (p, gen) in enumerate(ep.turns)
        ]
        trees += [build_tree(calls).segments] * 2  # two rollouts of each task and dialect (greedy: the same)
    return model_dir, trees


def test_real_agent_loop_rollouts_share_their_dialects_system_prompt(real_rollouts: tuple[Path, list[list]]) -> None:
    from transformers import AutoModelForCausalLM

    from policy.token_prefix import common_prefix_len

    model_dir, trees = real_rollouts
    on = pack_trees(trees, token_budget=8192, share_prefix_min=DEFAULT_MIN_TOKENS)
    off = pack_trees(trees, token_budget=8192)
    assert len(on) == len(off) == 1
    # The radix tree: the dialects' common header, each dialect's system prompt + tools, each task's user prompt.
    roots = [list(t[0].tokens) for t in trees]  # order: task 0 openai x2, anthropic x2, task 1 openai x2, ...
    header = common_prefix_len(roots[0], roots[2])
    system = [common_prefix_len(roots[0], roots[4]), common_prefix_len(roots[2], roots[6])]
    assert min(system) > 400  # the ~434-token system prompt + tool schemas of the quickstart
    assert on[0].shared_tokens == header + sum(s - header for s in system) + sum(
        len(roots[k]) - system[(k // 2) % 2] for k in (0, 2, 4, 6)
    )
    saved = sum(len(r) for r in roots) - on[0].shared_tokens
    assert off[0].num_tokens - on[0].num_tokens == saved
    assert off[0].num_tokens / on[0].num_tokens > 2
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa").float().eval()
    with torch.no_grad():
        a = trainable_by_rollout(on, [packed_logprobs(model, on[0])])
        b = trainable_by_rollout(off, [packed_logprobs(model, off[0])])
    for r in range(len(trees)):
        assert a[r][0] == b[r][0]
        torch.testing.assert_close(a[r][1], b[r][1], atol=1e-5, rtol=0)
