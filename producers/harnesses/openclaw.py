"""OpenClaw (``openclaw``, needs Node >= 24): OpenAI Chat (``openai-completions`` provider) at ``{base}/v1``.

Facts (docs/harnesses.md#openclaw): ``openclaw agent exec --config cfg.json5 --state-dir DIR --model
clawstream/policy --json --timeout N``; its system prompt embeds date/time and a session id, and it re-appends an
internal-context user message on every call (histories are not append-only: the proxy's prefix tree branches at the
longest common token prefix). ``agent exec`` deletes its state (and with it the transcript) unless ``--state-dir``
names an existing directory, and keeps transcripts in SQLite there; the wrapper
``producers.harnesses.openclaw_session`` creates ``$HOME/.openclaw`` and afterwards exports the run's session to
``$HOME/.openclaw/agents/<agent>/sessions/<session id>.jsonl`` (index ``sessions.json``), the file PinchBench's checks
read (``session_dir``; ``producers.tasks.transcript``).
"""

from producers.harnesses.base import ConfigFile, HarnessAdapter
from schemas.events import Dialect

CONFIG = """{
  "models": {"mode": "replace", "providers": {"clawstream": {
    "baseUrl": "${base_url_v1}", "apiKey": "${secret}", "api": "openai-completions",
    "models": [{"id": "${model}", "name": "${model}", "contextWindow": 131072, "maxTokens": 8192,
                "input": ["text"], "reasoning": false,
                "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0}}]
  }}},
  "agents": {"defaults": {"model": {"primary": "clawstream/${model}"}, "workspace": "${workspace}"}}
}
"""

ADAPTER = HarnessAdapter(
    name="openclaw",
    description="OpenClaw agent exec --json (Node 24), OpenAI Chat",
    dialect=Dialect.OPENAI_CHAT,
    install="openclaw",
    node24=True,
    # OpenClaw keeps its transcript only in a retained state dir, in SQLite: the wrapper exports it as the session
    # files PinchBench reads (producers.harnesses.openclaw_session; stdlib only, run by path: no PYTHONPATH for the
    # agent's own commands to inherit).
    command=(
        "${python}",
        "${clawstream_root}/producers/harnesses/openclaw_session.py",
        "--state-dir",
        "${home}/.openclaw",
        "--",
        "${exe}",
        "agent",
        "exec",
        "--config",
        "${home}/openclaw.json5",
        "--state-dir",
        "${home}/.openclaw",
        "--model",
        "clawstream/${model}",
        "--json",
        "--timeout",
        "${timeout_s}",
        "${prompt}",
    ),
    files=(ConfigFile("openclaw.json5", CONFIG),),
    call_kind_notes="internal-context user message moves each call: expect branching, not appends",
    session_dir=".openclaw/agents",  # $HOME/.openclaw/agents/<agent>/sessions/<session id>.jsonl (+ sessions.json)
)
