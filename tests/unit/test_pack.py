"""Tree packing: exact mask / positions / predictors on a readable tree, and packed logprobs == per-path logprobs."""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch", reason="learner tests need torch (the 'ml' extra)")
transformers = pytest.importorskip("transformers", reason="learner tests need transformers (the 'ml' extra)")

from learner.forward import gather_token_logprobs, packed_forward, packed_logprobs  # noqa: E402
from learner.pack import MicroBatch, PackError, additive_mask, pack_tree, pack_trees  # noqa: E402
from tests.support.segments import Seg  # noqa: E402
from tests.support.tiny_model import tiny_model  # noqa: E402

VOCAB = 64
# The packing checks' tiny model: its own vocabulary, an untied head, no pad row, and a large init so attention is far
# from uniform and a wrong mask or position visibly changes the logprobs.
PACK_MODEL = {
    "vocab_size": VOCAB,
    "initializer_range": 0.5,
    "tie_word_embeddings": False,
    "pad_token_id": None,
    "eos_token_id": None,
    "max_position_embeddings": 256,
}


def seg(index: int, parent: int, tokens: list[int], trainable: bool) -> Seg:
    # Placeholder rollout logprobs; the model test compares model logprobs, not these.
    lp = [-0.1 * (k + 1) for k in range(len(tokens))] if trainable else []
    return Seg(index, parent, tokens, trainable, lp)


def small_tree() -> list[Seg]:
    # seg0 prompt [10 11 12] -> seg1 generated [20 21] -> seg2 tool output [30]
    #                        -> seg3 generated [40 41]   (a retry branch at the root)
    return [
        seg(0, -1, [10, 11, 12], False),
        seg(1, 0, [20, 21], True),
        seg(2, 1, [30], False),
        seg(3, 0, [40, 41], True),
    ]


def test_small_tree_exact_layout() -> None:
    p = pack_tree(small_tree())
    assert p.input_ids.tolist() == [10, 11, 12, 20, 21, 30, 40, 41]
    assert p.position_ids.tolist() == [0, 1, 2, 3, 4, 5, 3, 4]
    assert p.predictor.tolist() == [-1, 0, 1, 2, 3, 4, 2, 6]
    assert p.loss_mask.tolist() == [False, False, False, True, True, False, True, True]
    assert p.rollout_logprobs.tolist() == pytest.approx([0, 0, 0, -0.1, -0.2, 0, -0.1, -0.2])
    expected = [
        [1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 1, 1, 0, 0],
        [1, 1, 1, 0, 0, 0, 1, 0],
        [1, 1, 1, 0, 0, 0, 1, 1],
    ]
    assert p.attention_allowed().int().tolist() == expected

    mb = MicroBatch.from_trees([p], [0])
    mask = mb.attention_mask(dtype=torch.float32)
    assert mask.shape == (1, 1, 8, 8)
    allowed = torch.tensor(expected, dtype=torch.bool)
    assert bool((mask[0, 0][allowed] == 0).all())
    assert bool((mask[0, 0][~allowed] == torch.finfo(torch.float32).min).all())


def test_two_trees_block_diagonal_and_index_shift() -> None:
    a = [seg(0, -1, [1, 2], False), seg(1, 0, [3], True)]
    b = [seg(0, -1, [5], True), seg(1, 0, [6, 7], True), seg(2, 0, [8], True)]
    mb = MicroBatch.from_trees([pack_tree(a), pack_tree(b)], [4, 2])
    assert mb.input_ids.tolist() == [1, 2, 3, 5, 6, 7, 8]
    assert mb.position_ids.tolist() == [0, 1, 2, 0, 1, 2, 1]
    assert mb.predictor.tolist() == [-1, 0, 1, -1, 3, 4, 3]
    # A trainable root's first token has no predictor, so it is not trainable.
    assert mb.loss_mask.tolist() == [False, False, True, False, True, True, True]
    assert mb.rollout_index.tolist() == [4, 4, 4, 2, 2, 2, 2]
    assert mb.tree_indices == (4, 2)
    assert mb.attention_allowed().int().tolist() == [
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0],
        [0, 0, 0, 1, 0, 0, 0],
        [0, 0, 0, 1, 1, 0, 0],
        [0, 0, 0, 1, 1, 1, 0],
        [0, 0, 0, 1, 0, 0, 1],
    ]


def test_empty_segment_passes_predictor_and_depth_through() -> None:
    tree = [seg(0, -1, [1, 2], False), seg(1, 0, [], False), seg(2, 1, [3, 4], True)]
    p = pack_tree(tree)
    assert p.input_ids.tolist() == [1, 2, 3, 4]
    assert p.position_ids.tolist() == [0, 1, 2, 3]
    assert p.predictor.tolist() == [-1, 0, 1, 2]
    assert p.attention_allowed().int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]


def test_tree_with_segments_attribute_and_malformed_trees() -> None:
    @dataclass
    class Tree:
        segments: list[Seg]

    assert pack_tree(Tree(small_tree())).num_tokens == 8
    with pytest.raises(PackError, match="parent"):
        pack_tree([seg(0, -1, [1], False), seg(1, 2, [2], False), seg(2, 0, [3], False)])
    with pytest.raises(PackError, match="logprobs"):
        pack_tree([seg(0, -1, [1], False), Seg(1, 0, [2, 3], True, [-0.5])])
    with pytest.raises(PackError, match="raw bytes"):
        pack_tree([Seg(0, -1, b"\x01\x00\x00\x00", False)])  # type: ignore[arg-type]
    with pytest.raises(PackError, match="index"):
        pack_tree([seg(0, -1, [1], False), seg(5, 0, [2], False)])


def tree_of(n: int) -> list[Seg]:
    return [seg(0, -1, list(range(1, n + 1)), False)]


def test_budget_packing_first_fit_decreasing() -> None:
    sizes = [4, 7, 3, 5, 2, 6]
    batches = pack_trees([tree_of(n) for n in sizes], token_budget=10)
    # Decreasing: 7 -> [7]; 6 -> [6]; 5 -> [5]; 4 -> [6,4]; 3 -> [7,3]; 2 -> [5,2].
    assert [mb.tree_indices for mb in batches] == [(1, 2), (5, 0), (3, 4)]
    assert [mb.num_tokens for mb in batches] == [10, 10, 7]
    assert all(mb.num_tokens <= 10 for mb in batches)
    assert sorted(i for mb in batches for i in mb.tree_indices) == list(range(len(sizes)))
    # Exactly the budget fits.
    assert [mb.tree_indices for mb in pack_trees([tree_of(10)], token_budget=10)] == [(0,)]


def test_a_tree_over_the_budget_gets_rows_of_its_own_and_a_path_over_the_limit_is_refused() -> None:
    # A chain of 11 > 10 tokens: one row of its own (no dense mask needed), the small trees share the others.
    batches = pack_trees([tree_of(3), tree_of(11), tree_of(4)], token_budget=10)
    assert [(mb.tree_indices, mb.num_tokens) for mb in batches] == [((1,), 11), ((2, 0), 7)]
    branching = [seg(0, -1, list(range(1, 7)), False), seg(1, 0, [7, 8, 9], True), seg(2, 0, [10, 11, 12], True)]
    batches = pack_trees([branching], token_budget=10)  # 12 tokens: one chain row per path
    assert [(mb.tree_indices, mb.input_ids.tolist()) for mb in batches] == [
        ((0,), [1, 2, 3, 4, 5, 6, 7, 8, 9]),
        ((0,), [1, 2, 3, 4, 5, 6, 10, 11, 12]),
    ]
    with pytest.raises(PackError, match=r"tree 1: a root-to-leaf path of 11 tokens is longer than the 10"):
        pack_trees([tree_of(3), tree_of(11)], token_budget=8, max_path_tokens=10)
    with pytest.raises(PackError, match="positive"):
        pack_trees([tree_of(3)], token_budget=0)


# ---------------------------------------------------------------- model checks


def rand_tokens(gen: torch.Generator, n: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=gen).tolist()


def random_trees() -> dict[str, list[Seg]]:
    g = torch.Generator().manual_seed(1234)
    return {
        # prompt -> gen -> tool -> gen: a chain (one path)
        "chain": [
            seg(0, -1, rand_tokens(g, 6), False),
            seg(1, 0, rand_tokens(g, 5), True),
            seg(2, 1, rand_tokens(g, 4), False),
            seg(3, 2, rand_tokens(g, 3), True),
        ],
        # two calls branch right after the prompt (retry of the first turn)
        "root_branch": [
            seg(0, -1, rand_tokens(g, 5), False),
            seg(1, 0, rand_tokens(g, 4), True),
            seg(2, 0, rand_tokens(g, 6), True),
            seg(3, 2, rand_tokens(g, 3), False),
        ],
        # a generated turn split where two later requests diverge inside it; depth 5
        "mid_generated_branch": [
            seg(0, -1, rand_tokens(g, 4), False),
            seg(1, 0, rand_tokens(g, 3), True),  # shared head of a generated turn
            seg(2, 1, rand_tokens(g, 2), True),  # its tail as generated
            seg(3, 1, rand_tokens(g, 2), False),  # a re-encoded tail (environment text) on another branch
            seg(4, 2, rand_tokens(g, 3), False),  # tool output
            seg(5, 4, rand_tokens(g, 4), True),
            seg(6, 3, rand_tokens(g, 3), True),
            seg(7, 4, rand_tokens(g, 2), True),  # a third branch under the tool output
        ],
        # two roots (history split at a compaction point) and a trainable root
        "forest": [
            seg(0, -1, rand_tokens(g, 4), False),
            seg(1, 0, rand_tokens(g, 3), True),
            seg(2, -1, rand_tokens(g, 3), True),
            seg(3, 2, rand_tokens(g, 2), False),
            seg(4, 3, rand_tokens(g, 3), True),
        ],
    }


def root_paths(tree: list[Seg]) -> list[list[int]]:
    """Every root-to-leaf path as a list of segment indices."""
    children: dict[int, list[int]] = {}
    for s in tree:
        children.setdefault(s.parent, []).append(s.index)
    paths: list[list[int]] = []

    def walk(i: int, path: list[int]) -> None:
        path = [*path, i]
        if i not in children:
            paths.append(path)
        for c in children.get(i, []):
            walk(c, path)

    for root in children[-1]:
        walk(root, [])
    return paths


def path_logprobs(model: torch.nn.Module, tree: list[Seg]) -> list[tuple[list[int], torch.Tensor]]:
    """For each root-to-leaf path: (packed index of each path token, its logprob from a plain causal run)."""
    starts: list[int] = []
    offset = 0
    for s in tree:
        starts.append(offset)
        offset += len(s.tokens)
    out = []
    for path in root_paths(tree):
        packed_idx = [starts[i] + k for i in path for k in range(len(tree[i].tokens))]
        ids = torch.tensor([t for i in path for t in tree[i].tokens])[None]  # (1, n)
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0]  # (n, V)
        lp = torch.log_softmax(logits[:-1].float(), dim=-1).gather(-1, ids[0, 1:, None])[:, 0]  # (n-1,)
        out.append((packed_idx[1:], lp))
    return out


def check_against_paths(model: torch.nn.Module, mb: MicroBatch, trees: dict[int, list[Seg]]) -> int:
    with torch.no_grad():
        packed = packed_logprobs(model, mb)  # (T,)
    token_offset = {}
    offset = 0
    for ti in mb.tree_indices:
        token_offset[ti] = offset
        offset += sum(len(s.tokens) for s in trees[ti])
    checked = 0
    for ti in mb.tree_indices:
        for idx, lp in path_logprobs(model, trees[ti]):
            got = packed[torch.tensor(idx) + token_offset[ti]]
            torch.testing.assert_close(got, lp, atol=1e-5, rtol=0)
            checked += len(idx)
    return checked


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_packed_logprobs_equal_per_path_logprobs(attn_implementation: str) -> None:
    model = tiny_model(0, attn_implementation, **PACK_MODEL)
    trees = random_trees()
    for tree in trees.values():
        mb = MicroBatch.from_trees([pack_tree(tree)], [0])
        assert check_against_paths(model, mb, {0: tree}) > 0


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_several_trees_in_one_micro_batch(attn_implementation: str) -> None:
    model = tiny_model(0, attn_implementation, **PACK_MODEL)
    by_index = dict(enumerate(random_trees().values()))
    batches = pack_trees([by_index[i] for i in range(len(by_index))], token_budget=60)
    assert any(len(mb.tree_indices) >= 2 for mb in batches)
    total = sum(check_against_paths(model, mb, by_index) for mb in batches)
    assert total > 0


def test_wrong_mask_would_be_caught() -> None:
    # Power check: a plain causal mask over the packed row (siblings see each other) changes branch logprobs.
    model = tiny_model(0, "sdpa", **PACK_MODEL)
    mb = MicroBatch.from_trees([pack_tree(random_trees()["root_branch"])], [0])
    with torch.no_grad():
        right = packed_logprobs(model, mb)
        causal = torch.ones(mb.num_tokens, mb.num_tokens, dtype=torch.bool).tril()
        logits = model(
            input_ids=mb.input_ids[None],
            attention_mask=additive_mask(causal)[None, None],
            position_ids=mb.position_ids[None],
        ).logits
    wrong = gather_token_logprobs(logits, mb)
    assert (right - wrong).abs().max() > 1e-3


def test_only_trainable_gradients_and_refusals() -> None:
    model = tiny_model(0, "eager", **PACK_MODEL)
    mb = MicroBatch.from_trees([pack_tree(random_trees()["mid_generated_branch"])], [0])
    lp = packed_logprobs(model, mb, only_trainable=True)
    assert bool((lp[~mb.loss_mask] == 0).all())
    assert bool((lp[mb.loss_mask] < 0).all())
    lp[mb.loss_mask].sum().backward()
    assert model.model.embed_tokens.weight.grad is not None

    with torch.no_grad():
        full = packed_logprobs(model, mb)
    torch.testing.assert_close(full[mb.loss_mask], lp.detach()[mb.loss_mask], atol=1e-6, rtol=0)

    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(PackError, match="4D mask"):
        packed_forward(model, mb)


# ---------------------------------------------------------------- sampling settings (issue 17 part 5)


@dataclass
class SampledSeg(Seg):
    """A segment as the assembler writes it: its call's sampling settings (None: recorded without them)."""

    temperature: float | None = 1.0
    top_p: float | None = 1.0
    top_k: int | None = 0
    call_id: str | None = None


def sampled_tree(g: torch.Generator) -> list[SampledSeg]:
    # prompt -> gen (T 0.5) -> tool -> gen (T 0.7, top_p 0.6); a retry at the root (T 1.0, top_k 3); a greedy turn
    def s(i: int, parent: int, n: int, trainable: bool, **sampling: float) -> SampledSeg:
        lp = [-0.1] * n if trainable else []
        return SampledSeg(i, parent, rand_tokens(g, n), trainable, lp, **sampling)

    return [
        s(0, -1, 5, False),
        s(1, 0, 4, True, temperature=0.5),
        s(2, 1, 3, False),
        s(3, 2, 4, True, temperature=0.7, top_p=0.6),
        s(4, 0, 5, True, temperature=1.0, top_k=3),
        s(5, 4, 3, True, temperature=0.0),  # greedy: the engine reports the model's own (T = 1) logprob
    ]


def test_logprobs_use_each_tokens_own_sampling_settings_as_the_engine_does() -> None:
    from policy.sampling import processed_logprobs

    model = tiny_model(0, "eager", **PACK_MODEL)
    tree = sampled_tree(torch.Generator().manual_seed(7))
    mb = MicroBatch.from_trees([pack_tree(tree)], [0])
    assert mb.uses_top_k and mb.uses_top_p
    with torch.no_grad():
        got = packed_logprobs(model, mb, only_trainable=True)
        plain = packed_logprobs(
            model,
            MicroBatch.from_trees(
                [
                    pack_tree(
                        [
                            Seg(**{k: getattr(x, k) for k in ("index", "parent", "tokens", "trainable", "logprobs")})
                            for x in tree
                        ]
                    )
                ],
                [0],
            ),
            only_trainable=True,
        )
    starts = [0]
    for x in tree:
        starts.append(starts[-1] + len(x.tokens))
    checked = 0
    for path in root_paths(tree):
        ids = torch.tensor([t for i in path for t in tree[i].tokens])[None]  # (1, n)
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0]  # (n, V)
        k = 0
        for i in path:
            seg_ = tree[i]
            for j, token in enumerate(seg_.tokens):
                if seg_.trainable and k > 0:
                    ref = processed_logprobs(  # the engine's own maths, on the plain causal run of the path
                        logits[k - 1 : k],
                        torch.tensor([seg_.temperature]),
                        torch.tensor([seg_.top_k]) if seg_.top_k else None,
                        torch.tensor([seg_.top_p]) if seg_.top_p < 1 else None,
                    )[0, token].clamp(min=-9999.0)
                    torch.testing.assert_close(got[starts[i] + j], ref, atol=1e-5, rtol=0)
                    checked += 1
                k += 1
    assert checked == sum(len(x.tokens) for x in tree if x.trainable)
    # The settings matter: at temperature 1 without filters, the non-plain segments' logprobs differ.
    differs = [bool((got - plain)[starts[i] : starts[i + 1]].abs().max() > 1e-4) for i in (1, 3, 4)]
    assert differs == [True, True, True]
    # Segment 5 is greedy: the model's own distribution, like a plain segment.
    torch.testing.assert_close(got[starts[5] : starts[6]], plain[starts[5] : starts[6]], atol=1e-6, rtol=0)


def test_a_token_outside_the_top_k_support_is_floored_with_zero_gradient() -> None:
    from learner.forward import MIN_LOGPROB

    model = tiny_model(0, "eager", **PACK_MODEL)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[5, 6, 7]])).logits[0, -1]  # (V,) predicts the next token
    least = int(logits.argmin())  # never in a top-1 support
    tree = [SampledSeg(0, -1, [5, 6, 7], False, []), SampledSeg(1, 0, [least], True, [-0.5], top_k=1)]
    mb = MicroBatch.from_trees([pack_tree(tree)], [0])
    lp = packed_logprobs(model, mb, only_trainable=True)
    assert float(lp[3].detach()) == MIN_LOGPROB
    lp.sum().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(bool(torch.isfinite(g).all()) for g in grads)


def test_unrecorded_or_impossible_sampling_settings_are_refused_with_the_reason() -> None:
    from learner.segment_sampling import UnreproducibleSampling

    base = [SampledSeg(0, -1, [1, 2], False, [], temperature=None, top_p=None, top_k=None)]  # context: settings unused
    pack_tree([*base, SampledSeg(1, 0, [3], True, [-0.1])])
    unrecorded = [*base, SampledSeg(1, 0, [3], True, [-0.1], temperature=None, top_p=None, top_k=None, call_id="c-7")]
    with pytest.raises(UnreproducibleSampling, match=r"tree 1: trainable segment 1 \(call c-7\) carries no sampling"):
        pack_trees([small_tree(), unrecorded], token_budget=64)
    for bad in ({"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -1}):
        with pytest.raises(UnreproducibleSampling, match="cannot be recomputed"):
            pack_tree([*base, SampledSeg(1, 0, [3], True, [-0.1], **bad)])  # type: ignore[arg-type]
