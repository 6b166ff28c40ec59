"""Built-in harness adapters: ``ADAPTERS[name]`` → :class:`HarnessAdapter` (data; see ``base`` for the template
variables). ``python -m producers.harnesses`` prints the table (``clawstream harness list`` shows the same data)."""

from __future__ import annotations

from producers.harnesses import agentloop, claude_code, codex, openclaw, opencode, qwen_code
from producers.harnesses.base import ConfigFile, HarnessAdapter, LaunchContext, LaunchSpec, render

ADAPTERS: dict[str, HarnessAdapter] = {
    a.name: a
    for a in (claude_code.ADAPTER, codex.ADAPTER, qwen_code.ADAPTER, openclaw.ADAPTER, opencode.ADAPTER,
              agentloop.ADAPTER, agentloop.ANTHROPIC_ADAPTER)
}  # fmt: skip

__all__ = ["ADAPTERS", "ConfigFile", "HarnessAdapter", "LaunchContext", "LaunchSpec", "render"]
