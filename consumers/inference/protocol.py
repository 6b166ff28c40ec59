"""The subset of vLLM's OpenAI-compatible completions API that the CPU engine serves: parsing and response shapes.

Pure functions (no HTTP server, no Kafka; topics in → out: none). ``consumers.inference.server`` calls them.
Field names and shapes follow vLLM's own models (vllm/entrypoints/openai/completion/protocol.py and serving.py):

* request: ``prompt`` (token ids, lists of them, a string or strings), ``max_tokens``, ``temperature``, ``top_p``,
  ``top_k``, ``seed``, ``n``, ``stop_token_ids``, ``ignore_eos``, ``logprobs`` (at most 20), ``return_token_ids``;
* response: vLLM's ``text_completion`` object, choices prompt-major, with ``usage.prompt_tokens_details.cached_tokens``
  (always present here, summed over every prompt of the request);
* errors: vLLM's ``{"error": {...}}`` with 400 ``BadRequestError`` or 404 ``NotFoundError`` (unknown model).

Our additions: top-level ``policy_version`` (also the ``X-Policy-Version`` header) and ``engine_telemetry`` (GPU
readings or null); the proxy copies both onto the call event. Departures: the options in ``UNSUPPORTED`` (streaming,
``echo``, stop strings, penalties, ...) are rejected with 400; unknown fields are ignored (as vLLM does). Which
log-probs are reported: ``policy.sampling``. Every field, default and departure:
docs/inference.md#the-completions-protocol.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from clawbase.errors import ClawstreamError
from consumers.inference.engine import GenerationResult, SamplingParams
from policy.sampling import clamp_logprob

# vLLM's --max-logprobs default (ModelConfig.max_logprobs).
DEFAULT_MAX_LOGPROBS = 20

# Options vLLM honours that this engine does not: accepted only at their neutral values.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "stream": (None, False),
    "stream_options": (None,),
    "echo": (None, False),
    "stop": (None, [], ""),
    "best_of": (None, 1),
    "use_beam_search": (None, False),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "min_p": (None, 0, 0.0),
    "min_tokens": (None, 0),
    "logit_bias": (None, {}),
    "prompt_logprobs": (None,),
    "suffix": (None, ""),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "response_format": (None,),
    "structured_outputs": (None,),
    "prompt_embeds": (None,),
    "logprob_token_ids": (None,),
    "return_tokens_as_token_ids": (None, False),
    "truncate_prompt_tokens": (None,),
}


class ProtocolError(ClawstreamError):
    """A request the server refuses; carries the HTTP status and OpenAI error type."""

    def __init__(self, message: str, *, status: int = 400, err_type: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.err_type = err_type
        self.param = param

    def body(self) -> dict[str, Any]:
        return error_body(self.message, status=self.status, err_type=self.err_type, param=self.param)


def error_body(message: str, *, status: int, err_type: str, param: str | None = None) -> dict[str, Any]:
    """vLLM's error JSON: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


@dataclass(frozen=True)
class CompletionRequest:
    """A validated ``/v1/completions`` request."""

    model: str
    prompts: list[list[int]]
    params: SamplingParams
    return_token_ids: bool


def _int(body: dict[str, Any], name: str, default: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or (isinstance(value, float) and not value.is_integer())
    ):
        raise ProtocolError(f"`{name}` must be an integer, got {value!r}", param=name)
    return int(value)


def _float(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ProtocolError(f"`{name}` must be a number, got {value!r}", param=name)
    return float(value)


def _token_list(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ProtocolError(f"`{what}` must be a list of integer token ids", param=what)
    if any(t < 0 for t in value):
        raise ProtocolError(f"`{what}` holds a negative token id", param=what)
    return value


def _prompts(value: Any, encode: Callable[[str], list[int]] | None) -> list[list[int]]:
    """``prompt`` as vLLM accepts it: list[int] | list[list[int]] | str | list[str] → list of token-id lists."""
    if value is None or value == "" or value == []:
        raise ProtocolError("Either prompt or prompt_embeds must be provided and non-empty.", param="prompt")
    items = value if isinstance(value, list) and not all(isinstance(t, int) for t in value) else [value]
    prompts: list[list[int]] = []
    for item in items:
        if isinstance(item, str):
            if encode is None:
                raise ProtocolError("text prompts need a tokenizer; send token ids", param="prompt")
            prompts.append(encode(item))
        else:
            prompts.append(_token_list(item, "prompt"))
        if not prompts[-1]:
            raise ProtocolError("a prompt must contain at least one token", param="prompt")
    return prompts


def parse_completion_request(
    body: Any,
    *,
    served_model_name: str,
    vocab_size: int,
    max_model_len: int,
    encode: Callable[[str], list[int]] | None = None,
    max_logprobs: int = DEFAULT_MAX_LOGPROBS,
    aliases: Collection[str] = (),
) -> CompletionRequest:
    """Validate a ``/v1/completions`` JSON body; raises :class:`ProtocolError` (400, or 404 for the model).

    ``model`` may be absent, the served name or one of ``aliases``; the request is answered as the served name.
    """
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != served_model_name and model not in aliases:
        raise ProtocolError(f"The model `{model}` does not exist.", status=404, err_type="NotFoundError", param="model")
    for name, neutral in UNSUPPORTED.items():
        value = body.get(name)
        if value is not None and not any(value == v and type(value) is type(v) for v in neutral if v is not None):
            raise ProtocolError(f"`{name}` is not supported by the clawstream CPU engine", param=name)
    prompts = _prompts(body.get("prompt"), encode)
    for prompt in prompts:
        if max(prompt) >= vocab_size:
            raise ProtocolError(f"token id {max(prompt)} is outside the vocabulary [0, {vocab_size})", param="prompt")

    stop_ids = body.get("stop_token_ids")
    stop_ids = [] if stop_ids is None else _token_list(stop_ids, "stop_token_ids")
    logprobs = _int(body, "logprobs", None)
    if logprobs is not None and logprobs < 0:
        raise ProtocolError("`logprobs` must be a positive value or -1.", param="logprobs")
    if logprobs is not None and logprobs > max_logprobs:
        raise ProtocolError(
            f"Requested sample logprobs of {logprobs}, which is greater than max allowed: {max_logprobs}",
            param="logprobs",
        )
    for flag in ("ignore_eos", "return_token_ids"):
        if body.get(flag) is not None and not isinstance(body[flag], bool):
            raise ProtocolError(f"`{flag}` must be a boolean", param=flag)
    top_k = _int(body, "top_k", 0)
    try:
        params = SamplingParams(
            max_tokens=_int(body, "max_tokens", 16),  # type: ignore[arg-type]
            temperature=_float(body, "temperature", 1.0),
            top_p=_float(body, "top_p", 1.0),
            top_k=top_k,  # type: ignore[arg-type]
            seed=_int(body, "seed", None),
            n=_int(body, "n", 1),  # type: ignore[arg-type]
            stop_token_ids=tuple(stop_ids),
            logprobs=logprobs,
            ignore_eos=bool(body.get("ignore_eos") or False),
        )
    except ValueError as exc:
        raise ProtocolError(str(exc)) from exc
    longest = max(len(p) for p in prompts)
    if longest + params.max_tokens > max_model_len:
        raise ProtocolError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{longest + params.max_tokens} tokens ({longest} in the prompt, {params.max_tokens} in the completion). "
            "Please reduce the length of the prompt or completion.",
            param="max_tokens",
        )
    return CompletionRequest(served_model_name, prompts, params, bool(body.get("return_token_ids") or False))


def _logprobs_object(
    token_ids: list[int], top: list[list[tuple[int, float]]], chosen: list[float], token_text: Callable[[int], str]
) -> dict[str, Any]:
    tokens = [token_text(t) for t in token_ids]
    offsets, position = [], 0
    for text in tokens:
        offsets.append(position)
        position += len(text)
    return {
        "text_offset": offsets,
        "token_logprobs": [clamp_logprob(lp) for lp in chosen],
        "tokens": tokens,
        "top_logprobs": [{token_text(tid): clamp_logprob(lp) for tid, lp in step} for step in top],
    }


def completion_response(
    result: GenerationResult,
    request: CompletionRequest,
    *,
    decode: Callable[[list[int]], str],
    token_text: Callable[[int], str],
    created: int | None = None,
    engine_telemetry: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``/v1/completions`` JSON for a finished generation (vLLM's ``CompletionResponse`` + ``policy_version``
    and ``engine_telemetry``)."""
    choices = []
    for index, out in enumerate(result.outputs):
        logprobs = None
        if request.params.logprobs is not None:
            logprobs = _logprobs_object(out.token_ids, out.top_logprobs, out.logprobs, token_text)
        choices.append(
            {
                "index": index,
                "text": decode(out.token_ids),
                "logprobs": logprobs,
                "finish_reason": out.finish_reason,
                "stop_reason": out.stop_reason,
                "token_ids": list(out.token_ids) if request.return_token_ids else None,
                "prompt_logprobs": None,
                "prompt_token_ids": list(result.prompts[out.prompt_index]) if request.return_token_ids else None,
            }
        )
    prompt_tokens = sum(len(p) for p in result.prompts)
    completion_tokens = sum(len(o.token_ids) for o in result.outputs)
    return {
        "id": result.request_id,
        "object": "text_completion",
        "created": int(time.time()) if created is None else created,
        "model": request.model,
        "choices": choices,
        "system_fingerprint": None,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_prompt_tokens(result)},
        },
        "policy_version": result.policy_version,
        "engine_telemetry": engine_telemetry,
    }


def cached_prompt_tokens(result: GenerationResult) -> int:
    """Prompt tokens of ``result`` served from the prefix cache, summed over its prompts (0 when not reported)."""
    return sum(int(n) for n in getattr(result, "cached_tokens", None) or ())


def models_response(
    served_model_name: str, root: str, max_model_len: int, created: int, aliases: Collection[str] = ()
) -> dict[str, Any]:
    """``GET /v1/models`` as vLLM answers it (``ModelList`` of one ``ModelCard`` per name, the served name first)."""
    names = [served_model_name, *(a for a in aliases if a != served_model_name)]
    return {
        "object": "list",
        "data": [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "clawstream",
                "root": root,
                "parent": None,
                "max_model_len": max_model_len,
                "permission": [],
            }
            for name in names
        ],
    }
