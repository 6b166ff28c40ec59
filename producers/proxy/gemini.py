"""The Gemini API dialect (Gemini CLI, the ``@google/genai`` SDK): its request parsed into the internal conversation,
its answer as a JSON body or a stream, its error body.

Routes (under ``/r/{rid}``, the harness's ``GOOGLE_GEMINI_BASE_URL``): ``POST /v1beta/models/{model}:generateContent``
and ``...:streamGenerateContent`` (``?alt=sse``); the model and whether to stream are in the URL (:func:`with_route`).

* Request: ``contents[]`` of ``{role: "user"|"model", parts: [...]}`` (a part is ``text`` — ``thought: true`` marks
  reasoning —, ``functionCall {name, args, id?}``, ``functionResponse {name, response, id?}``, ``inlineData`` /
  ``fileData``), ``systemInstruction`` (a content or a string), ``tools[].functionDeclarations[]`` (``parameters``
  or ``parametersJsonSchema``), ``generationConfig.maxOutputTokens``. A user content's function responses become tool
  messages, its text one user message after them; a model content is one assistant turn. ``thoughtSignature``,
  ``safetySettings``, ``toolConfig``, ``cachedContent`` and the sampling fields are ignored (the rollout samples).
* Answer: ``{candidates: [{content: {role: "model", parts}, finishReason, index}], usageMetadata, modelVersion,
  responseId}`` (``usageMetadata.cachedContentTokenCount``: the engine's cached prompt tokens); streamed as one
  ``data: {...}\\r\\n\\r\\n`` chunk. The SDK reads a line that does not start ``data:`` as garbage unless it is
  whitespace, so the keep-alive is a bare newline and there is no preamble; a failed stream is the error body
  itself, the raw JSON the SDK checks every chunk for.
* Error: ``{"error": {"code": 400, "message": ..., "status": "INVALID_ARGUMENT"}}``.

Pure: no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from producers.proxy.answer import Answer, SseStream
from producers.proxy.conversation import (
    IMAGE_PLACEHOLDER,
    Conversation,
    Message,
    ParsedRequest,
    ToolCall,
    canonical_json,
    function_tool,
    require,
)
from schemas.events import Dialect

PATHS = tuple(
    f"{version}/models/{{model}}:{method}"
    for version in ("/v1beta", "")  # under /r/{rid} and under /r/{rid}/v1 (apiVersion v1)
    for method in ("generateContent", "streamGenerateContent")
)
STREAM_METHOD = ":streamGenerateContent"

_STATUS = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    409: "ABORTED",
    413: "INVALID_ARGUMENT",
    429: "RESOURCE_EXHAUSTED",
    500: "INTERNAL",
    502: "UNAVAILABLE",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}


def gemini_error(status: int, message: str) -> dict[str, Any]:
    """Google's JSON error body for an HTTP status."""
    code = _STATUS.get(status, "INTERNAL" if status >= 500 else "INVALID_ARGUMENT")
    return {"error": {"code": status, "message": message, "status": code}}


def with_route(parsed: ParsedRequest, match: Mapping[str, str], path: str) -> ParsedRequest:
    """The request as its URL completes it: the model named in the path, streaming for ``:streamGenerateContent``."""
    return replace(parsed, model=match.get("model", parsed.model), stream=path.endswith(STREAM_METHOD))


# --- request ----------------------------------------------------------------------------------------------------


def parse_gemini(body: Any) -> ParsedRequest:
    require(isinstance(body, dict), "the request body must be a JSON object")
    contents = body.get("contents")
    require(isinstance(contents, list) and len(contents) > 0, "'contents' must be a non-empty list")
    out: list[Message] = []
    system = _system(body.get("systemInstruction", body.get("system_instruction")))
    if system:
        out.append(Message("system", system))
    for i, content in enumerate(contents):
        out.extend(_content(content, f"contents[{i}]"))
    model = body.get("model", "")
    require(isinstance(model, str), "'model' must be a string")
    return ParsedRequest(
        Dialect.GEMINI, model, Conversation(tuple(out), tuple(_tools(body.get("tools")))), False, _max_tokens(body)
    )


def _parts(content: Any, where: str) -> list[dict[str, Any]]:
    require(isinstance(content, dict), f"{where} must be an object")
    parts = content.get("parts", [])
    require(isinstance(parts, list), f"{where}: 'parts' must be a list")
    for j, part in enumerate(parts):
        require(isinstance(part, dict), f"{where}.parts[{j}] must be an object")
    return parts


def _text(part: dict[str, Any], where: str) -> str:
    text = part.get("text")
    require(isinstance(text, str), f"{where}: a part's 'text' must be a string")
    return str(text)


def _system(value: Any) -> str:
    if value is None or isinstance(value, str):
        return value or ""
    where = "systemInstruction"
    return "\n".join(_text(p, where) for p in _parts(value, where) if "text" in p)


def _content(content: Any, where: str) -> list[Message]:
    parts = _parts(content, where)
    role = content.get("role", "user")
    require(role in ("user", "model", "function"), f"{where}: role must be user or model")
    if role == "model":
        texts, reasoning, calls = [], [], []
        for part in parts:
            if "functionCall" in part:
                calls.append(_function_call(part["functionCall"], where))
            elif "text" in part:
                (reasoning if part.get("thought") is True else texts).append(_text(part, where))
        return [Message("assistant", "".join(texts), "\n".join(reasoning), tuple(calls))]
    tool_msgs: list[Message] = []
    user: list[str] = []
    for part in parts:
        if "functionResponse" in part:
            tool_msgs.append(_function_response(part["functionResponse"], where))
        elif "text" in part:
            if part.get("thought") is not True:
                user.append(_text(part, where))
        elif "inlineData" in part or "fileData" in part:
            user.append(IMAGE_PLACEHOLDER)
    if user or not tool_msgs:
        return [*tool_msgs, Message("user", "\n".join(user))]
    return tool_msgs


def _function_call(call: Any, where: str) -> ToolCall:
    require(isinstance(call, dict) and isinstance(call.get("name"), str), f"{where}: functionCall needs a 'name'")
    args = call.get("args", {})
    require(isinstance(args, dict), f"{where}: functionCall 'args' must be an object")
    call_id = call.get("id", "")
    return ToolCall(call_id if isinstance(call_id, str) else "", call["name"], args)


def _function_response(resp: Any, where: str) -> Message:
    require(isinstance(resp, dict) and isinstance(resp.get("name"), str), f"{where}: functionResponse needs a 'name'")
    value = resp.get("response", {})
    require(isinstance(value, dict), f"{where}: functionResponse 'response' must be an object")
    # Gemini CLI answers {"output": text} (or {"error": text}): the model reads the text itself.
    only = next(iter(value.values())) if len(value) == 1 else None
    text = only if isinstance(only, str) else canonical_json(value)
    call_id = resp.get("id", "")
    return Message("tool", text, tool_call_id=call_id if isinstance(call_id, str) else "", name=resp["name"])


def _tools(tools: Any) -> list[dict[str, Any]]:
    require(tools is None or isinstance(tools, list), "'tools' must be a list")
    out = []
    for j, tool in enumerate(tools or []):
        require(isinstance(tool, dict), f"tools[{j}] must be an object")
        decls = tool.get("functionDeclarations", tool.get("function_declarations")) or []
        require(isinstance(decls, list), f"tools[{j}].functionDeclarations must be a list")
        for k, decl in enumerate(decls):
            where = f"tools[{j}].functionDeclarations[{k}]"
            require(isinstance(decl, dict) and isinstance(decl.get("name"), str), f"{where} needs a string 'name'")
            description = decl.get("description", "")
            require(isinstance(description, str), f"{where}: 'description' must be a string")
            params = decl.get("parametersJsonSchema", decl.get("parameters"))
            out.append(function_tool(decl["name"], description, params))
        # googleSearch, codeExecution, urlContext...: server tools the model cannot call here: left out
    return out


def _max_tokens(body: dict[str, Any]) -> int | None:
    config = body.get("generationConfig", {})
    require(isinstance(config, dict), "'generationConfig' must be an object")
    value = config.get("maxOutputTokens")
    if value is None:
        return None
    require(isinstance(value, int) and not isinstance(value, bool) and value > 0, "'maxOutputTokens' must be > 0")
    return int(value)


# --- answer -----------------------------------------------------------------------------------------------------


def _parts_of(ans: Answer) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = []
    if ans.turn.reasoning:
        parts.append({"text": ans.turn.reasoning, "thought": True})
    if ans.turn.text or not ans.turn.tool_calls:
        parts.append({"text": ans.turn.text})
    for call, cid in zip(ans.turn.tool_calls, ans.tool_call_ids, strict=True):
        parts.append({"functionCall": {"id": cid, "name": call.name, "args": call.arguments}})
    return parts


def gemini_response(ans: Answer) -> dict[str, Any]:
    """The GenerateContentResponse of a served turn (tool calls end with STOP, as Gemini's do)."""
    finish = "MAX_TOKENS" if ans.finish == "length" and not ans.turn.tool_calls else "STOP"
    usage = {
        "promptTokenCount": ans.prompt_tokens,
        "candidatesTokenCount": ans.completion_tokens,
        "totalTokenCount": ans.prompt_tokens + ans.completion_tokens,
    }
    if ans.cached_tokens:
        usage["cachedContentTokenCount"] = ans.cached_tokens
    return {
        "candidates": [{"content": {"role": "model", "parts": _parts_of(ans)}, "finishReason": finish, "index": 0}],
        "usageMetadata": usage,
        "modelVersion": ans.model,
        "responseId": ans.response_id,
    }


class GeminiStream(SseStream):
    """``streamGenerateContent?alt=sse``: the whole turn in one ``data:`` chunk, CRLF-framed as Google frames it."""

    keepalive = b"\n"

    def preamble(self) -> bytes:
        return b""

    def body(self, ans: Answer) -> bytes:
        return b"data: " + json.dumps(gemini_response(ans), ensure_ascii=False).encode() + b"\r\n\r\n"

    def error(self, status: int, message: str) -> bytes:
        return json.dumps(gemini_error(status, message), ensure_ascii=False).encode()
