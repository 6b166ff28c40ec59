"""Qwen Code (``@qwen-code/qwen-code``): OpenAI Chat at ``{base}/v1/chat/completions``.

Facts (docs/harnesses.md#qwen-code):
``privacy.usageStatisticsEnabled=false`` (else telemetry to an outside host);
``memory.enableManagedAutoMemory=false`` (else, after the agent's answer, a "managed memory extraction" subagent —
its own ~18k-token prompt and tools — makes one more model call per run and may write memory files under
``~/.qwen/projects``); never set HTTP(S)_PROXY for it (it routes loopback through the proxy, fails, and still exits
0).
"""

from producers.harnesses.base import ConfigFile, HarnessAdapter
from schemas.events import Dialect

SETTINGS = """{
  "security": {"auth": {"selectedType": "openai"}},
  "model": {"name": "${model}"},
  "privacy": {"usageStatisticsEnabled": false},
  "memory": {"enableManagedAutoMemory": false}
}
"""

ADAPTER = HarnessAdapter(
    name="qwen-code",
    description="Qwen Code CLI, --yolo -o json, OpenAI Chat",
    dialect=Dialect.OPENAI_CHAT,
    install="qwen-code",
    command=("${exe}", "--auth-type", "openai", "--yolo", "-o", "json", "${prompt}"),
    env={"OPENAI_BASE_URL": "${base_url_v1}", "OPENAI_API_KEY": "${secret}", "OPENAI_MODEL": "${model}"},
    files=(ConfigFile(".qwen/settings.json", SETTINGS),),
    call_kind_notes="no side calls seen",
)
