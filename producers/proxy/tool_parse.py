"""Parse a finished assistant turn (decoded text) into reasoning, text and tool calls (Qwen3 markup; Llama 3's bare
JSON objects with ``bare_json``, for a template that writes tool calls that way).

The model writes ``<think>...</think>`` reasoning (optional, first) and any number of
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks. A block whose body is not a JSON object
with a string ``name`` and object (or JSON-string) ``arguments`` is *malformed*: it stays in the text verbatim,
so the harness sees exactly what the model wrote, and the call is flagged ``malformed_tool_json``.
An unterminated ``<tool_call>`` (cut off by the length limit) is malformed too, and so is a block nested deeper
than ``max_depth`` (measured before it is parsed: the policy writes it, so it is untrusted input like a request).

Pure: standard library and ``producers.proxy.nesting``. Used once per call on the whole turn (pseudo-streaming:
never on partial text).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from producers.proxy.nesting import ECHO_DEPTH, SAFE_DEPTH, loads_within

THINK_START, THINK_END = "<think>", "</think>"
TOOL_START, TOOL_END = "<tool_call>", "</tool_call>"
MALFORMED_TOOL_JSON = "malformed_tool_json"

_BLOCK = re.compile(re.escape(TOOL_START) + r"(.*?)" + re.escape(TOOL_END), re.DOTALL)


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: dict[str, Any]

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass
class ParsedTurn:
    text: str
    reasoning: str = ""
    tool_calls: list[ParsedToolCall] = field(default_factory=list)
    flags: list[str] = field(default_factory=list)


def _parse_block(body: str, max_depth: int) -> ParsedToolCall | None:
    try:  # TooDeep is a ValueError: a block nested past max_depth is malformed
        obj = loads_within(body, max_depth)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models emit the arguments as a JSON string
        try:
            args = loads_within(args, max_depth)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedToolCall(obj["name"], args)


def split_reasoning(text: str) -> tuple[str, str]:
    """(reasoning, rest). Reasoning is the body of a leading ``<think>`` block (or text before a lone ``</think>``)."""
    stripped = text.lstrip()
    if stripped.startswith(THINK_START):
        end = stripped.find(THINK_END)
        if end < 0:  # cut off while thinking: everything is reasoning
            return stripped[len(THINK_START) :].strip("\n"), ""
        return stripped[len(THINK_START) : end].strip("\n"), stripped[end + len(THINK_END) :]
    end = text.find(THINK_END)
    if end >= 0 and TOOL_START not in text[:end]:  # template put <think> in the prompt
        return text[:end].strip("\n"), text[end + len(THINK_END) :]
    return "", text


def _bare_json_calls(rest: str, max_depth: int) -> list[ParsedToolCall] | None:
    """Tool calls written as bare JSON objects, one per line (Llama 3's convention), or None if ``rest`` is not."""
    lines = [line for line in rest.strip().split("\n") if line.strip()]
    calls = [_parse_block(line.strip(), max_depth) for line in lines]
    return [c for c in calls if c is not None] if lines and None not in calls else None


def parse_turn(text: str, *, bare_json: bool = False, max_depth: int = SAFE_DEPTH - ECHO_DEPTH) -> ParsedTurn:
    """Split the generated text into reasoning, visible text and tool calls.

    ``bare_json``: the model's template writes tool calls as bare JSON objects (``{"name": ..., "parameters": ...}``,
    one per line, the whole turn), as Llama 3's does; ``producers.proxy.render.TemplateRenderer`` finds out which.
    ``max_depth``: the deepest a tool call's JSON may nest (the proxy's ``max_json_depth`` less what a harness's
    request wraps around the arguments it echoes, ``producers.proxy.nesting.ECHO_DEPTH``)."""
    if bare_json and TOOL_START not in text:
        thought, body = split_reasoning(text)
        bare = _bare_json_calls(body, max_depth)
        if bare is not None:
            return ParsedTurn(text="", reasoning=thought, tool_calls=bare)
        malformed = [MALFORMED_TOOL_JSON] if body.lstrip().startswith('{"name"') else []
        return ParsedTurn(text=body.strip(), reasoning=thought, flags=malformed)
    reasoning, rest = split_reasoning(text)
    calls: list[ParsedToolCall] = []
    kept: list[str] = []
    flags: list[str] = []
    pos = 0
    for m in _BLOCK.finditer(rest):
        kept.append(rest[pos : m.start()])
        call = _parse_block(m.group(1).strip(), max_depth)
        if call is None:
            kept.append(m.group(0))
            if MALFORMED_TOOL_JSON not in flags:
                flags.append(MALFORMED_TOOL_JSON)
        else:
            calls.append(call)
        pos = m.end()
    tail = rest[pos:]
    if TOOL_START in tail and MALFORMED_TOOL_JSON not in flags:
        flags.append(MALFORMED_TOOL_JSON)  # an unterminated block
    kept.append(tail)
    return ParsedTurn(text="".join(kept).strip(), reasoning=reasoning, tool_calls=calls, flags=flags)
