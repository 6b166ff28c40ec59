"""The CPU engine without HTTP or Kafka: sampling maths, KV-batch bookkeeping, scheduling, swaps.

The scheduler is driven by calling ``Engine.step()`` directly, so interleavings (a request joining a running batch,
a swap requested mid-generation) are deterministic.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache

from consumers.inference.engine import Engine, EngineError, GenerationResult, SamplingParams, SwapOutcome, WeightSwap
from consumers.inference.kv_batch import KVBatch, cache_layers, left_pad, merge, select
from policy import sampling
from tests.support.tiny_model import EOS, VOCAB, full_logprobs, greedy_reference, tiny_model

PROMPTS = [[5, 17, 3], [40, 9, 23, 2, 11, 7, 30, 12], [8], [60, 61, 62, 63, 64]]


# ---- sampling maths --------------------------------------------------------------------------------------------
def _logits(probs: list[float]) -> torch.Tensor:
    return torch.tensor([probs]).log()


def test_temperature_scales_and_greedy_rows_are_left_alone() -> None:
    logits = torch.tensor([[1.0, 2.0], [1.0, 2.0]])
    out = sampling.apply_temperature(logits, torch.tensor([0.5, 0.0]))
    assert out.tolist() == [[2.0, 4.0], [1.0, 2.0]]


def test_top_k_keeps_the_k_largest() -> None:
    logits = torch.tensor([[0.1, 3.0, 2.0, -1.0], [0.1, 3.0, 2.0, -1.0]])
    out = sampling.apply_top_k(logits, torch.tensor([2, 0]))
    assert torch.isinf(out[0]).tolist() == [True, False, False, True]
    assert torch.equal(out[1], logits[1])  # 0 disables


def test_top_p_keeps_the_smallest_nucleus_reaching_p() -> None:
    logits = _logits([0.15, 0.5, 0.05, 0.3]).repeat(3, 1)
    out = sampling.apply_top_p(logits, torch.tensor([0.8, 0.81, 1.0]))
    kept = (~torch.isinf(out)).tolist()
    assert kept[0] == [False, True, False, True]  # 0.5 + 0.3 reaches 0.8
    assert kept[1] == [True, True, False, True]  # 0.81 needs the 0.15 too
    assert kept[2] == [True, True, True, True]  # top_p = 1 never drops, even in a mixed batch


def test_processed_logprobs_are_the_renormalised_truncated_distribution() -> None:
    probs = [0.15, 0.5, 0.05, 0.3]
    logits = _logits(probs)
    lp = sampling.processed_logprobs(logits, torch.tensor([1.0]), torch.tensor([0]), torch.tensor([0.8]))[0]
    assert math.isclose(lp[1].exp().item(), 0.5 / 0.8, rel_tol=1e-5)
    assert math.isclose(lp[3].exp().item(), 0.3 / 0.8, rel_tol=1e-5)
    assert torch.isinf(lp[0]) and torch.isinf(lp[2])
    # temperature 2 flattens: q_i ∝ p_i^(1/2)
    lp_t = sampling.processed_logprobs(logits, torch.tensor([2.0]), torch.tensor([0]), torch.tensor([1.0]))[0]
    expected = torch.tensor(probs).sqrt() / torch.tensor(probs).sqrt().sum()
    assert torch.allclose(lp_t.exp(), expected, atol=1e-6)
    assert not torch.allclose(lp_t, sampling.raw_logprobs(logits)[0])


def test_sampling_follows_the_processed_distribution_and_seeds_reproduce() -> None:
    lp = sampling.processed_logprobs(
        _logits([0.6, 0.3, 0.1, 1e-9]), torch.tensor([1.0]), torch.tensor([0]), torch.tensor([0.95])
    )
    generator = torch.Generator().manual_seed(7)
    draws = torch.stack([sampling.sample(lp, torch.tensor([False]), [generator])[0] for _ in range(3000)])
    counts = torch.bincount(draws, minlength=4).float() / 3000
    assert counts[3] == 0 and counts[2] > 0  # outside the nucleus never, inside yes
    assert abs(counts[0].item() - 0.6) < 0.04 and abs(counts[1].item() - 0.3) < 0.04
    again = torch.Generator().manual_seed(7)
    replay = torch.stack([sampling.sample(lp, torch.tensor([False]), [again])[0] for _ in range(3000)])
    assert torch.equal(draws, replay)
    assert sampling.sample(lp, torch.tensor([True]), [None]).item() == 0  # greedy = argmax


def test_top_logprobs_and_clamp() -> None:
    values, ids = sampling.top_logprobs(torch.tensor([[-3.0, -0.5, -1.0]]), 2)
    assert ids.tolist() == [[1, 2]] and values.tolist() == [[-0.5, -1.0]]
    assert sampling.top_logprobs(torch.tensor([[-1.0]]), 0)[1].shape == (1, 0)
    assert sampling.clamp_logprob(float("-inf")) == sampling.MIN_REPORTED_LOGPROB


# ---- KV batch bookkeeping -------------------------------------------------------------------------------------
def _batch(lengths: list[int], width: int, tag: float) -> KVBatch:
    """A fake one-layer batch whose key at (row, col) is tag + row for real columns, 0 for padding."""
    mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for r, n in enumerate(lengths):
        mask[r, width - n :] = 1
    keys = (mask.float() * (tag + torch.arange(len(lengths)).float()).unsqueeze(1))[:, None, :, None]  # (B,1,T,1)
    cache = DynamicCache(ddp_cache_data=[(keys.clone(), keys.clone())])
    n = torch.tensor(lengths)
    return KVBatch(cache, mask, n, n * 0, list(range(len(lengths))))


def test_left_pad_right_aligns_prompts_with_per_row_positions() -> None:
    ids, mask, positions = left_pad([[7, 8, 9], [4]], pad_id=0)
    assert ids.tolist() == [[7, 8, 9], [0, 0, 4]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert positions[1, 2].item() == 0 and positions[0].tolist() == [0, 1, 2]


def test_merge_left_pads_the_shorter_batch_and_select_trims_unused_columns() -> None:
    a, b = _batch([2, 4], 4, 10.0), _batch([1], 1, 20.0)
    merged = merge(a, b)
    keys = cache_layers(merged.cache)[0][0][:, 0, :, 0]  # (3, 4)
    assert merged.mask.tolist() == [[0, 0, 1, 1], [1, 1, 1, 1], [0, 0, 0, 1]]
    assert keys.tolist() == [[0, 0, 10, 10], [11, 11, 11, 11], [0, 0, 0, 20]]
    assert merged.rows == [0, 1, 0] and merged.positions.tolist() == [2, 4, 1]
    kept = select(merged, torch.tensor([2, 0]), ["b0", "a0"])  # drop the long row: 2 columns become unused
    assert kept.mask.tolist() == [[0, 1], [1, 1]]
    assert cache_layers(kept.cache)[0][1][:, 0, :, 0].tolist() == [[0, 20], [10, 10]]
    assert kept.rows == ["b0", "a0"] and kept.positions.tolist() == [1, 2]


# ---- engine ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_model(0)


def _engine(model: torch.nn.Module, **kwargs: object) -> Engine:
    return Engine(model, eos_token_ids=[EOS], **kwargs)  # type: ignore[arg-type]


class _Collect:
    def __init__(self) -> None:
        self.results: dict[str, GenerationResult | BaseException] = {}

    def __call__(self, key: str):  # noqa: ANN204
        return lambda outcome: self.results.__setitem__(key, outcome)


def _run(engine: Engine, limit: int = 500) -> None:
    for _ in range(limit):
        if not engine.step():
            return
    raise AssertionError("engine did not go idle")


def test_staggered_greedy_requests_match_generate_and_never_recompute(model: torch.nn.Module) -> None:
    engine, got = _engine(model), _Collect()
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    engine.submit([PROMPTS[0]], greedy, got("0"))
    engine.submit([PROMPTS[1]], greedy, got("1"))
    for _ in range(4):  # 0 and 1 are 4 tokens in when 2 and 3 join the running batch
        engine.step()
    engine.submit([PROMPTS[2]], greedy, got("2"))
    engine.submit([PROMPTS[3]], greedy, got("3"))
    _run(engine)
    for key, prompt in zip("0123", PROMPTS, strict=True):
        result = got.results[key]
        assert isinstance(result, GenerationResult)
        assert result.outputs[0].token_ids == greedy_reference(model, prompt, 12), key
        assert result.outputs[0].finish_reason == "length"
    # 12 tokens × 4 sequences, one token per sequence per step: steps = prefills/decodes, not tokens × prompt.
    assert engine.tokens_generated == 48 and engine.steps <= 4 + 12


def test_logprobs_are_those_of_the_sampling_distribution(model: torch.nn.Module) -> None:
    engine, got = _engine(model), _Collect()
    engine.submit([PROMPTS[1]], SamplingParams(max_tokens=10, temperature=0.7, top_p=0.6, seed=3, logprobs=2), got("p"))
    engine.submit([PROMPTS[0]], SamplingParams(max_tokens=10, temperature=1.0, seed=4), got("t1"))
    _run(engine)
    out = got.results["p"].outputs[0]  # type: ignore[union-attr]
    raw = full_logprobs(model, PROMPTS[1], out.token_ids)
    for step, token in enumerate(out.token_ids):
        q = sampling.processed_logprobs(
            raw[step : step + 1], torch.tensor([0.7]), torch.tensor([0]), torch.tensor([0.6])
        )[0]
        assert math.isfinite(out.logprobs[step]) and out.logprobs[step] <= 0
        assert abs(out.logprobs[step] - q[token].item()) < 1e-4  # under temperature + top-p, renormalised
        assert out.top_logprobs[step][0] == (token, out.logprobs[step])  # sampled first, then the top 2
        assert [tid for tid, _ in out.top_logprobs[step][1:]] == q.topk(2).indices.tolist()
    plain = got.results["t1"].outputs[0]  # type: ignore[union-attr]
    raw_plain = full_logprobs(model, PROMPTS[0], plain.token_ids)
    expected = [raw_plain[i, t].item() for i, t in enumerate(plain.token_ids)]
    assert max(abs(a - b) for a, b in zip(plain.logprobs, expected, strict=True)) < 1e-4  # T=1: the model's own


def test_raw_logprobs_mode_reports_the_unprocessed_model(model: torch.nn.Module) -> None:
    engine, got = _engine(model, logprobs_mode="raw_logprobs"), _Collect()
    engine.submit([PROMPTS[0]], SamplingParams(max_tokens=6, temperature=0.5, seed=1), got("r"))
    _run(engine)
    out = got.results["r"].outputs[0]  # type: ignore[union-attr]
    raw = full_logprobs(model, PROMPTS[0], out.token_ids)
    assert all(
        abs(lp - raw[i, t].item()) < 1e-4 for i, (t, lp) in enumerate(zip(out.token_ids, out.logprobs, strict=True))
    )


def test_seeds_n_and_vllm_seed_offsets(model: torch.nn.Module) -> None:
    engine, got = _engine(model), _Collect()
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=11, n=3, ignore_eos=True)
    engine.submit([PROMPTS[3]], params, got("a"))
    engine.submit([PROMPTS[3]], params, got("b"))
    engine.submit([PROMPTS[3]], SamplingParams(max_tokens=16, temperature=1.0, seed=12, ignore_eos=True), got("c"))
    _run(engine)
    a, b, c = (got.results[k] for k in "abc")
    assert isinstance(a, GenerationResult) and isinstance(b, GenerationResult) and isinstance(c, GenerationResult)
    tokens = [o.token_ids for o in a.outputs]
    assert [o.sample_index for o in a.outputs] == [0, 1, 2]
    assert tokens == [o.token_ids for o in b.outputs]  # same seed, same tokens
    assert len({tuple(t) for t in tokens}) == 3  # the n samples differ
    assert tokens[1] == c.outputs[0].token_ids  # sample i uses seed + i, as vLLM


def test_stop_token_eos_and_length(model: torch.nn.Module) -> None:
    ref = greedy_reference(model, PROMPTS[1], 8)
    stop_at = max(i for i, t in enumerate(ref) if t not in ref[:i])  # the last first occurrence of a token
    engine, got = _engine(model), _Collect()
    engine.submit([PROMPTS[1]], SamplingParams(max_tokens=8, temperature=0, stop_token_ids=(ref[stop_at],)), got("s"))
    _run(engine)
    out = got.results["s"].outputs[0]  # type: ignore[union-attr]
    assert out.token_ids == ref[: stop_at + 1] and out.finish_reason == "stop" and out.stop_reason == ref[stop_at]

    eos_engine = Engine(model, eos_token_ids=[ref[stop_at]])
    eos_engine.submit([PROMPTS[1]], SamplingParams(max_tokens=8, temperature=0), got("e"))
    eos_engine.submit([PROMPTS[1]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), got("i"))
    _run(eos_engine)
    eos_out, ignored = got.results["e"].outputs[0], got.results["i"].outputs[0]  # type: ignore[union-attr]
    assert eos_out.finish_reason == "stop" and eos_out.stop_reason is None and eos_out.token_ids[-1] == ref[stop_at]
    assert ignored.token_ids == ref and ignored.finish_reason == "length"


def test_batch_limit_queues_and_an_oversized_request_runs_alone(model: torch.nn.Module) -> None:
    engine, got = _engine(model, max_batch_size=2), _Collect()
    for key in "abc":
        engine.submit([PROMPTS[0]], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), got(key))
    engine.step()
    assert engine.active_sequences == 2 and engine.queued_requests == 1
    _run(engine)
    assert set(got.results) == {"a", "b", "c"}
    engine.submit(
        [PROMPTS[0], PROMPTS[2]], SamplingParams(max_tokens=3, n=2, temperature=0, ignore_eos=True), got("big")
    )
    engine.step()
    assert engine.active_sequences == 4  # over the limit, but alone
    _run(engine)
    big = got.results["big"]
    assert isinstance(big, GenerationResult) and [(o.prompt_index, o.sample_index) for o in big.outputs] == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
    ]


def test_swap_waits_for_in_flight_requests_then_serves_the_new_version(model: torch.nn.Module) -> None:
    other = tiny_model(1)
    engine, got = Engine(tiny_model(0), eos_token_ids=[EOS], policy_version=3), _Collect()
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    engine.submit([PROMPTS[1]], greedy, got("old"))
    engine.step()
    outcomes: list[SwapOutcome] = []
    engine.request_swap(WeightSwap(4, lambda m: m.load_state_dict(other.state_dict()), outcomes.append))
    engine.submit([PROMPTS[1]], greedy, got("new"))  # arrives during the drain: must wait, not mix versions
    engine.step()
    assert engine.queued_requests == 1 and not outcomes
    _run(engine)
    old, new = got.results["old"], got.results["new"]
    assert isinstance(old, GenerationResult) and isinstance(new, GenerationResult)
    assert (old.policy_version, new.policy_version) == (3, 4) and engine.policy_version == 4
    assert old.outputs[0].token_ids == greedy_reference(model, PROMPTS[1], 10)
    assert new.outputs[0].token_ids == greedy_reference(other, PROMPTS[1], 10)
    assert outcomes[0].error is None and outcomes[0].wait_s > 0


def test_failed_swap_keeps_serving_and_abort_drops_a_request(model: torch.nn.Module) -> None:
    engine, got = _engine(model, policy_version=1), _Collect()
    outcomes: list[SwapOutcome] = []

    def broken(_: torch.nn.Module) -> None:
        raise RuntimeError("disk on fire")

    engine.request_swap(WeightSwap(2, broken, outcomes.append))
    rid = engine.submit([PROMPTS[0]], SamplingParams(max_tokens=30, ignore_eos=True), got("gone"))
    engine.submit([PROMPTS[2]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), got("kept"))
    engine.step()  # applies (and fails) the swap
    engine.step()
    engine.abort(rid)
    _run(engine)
    assert isinstance(outcomes[0].error, RuntimeError) and engine.policy_version == 1
    assert "gone" not in got.results and got.results["kept"].policy_version == 1  # type: ignore[union-attr]


def test_bad_input_and_model_failure(model: torch.nn.Module) -> None:
    engine, got = _engine(model), _Collect()
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.submit([[VOCAB]], SamplingParams(), got("x"))
    with pytest.raises(ValueError):
        engine.submit([[]], SamplingParams(), got("x"))
    with pytest.raises(ValueError):
        SamplingParams(top_p=0.0)
    broken = Engine(tiny_model(0), eos_token_ids=[EOS])
    broken.model.forward = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom"))  # type: ignore[method-assign]
    broken.submit([PROMPTS[0]], SamplingParams(), got("f"))
    broken.step()
    assert isinstance(got.results["f"], EngineError) and broken.active_sequences == 0
