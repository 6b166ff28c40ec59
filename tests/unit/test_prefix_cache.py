"""Automatic prefix caching and chunked prefill in the CPU engine, without HTTP or Kafka.

The pool (``consumers.inference.prefix_cache``) is checked on readable token ids; the engine is driven by
``Engine.step()`` so interleavings are deterministic. Correctness is always "cached == uncached": the same request
on an engine whose cache is disabled (``prefix_cache_bytes=0``) is the reference, to 1e-5 in fp32.
"""

from __future__ import annotations

import random

import pytest
import torch

from consumers.inference.engine import Engine, GenerationResult, SamplingParams, WeightSwap
from consumers.inference.prefix_cache import PrefixCache
from tests.support.tiny_model import EOS, VOCAB, full_logprobs, tiny_model

BLOCK = 4


# ---- the pool ----------------------------------------------------------------------------------------------------
def _kv(tokens: list[int], layers: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fake KV whose every entry is the token id at that column (so a copy can be read back): (1, 1, T, 1)."""
    col = torch.tensor(tokens, dtype=torch.float32).view(1, 1, -1, 1)
    return [(col + 1000 * i, -col - 1000 * i) for i in range(layers)]


def test_blocks_chain_on_their_prefix_and_partial_blocks_are_not_cached() -> None:
    cache = PrefixCache(block_size=BLOCK, budget_bytes=1 << 20)
    prompt = [10, 11, 12, 13, 20, 21, 22, 23, 30, 31]  # two full blocks + 2 tokens
    assert cache.insert(prompt, _kv(prompt)) == 2
    hit = cache.lookup([10, 11, 12, 13, 20, 21, 22, 23, 99])
    assert hit.tokens == 8
    assert hit.layers[1][0][0, 0, :, 0].tolist() == [1010, 1011, 1012, 1013, 1020, 1021, 1022, 1023]
    assert hit.layers[1][1][0, 0, :, 0].tolist() == [-1010, -1011, -1012, -1013, -1020, -1021, -1022, -1023]
    # The same second block after a different first block is another block: keys chain on everything before.
    assert cache.lookup([10, 11, 12, 99, 20, 21, 22, 23]).tokens == 0
    assert cache.lookup([10, 11, 12, 13, 20, 21, 99, 23]).tokens == 4  # branch inside block 2: block 1 only
    assert cache.lookup(prompt, limit=7).tokens == 4  # limit rounds down to whole blocks
    assert cache.stats.queries == 9 + 8 + 8 + 10 and cache.stats.hits == 8 + 0 + 4 + 4


def test_a_hash_collision_costs_a_miss_never_a_wrong_hit(monkeypatch: pytest.MonkeyPatch) -> None:
    cache = PrefixCache(block_size=BLOCK, budget_bytes=1 << 20)
    monkeypatch.setattr(PrefixCache, "_key", staticmethod(lambda parent, tokens: 7))  # every block collides
    cache.insert([1, 2, 3, 4, 5, 6, 7, 8], _kv([1, 2, 3, 4, 5, 6, 7, 8]))
    assert cache.blocks == 1  # the second block's key is taken: caching stops there
    assert cache.lookup([9, 9, 9, 9]).tokens == 0  # same key, other tokens: a miss
    assert cache.lookup([1, 2, 3, 4, 5, 6, 7, 8]).tokens == 4


def test_eviction_keeps_the_budget_and_drops_least_recent_leaves_first() -> None:
    one_block = 2 * 2 * BLOCK * 4  # 2 layers × (K, V) × BLOCK tokens × 1 float32
    cache = PrefixCache(block_size=BLOCK, budget_bytes=3 * one_block)
    a = [1, 1, 1, 1, 2, 2, 2, 2]
    b = [1, 1, 1, 1, 3, 3, 3, 3]  # shares a's first block
    cache.insert(a, _kv(a))
    cache.insert(b, _kv(b))
    assert cache.blocks == 3 and cache.bytes == 3 * one_block
    cache.lookup(a)  # a's leaf is now more recent than b's
    c = [5, 5, 5, 5]
    cache.insert(c, _kv(c))
    assert cache.bytes <= cache.budget_bytes and cache.stats.evicted_blocks == 1
    assert cache.lookup(b).tokens == 4  # b lost its leaf, not the shared root
    assert cache.lookup(a).tokens == 8 and cache.lookup(c).tokens == 4
    cache.clear()
    assert cache.blocks == 0 and cache.bytes == 0 and cache.lookup(a).tokens == 0


# ---- the engine --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_model(0)


def _run(engine: Engine, limit: int = 5000) -> None:
    for _ in range(limit):
        if not engine.step():
            return
    raise AssertionError("engine did not go idle")


def _generate(engine: Engine, prompt: list[int], params: SamplingParams) -> GenerationResult:
    results: list[GenerationResult | BaseException] = []
    engine.submit([prompt], params, results.append)
    _run(engine)
    (result,) = results
    assert isinstance(result, GenerationResult), result
    return result


def _close(a: GenerationResult, b: GenerationResult, tol: float = 1e-5) -> None:
    """Same tokens, log-probs and top log-probs (ids and values) to ``tol``."""
    for x, y in zip(a.outputs, b.outputs, strict=True):
        assert x.token_ids == y.token_ids
        assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs, strict=True)) <= tol
        for tx, ty in zip(x.top_logprobs, y.top_logprobs, strict=True):
            assert [t for t, _ in tx] == [t for t, _ in ty]
            assert max(abs(p - q) for (_, p), (_, q) in zip(tx, ty, strict=True)) <= tol


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, EOS) for _ in range(n)]


PARAMS = SamplingParams(max_tokens=12, temperature=1.0, seed=5, logprobs=3, ignore_eos=True)


def test_an_agent_turn_reuses_prompt_and_answer_and_matches_the_uncached_engine(model: torch.nn.Module) -> None:
    cached = Engine(model, eos_token_ids=[EOS], prefix_block_size=BLOCK, prefill_chunk_tokens=16)
    plain = Engine(model, eos_token_ids=[EOS], prefix_cache_bytes=0, prefill_chunk_tokens=16)
    first = _tokens(150, 1)
    call1 = _generate(cached, first, PARAMS)
    assert call1.cached_tokens == [0]
    _close(call1, _generate(plain, first, PARAMS))
    # Call 2 = call 1's prompt + its answer + a tool result: all of it but the tail is cached.
    second = first + call1.outputs[0].token_ids + _tokens(37, 2)
    call2 = _generate(cached, second, PARAMS)
    assert call2.cached_tokens[0] == (150 + 12 - 1) // BLOCK * BLOCK  # the answer's last token was never fed
    _close(call2, _generate(plain, second, PARAMS))
    # And against one unbatched forward of the whole sequence (raw model log-probs at temperature 1).
    reference = full_logprobs(tiny_model(0), second, call2.outputs[0].token_ids)
    expected = [reference[i, t].item() for i, t in enumerate(call2.outputs[0].token_ids)]
    assert max(abs(a - b) for a, b in zip(call2.outputs[0].logprobs, expected, strict=True)) < 1e-5
    stats = cached.stats()
    assert stats["prefix_cache_hits"] == call2.cached_tokens[0]
    assert stats["prefix_cache_queries"] == len(first) + len(second)
    assert stats["tokens_prefilled"] == len(first) + len(second) - call2.cached_tokens[0]


def test_a_branch_in_the_middle_of_a_block_reuses_up_to_the_block_before_it(model: torch.nn.Module) -> None:
    cached = Engine(model, eos_token_ids=[EOS], prefix_block_size=BLOCK)
    plain = Engine(model, eos_token_ids=[EOS], prefix_cache_bytes=0)
    base = _tokens(60, 3)
    _generate(cached, base, PARAMS)
    branch = base[:42] + _tokens(20, 4)  # differs from token 42 on: inside block 10 (tokens 40..43)
    got = _generate(cached, branch, PARAMS)
    assert got.cached_tokens == [40]
    _close(got, _generate(plain, branch, PARAMS))
    whole = _generate(cached, base, PARAMS)  # all 60 cached, but the last token is always recomputed
    assert whole.cached_tokens == [56]
    _close(whole, _generate(plain, base, PARAMS))


def test_eviction_under_a_tiny_budget_stays_correct(model: torch.nn.Module) -> None:
    block_bytes = model.config.num_hidden_layers * 2 * model.config.num_key_value_heads * BLOCK * 8 * 4
    budget = 12 * block_bytes  # one sequence (30 + 5 prompt tokens, 12 generated: 11 blocks) fits, two do not
    cached = Engine(model, eos_token_ids=[EOS], prefix_block_size=BLOCK, prefix_cache_bytes=budget)
    plain = Engine(model, eos_token_ids=[EOS], prefix_cache_bytes=0)
    prompts = [_tokens(30, s) for s in range(4)]
    hits = []
    for round_ in range(2):
        for prompt in prompts if round_ == 0 else prompts[::-1]:  # round 2 starts with the most recent
            extended = prompt + _tokens(5, 100 + round_)
            got = _generate(cached, extended, PARAMS)
            _close(got, _generate(plain, extended, PARAMS))
            assert cached.prefix_cache.bytes <= budget
            hits.append(got.cached_tokens[0])
    assert cached.stats()["prefix_cache_evictions"] > 0
    assert hits[:5] == [0, 0, 0, 0, 28] and hits[5:] == [0, 0, 0]  # only the survivor's first 7 blocks hit


def test_a_weight_swap_drops_the_cache_and_answers_as_a_fresh_engine_on_the_new_weights(
    model: torch.nn.Module,
) -> None:
    other = tiny_model(1)
    engine = Engine(tiny_model(0), eos_token_ids=[EOS], prefix_block_size=BLOCK)
    prompt = _tokens(80, 6)
    assert _generate(engine, prompt, PARAMS).cached_tokens == [0]
    assert _generate(engine, prompt, PARAMS).cached_tokens == [76]  # warm
    engine.request_swap(WeightSwap(1, lambda m: m.load_state_dict(other.state_dict()), lambda _outcome: None))
    _run(engine)
    assert engine.prefix_cache.blocks == 0
    after = _generate(engine, prompt, PARAMS)
    assert after.cached_tokens == [0] and after.policy_version == 1
    _close(after, _generate(Engine(tiny_model(1), eos_token_ids=[EOS], prefix_cache_bytes=0), prompt, PARAMS))


def test_concurrent_requests_share_a_prefix_as_soon_as_one_has_computed_it(model: torch.nn.Module) -> None:
    engine = Engine(model, eos_token_ids=[EOS], prefix_block_size=BLOCK, prefill_chunk_tokens=8, max_prefill_tokens=8)
    shared = _tokens(40, 7)
    got: dict[str, GenerationResult | BaseException] = {}
    engine.submit([shared + [1, 2]], PARAMS, lambda r: got.__setitem__("a", r))
    for _ in range(5):  # 5 chunks of 8: a has computed the whole shared part
        engine.step()
    engine.submit([shared + [3, 4]], PARAMS, lambda r: got.__setitem__("b", r))
    _run(engine)
    b = got["b"]
    assert isinstance(b, GenerationResult) and b.cached_tokens == [40]


def test_a_short_request_is_not_stuck_behind_a_long_prefill(model: torch.nn.Module) -> None:
    engine = Engine(model, eos_token_ids=[EOS], prefill_chunk_tokens=64, max_prefill_tokens=256)
    got: dict[str, GenerationResult | BaseException] = {}
    long_prompt = _tokens(3000, 8)
    engine.submit([long_prompt], SamplingParams(max_tokens=2, temperature=0), lambda r: got.__setitem__("long", r))
    engine.step()
    engine.submit([[5, 6, 7]], SamplingParams(max_tokens=1, temperature=0), lambda r: got.__setitem__("short", r))
    engine.step()  # one more chunk of the long prompt, and the whole short one
    assert "short" in got and "long" not in got
    _run(engine)
    long_result = got["long"]
    assert isinstance(long_result, GenerationResult)
    generated = long_result.outputs[0].token_ids
    reference = full_logprobs(tiny_model(0, max_position_embeddings=4096), long_prompt, generated)
    assert long_result.outputs[0].token_ids[0] == int(reference[0].argmax())


# ~2 min on 2 cores; `make test` serves Claude Code's ~37k-token prompt through this engine's chunked prefill
# (tests/integration/test_harness_prefix_cache.py, across rollouts) and checks a chunked prefill's answer above
@pytest.mark.long
def test_a_40k_token_prompt_is_served_without_a_quadratic_mask() -> None:
    big = tiny_model(0, max_position_embeddings=65536)
    engine = Engine(big, eos_token_ids=[EOS], prefill_chunk_tokens=4096, max_prefill_tokens=4096)
    prompt = _tokens(40_000, 9)
    result = _generate(engine, prompt, SamplingParams(max_tokens=2, temperature=0, logprobs=0))
    reference = full_logprobs(tiny_model(0, max_position_embeddings=65536), prompt, result.outputs[0].token_ids)
    assert result.outputs[0].token_ids[0] == int(reference[0].argmax())
    assert abs(result.outputs[0].logprobs[0] - reference[0].max().item()) < 1e-4
    assert VOCAB == big.config.vocab_size
