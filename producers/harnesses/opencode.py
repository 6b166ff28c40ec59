"""opencode (``opencode-ai``): OpenAI Chat at ``{base}/v1/chat/completions`` through ``@ai-sdk/openai-compatible``.

Facts (docs/harnesses.md#opencode):
config via ``OPENCODE_CONFIG``; ``OPENCODE_DISABLE_MODELS_FETCH=1``; at every start it npm-installs
``@opencode-ai/plugin`` into its config dir in the background (registry fetches, ~30 MB into ``~/.npm``):
``npm_config_offline=true`` makes that install fail at once (a logged warning), so no connection leaves the host.
Its title call uses the main model even with ``small_model`` set (classified SIDE by the proxy's short-system-prompt
rule).
"""

from producers.harnesses.base import ConfigFile, HarnessAdapter
from schemas.events import Dialect

CONFIG = """{
  "$$schema": "https://opencode.ai/config.json",
  "model": "clawstream/${model}",
  "provider": {"clawstream": {
    "npm": "@ai-sdk/openai-compatible",
    "options": {"baseURL": "${base_url_v1}", "apiKey": "${secret}"},
    "models": {"${model}": {"tool_call": true}}
  }},
  "permission": {"edit": "allow", "bash": "allow"}
}
"""

ADAPTER = HarnessAdapter(
    name="opencode",
    description="opencode run --format json, OpenAI Chat",
    dialect=Dialect.OPENAI_CHAT,
    install="opencode",
    command=("${exe}", "run", "--format", "json", "${prompt}"),
    env={
        "OPENCODE_CONFIG": "${home}/opencode.json",
        "OPENCODE_DISABLE_MODELS_FETCH": "1",
        "npm_config_offline": "true",
    },
    files=(ConfigFile("opencode.json", CONFIG),),
    call_kind_notes="title call on the main model, tool-less with a ~2.1k-char system prompt → SIDE",
)
