"""A scripted inference engine: a real aiohttp server speaking the engine protocol subset (vLLM ``/v1/completions``).

It answers each request with text chosen by the test (a list consumed in order, or a function of the decoded
prompt), encoded through the real tokenizer, followed by ``<|im_end|>`` (``finish_reason="stop"``) unless
``max_tokens`` cuts it (``"length"``). Logprobs are fake but valid (negative, one per token). It records every
request, reports ``policy_version`` in the body and the ``X-Policy-Version`` header, and can be slowed down
(``delay_s``) to exercise keep-alives, or held (``hold``: an ``asyncio.Event`` every answer waits for, set by the test
at a moment of its choosing). With ``prefix_cache=True`` it reports ``usage.prompt_tokens_details.
cached_tokens`` as a prefix cache would (the longest common prefix with an earlier prompt + its answer), and with
``engine_telemetry`` it adds that top-level object (the CPU engine's GPU readings). ``kill()`` drops every
connection at once, answers in flight unanswered (an engine killed mid-call), then stops. Shared by the scripted
teacher (``warmstart/teacher.py``), the proxy tests, the real-harness tests and ``bench/proxy.py``.

Use::

    async with ScriptedEngine(tokenizer, script=["<tool_call>...</tool_call>", "Done."]) as engine:
        engine.url  # http://127.0.0.1:PORT
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

Responder = Callable[[str, list[int], dict[str, Any]], str]  # (prompt text, prompt ids, request) -> answer text


@dataclass
class EngineRequest:
    prompt_ids: list[int]
    prompt_text: str
    body: dict[str, Any]


def tool_call_text(name: str, arguments: dict[str, Any], text: str = "") -> str:
    """The Qwen3 markup a model writes for one tool call (optionally after some text)."""
    block = f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments, ensure_ascii=False)}}}\n</tool_call>'
    return f"{text}\n{block}" if text else block


class ScriptedEngine:
    def __init__(
        self,
        tokenizer: Any,
        script: list[str] | Responder | None = None,
        *,
        policy_version: int = 7,
        delay_s: float = 0.0,
        host: str = "127.0.0.1",
        port: int = 0,
        prefix_cache: bool = False,
        engine_telemetry: dict[str, Any] | None = None,
    ) -> None:
        self.tok = tokenizer
        self.script = script if script is not None else []
        self.policy_version = policy_version
        self.delay_s = delay_s
        self.hold: asyncio.Event | None = None  # when set to an Event, every answer waits until it is set
        self.host, self.port = host, port
        self.requests: list[EngineRequest] = []
        self.im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.prefix_cache = prefix_cache
        self.engine_telemetry = engine_telemetry
        self.cached: list[int] = []  # cached_tokens reported per request (prefix_cache=True)
        self._seen: list[list[int]] = []  # prompt + answer of every earlier request
        self._runner: web.AppRunner | None = None
        self._transports: list[Any] = []  # every connection a request came on (kill() drops them)
        self.url = ""

    def next_text(self, prompt_text: str, prompt_ids: list[int], body: dict[str, Any]) -> str:
        if callable(self.script):
            return self.script(prompt_text, prompt_ids, body)
        if not self.script:
            return "Done."
        return self.script.pop(0)

    def generate(self, prompt_ids: list[int], body: dict[str, Any]) -> tuple[list[int], str]:
        text = self.next_text(self.tok.decode(prompt_ids, skip_special_tokens=False), prompt_ids, body)
        ids = [*self.tok.encode(text, add_special_tokens=False), self.im_end]
        max_tokens = int(body.get("max_tokens") or len(ids))
        if len(ids) > max_tokens:
            return ids[:max_tokens], "length"
        return ids, "stop"

    async def _completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        prompt = body.get("prompt")
        if not isinstance(prompt, list) or not all(isinstance(t, int) for t in prompt):
            return web.json_response({"error": {"message": "prompt must be token ids"}}, status=400)
        self.requests.append(EngineRequest(prompt, self.tok.decode(prompt, skip_special_tokens=False), body))
        self._transports.append(request.transport)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.hold is not None:
            await self.hold.wait()
        ids, finish = self.generate(prompt, body)
        logprobs = [-0.05 - 0.01 * (i % 7) for i in range(len(ids))]
        choice = {
            "index": 0,
            "text": self.tok.decode(ids, skip_special_tokens=True),
            "token_ids": ids,
            "logprobs": {"token_logprobs": logprobs, "tokens": None, "top_logprobs": None, "text_offset": None},
            "finish_reason": finish,
            "prompt_token_ids": prompt,
        }
        out = {
            "id": f"cmpl-{len(self.requests)}",
            "object": "text_completion",
            "model": body.get("model", "policy"),
            "choices": [choice],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids)},
            "policy_version": self.policy_version,
        }
        if self.prefix_cache:
            cached = max((_common_prefix(prompt, seen) for seen in self._seen), default=0)
            self.cached.append(cached)
            out["usage"]["prompt_tokens_details"] = {"cached_tokens": cached}
            self._seen.append(prompt + ids)
        if self.engine_telemetry is not None:
            out["engine_telemetry"] = self.engine_telemetry
        return web.json_response(out, headers={"X-Policy-Version": str(self.policy_version)})

    async def _health(self, _request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    def app(self) -> web.Application:
        app = web.Application(client_max_size=256 * 1024 * 1024)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/health", self._health)
        return app

    async def start(self) -> ScriptedEngine:
        self._runner = web.AppRunner(self.app())
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://{self.host}:{port}"
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def kill(self) -> None:
        """Drop every connection (a held answer is never sent), then stop: as an engine SIGKILLed mid-call."""
        for transport in self._transports:
            if transport is not None:
                transport.abort()
        if self.hold is not None:
            self.hold.set()  # the dropped handlers finish into closed connections, so stop() need not wait for them
        await self.stop()

    async def __aenter__(self) -> ScriptedEngine:
        return await self.start()

    async def __aexit__(self, *_exc: object) -> None:
        await self.stop()


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return min(n, len(a) - 1)  # as vLLM: the last prompt token is always computed


class ThreadedServer:
    """Run an aiohttp app factory on its own event loop in a thread (for sync tests driving subprocesses)."""

    def __init__(self, start: Callable[[], Any], stop: Callable[[], Any]) -> None:
        self._start, self._stop = start, stop
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> ThreadedServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(30)
        return self

    def __exit__(self, *_exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
