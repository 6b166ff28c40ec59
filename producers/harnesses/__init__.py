"""Harnesses: the real agent harnesses as data, the built-in agent loop, and their installation.

Purpose: describe how each harness (Claude Code, Codex, Qwen Code, OpenClaw, opencode, the built-in agent loop)
is launched headless inside a sandbox against the serving proxy: command, environment, config files, dialect,
side models (``base.HarnessAdapter``, one module per harness, collected in ``catalog.ADAPTERS``); install the npm
harnesses into a cache (``install``); and the built-in white-box loop itself (``builtin_loop``, stdlib only: it
runs inside the sandbox, so this package's ``__init__`` imports nothing).

Topics: none (the sandbox worker uses these adapters; harness traffic reaches Kafka through the proxy).
Run: ``clawstream harness list | install NAME...``; ``python -m producers.harnesses`` prints the adapter table.
"""
