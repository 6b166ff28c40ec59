"""Every built-in harness adapter by name: ``ADAPTERS[name]`` → :class:`HarnessAdapter` (data; see ``base``)."""

from __future__ import annotations

from producers.harnesses import agentloop, claude_code, codex, openclaw, opencode, qwen_code
from producers.harnesses.base import HarnessAdapter

ADAPTERS: dict[str, HarnessAdapter] = {
    a.name: a
    for a in (
        claude_code.ADAPTER,
        codex.ADAPTER,
        qwen_code.ADAPTER,
        openclaw.ADAPTER,
        opencode.ADAPTER,
        agentloop.ADAPTER,
        agentloop.ANTHROPIC_ADAPTER,
    )
}
