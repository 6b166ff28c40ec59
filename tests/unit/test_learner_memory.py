"""The learner's memory (issue #30 item 2): the step's estimate, the plan (activation checkpointing or a refusal)
before any update, checkpointing exact, fp32 master weights and optimizer state from a bf16 checkpoint, bf16 autocast
close to fp32. docs/method.md#learner-memory."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch", reason="learner tests need torch (the 'ml' extra)")

from transformers import Qwen3Config, Qwen3ForCausalLM  # noqa: E402

from learner.forward import packed_logprobs  # noqa: E402
from learner.hparams import Hyperparams  # noqa: E402
from learner.memory import SAFETY, ModelShape, activation_bytes, plan_step, step_memory  # noqa: E402
from learner.pack import pack_trees  # noqa: E402
from learner.precision import load_policy  # noqa: E402
from learner.step import ScoredTree, train_step  # noqa: E402
from schemas.events import TreeSegment  # noqa: E402

VOCAB = 3000
WARMSTART = Path(__file__).resolve().parents[2] / "models" / "warmstart"
PLAIN = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}


def _model(seed: int = 0, layers: int = 3) -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        config = Qwen3Config(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=512,
            attn_implementation="sdpa",
        )
        return Qwen3ForCausalLM(config).to(torch.float32)


def _trees(seed: int = 0) -> list[ScoredTree]:
    rng = np.random.default_rng(seed)

    def seg(parent: int, n: int, trainable: bool) -> TreeSegment:
        tokens = rng.integers(3, VOCAB, n).astype("<i4")
        if not trainable:
            return TreeSegment(
                parent=parent, tokens=tokens, trainable=False, logprobs=np.zeros(0, "<f4"), policy_version=0
            )
        lps = (-rng.random(n) * 3).astype("<f4")
        return TreeSegment(parent=parent, tokens=tokens, trainable=True, logprobs=lps, policy_version=0, **PLAIN)

    return [
        ScoredTree(
            [seg(-1, 20, False), seg(0, 9, True), seg(1, 6, False), seg(2, 7, True), seg(0, 8, True)], adv, 0.5, "h"
        )
        for adv in (1.0, -1.0, 0.5)
    ]


def _shapes(trees: list[ScoredTree], budget: int = 4096) -> list[tuple[int, bool, bool]]:
    rows = pack_trees([t.segments for t in trees], budget)
    return [(r.num_tokens, not r.is_chain, r.uses_top_k or r.uses_top_p) for r in rows]


def test_the_formula_counts_layers_checkpointing_the_head_and_the_tree_mask() -> None:
    shape = ModelShape.of(_model(layers=3))
    assert (shape.layers, shape.hidden, shape.intermediate, shape.q_width, shape.kv_width) == (3, 32, 64, 32, 16)
    plain = activation_bytes(shape, 1000, tree=False, checkpointing=False, chunk=256)
    # per token: 3 layers × (10·32 + 4·64 + 3·(32 + 2·16)) + 12·32 + 4·64 floats; the head: 5 × 256 × V floats; the
    # embedding's and head's gradients: 2 × V × 32
    assert plain == 4 * (1000 * (3 * (320 + 256 + 192) + 384 + 256) + 5 * 256 * VOCAB + 2 * VOCAB * 32)
    ckpt = activation_bytes(shape, 1000, tree=False, checkpointing=True, chunk=256)
    assert ckpt == 4 * (1000 * (3 * 64 + 768 + 640) + 5 * 256 * VOCAB + 2 * VOCAB * 32)
    assert activation_bytes(shape, 1000, tree=True, checkpointing=False, chunk=256) == plain + 4 * 2 * 1000 * 1000
    assert activation_bytes(shape, 1000, tree=False, checkpointing=False, chunk=256, top_k_or_p=True) > plain
    # The 0.6B Qwen3 shape, one 38k-token path: checkpointing keeps 2 H per layer instead of ~34 H.
    qwen = ModelShape(600_000_000, 28, 1024, 3072, 2048, 1024, 151_936)
    full = activation_bytes(qwen, 38_000, tree=False, checkpointing=False, chunk=256)
    less = activation_bytes(qwen, 38_000, tree=False, checkpointing=True, chunk=256)
    assert 143 < full / 2**30 < 144 and 18 < less / 2**30 < 19  # 143.4 vs 18.4 GiB


def test_gradients_and_moments_count_until_they_exist() -> None:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    shapes = _shapes(_trees())
    params = sum(p.numel() for p in model.parameters())
    first = step_memory(model, optimizer, shapes, checkpointing=False, chunk=256)
    assert (first.gradients, first.optimizer) == (4 * params, 8 * params)
    train_step(model, optimizer, _trees(), Hyperparams(lr=1e-3))
    later = step_memory(model, optimizer, shapes, checkpointing=False, chunk=256)
    assert (later.gradients, later.optimizer) == (0, 0)  # train_step leaves its gradients; AdamW keeps its moments
    assert later.activations == first.activations and later.row_tokens == max(s[0] for s in shapes)


def test_the_plan_checkpoints_only_when_needed_and_refuses_what_cannot_fit() -> None:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    shapes = _shapes(_trees())
    without = step_memory(model, optimizer, shapes, checkpointing=False, chunk=256).needed
    with_ckpt = step_memory(model, optimizer, shapes, checkpointing=True, chunk=256).needed
    assert with_ckpt < without

    def plan(mode: str, limit: int):  # noqa: ANN202
        return plan_step(model, optimizer, shapes, mode=mode, limit=limit, chunk=256)

    assert not plan("auto", without).checkpointing and plan("auto", without).refusal is None
    between = (with_ckpt + without) // 2
    assert plan("auto", between).checkpointing and plan("auto", between).refusal is None
    assert plan("on", 10 * without).checkpointing
    refused = plan("off", between).refusal
    assert refused is not None and "activation_checkpointing=on would need less" in refused
    too_small = plan("auto", with_ckpt - 1).refusal
    assert too_small is not None and "more than the" in too_small and "token budget" in too_small
    assert f"{SAFETY:g} × (activations of a {max(s[0] for s in shapes):,}-token row" in too_small


def test_activation_checkpointing_gives_the_same_step() -> None:
    results = []
    for checkpointing in (False, True):
        model = _model(seed=1)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        config = Hyperparams(lr=1e-2, mini_batches=2)  # two updates: π_old from no-grad passes, then gradients
        metrics = train_step(model, optimizer, _trees(3), config)
        results.append((metrics, {k: v.detach().clone() for k, v in model.state_dict().items()}))
    (m0, s0), (m1, s1) = results
    worst = max(float((s0[k] - s1[k]).abs().max()) for k in s0)
    assert worst <= 1e-6 and any(not torch.equal(s0[k], _model(seed=1).state_dict()[k]) for k in s0)
    assert abs(m0["loss"] - m1["loss"]) <= 1e-6


def test_a_bf16_checkpoint_trains_with_fp32_master_weights_and_moments(tmp_path: Path) -> None:
    _model(seed=2).to(torch.bfloat16).save_pretrained(tmp_path)
    model = load_policy(tmp_path)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    train_step(model, optimizer, _trees(4), Hyperparams(lr=1e-4))
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert {t.dtype for s in optimizer.state.values() for k, t in s.items() if k != "step"} == {torch.float32}
    # An update far below bf16's spacing survives in the fp32 master weights (pure bf16 would round it away).
    moved = [k for k in before if not torch.equal(before[k], model.state_dict()[k])]
    lost_in_bf16 = [k for k in moved if torch.equal(model.state_dict()[k].to(torch.bfloat16).float(), before[k])]
    assert moved and lost_in_bf16


def test_bf16_autocast_logprobs_are_within_1e_2_of_fp32() -> None:
    """On the shipped warm start's own samples (what RL trains on): a random model's near-uniform logits would hide
    the rounding, and text it never saw (logprobs around -13) exaggerates it (measured: 0.02)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(WARMSTART)
    model = load_policy(WARMSTART).eval()
    messages = [
        {"role": "system", "content": "You are a coding agent. Use the tools to solve the task."},
        {"role": "user", "content": "Create a file hello.txt containing the word hello, then list the directory."},
    ]
    prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
    torch.manual_seed(0)
    out = model.generate(torch.tensor([prompt]), do_sample=True, temperature=1.0, top_k=0, max_new_tokens=64)
    sampled = out[0, len(prompt) :].numpy().astype("<i4")
    segments = [
        TreeSegment(
            parent=-1, tokens=np.array(prompt, "<i4"), trainable=False, logprobs=np.zeros(0, "<f4"), policy_version=0
        ),
        TreeSegment(
            parent=0, tokens=sampled, trainable=True, logprobs=np.zeros(len(sampled), "<f4"), policy_version=0, **PLAIN
        ),
    ]
    [row] = pack_trees([segments], 4096)
    with torch.no_grad():
        fp32 = packed_logprobs(model, row, only_trainable=True)
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
            bf16 = packed_logprobs(model, row, only_trainable=True)
    mask = row.loss_mask
    delta = float((fp32[mask] - bf16[mask]).abs().mean())
    assert int(mask.sum()) >= 16 and 0.0 < delta <= 1e-2, delta  # > 0: autocast did compute in bf16
