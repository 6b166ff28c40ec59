"""Chat templates and control tokens of two more model families, for the architecture matrix (``policy.architectures``).

Written for this project after the public descriptions of the formats (no template text copied):

* ``CHATML_TEMPLATE`` — Qwen2.5 style ChatML: ``<|im_start|>{role}\\n{body}<|im_end|>\\n`` turns, a default system
  turn when the conversation has none, tool schemas in the system turn, tool calls in ``<tool_call>`` tags, tool
  results grouped into one user turn in ``<tool_response>`` tags; no reasoning block.
* ``LLAMA3_TEMPLATE`` — Llama-3 style: ``<|begin_of_text|>`` once, turns
  ``<|start_header_id|>{role}<|end_header_id|>\\n\\n{body}<|eot_id|>`` (no newline after the end of a turn), tool
  schemas in the system turn, a tool call as the JSON object ``{"name": ..., "parameters": ...}``, tool results
  in ``ipython`` turns.

Both keep every message verbatim (no trimming, no dropping of history), so they are prefix stable in the sense of
docs/method.md#the-chat-template-contract; the proxy derives the generation prompt, the end-of-turn token and the
turn suffix from them (``producers.proxy.render.TemplateRenderer``). Pure: strings only.
"""

from __future__ import annotations

# --- ChatML (Qwen2.5 style) -----------------------------------------------------------------------------------

CHATML_ENDOFTEXT = "<|endoftext|>"
CHATML_SPECIAL_TOKENS: tuple[str, ...] = (CHATML_ENDOFTEXT, "<|im_start|>", "<|im_end|>")
CHATML_MARKUP_TOKENS: tuple[str, ...] = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

CHATML_TEMPLATE = r"""{%- macro text(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is iterable and content is not mapping -%}
        {%- for part in content -%}
            {%- if part is string -%}{{- part -}}{%- elif part.type == 'text' -%}{{- part.text -}}{%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- set has_system = messages and messages[0].role == 'system' %}
{{- '<|im_start|>system\n' }}
{{- text(messages[0].content) if has_system else 'You are a helpful assistant.' }}
{%- if tools %}
    {{- '\n\n# Tools\n\nFunction signatures, one JSON object per line, inside <tools></tools>:\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\n</tools>\n\nTo call a function, answer with <tool_call>\n{"name": <name>, "arguments": <object>}\n'
        + '</tool_call> (one block per call).' }}
{%- endif %}
{{- '<|im_end|>\n' }}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
    {%- elif message.role == 'user' or message.role == 'system' %}
        {{- '<|im_start|>' + message.role + '\n' + text(message.content) + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant\n' }}
        {%- generation %}
        {%- set body = text(message.content) %}
        {{- body }}
        {%- for call in message.tool_calls or [] %}
            {%- if body or not loop.first %}{{- '\n' }}{%- endif %}
            {%- set fn = call.function if call.function else call %}
            {{- '<tool_call>\n{"name": "' + fn.name + '", "arguments": ' }}
            {{- fn.arguments if fn.arguments is string else (fn.arguments | tojson) }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>' }}
        {%- endgeneration %}
        {{- '\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' + text(message.content) + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- else %}
        {{- raise_exception('Unknown message role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

# --- Llama-3 style ----------------------------------------------------------------------------------------------

LLAMA3_BEGIN = "<|begin_of_text|>"
LLAMA3_END = "<|end_of_text|>"
LLAMA3_EOT = "<|eot_id|>"
LLAMA3_PAD = "<|finetune_right_pad_id|>"
LLAMA3_SPECIAL_TOKENS: tuple[str, ...] = (
    LLAMA3_BEGIN,
    LLAMA3_END,
    "<|start_header_id|>",
    "<|end_header_id|>",
    LLAMA3_EOT,
    "<|eom_id|>",
    "<|python_tag|>",
    LLAMA3_PAD,
)

LLAMA3_TEMPLATE = r"""{%- macro text(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is iterable and content is not mapping -%}
        {%- for part in content -%}
            {%- if part is string -%}{{- part -}}{%- elif part.type == 'text' -%}{{- part.text -}}{%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- macro header(role) -%}{{- '<|start_header_id|>' + role + '<|end_header_id|>\n\n' -}}{%- endmacro -%}
{{- '<|begin_of_text|>' }}
{%- set has_system = messages and messages[0].role == 'system' %}
{%- if has_system or tools %}
    {{- header('system') }}
    {%- if has_system %}{{- text(messages[0].content) }}{%- endif %}
    {%- if tools %}
        {{- ('\n\n' if has_system else '') + 'You can call these functions. To call one, answer with a JSON object '
            + '{"name": <function name>, "parameters": <object of arguments>} and nothing else.' }}
        {%- for tool in tools %}
            {{- '\n\n' + (tool | tojson) }}
        {%- endfor %}
    {%- endif %}
    {{- '<|eot_id|>' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
    {%- elif message.role == 'user' or message.role == 'system' %}
        {{- header(message.role) + text(message.content) + '<|eot_id|>' }}
    {%- elif message.role == 'assistant' %}
        {{- header('assistant') }}
        {%- generation %}
        {%- set body = text(message.content) %}
        {{- body }}
        {%- for call in message.tool_calls or [] %}
            {%- if body or not loop.first %}{{- '\n' }}{%- endif %}
            {%- set fn = call.function if call.function else call %}
            {{- '{"name": "' + fn.name + '", "parameters": ' }}
            {{- fn.arguments if fn.arguments is string else (fn.arguments | tojson) }}
            {{- '}' }}
        {%- endfor %}
        {{- '<|eot_id|>' }}
        {%- endgeneration %}
    {%- elif message.role == 'tool' %}
        {{- header('ipython') + text(message.content) + '<|eot_id|>' }}
    {%- else %}
        {{- raise_exception('Unknown message role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- header('assistant') }}
{%- endif %}
"""
