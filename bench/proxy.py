"""Serving-proxy benchmark: added latency, calls/s, per-call CPU as the context grows, bytes published.

Everything runs in one process on loopback: the scripted engine (tests/support/scripted_engine.py, answers
instantly), the real proxy HTTP server and an aiohttp client. Kafka is replaced by an in-memory publisher that
encodes each CallEvent exactly as the real one does (the broker's ack time is not part of the proxy's cost; with
acks=all on a local broker it adds a few ms per call).

1. Latency, side by side in one run against the same instant engine, interleaved round by round: the engine
   directly (token ids, ``/v1/completions``), our proxy (OpenAI Chat, non-streaming, a fresh 1-call rollout each
   time, so each call is a first/full render), and a LiteLLM proxy in front of the same engine. LiteLLM forwards
   OpenAI Chat as OpenAI Chat (it has no token-in-token-out path), so the engine also gets a bench-only
   ``/v1/chat/completions`` route that does what vLLM's does: chat template + tokenize, generate, parse the tool
   call; LiteLLM's added latency is measured against that route called directly. LiteLLM runs in its own process
   (``litellm --config``, one worker, master key, no database), installed in a separate venv
   (``python3 -m venv /tmp/litellm-venv && /tmp/litellm-venv/bin/pip install 'litellm[proxy]==1.106.12'``); the
   row is skipped, with the reason printed, when it is not found or does not start.
2. Growth: one rollout of 50 calls (Anthropic dialect, Claude-Code-shaped), each adding a ~640-token tool result,
   growing to ~32k tokens; per call: the proxy's render time and its whole CPU time (process CPU minus the
   engine handler's), which should stay flat.
3. Bytes: Avro bytes published for that rollout (delta-encoded prompts; raw and zstd) vs the full prompts as int32.

Run: ``HF_HUB_OFFLINE=1 .venv/bin/python -m bench.proxy [--calls 50] [--latency-rounds 200] [--litellm PATH]``;
writes ``bench/results/proxy.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import cramjam
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from producers.proxy.app import Proxy, ProxySettings  # noqa: E402
from producers.proxy.conversation import Message, ToolCall  # noqa: E402
from producers.proxy.tool_parse import parse_turn  # noqa: E402
from schemas.events import CallEvent  # noqa: E402
from tests.support import proxy_helpers as H  # noqa: E402
from tests.support.scripted_engine import ScriptedEngine, tool_call_text  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "proxy.md"
WORDS = "alpha beta gamma delta file line total report value config entry status output result".split()


class MemoryPublisher:
    def __init__(self) -> None:
        self.values: list[bytes] = []

    async def publish(self, topic: str, key: str, value: bytes, timeout: float) -> None:
        self.values.append(value)

    def close(self) -> None:
        pass


class TimedEngine(ScriptedEngine):
    """Counts the CPU time spent in the engine handler so it can be subtracted from the process's CPU time."""

    cpu = 0.0

    async def _completions(self, request: web.Request) -> web.Response:
        t = time.process_time()
        try:
            return await super()._completions(request)
        finally:
            TimedEngine.cpu += time.process_time() - t

    async def _chat(self, request: web.Request) -> web.Response:
        """OpenAI Chat served by the engine itself (what vLLM's route does), for the LiteLLM comparison only."""
        body = await request.json()
        prompt = self.tok.apply_chat_template(
            body["messages"], tools=body.get("tools"), add_generation_prompt=True, tokenize=True, return_dict=False
        )
        ids, finish = self.generate(list(prompt), body)
        turn = parse_turn(self.tok.decode(ids, skip_special_tokens=True))
        calls = [
            {"id": f"call_{i}", "type": "function", "function": {"name": c.name, "arguments": c.arguments_json}}
            for i, c in enumerate(turn.tool_calls)
        ]
        message = {"role": "assistant", "content": turn.text or None, **({"tool_calls": calls} if calls else {})}
        out = {
            "id": f"chatcmpl-{len(self.requests)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model", "policy"),
            "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls" if calls else finish}],
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(ids),
                "total_tokens": len(prompt) + len(ids),
            },
        }
        return web.json_response(out)

    def app(self) -> web.Application:
        app = super().app()
        app.router.add_post("/v1/chat/completions", self._chat)
        return app


def find_litellm(option: str | None) -> str | None:
    if option:
        return option if os.access(option, os.X_OK) else None
    default = "/tmp/litellm-venv/bin/litellm"
    return default if os.access(default, os.X_OK) else shutil.which("litellm")


class LiteLLM:
    """A LiteLLM proxy process (one worker) whose model ``policy`` forwards OpenAI Chat to the engine's route."""

    def __init__(self, exe: str, engine_url: str) -> None:
        self.exe, self.engine_url = exe, engine_url
        self.key = "sk-" + secrets.token_hex(32)  # recent LiteLLM refuses to start without a master key
        self.dir = Path(tempfile.mkdtemp(prefix="clawstream-litellm-"))
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self, http: aiohttp.ClientSession, timeout: float = 120.0) -> None:
        (self.dir / "config.yaml").write_text(
            "model_list:\n  - model_name: policy\n    litellm_params:\n      model: openai/policy\n"
            f"      api_base: {self.engine_url}/v1\n      api_key: none\n"
            "litellm_settings:\n  telemetry: false\n"
            f"general_settings:\n  master_key: {self.key}\n"
        )
        # the local cost map: else it fetches model prices from GitHub at start (no internet here)
        env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR"}
        log = open(self.dir / "litellm.log", "wb")  # noqa: SIM115 (lives as long as the process)
        self.proc = await asyncio.create_subprocess_exec(
            self.exe,
            "--config",
            str(self.dir / "config.yaml"),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--num_workers",
            "1",
            cwd=self.dir,
            env=env,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.returncode is None:
            try:
                async with http.get(f"{self.url}/health/liveliness") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.5)
        tail = (self.dir / "litellm.log").read_text(errors="replace")[-1500:]
        await self.stop()
        raise RuntimeError(f"LiteLLM did not come up in {timeout:.0f}s:\n{tail}")

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # its own session: the CLI may fork uvicorn workers
            try:
                await asyncio.wait_for(self.proc.wait(), 15)
            except TimeoutError:
                os.killpg(self.proc.pid, signal.SIGKILL)
                await self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)  # config + log: a failed start already printed the log's tail


async def start_proxy(engine_url: str, pub: MemoryPublisher) -> tuple[web.AppRunner, Proxy, str]:
    settings = ProxySettings(
        model=H.tiny_model_dir(),
        engine_url=engine_url,
        port=0,
        admin_token="a",
        max_calls_per_rollout=0,  # a benchmark's rollouts make as many calls as it measures
        max_prompt_tokens_per_rollout=0,
    )
    proxy = Proxy(settings, pub, "calls", tokenizer=H.tiny_tokenizer())
    runner, admin = web.AppRunner(proxy.app(), access_log=None), web.AppRunner(proxy.admin_app(), access_log=None)
    await runner.setup()
    await admin.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    await web.TCPSite(admin, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    proxy.public_url = url
    ADMIN_URLS[url] = f"http://127.0.0.1:{admin.addresses[0][1]}"
    runner.app.on_cleanup.append(lambda _app: admin.cleanup())  # the admin listener goes with the proxy
    return runner, proxy, url


ADMIN_URLS: dict[str, str] = {}  # a proxy's harness-facing URL → its admin listener


async def register(http: aiohttp.ClientSession, url: str, rid: str) -> str:
    admin, body = ADMIN_URLS[url], {"rollout_id": rid}
    async with http.post(f"{admin}/admin/rollouts", json=body, headers={"Authorization": "Bearer a"}) as r:
        return (await r.json())["secret"]


async def timed_post(http: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str]) -> float:
    t = time.perf_counter()
    async with http.post(url, json=body, headers=headers) as r:
        assert r.status == 200, await r.text()
        answer = await r.json()
    elapsed = time.perf_counter() - t
    if "choices" in answer and "message" in answer["choices"][0]:  # a chat answer must carry the parsed tool call
        assert answer["choices"][0]["message"].get("tool_calls"), answer
    return elapsed


async def latency(
    http: aiohttp.ClientSession, engine: ScriptedEngine, url: str, rounds: int, litellm: LiteLLM | None
) -> dict[str, Any]:
    body = H.qwen_request([], stream=False)
    prompt = H.tiny_tokenizer().apply_chat_template(
        body["messages"], tools=body["tools"], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    times: dict[str, list[float]] = {"direct": [], "direct_chat": [], "proxy": [], "litellm": []}
    warmup = 5
    for i in range(rounds + warmup):  # interleaved: the machine is shared and noisy
        row = {
            "direct": await timed_post(
                http, f"{engine.url}/v1/completions", {"prompt": list(prompt), "max_tokens": 64}, {}
            )
        }
        secret = await register(http, url, f"lat-{i}")
        row["proxy"] = await timed_post(
            http, f"{url}/r/lat-{i}/v1/chat/completions", body, {"Authorization": f"Bearer {secret}"}
        )
        if litellm is not None:
            row["direct_chat"] = await timed_post(http, f"{engine.url}/v1/chat/completions", body, {})
            row["litellm"] = await timed_post(
                http, f"{litellm.url}/v1/chat/completions", body, {"Authorization": f"Bearer {litellm.key}"}
            )
        if i >= warmup:  # the first calls of each path pay for connection set-up and lazy imports
            for k, v in row.items():
                times[k].append(v)
    med = {k: statistics.median(v) for k, v in times.items() if v}
    out: dict[str, Any] = {
        "prompt_tokens": len(prompt),
        "ms": {k: v * 1000 for k, v in med.items()},
        "cps": {k: 1 / v for k, v in med.items()},
    }
    out["added_ms"] = {"proxy": (med["proxy"] - med["direct"]) * 1000}
    if litellm is not None:
        out["added_ms"]["litellm"] = (med["litellm"] - med["direct_chat"]) * 1000
    return out


async def growth(http: aiohttp.ClientSession, url: str, calls: int, pub: MemoryPublisher) -> list[dict[str, Any]]:
    rng = random.Random(0)
    secret = await register(http, url, "grow")
    history: list[dict[str, Any]] = [H.claude_first_user()]
    rows = []
    bodies: list[dict[str, Any]] = []
    first_value = len(pub.values)
    for i in range(calls):
        body = H.claude_request(history, stream=False)
        bodies.append(body)
        cpu0, eng0 = time.process_time(), TimedEngine.cpu
        async with http.post(f"{url}/r/grow/v1/messages", json=body, headers={"x-api-key": secret}) as r:
            assert r.status == 200, await r.text()
            answer = await r.json()
        cpu = time.process_time() - cpu0 - (TimedEngine.cpu - eng0)
        event = CallEvent.from_bytes(pub.values[-1])
        rows.append(
            {
                "call": i + 1,
                "prompt_len": event.prompt_len,
                "new": len(event.new_tokens),
                "render_ms": event.render_ms,
                "proxy_cpu_ms": cpu * 1000,
                "flags": event.flags,
            }
        )
        result = " ".join(rng.choice(WORDS) for _ in range(480))  # ~640 tokens of tool output
        history += H.claude_followup(answer, result)
    rows[0]["values"] = pub.values[first_value:]
    # Parse + render alone (no HTTP, no JSON), replayed on a fresh renderer: the part TITO makes incremental.
    from producers.proxy.dialects import parse_anthropic
    from producers.proxy.render import RolloutRenderer, TemplateRenderer
    from producers.proxy.tool_parse import parse_turn

    rr = RolloutRenderer(TemplateRenderer(H.tiny_tokenizer()))
    events = [CallEvent.from_bytes(v) for v in rows[0]["values"]]
    for i, (body, event) in enumerate(zip(bodies, events, strict=True)):
        conv = parse_anthropic(body).conversation
        t = time.process_time()  # one cold render: a repeat would hit the segment cache
        result = rr.render(conv)
        rows[i]["render_cpu_ms"] = (time.process_time() - t) * 1000
        gen = event.generated_tokens.tolist()
        turn = parse_turn(H.tiny_tokenizer().decode(gen, skip_special_tokens=True))
        answer = history[2 * i + 1]  # the assistant message the harness stored
        calls = tuple(ToolCall(b["id"], b["name"], b["input"]) for b in answer["content"] if b["type"] == "tool_use")
        rr.record(event.call_id, i, result, gen, Message("assistant", turn.text, turn.reasoning, calls))
        assert result.parent_call_id == (events[i - 1].call_id if i else None)  # same TITO chain as the proxy
    return rows


async def main_async(args: argparse.Namespace) -> str:
    def respond(_text: str, _ids: list[int], _body: dict[str, Any]) -> str:
        return tool_call_text("Bash", {"command": "cat report.txt"})

    pub = MemoryPublisher()
    litellm_skip = ""
    async with TimedEngine(H.tiny_tokenizer(), respond) as engine, aiohttp.ClientSession() as http:
        runner, _proxy, url = await start_proxy(engine.url, pub)
        litellm: LiteLLM | None = None
        exe = find_litellm(args.litellm)
        if exe is None:
            litellm_skip = (
                f"LiteLLM not found ({args.litellm or '/tmp/litellm-venv/bin/litellm or litellm on PATH'});"
                " install it in its own venv, see the module docstring"
            )
        else:
            litellm = LiteLLM(exe, engine.url)
            try:
                await litellm.start(http)
            except RuntimeError as exc:
                litellm, litellm_skip = None, f"LiteLLM ({exe}) did not start: {exc}"
        if litellm_skip:
            print(f"skipping the LiteLLM row: {litellm_skip}", file=sys.stderr)
        try:
            lat = await latency(http, engine, url, args.latency_rounds, litellm)
            rows = await growth(http, url, args.calls, pub)
        finally:
            await runner.cleanup()
            if litellm is not None:
                await litellm.stop()
    version = "" if litellm is None else litellm_version(litellm.exe)
    values = rows[0].pop("values")
    events = [CallEvent.from_bytes(v) for v in values]
    published = sum(len(v) for v in values)
    published_zstd = sum(len(bytes(cramjam.zstd.compress(v, level=3))) for v in values)
    full = sum(4 * e.prompt_len + 8 * len(e.generated_tokens) for e in events)
    head, tail = rows[:5], rows[-5:]
    cpu_first = statistics.median(r["proxy_cpu_ms"] for r in rows[1:6])
    cpu_last = statistics.median(r["proxy_cpu_ms"] for r in rows[-5:])
    r_first = statistics.median(r["render_cpu_ms"] for r in rows[1:6])
    r_last = statistics.median(r["render_cpu_ms"] for r in rows[-5:])
    lines = [
        "# Serving proxy benchmark",
        "",
        f"In-process on loopback: scripted engine (instant answers), real proxy HTTP server, aiohttp client; Kafka "
        f"replaced by an in-memory publisher (events still Avro-encoded). {platform.python_implementation()} "
        f"{platform.python_version()}, {platform.machine()}, 2 shared cores. Run: `HF_HUB_OFFLINE=1 .venv/bin/python "
        "-m bench.proxy`.",
        "",
        f"## Latency ({args.latency_rounds} interleaved rounds after 5 warm-up rounds, medians, "
        f"~{lat['prompt_tokens']}-token prompt, non-streaming, one client)",
        "",
        *latency_table(lat, version, litellm_skip),
        "",
        f"## Per-call proxy CPU as one rollout grows ({args.calls} Anthropic calls, +~640 tokens each)",
        "",
        "| call | prompt tokens | new tokens | render, wall in proxy (ms) | render CPU alone (ms) "
        "| proxy+client CPU (ms) | flags |",
        "|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in [*head, *tail]:
        lines.append(
            f"| {r['call']} | {r['prompt_len']} | {r['new']} | {r['render_ms']:.2f} | "
            f"{r['render_cpu_ms']:.2f} | {r['proxy_cpu_ms']:.2f} | {','.join(r['flags'])} |"
        )
    lines += [
        "",
        f"Render CPU alone (parse excluded, one cold render per call): calls 2-6 median {r_first:.2f} ms, last 5 calls "
        f"{r_last:.2f} ms. Whole-process CPU per call (proxy + the in-process client, engine subtracted): calls 2-6 "
        f"{cpu_first:.2f} ms, last 5 {cpu_last:.2f} ms (ratio {cpu_last / cpu_first:.2f} for a "
        f"{rows[-1]['prompt_len'] / rows[1]['prompt_len']:.1f}x longer prompt): that part grows because the client "
        "encodes and the proxy reads + JSON-decodes the whole history on every call (the harness resends it), "
        "which no renderer can avoid. The render wall time in the proxy is noisy on this shared machine.",
        "",
        "## Bytes published for that rollout",
        "",
        "| what | bytes |",
        "|---|---:|",
        f"| call events as published (Avro, delta-encoded prompts) | {published:,} |",
        f"| same after zstd-3 (what the producer sends) | {published_zstd:,} |",
        f"| full prompts as int32 + generated ids and logprobs | {full:,} |",
        f"| **ratio full / published** | **{full / published:.1f}x** |",
        "",
    ]
    return "\n".join(lines)


def litellm_version(exe: str) -> str:
    python = Path(exe).parent / "python"  # the venv LiteLLM was installed in
    try:
        out = subprocess.run(
            [str(python), "-c", "import importlib.metadata as m; print(m.version('litellm'))"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        return out.stdout.strip()
    except OSError:
        return ""


def latency_table(lat: dict[str, Any], version: str, litellm_skip: str) -> list[str]:
    ms, cps, added = lat["ms"], lat["cps"], lat["added_ms"]
    lines = [
        "| path | client sends | latency (ms) | calls/s | added vs the engine (ms) |",
        "|---|---|---:|---:|---:|",
        f"| (a) engine directly, `/v1/completions` (token ids) | token ids | {ms['direct']:.2f} | "
        f"{cps['direct']:.0f} | |",
        f"| (b) **our proxy** → engine `/v1/completions` (renders + TITO, full render: 1st call of a rollout) | "
        f"OpenAI Chat | {ms['proxy']:.2f} | {cps['proxy']:.0f} | **{added['proxy']:.2f}** vs (a) |",
    ]
    if litellm_skip:
        return [*lines, f"| (c) LiteLLM proxy | skipped: {litellm_skip.splitlines()[0]} | | | |"]
    return [
        *lines,
        f"| (a') engine directly, `/v1/chat/completions` (engine renders + parses the tool call, as vLLM) | "
        f"OpenAI Chat | {ms['direct_chat']:.2f} | {cps['direct_chat']:.0f} | |",
        f"| (c) LiteLLM {version} proxy (`openai/policy`, 1 worker) → engine `/v1/chat/completions` | OpenAI Chat | "
        f"{ms['litellm']:.2f} | {cps['litellm']:.0f} | **{added['litellm']:.2f}** vs (a') |",
        "",
        "(b) and (c) answer the same OpenAI Chat request; (b) does the chat-template rendering itself (the engine then "
        "only generates), (c) leaves it to the engine, so each is measured against the engine route that does the "
        "rest of its work. End to end, client to answer: (b) "
        f"{ms['proxy']:.2f} ms vs (c) {ms['litellm']:.2f} ms. LiteLLM runs in its own process (its CPU work overlaps "
        "the bench process's on the second core); our proxy shares one Python process and event loop with the "
        "engine and the client. Neither records anything durable here (ours publishes to an in-memory publisher; "
        "LiteLLM has no database).",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--latency-rounds", type=int, default=200)
    parser.add_argument(
        "--litellm",
        default=None,
        help="LiteLLM executable (default: /tmp/litellm-venv/bin/litellm, else litellm on PATH)",
    )
    args = parser.parse_args()
    report = asyncio.run(main_async(args))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(report)
    print(report)


if __name__ == "__main__":
    main()
