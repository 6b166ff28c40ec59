"""The serving proxy's internal conversation: what every dialect is translated into, and the call-kind rules.

A :class:`Conversation` is a list of :class:`Message` (roles ``system``/``user``/``assistant``/``tool``) plus the
tool schemas (OpenAI ``{"type": "function", "function": {...}}`` form, the one the Qwen3 template renders). Text
is plain ``str``: content parts are joined, images become a placeholder, fields the model never sees (ids,
``cache_control``, ``metadata``...) are dropped, so two requests that render the same compare equal.

``Message.key`` is the equality used to decide whether a request *extends* an earlier call: role + rendered
content, and for assistant turns the text (stripped) and the tool calls (name + canonical JSON arguments), which
is what the proxy itself returned and the harness echoes back (reasoning is not compared: harnesses drop or
re-encode it, and the proxy never re-renders its own turns anyway).

Call kinds (:func:`classify_call`, rules configurable through :class:`CallKindRules`), first match wins:

1. the requested model matches ``side_model_pattern``                         → SIDE
2. the last user/tool text or the system prompt matches ``compaction_pattern`` → COMPACTION
3. the rollout has no main system fingerprint yet: a call with tools, or with a system prompt longer than
   ``short_system_chars`` (default 4000: opencode's title prompt has ~2.1k chars, the smallest main prompt seen
   ~5.7k) defines it                                                           → MAIN; otherwise (no tools, short
   "title"-like system prompt)                                                  → SIDE
4. same system fingerprint as the main agent                                  → MAIN
5. different fingerprint with tools                                           → SUBAGENT; without tools → SIDE

Pure: standard library and ``producers.proxy.nesting``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from producers.proxy.nesting import loads_within
from schemas.events import CallKind, Dialect

IMAGE_PLACEHOLDER = "[image]"
# Assistant turns shipped harnesses write themselves, never the model: text only, claiming nothing a grader scores,
# so a request holding one is not tampered (``RolloutRenderer.provenance``).
HARNESS_TURNS = frozenset(
    {
        "Got it. Thanks for the context!",  # Qwen Code (as Gemini CLI) after its startup context
        "Got it. Thanks for the additional context!",  # Qwen Code after a compression summary
        "No response requested.",  # Claude Code's synthetic answer to a message that wants none
        "(no content)",  # Claude Code's stand-in for an assistant turn with no content
    }
)


class DialectError(ValueError):
    """The request body does not follow its dialect's schema (→ 400 in the caller's dialect)."""


def require(cond: bool, message: str) -> None:
    """:class:`DialectError` ``message`` unless ``cond``: the one rule form of every dialect's parser."""
    if not cond:
        raise DialectError(message)


def canonical_json(value: Any) -> str:
    """Key-sorted compact JSON: equal for equal values whatever order or spacing the harness used."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def canonical_arguments(arguments: Any) -> str:
    """Tool-call arguments (a JSON string or an object) → canonical JSON; unparseable strings, and strings nested past
    ``SAFE_DEPTH`` (never parsed), stay as they are."""
    if isinstance(arguments, str):
        try:
            arguments = loads_within(arguments)
        except ValueError:
            return arguments
    return canonical_json(arguments)


@dataclass(frozen=True)
class ToolCall:
    """One tool call of an assistant turn. ``arguments`` is what the template renders (object or JSON text)."""

    id: str
    name: str
    arguments: Any

    def key(self) -> tuple[str, str]:
        return (self.name, canonical_arguments(self.arguments))


@dataclass(frozen=True)
class Message:
    role: str  # system | user | assistant | tool
    content: str = ""
    reasoning: str = ""  # assistant only
    tool_calls: tuple[ToolCall, ...] = ()  # assistant only
    tool_call_id: str = ""  # tool only; not rendered, so not compared
    name: str = ""  # tool only: the function name when the dialect gives it

    def key(self) -> tuple[Any, ...]:
        if self.role == "assistant":
            return ("assistant", self.content.strip(), tuple(tc.key() for tc in self.tool_calls))
        return (self.role, self.content)

    def carries_nothing(self) -> bool:
        """An assistant turn with neither text nor tool calls, or one a harness writes itself (``HARNESS_TURNS``)."""
        text = self.content.strip()
        return not self.tool_calls and (not text or text in HARNESS_TURNS)

    def to_template(self) -> dict[str, Any]:
        """The message as the chat template expects it (transformers / Qwen3 conventions)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.role == "assistant":
            if self.reasoning:
                out["reasoning_content"] = self.reasoning
            if self.tool_calls:
                out["tool_calls"] = [
                    {"id": tc.id, "type": "function", "function": {"name": tc.name, "arguments": tc.arguments}}
                    for tc in self.tool_calls
                ]
        return out


@dataclass(frozen=True)
class Conversation:
    messages: tuple[Message, ...]
    tools: tuple[dict[str, Any], ...] = ()

    @property
    def system(self) -> str:
        """The leading system prompt ('' when the conversation does not start with one)."""
        if self.messages and self.messages[0].role == "system":
            return self.messages[0].content
        return ""

    def tools_key(self) -> str:
        return canonical_json(list(self.tools))

    def last_text(self) -> str:
        """Text of the trailing user/tool messages (the request's new environment input)."""
        parts: list[str] = []
        for msg in reversed(self.messages):
            if msg.role == "assistant":
                break
            if msg.role in ("user", "tool"):
                parts.append(msg.content)
        return "\n".join(reversed(parts))


@dataclass(frozen=True)
class ParsedRequest:
    """A request of any dialect: its conversation and what the dialect says about the answer it wants."""

    dialect: Dialect
    model: str
    conversation: Conversation
    stream: bool
    max_tokens: int | None
    include_usage: bool = False  # OpenAI Chat stream_options.include_usage


def transcript_messages(
    conv: Conversation,
    answer: Message,
    forged: tuple[int, ...] = (),
    reasoning: dict[int, str] | None = None,
) -> list[dict[str, Any]]:
    """A call's conversation plus the answer it got, as OpenAI Chat shaped dicts (``Message.to_template`` with the
    tool messages' ``tool_call_id`` / ``name``): what the rollout's transcript is built from
    (``producers.tasks.transcript.session_transcript``) when the seal reports the last main-agent call's.

    Only what the proxy generated and the environment's input: the assistant turns at the indices ``forged`` (ones
    the rollout never generated, ``RolloutRenderer.provenance``) are left out with their tool results (the tool
    messages right after them, and any answering one of their tool-call ids); ``reasoning`` (index -> the proxy's
    own reasoning for an assistant turn) replaces the reasoning the client sent back."""
    drop = set(forged)
    forged_ids = {tc.id for i in drop for tc in conv.messages[i].tool_calls if tc.id}
    out: list[dict[str, Any]] = []
    after_forged = False
    for i, msg in enumerate(conv.messages):
        if msg.role == "tool":
            if after_forged or msg.tool_call_id in forged_ids:
                continue
        else:
            after_forged = i in drop
            if after_forged:
                continue
            if msg.role == "assistant" and reasoning is not None:
                msg = dataclasses.replace(msg, reasoning=reasoning.get(i, ""))
        out.append(_transcript_dict(msg))
    out.append(_transcript_dict(answer))
    return out


def _transcript_dict(msg: Message) -> dict[str, Any]:
    d = msg.to_template()
    if msg.role == "tool":
        d.update({"tool_call_id": msg.tool_call_id, **({"name": msg.name} if msg.name else {})})
    return d


def function_tool(name: str, description: str = "", parameters: Any = None) -> dict[str, Any]:
    """A tool schema in the OpenAI function form the template renders."""
    params = parameters if isinstance(parameters, dict) else {"type": "object", "properties": {}}
    return {"type": "function", "function": {"name": name, "description": description or "", "parameters": params}}


def system_fingerprint(system: str) -> str:
    """Short stable hash of a system prompt (CallEvent.system_fingerprint)."""
    return hashlib.sha256(system.encode("utf-8")).hexdigest()[:16]


# --- call kinds -------------------------------------------------------------------------------------------------

DEFAULT_SIDE_MODEL_PATTERN = r"(?i)(haiku|-side$|^side$|title)"
# Claude Code: "Your task is to create a detailed summary of the conversation so far"; Codex: "CONTEXT CHECKPOINT
# COMPACTION"; generic phrasings of a summary request.
DEFAULT_COMPACTION_PATTERN = (
    r"(?i)(create a detailed summary of the conversation|summari[sz]e (the|this) conversation"
    r"|context checkpoint compaction|compact(ing)? (the )?conversation)"
)


@dataclass(frozen=True)
class CallKindRules:
    side_model_pattern: str = DEFAULT_SIDE_MODEL_PATTERN
    compaction_pattern: str = DEFAULT_COMPACTION_PATTERN
    short_system_chars: int = 4000
    _compiled: dict[str, re.Pattern[str]] = field(default_factory=dict, compare=False, repr=False)

    def _re(self, pattern: str) -> re.Pattern[str] | None:
        if not pattern:
            return None
        if pattern not in self._compiled:
            self._compiled[pattern] = re.compile(pattern)
        return self._compiled[pattern]

    def is_side_model(self, model: str) -> bool:
        rx = self._re(self.side_model_pattern)
        return bool(rx and rx.search(model or ""))

    def is_compaction(self, conv: Conversation) -> bool:
        rx = self._re(self.compaction_pattern)
        return bool(rx and (rx.search(conv.last_text()) or rx.search(conv.system)))


def classify_call(
    conv: Conversation, model: str, main_fingerprint: str | None, rules: CallKindRules
) -> tuple[CallKind, str | None]:
    """(kind, main fingerprint after this call). The caller stores the returned fingerprint with the rollout."""
    if rules.is_side_model(model):
        return CallKind.SIDE, main_fingerprint
    if rules.is_compaction(conv):
        return CallKind.COMPACTION, main_fingerprint
    fp = system_fingerprint(conv.system)
    if main_fingerprint is None:
        if conv.tools or len(conv.system) > rules.short_system_chars:
            return CallKind.MAIN, fp
        return CallKind.SIDE, None
    if fp == main_fingerprint:
        return CallKind.MAIN, main_fingerprint
    return (CallKind.SUBAGENT if conv.tools else CallKind.SIDE), main_fingerprint
