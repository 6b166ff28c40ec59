"""A large body is decoded and checked against the request limits in a process of its own, never in the proxy's.

``json.loads`` of a body of many tiny values (an 8 MiB one: ~280k one-character messages) holds the interpreter
lock for a tenth of a second or more, and every other rollout's call waits for it. So the proxy decodes no body
above ``precheck_bytes`` itself: a separate process decodes it, checks every limit (the same refusals, in the
caller's dialect) and also the count of JSON values (``max_json_values``), and only what passed comes back. Asserted
on the mechanism, not on timings: ``json.loads`` in the proxy's process is watched, and never sees a large body,
neither the refused ones nor the honest one that is served. Real broker, real proxy, scripted engine.
"""

from __future__ import annotations

import json
import os
import signal
from typing import Any

import aiohttp
import pytest

from producers.proxy.body_precheck import BodyPrecheck, count_values
from producers.proxy.dialects import RequestLimits
from producers.proxy.emit import ApiError
from producers.proxy.settings import ProxySettings
from schemas.events import Dialect
from tests.integration.test_proxy import auth, request_body
from tests.support import proxy_helpers as H
from tests.support.proxy_server import register, running_proxy
from tests.support.scripted_engine import ScriptedEngine

pytestmark = pytest.mark.integration

LARGE = 256 * 1024  # the proxy's precheck_bytes: larger bodies are decoded apart


def spliced(items: bytes, count: int, key: bytes = b'"messages": [') -> bytes:
    """A Chat Completions body whose ``messages`` list (or list ``key``) starts with ``count`` copies of ``items``."""
    base = json.dumps({**request_body("chat", [], False), "stop": ["never"]}).encode()
    head, tail = base.split(key, 1)
    return head + key + items * count + tail


async def post(http: aiohttp.ClientSession, url: str, reg: dict[str, Any], data: bytes) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **auth("chat", reg["secret"])}
    async with http.post(f"{url}/r/{reg['rollout_id']}/v1/chat/completions", data=data, headers=headers) as r:
        return r.status, json.loads(await r.read())


@pytest.fixture
def decoded_here(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Sizes of the bodies ``json.loads`` decoded in this (the proxy's) process: bytes, as the proxy reads them (the
    scripted engine, here too, decodes the proxy's requests from text)."""
    sizes: list[int] = []
    loads = json.loads

    def watched(text: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(text, bytes | bytearray):
            sizes.append(len(text))
        return loads(text, *args, **kwargs)

    monkeypatch.setattr(json, "loads", watched)
    return sizes


async def test_large_bodies_are_decoded_and_refused_apart(kafka_settings, decoded_here: list[int]) -> None:
    tiny = b'{"role":"user","content":"x"},'
    many_messages = spliced(tiny, LARGE // len(tiny))  # 256 KiB, ~9k messages: past max_messages
    # Within every other limit, but ~200k JSON values (in a field no parser reads; the parts of one message would do).
    many_values = spliced(b"0," * 200_000, 1, key=b'"stop": [')
    # An honest large body: a tool result of 300 KB of text in a few messages.
    result = ("line of output, with commas\n" * 11_000)[:300_000]
    honest = json.dumps(request_body("chat", [{"role": "user", "content": result}], False)).encode()
    async with (
        ScriptedEngine(H.tiny_tokenizer(), lambda *_: "ok") as engine,
        running_proxy(kafka_settings, engine.url, max_calls_per_rollout=0, max_prompt_tokens=10**7) as (proxy, url),
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http,
    ):
        attacker = await register(http, url, rollout_id="attacker")
        neighbour = await register(http, url, rollout_id="neighbour")

        status, answer = await post(http, url, attacker, many_messages)
        assert status == 400 and "max_messages" in answer["error"]["message"], answer  # today's refusal, unchanged
        assert not [n for n in decoded_here if n >= LARGE], f"the proxy's process decoded bodies of {decoded_here}"
        status, answer = await post(http, url, attacker, many_values)
        assert status == 400 and "max_json_values" in answer["error"]["message"], answer
        assert len(engine.requests) == 0
        status, answer = await post(http, url, neighbour, honest)
        assert status == 200, answer
        assert len(engine.requests) == 1 and result in engine.requests[0].prompt_text
        assert not [n for n in decoded_here if n >= LARGE], f"the proxy's process decoded bodies of {decoded_here}"
        assert (proxy.precheck.checked, proxy.precheck.refused) == (3, 2)
        async with http.get(f"{proxy.admin_url}/metrics") as r:  # nothing queued now
            assert "clawstream_proxy_intake_queued 0.0" in await r.text()


def test_values_are_counted_without_recursion() -> None:
    assert count_values(7, 10) == 1
    assert count_values({"a": [1, 2, {"b": None}], "c": "x"}, 100) == 7  # keys are not values
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    assert count_values(deep, 10**6) == 100_001
    assert count_values([0] * 1000, 10) == 11  # stops past the cap


def test_small_bodies_cannot_pass_max_json_values_unchecked() -> None:
    with pytest.raises(ValueError, match="precheck_bytes"):
        ProxySettings(model=H.tiny_model_dir(), max_json_values=1024, precheck_bytes=4096)


def test_a_precheck_process_that_dies_refuses_its_body_and_is_replaced() -> None:
    precheck = BodyPrecheck(0, 1024, 1)
    body = json.dumps(request_body("chat", [], False)).encode()
    try:
        precheck.warm()
        for pid in list(precheck._pool._processes):  # as if the kernel had killed it for its memory
            os.kill(pid, signal.SIGKILL)
        with pytest.raises(ApiError) as refused:
            precheck.parse(body, Dialect.OPENAI_CHAT, RequestLimits())
        assert refused.value.status == 400
        parsed, _ = precheck.parse(body, Dialect.OPENAI_CHAT, RequestLimits())  # a fresh process took over
        assert parsed.conversation.messages
    finally:
        precheck.close()
