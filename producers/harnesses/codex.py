"""Codex CLI (``@openai/codex``): OpenAI Responses at ``{base}/v1/responses`` (``wire_api="chat"`` is rejected).

Facts (docs/harnesses.md#codex-cli):
provider config in ``$CODEX_HOME/config.toml``; ``features.plugins=false`` stops its
GitHub/plugin fetches; the default read-only sandbox makes writes fail, so ``workspace-write``; stdin must be closed.
In a container (the docker backend) Codex's own sandbox cannot start (bubblewrap: "No permissions to create a new
namespace"; every command fails), and inside the isolated local backend (bubblewrap already) it is not needed, so
there the sandbox is ours: ``danger-full-access``. Unsandboxed on a host with a system ``bwrap``, Codex's own
sandbox needs CODEX_HOME outside ``$TMPDIR`` (it will not put its ``codex-linux-sandbox`` helper there).
"""

from producers.harnesses.base import ConfigFile, HarnessAdapter
from schemas.events import Dialect

CONFIG = """model = "${model}"
model_provider = "clawstream"
check_for_update_on_startup = false

[analytics]
enabled = false

[model_providers.clawstream]
name = "clawstream"
base_url = "${base_url_v1}"
wire_api = "responses"
env_key = "CLAWSTREAM_API_KEY"
"""

ADAPTER = HarnessAdapter(
    name="codex",
    description="OpenAI Codex CLI, codex exec --json, OpenAI Responses",
    dialect=Dialect.OPENAI_RESPONSES,
    install="codex",
    command=(
        "${exe}",
        "exec",
        "--skip-git-repo-check",
        "--sandbox",
        "workspace-write",
        "-c",
        "features.plugins=false",
        "--json",
        "${prompt}",
    ),
    env={"CODEX_HOME": "${home}/.codex", "CLAWSTREAM_API_KEY": "${secret}"},
    files=(ConfigFile(".codex/config.toml", CONFIG),),
    call_kind_notes="no side calls seen; everything is MAIN",
    in_container={"workspace-write": "danger-full-access"},
)
