"""Chunked logprobs (issue #30 item 1): the LM head runs on the wanted positions a chunk at a time, checkpointed, and
gives the same logprobs, gradients, entropy, values and training steps as the full (T, V) logits did; the policy
loads with fp32 master weights (item 2). docs/method.md#chunked-logprobs."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch", reason="learner tests need torch (the 'ml' extra)")

from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from clawbase.errors import ConfigError  # noqa: E402
from learner.forward import gather_token_logprobs, packed_forward, packed_logprobs  # noqa: E402
from learner.hparams import Hyperparams  # noqa: E402
from learner.pack import MicroBatch, PackError, pack_trees  # noqa: E402
from learner.precision import load_policy  # noqa: E402
from learner.step import ScoredTree, train_step  # noqa: E402
from learner.value import ValueHead, policy_and_values  # noqa: E402
from policy.sampling import apply_temperature  # noqa: E402
from schemas.events import TreeSegment  # noqa: E402

VOCAB = 3000
ATOL = 1e-5
SMALL = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
HEADS = {"num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}

# Each trainable call's sampling settings: plain, hot, cold with top-k, top-p, both, greedy.
CALLS = [
    {"temperature": 1.0, "top_p": 1.0, "top_k": 0},
    {"temperature": 1.7, "top_p": 1.0, "top_k": 0},
    {"temperature": 0.6, "top_p": 1.0, "top_k": 40},
    {"temperature": 0.9, "top_p": 0.8, "top_k": 0},
    {"temperature": 1.2, "top_p": 0.9, "top_k": 200},
    {"temperature": 0.0, "top_p": 1.0, "top_k": 0},
]


def _model(kind: str, seed: int = 0) -> torch.nn.Module:
    """A float32 random causal LM in eval mode: Qwen2 with a tied head, or Llama with its own."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if kind == "qwen2":
            config = Qwen2Config(**SMALL, **HEADS, tie_word_embeddings=True, attn_implementation="sdpa")
            model: torch.nn.Module = Qwen2ForCausalLM(config)
        else:
            config = LlamaConfig(**SMALL, **HEADS, tie_word_embeddings=False, attn_implementation="sdpa")
            model = LlamaForCausalLM(config)
    return model.to(torch.float32).eval()


def _seg(parent: int, n: int, rng: np.random.Generator, call: dict | None = None) -> TreeSegment:
    tokens = rng.integers(3, VOCAB, n).astype("<i4")
    if call is None:
        return TreeSegment(parent=parent, tokens=tokens, trainable=False, logprobs=np.zeros(0, "<f4"), policy_version=0)
    logprobs = (-rng.random(n) * 3).astype("<f4")
    return TreeSegment(parent=parent, tokens=tokens, trainable=True, logprobs=logprobs, policy_version=0, **call)


def _tree(rng: np.random.Generator, first: int = 0) -> list[TreeSegment]:
    """A shared prompt, two turns with a tool result between, and a retry branching at the prompt."""
    return [
        _seg(-1, 9, rng),
        _seg(0, 5, rng, CALLS[first % len(CALLS)]),
        _seg(1, 4, rng),
        _seg(2, 6, rng, CALLS[(first + 1) % len(CALLS)]),
        _seg(0, 7, rng, CALLS[(first + 2) % len(CALLS)]),
    ]


def _row(seed: int = 0) -> MicroBatch:
    """Two trees in one row (block-diagonal tree mask) that use every sampling setting of CALLS."""
    rng = np.random.default_rng(seed)
    [row] = pack_trees([_tree(rng, 0), _tree(rng, 3)], 4096)
    assert row.uses_top_k and row.uses_top_p and int(row.loss_mask.sum()) == 36
    return row


def _full(model: torch.nn.Module, row: MicroBatch, only_trainable: bool) -> torch.Tensor:
    """The path before the change: the row's full logits, then the gather."""
    return gather_token_logprobs(packed_forward(model, row).logits, row, only_trainable=only_trainable)


def _full_entropy(model: torch.nn.Module, row: MicroBatch) -> list:
    """The entropy the step computed before the change: softmax at the sampling temperature, trainable positions."""
    with torch.no_grad():
        logits = packed_forward(model, row).logits[0]  # (T, V)
        rows = (row.loss_mask & (row.predictor >= 0)).nonzero(as_tuple=True)[0]  # (K,)
        logq = torch.log_softmax(apply_temperature(logits[row.predictor[rows]], row.temperature[rows]), dim=-1)
        return [float(-(logq.exp() * logq).sum()), int(rows.numel())]


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
@pytest.mark.parametrize("only_trainable", [True, False])
@pytest.mark.parametrize("chunk", [1, 3, 10_000])
def test_chunked_logprobs_equal_the_full_logits(kind: str, only_trainable: bool, chunk: int) -> None:
    model, row = _model(kind), _row()
    with torch.no_grad():
        full = _full(model, row, only_trainable)
        chunked = packed_logprobs(model, row, only_trainable=only_trainable, chunk=chunk)
    assert chunked.shape == full.shape == (row.num_tokens,) and chunked.dtype == torch.float32
    torch.testing.assert_close(chunked, full, atol=ATOL, rtol=0)
    assert bool((full != 0).any()) and float(full.min()) < -1.0  # not trivially equal
    if not only_trainable:  # the untrainable positions with a predictor are there too
        assert bool((full[~row.loss_mask] != 0).any())


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
@pytest.mark.parametrize("chunk", [1, 3, 10_000])
def test_chunked_gradients_equal_the_full_logits(kind: str, chunk: int) -> None:
    row = _row(1)
    weight = torch.linspace(-1.0, 1.0, row.num_tokens)  # (T,) a loss that weighs every token differently

    def grads(use_chunks: bool) -> dict[str, torch.Tensor]:
        model = _model(kind)
        if use_chunks:
            lp = packed_logprobs(model, row, only_trainable=True, chunk=chunk)
        else:
            lp = _full(model, row, only_trainable=True)
        (lp * weight).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    full, chunked = grads(False), grads(True)
    assert full.keys() == chunked.keys() and len(full) == len(list(_model(kind).parameters()))
    for name in full:
        torch.testing.assert_close(chunked[name], full[name], atol=ATOL, rtol=0, msg=name)
    assert max(float(g.abs().max()) for g in full.values()) > 1e-3


@pytest.mark.parametrize("chunk", [1, 3, 10_000])
def test_entropy_equals_the_full_logits_entropy_and_counts_once_with_recomputation(chunk: int) -> None:
    model, row = _model("qwen2"), _row(2)
    reference = _full_entropy(model, row)
    # With a backward pass (the checkpointed chunks run twice) and without one (no checkpointing).
    with_grad = [0.0, 0]
    packed_logprobs(model, row, only_trainable=True, chunk=chunk, entropy=with_grad).sum().backward()
    no_grad = [0.0, 0]
    with torch.no_grad():
        packed_logprobs(model, row, only_trainable=False, chunk=chunk, entropy=no_grad)
    for got in (with_grad, no_grad):
        assert got[1] == reference[1] == 36
        assert got[0] == pytest.approx(reference[0], rel=1e-6, abs=ATOL)


def test_value_path_equals_the_output_hidden_states_path() -> None:
    model, row = _model("llama"), _row(3)
    head = ValueHead.for_model(model)
    torch.nn.init.normal_(head.proj.weight, std=0.5)
    with torch.no_grad():
        out = packed_forward(model, row, output_hidden_states=True)
        old_lp = gather_token_logprobs(out.logits, row, only_trainable=True)
        hidden = out.hidden_states[-1][0]
        has_pred = row.predictor >= 0
        old_values = torch.zeros(row.num_tokens)
        old_values[has_pred] = head(hidden[row.predictor[has_pred]])
        lp, values = policy_and_values(model, head, row, chunk=3)
    torch.testing.assert_close(lp, old_lp, atol=ATOL, rtol=0)
    torch.testing.assert_close(values, old_values, atol=ATOL, rtol=0)
    assert float(old_values.abs().max()) > 1e-3


def _trees(seed: int) -> list[ScoredTree]:
    rng = np.random.default_rng(seed)
    return [ScoredTree(_tree(rng, i), (-1.0) ** i, float(i % 2), "h") for i in range(4)]


@pytest.mark.parametrize("hp", [{}, {"mini_batches": 2}, {"algorithm": "ppo"}, {"kl_coef": 0.5}])
def test_train_step_with_small_chunks_equals_one_chunk(hp: dict) -> None:
    def step(chunk: int) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
        torch.manual_seed(0)
        model = _model("qwen2")
        config = Hyperparams(lr=1e-3, logprob_chunk=chunk, **hp)
        params = list(model.parameters())
        head = None
        if config.algorithm == "ppo":
            head = ValueHead.for_model(model)
            params += list(head.parameters())
        ref = _model("qwen2").requires_grad_(False) if config.kl_coef > 0 else None
        metrics = train_step(model, torch.optim.AdamW(params, lr=config.lr), _trees(5), config, head, ref)
        return metrics, {k: v.detach().clone() for k, v in model.state_dict().items()}

    (m_small, w_small), (m_one, w_one) = step(2), step(10_000)
    timing = {k for k in m_one if k.endswith(("_seconds", "_per_s"))}
    assert m_small.keys() == m_one.keys()
    for key in sorted(m_one.keys() - timing):
        assert m_small[key] == pytest.approx(m_one[key], rel=1e-5, abs=ATOL), key
    assert m_one["grad_norm"] > 0 and ("entropy" in m_one) == (hp.get("algorithm") != "ppo")
    for name in w_one:
        torch.testing.assert_close(w_small[name], w_one[name], atol=ATOL, rtol=0, msg=name)


def test_load_policy_gives_fp32_master_weights_from_a_bf16_checkpoint(tmp_path: Path) -> None:
    model = _model("llama").to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    assert "bfloat16" in (tmp_path / "config.json").read_text()  # the checkpoint says bf16
    loaded = load_policy(tmp_path)
    assert {p.dtype for p in loaded.parameters()} == {torch.float32}
    assert loaded.config._attn_implementation == "sdpa"
    for name, value in model.state_dict().items():  # the bf16 values, exactly, in fp32
        assert torch.equal(loaded.state_dict()[name], value.float()), name


def test_a_model_that_transforms_its_logits_is_refused() -> None:
    model = _model("qwen2")
    model.config.final_logit_softcapping = 30.0  # Gemma 2's: logits = 30 tanh(lm_head(h) / 30)
    with pytest.raises(PackError, match="final_logit_softcapping"), torch.no_grad():
        packed_logprobs(model, _row())


def test_logprob_chunk_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="logprob_chunk"):
        Hyperparams(logprob_chunk=0)
    assert Hyperparams().logprob_chunk == 256
