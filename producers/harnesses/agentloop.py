"""Adapters of the built-in white-box agent loop (``producers.harnesses.builtin_loop``), two different variants.

``agentloop``: OpenAI Chat, tools read_file / write_file / list_files / run / finish, a short system prompt.
``agentloop-anthropic``: Anthropic Messages, tools Read / Write / LS / Shell / Done, a different system prompt.
Both need only the sandbox's Python (stdlib client), so two different harnesses can be mixed on a CPU machine.
"""

from producers.harnesses.base import HarnessAdapter
from schemas.events import Dialect

_ENV = {"AGENTLOOP_API_KEY": "${secret}", "PYTHONPATH": "${clawstream_root}", "PYTHONDONTWRITEBYTECODE": "1"}

ADAPTER = HarnessAdapter(
    name="agentloop",
    description="built-in white-box agent loop, OpenAI Chat (paper's baseline)",
    dialect=Dialect.OPENAI_CHAT,
    command=(
        "${python}",
        "-m",
        "producers.harnesses.builtin_loop",
        "--dialect",
        "openai",
        "--base-url",
        "${base_url_v1}",
        "--model",
        "${model}",
        "--workspace",
        "${workspace}",
        "${prompt}",
    ),
    env=_ENV,
    call_kind_notes="one main agent, no side calls",
)

ANTHROPIC_ADAPTER = HarnessAdapter(
    name="agentloop-anthropic",
    description="built-in agent loop variant, Anthropic Messages, other tool names and system prompt",
    dialect=Dialect.ANTHROPIC_MESSAGES,
    command=(
        "${python}",
        "-m",
        "producers.harnesses.builtin_loop",
        "--dialect",
        "anthropic",
        "--base-url",
        "${base_url}",
        "--model",
        "${model}",
        "--workspace",
        "${workspace}",
        "${prompt}",
    ),
    env=_ENV,
    call_kind_notes="one main agent, no side calls",
)
