"""REAL agent harnesses through the serving proxy: "create hello.txt containing hi" in 2 model calls.

Each harness is installed from the npm registry into ``$CLAWSTREAM_HOME/harnesses/<name>`` (once; see
``producers.harness_install``) and run headless and offline (HARNESSES.md) against a real proxy (real Kafka
broker) whose engine is the scripted engine: it answers the harness's first call with the tool call that harness
needs (Claude Code ``Write{file_path,content}``, Codex ``exec_command{cmd,workdir}``, Qwen Code
``write_file{file_path,content}``, opencode ``write{filePath,content}``) and the follow-up with a final message,
and title-style calls (no tools) with a title. Asserts: the harness exits 0 and wrote the file, the rollout's
main calls on the broker form an append-only TITO chain, side calls are classified SIDE.
If npm or the package is unavailable the test SKIPS with the reason.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from producers.harness_install import HarnessInstallError, install_harness
from schemas.events import CallKind
from streams.tree import TreeCall, rebuild_prompts
from tests.integration.test_proxy import consume_calls, register, running_proxy, seal
from tests.support import proxy_helpers as H
from tests.support.scripted_engine import ScriptedEngine, tool_call_text

pytestmark = pytest.mark.integration
RUN_TIMEOUT = 240


def _installed(name: str) -> Path:
    if shutil.which("npm") is None:
        pytest.skip(f"{name}: npm is not on PATH, cannot install the real harness")
    try:
        return install_harness(name)
    except HarnessInstallError as exc:
        pytest.skip(f"{name}: install failed: {exc}")


def _responder(tool: str, args: dict[str, Any]):
    def respond(prompt_text: str, _ids: list[int], _body: dict[str, Any]) -> str:
        if "<tools>" not in prompt_text:  # title / side call
            return '{"title": "Create hello file"}'
        if "<tool_response>" in prompt_text:
            return "Done: hello.txt contains hi."
        return tool_call_text(tool, args)

    return respond


def _command(name: str, exe: Path, base: str, secret: str, home: Path, ws: Path, variant: str) -> tuple[list, dict]:
    env = {"PATH": f"{shutil.which('node') and Path(shutil.which('node')).parent}:/usr/bin:/bin", "HOME": str(home)}
    if name == "claude-code":
        env.update({"ANTHROPIC_BASE_URL": base, "ANTHROPIC_API_KEY": secret, "ANTHROPIC_MODEL": "policy",
                    "ANTHROPIC_DEFAULT_HAIKU_MODEL": "policy-side", "CLAUDE_CODE_ATTRIBUTION_HEADER": "0"})  # fmt: skip
        if variant != "with-title":  # else it also makes a title call on the side model (and tries to phone home)
            env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] = "1"
        return [str(exe), "-p", H.TASK, "--output-format", "json", "--allowedTools", "Write,Bash,Edit"], env
    if name == "codex":
        codex_home = home / ".codex"
        codex_home.mkdir()
        (codex_home / "config.toml").write_text(
            'model = "policy"\nmodel_provider = "clawstream"\ncheck_for_update_on_startup = false\n'
            "[analytics]\nenabled = false\n[model_providers.clawstream]\nname = \"clawstream\"\n"
            f'base_url = "{base}/v1"\nwire_api = "responses"\nenv_key = "CLAWSTREAM_API_KEY"\n'
        )
        env.update({"CODEX_HOME": str(codex_home), "CLAWSTREAM_API_KEY": secret})
        cmd = [str(exe), "exec", "--skip-git-repo-check", "--sandbox", "workspace-write",
               "-c", "features.plugins=false", "--json", H.TASK]  # fmt: skip
        return cmd, env
    if name == "qwen-code":
        settings = {"security": {"auth": {"selectedType": "openai"}}, "model": {"name": "policy"},
                    "privacy": {"usageStatisticsEnabled": False}}  # fmt: skip
        (home / ".qwen").mkdir()
        (home / ".qwen" / "settings.json").write_text(json.dumps(settings))
        env.update({"OPENAI_BASE_URL": f"{base}/v1", "OPENAI_API_KEY": secret, "OPENAI_MODEL": "policy"})
        return [str(exe), "--auth-type", "openai", "--yolo", "-o", "json", H.TASK], env
    # opencode
    config = {"$schema": "https://opencode.ai/config.json", "model": "clawstream/policy", "provider": {"clawstream": {
        "npm": "@ai-sdk/openai-compatible", "options": {"baseURL": f"{base}/v1", "apiKey": secret},
        "models": {"policy": {"tool_call": True}}}}, "permission": {"edit": "allow", "bash": "allow"}}  # fmt: skip
    (ws / "opencode.json").write_text(json.dumps(config))
    env.update({"OPENCODE_CONFIG": str(ws / "opencode.json"), "OPENCODE_DISABLE_MODELS_FETCH": "1"})
    return [str(exe), "run", "--format", "json", H.TASK], env


CASES = {
    "claude-code": lambda ws: ("Write", {"file_path": f"{ws}/hello.txt", "content": "hi"}),
    "claude-code/with-title": lambda ws: ("Write", {"file_path": f"{ws}/hello.txt", "content": "hi"}),
    "codex": lambda ws: ("exec_command", {"cmd": "printf hi > hello.txt", "workdir": str(ws)}),
    "qwen-code": lambda ws: ("write_file", {"file_path": f"{ws}/hello.txt", "content": "hi"}),
    "opencode": lambda ws: ("write", {"filePath": f"{ws}/hello.txt", "content": "hi"}),
}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", list(CASES))
async def test_real_harness_episode(kafka_settings, tmp_path: Path, case: str) -> None:
    name, _, variant = case.partition("/")
    exe = await asyncio.to_thread(_installed, name)
    ws, home = tmp_path / "ws", tmp_path / "home"
    ws.mkdir()
    home.mkdir()
    tool, args = CASES[case](ws)
    async with (
        ScriptedEngine(H.tiny_tokenizer(), _responder(tool, args)) as engine,
        running_proxy(kafka_settings, engine.url, keepalive_s=1.0) as (proxy, url),
        aiohttp.ClientSession() as http,
    ):
        reg = await register(http, url, rollout_id=f"h-{name}-{variant or 'main'}")
        cmd, env = _command(name, exe, reg["base_url"], reg["secret"], home, ws, variant)
        proc = await asyncio.create_subprocess_exec(
            *cmd, cwd=ws, env=env, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            out, err = await asyncio.wait_for(proc.communicate(), RUN_TIMEOUT)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            pytest.fail(f"{case} did not finish in {RUN_TIMEOUT}s")
        status = await seal(http, url, reg["rollout_id"])
    log = f"rc={proc.returncode}\nstdout:\n{out.decode()[-2000:]}\nstderr:\n{err.decode()[-2000:]}"
    assert proc.returncode == 0, log
    assert (ws / "hello.txt").read_text().strip() == "hi", log
    assert status["status"] == "ok" and status["calls_served"] >= 2
    events = consume_calls(kafka_settings, {reg["rollout_id"]}, status["calls_served"])
    assert len(events) == status["calls_served"]
    calls = [TreeCall(e.call_id, e.seq, e.parent_call_id, e.shared_prefix_len, e.new_tokens.tolist(),
                      e.generated_tokens.tolist(), e.logprobs.tolist(), e.call_kind.value.lower(), e.policy_version,
                      e.finish_reason) for e in events]  # fmt: skip
    prompts = rebuild_prompts(calls)
    assert [prompts[e.call_id] for e in events] == [r.prompt_ids for r in engine.requests]
    main = [e for e in events if e.call_kind == CallKind.MAIN]
    assert len(main) == 2, [(e.call_kind, e.requested_model) for e in events]
    first, second = main
    g1 = first.generated_tokens.tolist()
    p1 = prompts[first.call_id]
    # append-only TITO: call 2 = call 1's prompt + generated + turn suffix + new tokens
    assert second.parent_call_id == first.call_id and second.shared_prefix_len == len(p1) + len(g1)
    assert prompts[second.call_id][: len(p1) + len(g1)] == p1 + g1 and "full_render" not in second.flags
    assert first.finish_reason == "tool_calls" and second.finish_reason == "stop"
    others = [e for e in events if e.call_kind != CallKind.MAIN]
    assert all(e.call_kind == CallKind.SIDE for e in others), [(e.call_kind, e.requested_model) for e in others]
    if variant == "with-title":
        assert any(e.requested_model == "policy-side" for e in others), "expected a title call on the side model"
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
