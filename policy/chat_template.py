"""The policy's chat template and its control tokens: the Qwen3-style format every stage renders and parses.

The serving proxy renders prompts with it (token-in-token-out), the tiny model's tokenizer carries it, the warm
start trains on it. Pure: no model, no tokenizer needed (``render_chat`` uses transformers' Jinja environment).

Contract (what the serving proxy relies on for token-in-token-out)
-----------------------------------------------------------------
* A turn is ``<|im_start|>{role}\\n{body}<|im_end|>\\n``. The generation prompt is ``<|im_start|>assistant\\n``
  (``GENERATION_PROMPT``); after the assistant's body the template puts exactly ``<|im_end|>`` + ``\\n``
  (``ASSISTANT_TURN_SUFFIX``), i.e. the token ids ``[id(<|im_end|>), id("\\n")]`` (``assistant_turn_suffix_ids``).
  ``<|im_end|>`` is the eos, so a turn that finished with ``stop`` already ends with it among the generated ids
  and the proxy appends only the ``\\n`` id; a turn cut off by the length limit needs both.
* Prefix stability: for a conversation whose message k is an assistant turn, the rendering of messages[:k] with
  ``add_generation_prompt=True`` is a string prefix of the rendering of messages[:k+1] (and of any longer
  conversation). Unlike Qwen3's own template, reasoning of earlier turns is never dropped and no empty
  ``<think></think>`` block is injected into history, so this holds for every assistant turn, not just the last.
  It is also a token prefix, because ``<|im_start|>`` splits the text and the trailing ``\\n`` is its own
  pre-token, except when the assistant body starts with whitespace containing a line break (``"\\n..."``,
  ``"  \\n..."``): the pre-tokenizer then merges that run with the prompt's ``\\n`` (the Qwen2 regex has
  ``\\s*[\\r\\n]+``). TITO never re-encodes generated text, so this only matters to code that re-tokenizes.
* The same holds at user/system/tool boundaries (render(messages[:k]) is a prefix of render(messages[:k+1])),
  except between two consecutive ``tool`` messages: they are grouped into one user turn, as in Qwen3.
* ``enable_thinking=False`` appends ``<think>\\n\\n</think>\\n\\n`` to the generation prompt (Qwen3's switch); those
  tokens are then part of the prompt, not of the assistant message, so that mode is outside the prefix contract.
* The assistant body is wrapped in ``{% generation %}`` so ``return_assistant_tokens_mask=True`` marks exactly
  the tokens the model produced (reasoning, content, tool calls, ``<|im_end|>``), which SFT uses.
"""

from __future__ import annotations

from typing import Any

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

    rendered, _ = render_jinja_template(
        conversations=[messages],
        tools=tools,
        chat_template=CHAT_TEMPLATE,
        add_generation_prompt=add_generation_prompt,
        **kwargs,
    )
    return rendered[0]


def assistant_turn_suffix_ids(tokenizer: Any) -> list[int]:
    """Token ids the template puts after an assistant turn's body: ``<|im_end|>`` then ``\\n``."""
    return [tokenizer.convert_tokens_to_ids(IM_END), *tokenizer.encode("\n", add_special_tokens=False)]
