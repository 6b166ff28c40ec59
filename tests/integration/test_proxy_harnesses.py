"""REAL agent harnesses through the serving proxy: "create hello.txt containing hi" in 2 model calls.

Each harness is installed from the npm registry into ``$CLAWSTREAM_HOME/harnesses/<name>`` (once; see
``producers.harnesses.install``) and run headless and offline (docs/harnesses.md) against a real proxy (real Kafka
broker) whose engine is the scripted engine: it answers the harness's first call with the tool call that harness
needs (Claude Code ``Write{file_path,content}``, Codex ``exec_command{cmd,workdir}``, Qwen Code
``write_file{file_path,content}``, opencode ``write{filePath,content}``) and the follow-up with a final message,
and title-style calls (no tools) with a title. Asserts: the harness exits 0 and wrote the file, the rollout's
main calls on the broker form an append-only TITO chain, side calls are classified SIDE, no call is ``tampered``.
OpenClaw (Node 24, ``write{path,content}``, 13-16 s a run) has its own test: its history is not append-only, so
call 2 must branch from call 1 at the longest common token prefix while keeping call 1's generated ids (TITO).
If npm or the package is unavailable the test SKIPS with the reason.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from producers.harnesses.install import HarnessInstallError, install_harness, install_node24
from schemas.events import CallKind
from streams.tree import TreeCall, rebuild_prompts
from tests.support import proxy_helpers as H
from tests.support.proxy_server import consume_calls, register, running_proxy, seal
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
        env.update(
            {
                "ANTHROPIC_BASE_URL": base,
                "ANTHROPIC_API_KEY": secret,
                "ANTHROPIC_MODEL": "policy",
                "ANTHROPIC_DEFAULT_HAIKU_MODEL": "policy-side",
                "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
            }
        )
        if variant != "with-title":  # else it also makes a title call on the side model (and tries to phone home)
            env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] = "1"
        return [str(exe), "-p", H.TASK, "--output-format", "json", "--allowedTools", "Write,Bash,Edit"], env
    if name == "codex":
        codex_home = home / ".codex"
        codex_home.mkdir()
        (codex_home / "config.toml").write_text(
            'model = "policy"\nmodel_provider = "clawstream"\ncheck_for_update_on_startup = false\n'
            '[analytics]\nenabled = false\n[model_providers.clawstream]\nname = "clawstream"\n'
            f'base_url = "{base}/v1"\nwire_api = "responses"\nenv_key = "CLAWSTREAM_API_KEY"\n'
        )
        # Its own TMPDIR: Codex refuses to put its sandbox helper (codex-linux-sandbox, which a system bubblewrap
        # execs) under the temporary directory, and CODEX_HOME lies under /tmp here.
        (home / "tmp").mkdir()
        env.update({"CODEX_HOME": str(codex_home), "CLAWSTREAM_API_KEY": secret, "TMPDIR": str(home / "tmp")})
        cmd = [
            str(exe),
            "exec",
            "--skip-git-repo-check",
            "--sandbox",
            "workspace-write",
            "-c",
            "features.plugins=false",
            "--json",
            H.TASK,
        ]
        return cmd, env
    if name == "qwen-code":
        settings = {
            "security": {"auth": {"selectedType": "openai"}},
            "model": {"name": "policy"},
            "privacy": {"usageStatisticsEnabled": False},
        }
        (home / ".qwen").mkdir()
        (home / ".qwen" / "settings.json").write_text(json.dumps(settings))
        env.update({"OPENAI_BASE_URL": f"{base}/v1", "OPENAI_API_KEY": secret, "OPENAI_MODEL": "policy"})
        return [str(exe), "--auth-type", "openai", "--yolo", "-o", "json", H.TASK], env
    # opencode
    config = {
        "$schema": "https://opencode.ai/config.json",
        "model": "clawstream/policy",
        "provider": {
            "clawstream": {
                "npm": "@ai-sdk/openai-compatible",
                "options": {"baseURL": f"{base}/v1", "apiKey": secret},
                "models": {"policy": {"tool_call": True}},
            }
        },
        "permission": {"edit": "allow", "bash": "allow"},
    }
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
            *cmd,
            cwd=ws,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            out, err = await asyncio.wait_for(proc.communicate(), RUN_TIMEOUT)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            pytest.fail(f"{case} did not finish in {RUN_TIMEOUT}s")
        status = await seal(http, url, reg["rollout_id"])
    log = f"rc={proc.returncode}\nstdout:\n{out.decode()[-2000:]}\nstderr:\n{err.decode()[-2000:]}"
    assert proc.returncode == 0, log
    assert (ws / "hello.txt").is_file() and (ws / "hello.txt").read_text().strip() == "hi", log
    assert status["status"] == "ok" and status["calls_served"] >= 2
    events = consume_calls(kafka_settings, {reg["rollout_id"]}, status["calls_served"])
    assert len(events) == status["calls_served"]
    assert status["tampered"] == 0 and not [e.seq for e in events if e.tampered], status  # only the proxy's turns
    calls = [
        TreeCall(
            e.call_id,
            e.seq,
            e.parent_call_id,
            e.shared_prefix_len,
            e.new_tokens.tolist(),
            e.generated_tokens.tolist(),
            e.logprobs.tolist(),
            e.call_kind.value.lower(),
            e.policy_version,
            e.finish_reason,
        )
        for e in events
    ]
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


_TOOL_LINE = re.compile(r"^\{.*\}$", re.MULTILINE)
_OFFLINE_ERRORS = re.compile(r"ENOTFOUND|EAI_AGAIN|ENETUNREACH|getaddrinfo|fetch failed")


def _prompt_tools(prompt_text: str) -> dict[str, set[str]]:
    """Tool name -> parameter names, read back from the ``<tools>`` block the chat template rendered."""
    # the system prompt first *mentions* "<tools></tools>"; the block itself is on lines of its own
    block = prompt_text.split("\n<tools>\n", 1)[1].split("\n</tools>", 1)[0]
    tools: dict[str, set[str]] = {}
    for line in _TOOL_LINE.findall(block):
        spec = json.loads(line)
        fn = spec.get("function", spec)
        tools[fn["name"]] = set(fn.get("parameters", {}).get("properties", {}))
    return tools


def _openclaw_responder(ws: Path, seen_tools: list[dict[str, set[str]]]):
    """Answer with whichever offered tool writes a file from ``path`` + ``content`` (OpenClaw's ``write``)."""

    def respond(prompt_text: str, _ids: list[int], _body: dict[str, Any]) -> str:
        if "<tools>" not in prompt_text:
            return '{"title": "Create hello file"}'
        if "<tool_response>" in prompt_text:
            return "Done: hello.txt contains hi."
        tools = _prompt_tools(prompt_text)
        seen_tools.append(tools)
        # Prefer the documented name; otherwise any tool taking {path, content} (so a rename shows up in the
        # recorded tool list rather than as a mysterious missing file).
        name = "write" if "write" in tools else next((n for n, p in tools.items() if {"path", "content"} <= p), "")
        if not name:
            return f"no write tool among {sorted(tools)}"
        return tool_call_text(name, {"path": str(ws / "hello.txt"), "content": "hi"})

    return respond


def _openclaw_command(exe: Path, node: Path, base: str, secret: str, home: Path, ws: Path) -> tuple[list, dict]:
    config = {
        "models": {
            "mode": "replace",
            "providers": {
                "clawstream": {
                    "baseUrl": f"{base}/v1",
                    "apiKey": secret,
                    "api": "openai-completions",
                    "models": [
                        {
                            "id": "policy",
                            "name": "policy",
                            "contextWindow": 131072,
                            "maxTokens": 8192,
                            "input": ["text"],
                            "reasoning": False,
                            "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0},
                        }
                    ],
                }
            },
        },
        "agents": {"defaults": {"model": {"primary": "clawstream/policy"}, "workspace": str(ws)}},
    }
    (home / "openclaw.json5").write_text(json.dumps(config))  # JSON is valid JSON5
    # Node 24 first on PATH: the ``openclaw`` bin is a ``#!/usr/bin/env node`` script and refuses Node < 24.16.
    env = {"PATH": f"{node.parent}:/usr/bin:/bin", "HOME": str(home)}
    cmd = [
        str(exe),
        "agent",
        "exec",
        "--config",
        str(home / "openclaw.json5"),
        "--model",
        "clawstream/policy",
        "--json",
        "--timeout",
        "120",
        H.TASK,
    ]
    return cmd, env


@pytest.mark.timeout(900)
# ~2 min; `make test` runs the real OpenClaw in test_harness_matrix.py and its reordered history's branch at the
# longest common token prefix in tests/unit/test_proxy_render.py
@pytest.mark.long
async def test_real_openclaw_branches_at_common_token_prefix(kafka_settings, tmp_path: Path) -> None:
    """OpenClaw moves its internal-context user message to the end on every call (docs/harnesses.md#openclaw), so call
    2 is
    not an append of call 1: the proxy must lay it out again (``full_render``), branch from call 1 at the longest
    common token prefix, and still keep call 1's generated ids verbatim (TITO) inside the re-ordered history."""
    exe = await asyncio.to_thread(_installed, "openclaw")
    node = await asyncio.to_thread(install_node24)
    ws, home = tmp_path / "ws", tmp_path / "home"
    ws.mkdir()
    home.mkdir()
    seen_tools: list[dict[str, set[str]]] = []
    async with (
        ScriptedEngine(H.tiny_tokenizer(), _openclaw_responder(ws, seen_tools)) as engine,
        running_proxy(kafka_settings, engine.url, keepalive_s=1.0) as (proxy, url),
        aiohttp.ClientSession() as http,
    ):
        reg = await register(http, url, rollout_id="h-openclaw-main")
        cmd, env = _openclaw_command(exe, node, reg["base_url"], reg["secret"], home, ws)
        t0 = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            *cmd,
            cwd=ws,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            out, err = await asyncio.wait_for(proc.communicate(), RUN_TIMEOUT)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            pytest.fail(f"openclaw did not finish in {RUN_TIMEOUT}s")
        wall = time.monotonic() - t0
        status = await seal(http, url, reg["rollout_id"])
    log = (
        f"rc={proc.returncode} wall={wall:.1f}s tools={seen_tools}\nstdout:\n{out.decode()[-2000:]}\n"
        f"stderr:\n{err.decode()[-2000:]}"
    )
    if proc.returncode != 0 and not engine.requests and _OFFLINE_ERRORS.search(out.decode() + err.decode()):
        pytest.skip(f"openclaw needs the network before its first model call, cannot run offline here: {log}")
    assert proc.returncode == 0, log
    assert seen_tools and "write" in seen_tools[0] and {"path", "content"} <= seen_tools[0]["write"], log
    assert (ws / "hello.txt").read_text().strip() == "hi", log
    assert status["status"] == "ok" and status["calls_served"] >= 2, (status, log)
    events = consume_calls(kafka_settings, {reg["rollout_id"]}, status["calls_served"])
    assert len(events) == status["calls_served"]
    assert status["tampered"] == 0 and not [e.seq for e in events if e.tampered], status  # only the proxy's turns
    calls = [
        TreeCall(
            e.call_id,
            e.seq,
            e.parent_call_id,
            e.shared_prefix_len,
            e.new_tokens.tolist(),
            e.generated_tokens.tolist(),
            e.logprobs.tolist(),
            e.call_kind.value.lower(),
            e.policy_version,
            e.finish_reason,
        )
        for e in events
    ]
    prompts = rebuild_prompts(calls)
    # the tree's delta encoding reproduces, token for token, what the engine was asked
    assert [prompts[e.call_id] for e in events] == [r.prompt_ids for r in engine.requests]
    main = [e for e in events if e.call_kind == CallKind.MAIN]
    assert len(main) == 2, [(e.call_kind, e.requested_model, e.flags) for e in events]
    first, second = main
    p1, g1, p2 = prompts[first.call_id], first.generated_tokens.tolist(), prompts[second.call_id]
    assert first.finish_reason == "tool_calls" and second.finish_reason == "stop"
    # not an append: laid out again and branched from call 1 at the longest common token prefix
    assert "full_render" in second.flags, second.flags
    assert second.parent_call_id == first.call_id
    shared = second.shared_prefix_len
    assert 0 < shared < len(p1) + len(g1), (shared, len(p1), len(g1))
    assert p2[:shared] == (p1 + g1)[:shared] and p2[shared] != (p1 + g1)[shared]
    # TITO survives the re-ordering: call 1's sampled ids sit verbatim in call 2's prompt, not a re-encoding
    assert any(p2[i : i + len(g1)] == g1 for i in range(shared, len(p2) - len(g1) + 1)), "call 1's ids re-encoded"
    others = [e for e in events if e.call_kind != CallKind.MAIN]
    assert all(e.call_kind == CallKind.SIDE for e in others), [(e.call_kind, e.requested_model) for e in others]
