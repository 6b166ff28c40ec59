"""The learner recomputes the engine's rollout logprobs: same weights + each call's own sampling settings ⇒ π_old
equals π_rollout token for token (issue 17 part 5). Before, the learner used one configured temperature and no
top-k/top-p for every token, so the TIS weights π_old/π_rollout of a top-p rollout were off by design."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch", reason="learner tests need torch (the 'ml' extra)")

from consumers.inference.engine import Engine, GenerationResult, SamplingParams  # noqa: E402
from learner.forward import packed_logprobs  # noqa: E402
from learner.pack import pack_trees  # noqa: E402
from schemas.events import TreeSegment  # noqa: E402
from tests.support.tiny_model import EOS, tiny_model  # noqa: E402


def _generate(engine: Engine, prompt: list[int], params: SamplingParams) -> GenerationResult:
    results: list[GenerationResult | BaseException] = []
    engine.submit([prompt], params, results.append)
    for _ in range(5000):
        if not engine.step():
            break
    (result,) = results
    assert isinstance(result, GenerationResult), result
    return result


def _segment(parent: int, tokens: list[int], logprobs: list[float] | None = None, **sampling: float) -> TreeSegment:
    import numpy as np

    trainable = logprobs is not None
    return TreeSegment(
        parent=parent,
        tokens=np.asarray(tokens, "<i4"),
        trainable=trainable,
        logprobs=np.asarray(logprobs or [], "<f4"),
        policy_version=0,
        call_id=f"c{parent}",
        **(sampling if trainable else {}),
    )


def test_packed_logprobs_equal_the_engines_under_each_calls_sampling_settings() -> None:
    engine = Engine(tiny_model(0), eos_token_ids=[EOS])  # the engine sets its own attention on its copy
    learner_model = tiny_model(0, "sdpa")  # the same weights, as the learner loads them
    calls = [  # (temperature, top_p, top_k) per call: a two-call agent rollout with a retried first turn
        {"temperature": 0.7, "top_p": 0.9, "top_k": 0},
        {"temperature": 1.3, "top_p": 1.0, "top_k": 5},
        {"temperature": 1.0, "top_p": 0.8, "top_k": 12},
    ]
    prompt, tool = [5, 17, 3, 40, 9, 23], [60, 61, 62]
    gen = []
    for k, s in enumerate(calls):
        context = prompt if k != 1 else prompt + gen[0].token_ids + tool
        params = SamplingParams(max_tokens=10, seed=11 + k, ignore_eos=True, **s)
        gen.append(_generate(engine, context, params).outputs[0])
    segments = [
        _segment(-1, prompt),
        _segment(0, gen[0].token_ids, gen[0].logprobs, **calls[0]),
        _segment(1, tool),
        _segment(2, gen[1].token_ids, gen[1].logprobs, **calls[1]),
        _segment(0, gen[2].token_ids, gen[2].logprobs, **calls[2]),  # the retry branches at the prompt
    ]
    [row] = pack_trees([segments], 4096)
    with torch.no_grad():
        ours = packed_logprobs(learner_model, row, only_trainable=True)
    rollout = row.rollout_logprobs
    mask = row.loss_mask
    assert int(mask.sum()) == 30
    torch.testing.assert_close(ours[mask], rollout[mask], atol=2e-5, rtol=0)  # log π_old − log π_rollout ≈ 0

    # What a learner-wide temperature of 1 without filters computes instead: the weights would be off by design.
    plain = [
        _segment(
            s.parent,
            s.tokens.tolist(),
            s.logprobs.tolist() if s.trainable else None,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
        )
        for s in segments
    ]
    [plain_row] = pack_trees([plain], 4096)
    with torch.no_grad():
        wrong = packed_logprobs(learner_model, plain_row, only_trainable=True)
    assert float((wrong[mask] - rollout[mask]).abs().max()) > 0.05
