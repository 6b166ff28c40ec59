"""The policy's chat template and its control tokens: the Qwen3-style format every stage renders and parses.

The serving proxy renders prompts with it (token-in-token-out), the tiny model's tokenizer carries it, the warm
start trains on it. Pure: no model, no tokenizer needed (``render_chat`` uses transformers' Jinja environment).

The contract the proxy relies on: a turn is ``<|im_start|>{role}\\n{body}<|im_end|>\\n``; the generation prompt is
``GENERATION_PROMPT``; after an assistant body comes exactly ``ASSISTANT_TURN_SUFFIX``; and the template is prefix
stable (render(messages[:k]) is a prefix of render(messages[:k+1]), except between consecutive ``tool`` messages,
which share one user turn). In full, with the token-level exceptions: docs/method.md#the-chat-template-contract.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

# --- tokens ---------------------------------------------------------------------------------------------------

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
TOOL_RESPONSE_START = "<tool_response>"
TOOL_RESPONSE_END = "</tool_response>"
THINK_START = "<think>"
THINK_END = "</think>"

# Qwen3 marks only the chat-control tokens ``special`` (skipped by ``decode(skip_special_tokens=True)``); the
# tool-call / tool-response / think markers are added tokens with special=false, so they survive decoding and a
# harness-side parser still sees them in the text.
SPECIAL_TOKENS: tuple[str, ...] = (ENDOFTEXT, IM_START, IM_END)
MARKUP_TOKENS: tuple[str, ...] = (
    TOOL_CALL_START,
    TOOL_CALL_END,
    TOOL_RESPONSE_START,
    TOOL_RESPONSE_END,
    THINK_START,
    THINK_END,
)
ADDED_TOKENS: tuple[str, ...] = SPECIAL_TOKENS + MARKUP_TOKENS

GENERATION_PROMPT = f"{IM_START}assistant\n"
ASSISTANT_TURN_SUFFIX = f"{IM_END}\n"

# --- chat template ----------------------------------------------------------------------------------------------

# Rendered by transformers' sandboxed Jinja environment (trim_blocks, lstrip_blocks, a json.dumps-based `tojson`
# with ensure_ascii=False, and the `{% generation %}` extension). Modelled on Qwen3's template; the differences
# (reasoning always kept, content rendered verbatim, list-of-parts content, empty-message guard) make it
# prefix-stable, see the module docstring.
CHAT_TEMPLATE = r"""{%- macro render_text(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is iterable and content is not mapping -%}
        {%- for part in content -%}
            {%- if part is string -%}
                {{- part -}}
            {%- elif part.type == 'text' -%}
                {{- part.text -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages and messages[0].role == 'system' %}
        {{- render_text(messages[0].content) + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        + "You are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
        + "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
        + "\"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- elif messages and messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + render_text(messages[0].content) + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
    {%- elif message.role == 'user' or message.role == 'system' %}
        {{- '<|im_start|>' + message.role + '\n' + render_text(message.content) + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant\n' }}
        {%- generation %}
        {%- if message.reasoning_content is string and message.reasoning_content %}
            {{- '<think>\n' + message.reasoning_content.strip('\n') + '\n</think>\n\n' }}
        {%- endif %}
        {%- set content = render_text(message.content) %}
        {{- content }}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>' }}
        {%- endgeneration %}
        {{- '\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + render_text(message.content) + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('Unknown message role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""


def render_chat(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    *,
    add_generation_prompt: bool = False,
    **kwargs: Any,
) -> str:
    """Render ``messages`` with ``CHAT_TEMPLATE`` through transformers' own Jinja environment (no tokenizer needed).

    Used to build the tokenizer's training corpus before any tokenizer exists; the result is identical to
    ``tokenizer.apply_chat_template(..., tokenize=False)`` on the saved tokenizer.
    """
    from transformers.utils.chat_template_utils import render_jinja_template

    # transformers types ``tools`` as list[dict | Callable] (invariant: a list of dicts is copied into one) and the
    # result as ``str``, but returns (rendered conversations, generation indices).
    schemas: list[dict[str, Any] | Callable[..., Any]] | None = list(tools) if tools is not None else None
    rendered, _ = cast(
        tuple[list[str], Any],
        render_jinja_template(
            conversations=[messages],
            tools=schemas,
            chat_template=CHAT_TEMPLATE,
            add_generation_prompt=add_generation_prompt,
            **kwargs,
        ),
    )
    return rendered[0]


def assistant_turn_suffix_ids(tokenizer: Any) -> list[int]:
    """Token ids the template puts after an assistant turn's body: ``<|im_end|>`` then ``\\n``."""
    return [tokenizer.convert_tokens_to_ids(IM_END), *tokenizer.encode("\n", add_special_tokens=False)]
