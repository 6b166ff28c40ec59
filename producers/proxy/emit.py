"""The response side of each dialect: a finished turn as a JSON body or as its exact SSE event sequence.

Pseudo-streaming (docs/method.md#pseudo-streaming): the proxy parses the whole turn once, then streams it. A
stream (:class:`SseStream`) has a *preamble* (sent as soon as it opens, before the engine answers: ids, model
name, prompt length), a *keep-alive* (sent while the engine works), then the *body* (the turn) or an *error*.

* Anthropic: ``message_start`` | ``ping`` | ``content_block_start/delta/stop`` per block, ``message_delta``
  (stop_reason + usage), ``message_stop``.
* OpenAI Chat: a ``role`` chunk | SSE comment | content / ``reasoning_content`` / ``tool_calls`` chunks, a
  ``finish_reason`` chunk, a usage chunk (``choices: []``) when ``include_usage``, ``[DONE]``.
* OpenAI Responses: ``response.created`` + ``response.in_progress`` | SSE comment | per output item
  ``response.output_item.added`` ... ``.done``, then ``response.completed`` (or ``response.incomplete``).
* Gemini: ``data:`` GenerateContentResponse chunks (``producers.proxy.gemini``: its request side too).

:data:`EMITTERS` is the table, one :class:`Emitter` row per dialect: its routes, id prefixes, JSON body, error
body and stream. Where each API reports cached prompt tokens: docs/method.md#pseudo-streaming. Pure: no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from producers.proxy import gemini
from producers.proxy.answer import KEEPALIVE_COMMENT, Answer, ApiError, SseStream, StreamHead, sse
from producers.proxy.conversation import ParsedRequest
from producers.proxy.dialects import anthropic_error, gemini_error, openai_error
from schemas.events import Dialect

__all__ = ["KEEPALIVE_COMMENT", "EMITTERS", "Answer", "ApiError", "Emitter", "SseStream", "StreamHead", "sse"]

# --- Anthropic --------------------------------------------------------------------------------------------------


def anthropic_stop_reason(ans: Answer) -> str:
    if ans.turn.tool_calls:
        return "tool_use"
    return "max_tokens" if ans.finish == "length" else "end_turn"


def _anthropic_usage(prompt_tokens: int, output_tokens: int, cached_tokens: int = 0) -> dict[str, int]:
    """Anthropic usage: ``input_tokens`` excludes the cache reads (their sum is the prompt)."""
    return {
        "input_tokens": prompt_tokens - cached_tokens,
        "output_tokens": output_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached_tokens,
    }


def _anthropic_blocks(ans: Answer) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if ans.turn.reasoning:
        blocks.append({"type": "thinking", "thinking": ans.turn.reasoning, "signature": "clawstream"})
    if ans.turn.text or not ans.turn.tool_calls:
        blocks.append({"type": "text", "text": ans.turn.text})
    for call, cid in zip(ans.turn.tool_calls, ans.tool_call_ids, strict=True):
        blocks.append({"type": "tool_use", "id": cid, "name": call.name, "input": call.arguments})
    return blocks


def anthropic_message(ans: Answer) -> dict[str, Any]:
    return {
        "id": ans.response_id,
        "type": "message",
        "role": "assistant",
        "model": ans.model,
        "content": _anthropic_blocks(ans),
        "stop_reason": anthropic_stop_reason(ans),
        "stop_sequence": None,
        "usage": _anthropic_usage(ans.prompt_tokens, ans.completion_tokens, ans.cached_tokens),
    }


def anthropic_preamble(response_id: str, model: str, prompt_tokens: int) -> bytes:
    message: dict[str, Any] = {
        "id": response_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": _anthropic_usage(prompt_tokens, 1),
    }
    return sse({"type": "message_start", "message": message}, "message_start")


ANTHROPIC_PING = sse({"type": "ping"}, "ping")


def anthropic_body(ans: Answer) -> bytes:
    out: list[bytes] = []
    for i, block in enumerate(_anthropic_blocks(ans)):
        if block["type"] == "thinking":
            start: dict[str, Any] = {"type": "thinking", "thinking": "", "signature": ""}
            deltas = [
                {"type": "thinking_delta", "thinking": block["thinking"]},
                {"type": "signature_delta", "signature": block["signature"]},
            ]
        elif block["type"] == "text":
            start = {"type": "text", "text": ""}
            deltas = [{"type": "text_delta", "text": block["text"]}] if block["text"] else []
        else:
            start = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
            deltas = [{"type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}]
        out.append(sse({"type": "content_block_start", "index": i, "content_block": start}, "content_block_start"))
        for delta in deltas:
            out.append(sse({"type": "content_block_delta", "index": i, "delta": delta}, "content_block_delta"))
        out.append(sse({"type": "content_block_stop", "index": i}, "content_block_stop"))
    delta = {"stop_reason": anthropic_stop_reason(ans), "stop_sequence": None}
    usage = _anthropic_usage(ans.prompt_tokens, ans.completion_tokens, ans.cached_tokens)
    out.append(sse({"type": "message_delta", "delta": delta, "usage": usage}, "message_delta"))
    out.append(sse({"type": "message_stop"}, "message_stop"))
    return b"".join(out)


def anthropic_stream_error(message: str, kind: str = "api_error") -> bytes:
    return sse({"type": "error", "error": {"type": kind, "message": message}}, "error")


class AnthropicStream(SseStream):
    keepalive = ANTHROPIC_PING

    def preamble(self) -> bytes:
        return anthropic_preamble(self.head.response_id, self.head.model, self.head.prompt_tokens)

    def body(self, ans: Answer) -> bytes:
        return anthropic_body(ans)

    def error(self, status: int, message: str) -> bytes:
        return anthropic_stream_error(message, anthropic_error(status, message)["error"]["type"])


# --- OpenAI Chat ------------------------------------------------------------------------------------------------


def chat_finish_reason(ans: Answer) -> str:
    if ans.turn.tool_calls:
        return "tool_calls"
    return "length" if ans.finish == "length" else "stop"


def _chat_usage(ans: Answer) -> dict[str, Any]:
    total = ans.prompt_tokens + ans.completion_tokens
    return {
        "prompt_tokens": ans.prompt_tokens,
        "completion_tokens": ans.completion_tokens,
        "total_tokens": total,
        "prompt_tokens_details": {"cached_tokens": ans.cached_tokens},
    }


def _chat_tool_calls(ans: Answer) -> list[dict[str, Any]]:
    return [
        {"id": cid, "type": "function", "function": {"name": c.name, "arguments": c.arguments_json}}
        for c, cid in zip(ans.turn.tool_calls, ans.tool_call_ids, strict=True)
    ]


def chat_completion(ans: Answer) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": ans.turn.text or None}
    if ans.turn.reasoning:
        message["reasoning_content"] = ans.turn.reasoning
    if ans.turn.tool_calls:
        message["tool_calls"] = _chat_tool_calls(ans)
    return {
        "id": ans.response_id,
        "object": "chat.completion",
        "created": ans.created,
        "model": ans.model,
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": chat_finish_reason(ans)}],
        "usage": _chat_usage(ans),
    }


def _chunk(
    response_id: str,
    model: str,
    created: int,
    delta: dict[str, Any],
    finish: str | None = None,
    include_usage: bool = False,
) -> bytes:
    chunk: dict[str, Any] = {
        "id": response_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }
    if include_usage:
        chunk["usage"] = None
    return sse(chunk)


def chat_preamble(response_id: str, model: str, created: int, include_usage: bool) -> bytes:
    return _chunk(response_id, model, created, {"role": "assistant", "content": ""}, None, include_usage)


def chat_body(ans: Answer, include_usage: bool) -> bytes:
    rid, model, created = ans.response_id, ans.model, ans.created
    out: list[bytes] = []
    if ans.turn.reasoning:
        out.append(_chunk(rid, model, created, {"reasoning_content": ans.turn.reasoning}, None, include_usage))
    if ans.turn.text:
        out.append(_chunk(rid, model, created, {"content": ans.turn.text}, None, include_usage))
    for i, call in enumerate(_chat_tool_calls(ans)):
        head = {
            "index": i,
            "id": call["id"],
            "type": "function",
            "function": {"name": call["function"]["name"], "arguments": ""},
        }
        out.append(_chunk(rid, model, created, {"tool_calls": [head]}, None, include_usage))
        args = {"index": i, "function": {"arguments": call["function"]["arguments"]}}
        out.append(_chunk(rid, model, created, {"tool_calls": [args]}, None, include_usage))
    out.append(_chunk(rid, model, created, {}, chat_finish_reason(ans), include_usage))
    if include_usage:
        usage = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [],
            "usage": _chat_usage(ans),
        }
        out.append(sse(usage))
    out.append(sse("[DONE]"))
    return b"".join(out)


def chat_stream_error(body: dict[str, Any]) -> bytes:
    return sse(body)


class ChatStream(SseStream):
    def preamble(self) -> bytes:
        head = self.head
        return chat_preamble(head.response_id, head.model, head.created, head.include_usage)

    def body(self, ans: Answer) -> bytes:
        return chat_body(ans, self.head.include_usage)

    def error(self, status: int, message: str) -> bytes:
        return chat_stream_error(openai_error(status, message))


# --- OpenAI Responses -------------------------------------------------------------------------------------------


class ResponsesStream(SseStream):
    """Builds the Responses event sequence; keeps the ``sequence_number`` counter across preamble and body."""

    def __init__(self, head: StreamHead) -> None:
        super().__init__(head)
        self.seq = 0

    def event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse(data, kind)

    def response(
        self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None, **extra: Any
    ) -> dict[str, Any]:
        return {
            "id": self.head.response_id,
            "object": "response",
            "created_at": self.head.created,
            "status": status,
            "model": self.head.model,
            "output": output,
            "usage": usage,
            "error": None,
            "incomplete_details": None,
            "instructions": None,
            "metadata": {},
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
            **extra,
        }

    def preamble(self) -> bytes:
        resp = self.response("in_progress", [])
        return self.event("response.created", response=resp) + self.event("response.in_progress", response=resp)

    def error(self, status: int, message: str) -> bytes:
        # Whatever the status: the Responses clients read a failed stream's code, not an HTTP status.
        resp = self.response("failed", [], error={"code": "server_error", "message": message})
        return self.event("response.failed", response=resp)

    def body(self, ans: Answer) -> bytes:
        out: list[bytes] = []
        for idx, item in enumerate(responses_output(ans)):
            done = dict(item)
            if item["type"] == "message":
                added = {**item, "status": "in_progress", "content": []}
                out.append(self.event("response.output_item.added", output_index=idx, item=added))
                part = item["content"][0]
                ids = {"item_id": item["id"], "output_index": idx, "content_index": 0}
                out.append(self.event("response.content_part.added", **ids, part={**part, "text": ""}))
                out.append(self.event("response.output_text.delta", **ids, delta=part["text"], logprobs=[]))
                out.append(self.event("response.output_text.done", **ids, text=part["text"], logprobs=[]))
                out.append(self.event("response.content_part.done", **ids, part=part))
            elif item["type"] == "function_call":
                added = {**item, "status": "in_progress", "arguments": ""}
                out.append(self.event("response.output_item.added", output_index=idx, item=added))
                ids = {"item_id": item["id"], "output_index": idx}
                out.append(self.event("response.function_call_arguments.delta", **ids, delta=item["arguments"]))
                out.append(self.event("response.function_call_arguments.done", **ids, arguments=item["arguments"]))
            elif item["type"] == "reasoning":
                out.append(self.event("response.output_item.added", output_index=idx, item={**item, "summary": []}))
                ids = {"item_id": item["id"], "output_index": idx, "summary_index": 0}
                text = item["summary"][0]["text"]
                out.append(
                    self.event(
                        "response.reasoning_summary_part.added", **ids, part={"type": "summary_text", "text": ""}
                    )
                )
                out.append(self.event("response.reasoning_summary_text.delta", **ids, delta=text))
                out.append(self.event("response.reasoning_summary_text.done", **ids, text=text))
                out.append(self.event("response.reasoning_summary_part.done", **ids, part=item["summary"][0]))
            else:  # custom_tool_call
                out.append(self.event("response.output_item.added", output_index=idx, item={**item, "input": ""}))
            out.append(self.event("response.output_item.done", output_index=idx, item=done))
        final = responses_object(ans)
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        out.append(self.event(kind, response=final))
        return b"".join(out)


def responses_output(ans: Answer) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    suffix = ans.response_id.removeprefix("resp_")
    if ans.turn.reasoning:
        items.append(
            {
                "id": f"rs_{suffix}",
                "type": "reasoning",
                "summary": [{"type": "summary_text", "text": ans.turn.reasoning}],
            }
        )
    if ans.turn.text or not ans.turn.tool_calls:
        part = {"type": "output_text", "text": ans.turn.text, "annotations": []}
        items.append(
            {"id": f"msg_{suffix}", "type": "message", "status": "completed", "role": "assistant", "content": [part]}
        )
    for i, (call, cid) in enumerate(zip(ans.turn.tool_calls, ans.tool_call_ids, strict=True)):
        if call.name in ans.custom_tools:
            items.append(
                {
                    "id": f"ctc_{suffix}_{i}",
                    "type": "custom_tool_call",
                    "status": "completed",
                    "call_id": cid,
                    "name": call.name,
                    "input": str(call.arguments.get("input", "")),
                }
            )
        else:
            items.append(
                {
                    "id": f"fc_{suffix}_{i}",
                    "type": "function_call",
                    "status": "completed",
                    "call_id": cid,
                    "name": call.name,
                    "arguments": call.arguments_json,
                }
            )
    return items


def responses_object(ans: Answer) -> dict[str, Any]:
    usage = {
        "input_tokens": ans.prompt_tokens,
        "input_tokens_details": {"cached_tokens": ans.cached_tokens},
        "output_tokens": ans.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": ans.prompt_tokens + ans.completion_tokens,
    }
    stream = ResponsesStream(StreamHead(ans.response_id, ans.model, ans.created))
    if ans.finish == "length" and not ans.turn.tool_calls:
        return stream.response(
            "incomplete", responses_output(ans), usage, incomplete_details={"reason": "max_output_tokens"}
        )
    return stream.response("completed", responses_output(ans), usage)


# --- the table --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Emitter:
    """One dialect's response side (its request side: ``dialects.PARSERS``)."""

    paths: tuple[str, ...]  # POST routes under /r/{rid} and /r/{rid}/v1
    response_prefix: str  # response id = prefix + the call id's first 24 hex digits
    tool_call_prefix: str  # tool-call id = prefix + 24 random hex digits
    body: Callable[[Answer], dict[str, Any]]  # the non-streaming JSON body
    error_body: Callable[[int, str], dict[str, Any]]  # the JSON error body for an HTTP status
    stream: Callable[[StreamHead], SseStream]  # the SSE event sequence of one streamed answer
    # What the route itself says about the request (Gemini: the model and whether to stream are in the URL).
    route: Callable[[ParsedRequest, Mapping[str, str], str], ParsedRequest] = lambda parsed, _match, _path: parsed

    def response_id(self, call_id: str) -> str:
        return self.response_prefix + call_id[:24]


EMITTERS: dict[Dialect, Emitter] = {
    Dialect.ANTHROPIC_MESSAGES: Emitter(
        ("/messages",), "msg_", "toolu_", anthropic_message, anthropic_error, AnthropicStream
    ),
    Dialect.OPENAI_CHAT: Emitter(
        ("/chat/completions",), "chatcmpl-", "call_", chat_completion, openai_error, ChatStream
    ),
    Dialect.OPENAI_RESPONSES: Emitter(
        ("/responses",), "resp_", "call_", responses_object, openai_error, ResponsesStream
    ),
    Dialect.GEMINI: Emitter(
        gemini.PATHS, "", "fc_", gemini.gemini_response, gemini_error, gemini.GeminiStream, gemini.with_route
    ),
}
