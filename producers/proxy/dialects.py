"""Parse requests of the harness dialects into one internal :class:`~producers.proxy.conversation.Conversation`.

* Anthropic Messages (Claude Code, OpenClaw's anthropic provider): ``system`` (string or text blocks) and
  ``role: "system"`` messages *inside* ``messages``; ``tool_use`` / ``tool_result`` / ``thinking`` blocks.
* OpenAI Chat Completions (Qwen Code, OpenClaw, opencode): ``system``/``developer``/``user``/``assistant`` (with
  ``tool_calls``)/``tool`` messages, content as a string or parts.
* OpenAI Responses (Codex): ``instructions``, ``input`` items ``message`` (roles developer/system/user/assistant),
  ``function_call``, ``function_call_output``, ``reasoning``, ``custom_tool_call(_output)``.
* Gemini (Gemini CLI): ``contents`` / ``systemInstruction`` / ``functionDeclarations``, in
  ``producers.proxy.gemini`` with its answer and error body.

Unknown fields (``thinking``, ``context_management``, ``output_config``, ``metadata``, ``cache_control``,
``stream_options`` apart from ``include_usage``, ``reasoning``, ``include``, ``store``...) are ignored. A body that
is not what the dialect requires raises :class:`DialectError` (the proxy answers 400), and so does one past the
:class:`RequestLimits` (nesting depth, message count), checked before the work each bounds. The error bodies of the
API families (:func:`anthropic_error`, :func:`openai_error`, Gemini's :func:`gemini_error`) are here too. Pure: no I/O.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from producers.proxy.conversation import (
    IMAGE_PLACEHOLDER,
    Conversation,
    DialectError,
    Message,
    ParsedRequest,
    ToolCall,
    function_tool,
    require,
)
from producers.proxy.gemini import gemini_error as gemini_error  # its answer side is in emit
from producers.proxy.gemini import parse_gemini
from producers.proxy.nesting import json_depth
from schemas.events import Dialect

_req = require


def _text_of(content: Any, where: str, joiner: str = "\n") -> str:
    """String, or a list of text parts (``text``/``input_text``/``output_text``); images become a placeholder."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    _req(isinstance(content, list), f"{where}: content must be a string or a list of parts")
    parts: list[str] = []
    for part in content:
        if isinstance(part, str):
            parts.append(part)
            continue
        _req(isinstance(part, dict), f"{where}: each content part must be an object")
        kind = part.get("type", "text")
        if kind in ("text", "input_text", "output_text", "reasoning_text", "summary_text"):
            _req(isinstance(part.get("text"), str), f"{where}: a '{kind}' part needs a string 'text'")
            parts.append(part["text"])
        elif kind in ("image", "image_url", "input_image", "document", "input_file", "file"):
            parts.append(IMAGE_PLACEHOLDER)
        # other part kinds (refusal, cache markers...) carry nothing the model reads
    return joiner.join(parts)


def _model_and_stream(body: Any) -> tuple[str, bool]:
    _req(isinstance(body, dict), "the request body must be a JSON object")
    model = body.get("model", "")
    _req(isinstance(model, str), "'model' must be a string")
    stream = body.get("stream", False)
    _req(isinstance(stream, bool), "'stream' must be a boolean")
    return model, stream


def _max_tokens(body: dict[str, Any], *names: str) -> int | None:
    for name in names:
        value = body.get(name)
        if value is not None:
            _req(isinstance(value, int) and not isinstance(value, bool) and value > 0, f"'{name}' must be > 0")
            return value
    return None


def _arguments(value: Any, where: str) -> Any:
    _req(isinstance(value, (str, dict)), f"{where}: tool-call arguments must be a JSON string or an object")
    return value


# --- Anthropic Messages -----------------------------------------------------------------------------------------


def parse_anthropic(body: Any) -> ParsedRequest:
    model, stream = _model_and_stream(body)
    messages = body.get("messages")
    _req(isinstance(messages, list) and len(messages) > 0, "'messages' must be a non-empty list")
    out: list[Message] = []
    system = _text_of(body.get("system"), "system", joiner="\n\n")
    if system:
        out.append(Message("system", system))
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        _req(isinstance(msg, dict), f"{where} must be an object")
        role, content = msg.get("role"), msg.get("content")
        _req(role in ("user", "assistant", "system"), f"{where}: role must be user, assistant or system")
        if role == "system":
            out.append(Message("system", _text_of(content, where)))
        elif isinstance(content, str):
            out.append(Message(role, content))
        else:
            _req(isinstance(content, list), f"{where}: content must be a string or a list of blocks")
            out.extend(_anthropic_blocks(role, content, where))
    tools = []
    for j, tool in enumerate(body.get("tools") or []):
        _req(isinstance(tool, dict) and isinstance(tool.get("name"), str), f"tools[{j}] needs a string 'name'")
        if "input_schema" in tool or tool.get("type") in (None, "custom"):
            tools.append(function_tool(tool["name"], tool.get("description", ""), tool.get("input_schema")))
        # server tools (web_search_..., bash_...) have no schema the model could follow: left out
    return ParsedRequest(
        Dialect.ANTHROPIC_MESSAGES,
        model,
        Conversation(tuple(out), tuple(tools)),
        stream,
        _max_tokens(body, "max_tokens"),
    )


def _str_field(block: dict[str, Any], name: str, where: str) -> str:
    """A block's optional string field: absent or null is "", anything but a string is a 400 (it was a 500)."""
    value = block.get(name)
    _req(value is None or isinstance(value, str), f"{where}: a '{block.get('type')}' block's '{name}' must be a string")
    return value or ""


def _anthropic_blocks(role: str, blocks: list[Any], where: str) -> list[Message]:
    texts: list[str] = []
    if role == "assistant":
        reasoning: list[str] = []
        calls: list[ToolCall] = []
        for block in blocks:
            _req(isinstance(block, dict), f"{where}: each content block must be an object")
            kind = block.get("type")
            if kind == "text":
                texts.append(_str_field(block, "text", where))
            elif kind == "thinking":
                reasoning.append(_str_field(block, "thinking", where))
            elif kind == "tool_use":
                _req(isinstance(block.get("name"), str), f"{where}: tool_use needs a string 'name'")
                calls.append(ToolCall(block.get("id", ""), block["name"], _arguments(block.get("input", {}), where)))
        return [Message("assistant", "".join(texts), "\n".join(reasoning), tuple(calls))]
    tool_msgs: list[Message] = []
    for block in blocks:
        _req(isinstance(block, dict), f"{where}: each content block must be an object")
        kind = block.get("type")
        if kind == "tool_result":
            text = _text_of(block.get("content"), where)
            tool_msgs.append(Message("tool", text, tool_call_id=str(block.get("tool_use_id", ""))))
        elif kind == "text":
            texts.append(_str_field(block, "text", where))
        elif kind in ("image", "document"):
            texts.append(IMAGE_PLACEHOLDER)
    out = tool_msgs
    if texts or not tool_msgs:
        out = [*tool_msgs, Message("user", "\n".join(texts))]
    return out


# --- OpenAI Chat Completions ------------------------------------------------------------------------------------


def parse_openai_chat(body: Any) -> ParsedRequest:
    model, stream = _model_and_stream(body)
    messages = body.get("messages")
    _req(isinstance(messages, list) and len(messages) > 0, "'messages' must be a non-empty list")
    out: list[Message] = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        _req(isinstance(msg, dict), f"{where} must be an object")
        role = msg.get("role")
        content = _text_of(msg.get("content"), where)
        if role in ("system", "developer"):
            out.append(Message("system", content))
        elif role == "user":
            out.append(Message("user", content))
        elif role == "assistant":
            calls = []
            for tc in msg.get("tool_calls") or []:
                fn: Any = tc.get("function") if isinstance(tc, dict) else None
                _req(isinstance(fn, dict) and isinstance(fn.get("name"), str), f"{where}: bad tool_calls entry")
                calls.append(ToolCall(str(tc.get("id", "")), fn["name"], _arguments(fn.get("arguments", "{}"), where)))
            reasoning = msg.get("reasoning_content") or msg.get("reasoning") or ""
            out.append(Message("assistant", content, reasoning if isinstance(reasoning, str) else "", tuple(calls)))
        elif role in ("tool", "function"):
            call_id = str(msg.get("tool_call_id", ""))
            out.append(Message("tool", content, tool_call_id=call_id, name=msg.get("name") or ""))
        else:
            raise DialectError(f"{where}: unknown role {role!r}")
    tools = []
    for j, tool in enumerate(body.get("tools") or []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        _req(isinstance(fn, dict) and isinstance(fn.get("name"), str), f"tools[{j}] needs function.name")
        tools.append(function_tool(fn["name"], fn.get("description", ""), fn.get("parameters")))
    opts = body.get("stream_options")
    include_usage = bool(isinstance(opts, dict) and opts.get("include_usage"))
    return ParsedRequest(
        Dialect.OPENAI_CHAT,
        model,
        Conversation(tuple(out), tuple(tools)),
        stream,
        _max_tokens(body, "max_completion_tokens", "max_tokens"),
        include_usage,
    )


# --- OpenAI Responses -------------------------------------------------------------------------------------------

CUSTOM_TOOL_PARAMETERS = {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}


def parse_openai_responses(body: Any) -> ParsedRequest:
    model, stream = _model_and_stream(body)
    items = body.get("input")
    _req(isinstance(items, (str, list)) and len(items) > 0, "'input' must be a non-empty string or list of items")
    out: list[Message] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        out.append(Message("system", instructions))
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    _responses_input(items, out)
    return ParsedRequest(
        Dialect.OPENAI_RESPONSES,
        model,
        Conversation(tuple(out), tuple(_responses_tools(body))),
        stream,
        _max_tokens(body, "max_output_tokens"),
    )


def _responses_input(items: list[Any], out: list[Message]) -> None:
    """Append the messages of a Responses ``input`` list to ``out``: consecutive reasoning, text and tool-call
    items form one assistant turn."""
    pending: dict[str, Any] | None = None  # the assistant turn being assembled from consecutive items

    def flush() -> None:
        nonlocal pending
        if pending is not None:
            out.append(Message("assistant", pending["text"], pending["reasoning"], tuple(pending["calls"])))
            pending = None

    def assistant() -> dict[str, Any]:
        nonlocal pending
        if pending is None:
            pending = {"text": "", "reasoning": "", "calls": []}
        return pending

    for i, item in enumerate(items):
        where = f"input[{i}]"
        _req(isinstance(item, dict), f"{where} must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            text = _text_of(item.get("content"), where)
            if role == "assistant":
                cur = assistant()
                if cur["calls"]:  # text after tool calls starts a new turn
                    flush()
                    cur = assistant()
                cur["text"] += text
            elif role in ("system", "developer", "user"):
                flush()
                out.append(Message("system" if role != "user" else "user", text))
            else:
                raise DialectError(f"{where}: unknown role {role!r}")
        elif kind == "reasoning":
            if pending is not None and (pending["text"] or pending["calls"]):
                flush()
            summary = _text_of(item.get("summary") or [], where)
            content = _text_of(item.get("content") or [], where)
            assistant()["reasoning"] += content or summary
        elif kind in ("function_call", "custom_tool_call"):
            _req(isinstance(item.get("name"), str), f"{where}: {kind} needs a string 'name'")
            args = (
                _arguments(item.get("arguments", "{}"), where)
                if kind == "function_call"
                else {"input": item.get("input", "")}
            )
            assistant()["calls"].append(ToolCall(str(item.get("call_id", "")), item["name"], args))
        elif kind in ("function_call_output", "custom_tool_call_output"):
            flush()
            out.append(Message("tool", _text_of(item.get("output"), where), tool_call_id=str(item.get("call_id", ""))))
        # other item kinds (web_search_call, item_reference, ...) carry nothing this model reads
    flush()


def _responses_tools(body: Any) -> list[Any]:
    tools = []
    flat: list[Any] = []
    for tool in body.get("tools") or []:
        # Codex groups sub-agent tools in a {"type": "namespace", "tools": [...]}: the model sees the functions.
        is_ns = isinstance(tool, dict) and tool.get("type") == "namespace" and isinstance(tool.get("tools"), list)
        flat.extend(tool["tools"] if is_ns else [tool])
    for j, tool in enumerate(flat):
        _req(isinstance(tool, dict), f"tools[{j}] must be an object")
        if tool.get("type") == "function":
            _req(isinstance(tool.get("name"), str), f"tools[{j}] needs a string 'name'")
            tools.append(function_tool(tool["name"], tool.get("description", ""), tool.get("parameters")))
        elif tool.get("type") == "custom" and isinstance(tool.get("name"), str):
            tools.append(function_tool(tool["name"], tool.get("description", ""), CUSTOM_TOOL_PARAMETERS))
    return tools


PARSERS = {
    Dialect.ANTHROPIC_MESSAGES: parse_anthropic,
    Dialect.OPENAI_CHAT: parse_openai_chat,
    Dialect.OPENAI_RESPONSES: parse_openai_responses,
    Dialect.GEMINI: parse_gemini,
}


def custom_tool_names(body: Any) -> frozenset[str]:
    """Names of Responses ``custom`` (free-form) tools: their calls go back as ``custom_tool_call`` items."""
    tools = body.get("tools") if isinstance(body, dict) else None
    custom = [t for t in tools or [] if isinstance(t, dict) and t.get("type") == "custom"]
    return frozenset(t["name"] for t in custom if isinstance(t.get("name"), str))


# --- limits -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestLimits:
    """What one request may hold, each checked before the work it bounds (``ProxySettings.max_json_depth``,
    ``max_messages``; the body's bytes are aiohttp's ``client_max_size``): :class:`DialectError` past one."""

    max_json_depth: int = 64
    max_messages: int = 4096

    def check_text(self, raw: bytes) -> None:
        """Before the body is decoded: its nesting."""
        self._depth(json_depth(raw), "the request body")

    def check_body(self, body: Any) -> None:
        """Before the dialect's parser: the length of its message list (``messages``, Responses' ``input``,
        Gemini's ``contents``)."""
        for name in ("messages", "input", "contents"):
            items = body.get(name) if isinstance(body, dict) else None
            if isinstance(items, list) and len(items) > self.max_messages:
                raise DialectError(f"'{name}' holds {len(items)} items; {self._most('max_messages')}")

    def check_parsed(self, parsed: ParsedRequest) -> None:
        """Before rendering: the conversation's length (content blocks can make more messages than the list) and
        the nesting of each tool call's arguments given as JSON text (parsed again whenever calls are compared)."""
        messages = parsed.conversation.messages
        if len(messages) > self.max_messages:
            raise DialectError(f"the conversation holds {len(messages)} messages; {self._most('max_messages')}")
        for i, msg in enumerate(messages):
            for call in msg.tool_calls:
                if isinstance(call.arguments, str):
                    self._depth(json_depth(call.arguments), f"the arguments of tool call {call.name!r} (message {i})")

    def _depth(self, depth: int, what: str) -> None:
        if depth > self.max_json_depth:
            raise DialectError(f"{what}: JSON nested {depth} levels deep; {self._most('max_json_depth')}")

    def _most(self, name: str) -> str:
        return f"at most {getattr(self, name)} (the proxy's {name}, CLAWSTREAM_PROXY_{name.upper()})"


def utf8_body(raw: bytes) -> bytes:
    """A request body as UTF-8, the one encoding the byte-level checks read: JSON sent in UTF-16 or UTF-32 (which
    ``json.loads`` accepts) re-encoded first; :class:`DialectError` if it does not decode."""
    encoding = json.detect_encoding(raw)
    if encoding == "utf-8":
        return raw
    try:
        return raw.decode(encoding, "surrogatepass").encode("utf-8", "surrogatepass")
    except UnicodeError as exc:
        raise DialectError(f"request body is not valid {encoding}: {exc}") from exc


# --- errors -----------------------------------------------------------------------------------------------------

_ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    503: "overloaded_error",
    504: "api_error",
}
_OPENAI_ERRORS = {
    400: ("invalid_request_error", "invalid_request"),
    401: ("invalid_request_error", "invalid_api_key"),
    404: ("invalid_request_error", "not_found"),
    409: ("invalid_request_error", "conflict"),
    413: ("invalid_request_error", "request_too_large"),
    500: ("server_error", "internal_error"),
    502: ("server_error", "engine_unavailable"),
    503: ("server_error", "service_unavailable"),
    504: ("server_error", "engine_timeout"),
}


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    """Anthropic's JSON error body for an HTTP status."""
    return {"type": "error", "error": {"type": _ANTHROPIC_ERROR_TYPES.get(status, "api_error"), "message": message}}


def openai_error(status: int, message: str) -> dict[str, Any]:
    """The OpenAI JSON error body (Chat and Responses) for an HTTP status."""
    kind, code = _OPENAI_ERRORS.get(status, ("server_error" if status >= 500 else "invalid_request_error", None))
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}
