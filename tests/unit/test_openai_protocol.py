"""Request validation and response shapes of the vLLM completions subset (consumers.inference.protocol)."""

from __future__ import annotations

from typing import Any

import pytest

from consumers.inference.engine import GenerationResult, SamplingParams, SequenceOutput
from consumers.inference.protocol import (
    ProtocolError,
    completion_response,
    models_response,
    parse_completion_request,
)


def _parse(body: Any, **kwargs: Any):  # noqa: ANN202
    defaults = {"served_model_name": "tiny", "vocab_size": 100, "max_model_len": 64}
    return parse_completion_request(body, **{**defaults, **kwargs})


def test_defaults_match_vllm() -> None:
    req = _parse({"prompt": [1, 2, 3]})
    assert req.prompts == [[1, 2, 3]] and req.model == "tiny" and not req.return_token_ids
    assert req.params == SamplingParams(max_tokens=16, temperature=1.0, top_p=1.0, n=1)
    assert _parse({"prompt": [1], "max_tokens": None}).params.max_tokens == 16  # null means the default


def test_prompt_forms_and_sampling_fields() -> None:
    req = _parse(
        {
            "model": "tiny",
            "prompt": [[1, 2], [3]],
            "max_tokens": 5,
            "temperature": 0,
            "top_p": 0.9,
            "top_k": -1,
            "seed": 7,
            "n": 2,
            "stop_token_ids": [4],
            "logprobs": 3,
            "ignore_eos": True,
            "return_token_ids": True,
            "stream": False,
            "echo": False,
            "unknown_field": 1,
        }
    )
    assert req.prompts == [[1, 2], [3]] and req.return_token_ids
    p = req.params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed, p.n) == (5, 0.0, 0.9, -1, 7, 2)
    assert p.stop_token_ids == (4,) and p.logprobs == 3 and p.ignore_eos and p.greedy
    text = _parse({"prompt": ["ab", "c"]}, encode=lambda s: [ord(ch) - 90 for ch in s])
    assert text.prompts == [[7, 8], [9]]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ([1, 2], None),
        ({}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [[]]}, "prompt"),
        ({"prompt": [1, -2]}, "prompt"),
        ({"prompt": [1, 100]}, "prompt"),
        ({"prompt": [1, "x"]}, "prompt"),
        ({"prompt": [1], "max_tokens": 0}, None),
        ({"prompt": [1], "max_tokens": 64}, "max_tokens"),
        ({"prompt": [1], "temperature": -1}, None),
        ({"prompt": [1], "temperature": "hot"}, "temperature"),
        ({"prompt": [1], "top_p": 0}, None),
        ({"prompt": [1], "n": 0}, None),
        ({"prompt": [1], "n": 1.5}, "n"),
        ({"prompt": [1], "logprobs": 21}, "logprobs"),
        ({"prompt": [1], "logprobs": True}, "logprobs"),
        ({"prompt": [1], "stop_token_ids": "5"}, "stop_token_ids"),
        ({"prompt": [1], "stream": True}, "stream"),
        ({"prompt": [1], "stop": ["\n"]}, "stop"),
        ({"prompt": [1], "presence_penalty": 0.5}, "presence_penalty"),
        ({"prompt": "text"}, "prompt"),  # no tokenizer given
    ],
)
def test_bad_requests_are_400(body: Any, param: str | None) -> None:
    with pytest.raises(ProtocolError) as info:
        _parse(body)
    err = info.value
    assert err.status == 400 and err.err_type == "BadRequestError" and err.param == param
    assert err.body() == {"error": {"message": err.message, "type": "BadRequestError", "param": param, "code": 400}}


def test_unknown_model_is_404() -> None:
    with pytest.raises(ProtocolError) as info:
        _parse({"model": "gpt-9", "prompt": [1]})
    assert info.value.status == 404 and info.value.err_type == "NotFoundError"
    assert info.value.message == "The model `gpt-9` does not exist."


def test_aliases_are_accepted_and_answered_as_the_served_name() -> None:
    """Like vLLM's several --served-model-name values: any is accepted, the response names the first."""
    req = _parse({"model": "models-dir", "prompt": [1]}, served_model_name="policy", aliases=("models-dir",))
    assert req.model == "policy"
    with pytest.raises(ProtocolError) as info:
        _parse({"model": "models-dir", "prompt": [1]}, served_model_name="policy")
    assert info.value.status == 404


def _result() -> GenerationResult:
    outputs = [
        SequenceOutput(
            0,
            0,
            [3, 4],
            [-0.5, float("-inf")],
            [[(3, -0.5), (9, -0.1)], [(4, float("-inf")), (9, -0.2)]],
            "length",
            None,
        ),
        SequenceOutput(0, 1, [7], [-1.0], [[(7, -1.0), (9, -0.3)]], "stop", 7),
        SequenceOutput(1, 0, [5], [-2.0], [[(5, -2.0), (5, -2.0)]], "stop", None),
    ]
    return GenerationResult("cmpl-x", [[1, 2], [8]], outputs, policy_version=6, queued_s=0.0, total_s=0.1)


def test_response_has_vllm_shapes_and_our_policy_version() -> None:
    req = _parse({"prompt": [[1, 2], [8]], "n": 2, "logprobs": 1, "return_token_ids": True})
    body = completion_response(
        _result(), req, decode=lambda ids: "".join(f"<{i}>" for i in ids), token_text=lambda i: f"t{i}", created=123
    )
    assert set(body) == {
        "id",
        "object",
        "created",
        "model",
        "choices",
        "system_fingerprint",
        "usage",
        "policy_version",
        "engine_telemetry",
    }
    assert (body["id"], body["object"], body["created"], body["model"]) == ("cmpl-x", "text_completion", 123, "tiny")
    assert body["policy_version"] == 6 and body["engine_telemetry"] is None
    assert body["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 4,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    first, second, third = body["choices"]
    assert set(first) == {
        "index",
        "text",
        "logprobs",
        "finish_reason",
        "stop_reason",
        "token_ids",
        "prompt_logprobs",
        "prompt_token_ids",
    }
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert first["text"] == "<3><4>" and first["finish_reason"] == "length" and first["stop_reason"] is None
    assert first["token_ids"] == [3, 4] and first["prompt_token_ids"] == [1, 2] and third["prompt_token_ids"] == [8]
    assert second["stop_reason"] == 7 and second["finish_reason"] == "stop"
    lp = first["logprobs"]
    assert lp["tokens"] == ["t3", "t4"] and lp["text_offset"] == [0, 2]
    assert lp["token_logprobs"] == [-0.5, -9999.0]  # -inf as vLLM writes it
    assert lp["top_logprobs"] == [{"t3": -0.5, "t9": -0.1}, {"t4": -9999.0, "t9": -0.2}]
    assert third["logprobs"]["top_logprobs"] == [{"t5": -2.0}]  # a collision collapses, as in vLLM's dict


def test_without_logprobs_or_token_ids_the_fields_are_null() -> None:
    req = _parse({"prompt": [[1, 2], [8]], "n": 2})
    body = completion_response(_result(), req, decode=str, token_text=str)
    assert all(
        c["logprobs"] is None and c["token_ids"] is None and c["prompt_token_ids"] is None for c in body["choices"]
    )


def test_cached_tokens_are_summed_over_prompts_as_prompt_tokens_details() -> None:
    """vLLM's ``usage.prompt_tokens_details.cached_tokens``; the engine reports one count per prompt."""
    result = _result()
    result.cached_tokens = [2, 0]  # type: ignore[attr-defined]  # GenerationResult.cached_tokens (prefix cache)
    req = _parse({"prompt": [[1, 2], [8]], "n": 2})
    telemetry = {"gpu_utilization": 37.0, "gpu_memory_used_bytes": 1 << 30}
    body = completion_response(result, req, decode=str, token_text=str, engine_telemetry=telemetry)
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}
    assert body["usage"]["prompt_tokens"] == 3 and body["engine_telemetry"] == telemetry


def test_models_response() -> None:
    body = models_response("tiny", "/models/tiny", 512, 99)
    assert body["object"] == "list"
    card = {"id": "tiny", "object": "model", "created": 99, "owned_by": "clawstream", "root": "/models/tiny"}
    assert body["data"] == [{**card, "parent": None, "max_model_len": 512, "permission": []}]
    with_alias = models_response("policy", "/models/tiny", 512, 99, aliases=("tiny",))
    assert [c["id"] for c in with_alias["data"]] == ["policy", "tiny"]
