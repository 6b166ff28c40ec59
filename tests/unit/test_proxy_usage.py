"""What the proxy takes from the engine's answer beyond the tokens (cached prompt tokens, GPU readings), where each
dialect reports the cached tokens to the harness (JSON and SSE), and the engine model name setting."""

from __future__ import annotations

from typing import Any

import pytest

from clawbase.settings import load_settings
from policy import DEFAULT_MODEL_NAME
from producers.proxy import emit
from producers.proxy.app import ProxySettings
from producers.proxy.emit import ApiError
from producers.proxy.engine_client import EngineReply, engine_reply
from producers.proxy.tool_parse import ParsedTurn
from tests.support import proxy_helpers as H


def _engine_answer(**extra: Any) -> dict[str, Any]:
    choice = {"token_ids": [5, 6], "logprobs": {"token_logprobs": [-0.1, -0.2]}, "finish_reason": "stop"}
    return {"choices": [choice], "usage": {"prompt_tokens": 40, "completion_tokens": 2}, "policy_version": 3, **extra}


# --- engine answer → EngineReply -------------------------------------------------------------------------------


def test_reply_without_cached_tokens_or_telemetry_leaves_them_null() -> None:
    """vLLM without --enable-prompt-tokens-details, or our engine off a GPU: the call event fields stay null."""
    reply = engine_reply(_engine_answer())
    assert reply == EngineReply([5, 6], [-0.1, -0.2], "stop", 3)
    assert reply.cached_tokens is None and reply.gpu_utilization is None and reply.gpu_memory_used_bytes is None
    nulls = engine_reply(
        _engine_answer(usage={"prompt_tokens": 40, "prompt_tokens_details": None}, engine_telemetry=None)
    )
    assert (nulls.cached_tokens, nulls.gpu_utilization, nulls.gpu_memory_used_bytes) == (None, None, None)


def test_reply_reads_cached_tokens_and_gpu_readings() -> None:
    reply = engine_reply(
        _engine_answer(
            usage={"prompt_tokens": 40, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 32}},
            engine_telemetry={"gpu_utilization": 87.0, "gpu_memory_used_bytes": 12_884_901_888},
        )
    )
    assert reply.cached_tokens == 32
    assert reply.gpu_utilization == 87.0 and isinstance(reply.gpu_utilization, float)
    assert reply.gpu_memory_used_bytes == 12_884_901_888 and isinstance(reply.gpu_memory_used_bytes, int)


@pytest.mark.parametrize(
    "extra",
    [
        {"usage": {"prompt_tokens_details": {"cached_tokens": "12"}}},
        {"usage": {"prompt_tokens_details": {"cached_tokens": -1}}},
        {"usage": {"prompt_tokens_details": {"cached_tokens": True}}},
        {"usage": "n/a", "engine_telemetry": ["x"]},
        {"engine_telemetry": {"gpu_utilization": "hot", "gpu_memory_used_bytes": float("inf")}},
    ],
)
def test_malformed_extras_are_null_not_errors(extra: dict[str, Any]) -> None:
    reply = engine_reply(_engine_answer(**extra))
    assert (reply.cached_tokens, reply.gpu_utilization, reply.gpu_memory_used_bytes) == (None, None, None)
    assert reply.token_ids == [5, 6]


def test_reply_without_tokens_is_502() -> None:
    with pytest.raises(ApiError) as info:
        engine_reply({"choices": [{"finish_reason": "stop"}]})
    assert info.value.status == 502


# --- dialects: cached tokens in each API's own field ------------------------------------------------------------


def _answer(cached: int) -> emit.Answer:
    return emit.Answer(
        ParsedTurn("hi"),
        "stop",
        prompt_tokens=100,
        completion_tokens=7,
        model="policy",
        response_id="msg_x",
        created=1,
        cached_tokens=cached,
    )


def _sse_usage(dialect: str, raw: bytes) -> dict[str, Any]:
    events, _ = H.read_sse(raw)
    if dialect == "anthropic":
        return next(d["usage"] for _, d in events if d != "[DONE]" and d["type"] == "message_delta")
    if dialect == "chat":
        return next(d["usage"] for _, d in events if d != "[DONE]" and d.get("usage"))
    return next(d["response"]["usage"] for n, d in events if n == "response.completed")


def test_anthropic_reports_cache_reads_and_the_uncached_rest_as_input() -> None:
    """Anthropic's input total is input + cache_creation + cache_read (what Claude Code counts as context)."""
    usage = emit.anthropic_message(_answer(96))["usage"]
    assert usage == {
        "input_tokens": 4,
        "output_tokens": 7,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 96,
    }
    assert _sse_usage("anthropic", emit.anthropic_body(_answer(96))) == usage
    # the stream's message_start goes out before the engine answered: nothing known to be cached yet
    start = H.read_sse(emit.anthropic_preamble("msg_x", "policy", 100))[0][0][1]["message"]["usage"]
    assert start["input_tokens"] == 100 and start["cache_read_input_tokens"] == 0
    assert emit.anthropic_message(_answer(0))["usage"]["input_tokens"] == 100


def test_openai_chat_reports_prompt_tokens_details() -> None:
    usage = emit.chat_completion(_answer(96))["usage"]
    assert usage == {
        "prompt_tokens": 100,
        "completion_tokens": 7,
        "total_tokens": 107,
        "prompt_tokens_details": {"cached_tokens": 96},
    }
    assert _sse_usage("chat", emit.chat_body(_answer(96), include_usage=True)) == usage


def test_openai_responses_reports_input_tokens_details() -> None:
    answer = _answer(96)
    answer.response_id = "resp_x"
    usage = emit.responses_object(answer)["usage"]
    assert usage["input_tokens"] == 100 and usage["input_tokens_details"] == {"cached_tokens": 96}
    assert usage["total_tokens"] == 107
    stream = emit.ResponsesStream(emit.StreamHead("resp_x", "policy", 1))
    assert _sse_usage("responses", stream.body(answer)) == usage


# --- the engine model name --------------------------------------------------------------------------------------


def test_engine_model_defaults_to_the_engines_served_name(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    from consumers.inference.settings import InferenceWorkerSettings
    from learner.settings import LearnerSettings

    for var in (
        "CLAWSTREAM_PROXY_ENGINE_MODEL",
        "CLAWSTREAM_PROXY_SERVED_MODEL_NAME",
        "CLAWSTREAM_INFER_SERVED_MODEL_NAME",
        "CLAWSTREAM_LEARNER_MODEL_NAME",
    ):
        monkeypatch.delenv(var, raising=False)
    proxy = ProxySettings(model=tmp_path)
    infer = InferenceWorkerSettings(model=tmp_path / "tiny-qwen3")
    learner = LearnerSettings(model_dir=tmp_path, weight_store=tmp_path)
    assert proxy.engine_model == infer.name() == learner.model_name == DEFAULT_MODEL_NAME == "policy"
    assert infer.aliases() == ("tiny-qwen3",)  # the directory's name is still accepted in requests


def test_engine_model_flag_env_and_earlier_env_name(monkeypatch: pytest.MonkeyPatch, tmp_path, capsys) -> None:
    from producers.proxy.app import main

    assert load_settings(ProxySettings, model=tmp_path, engine_model="tiny").engine_model == "tiny"
    monkeypatch.setenv("CLAWSTREAM_PROXY_SERVED_MODEL_NAME", "earlier")
    assert ProxySettings(model=tmp_path).engine_model == "earlier"
    monkeypatch.setenv("CLAWSTREAM_PROXY_ENGINE_MODEL", "current")
    assert ProxySettings(model=tmp_path).engine_model == "current"
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0 and "--engine-model" in capsys.readouterr().out
