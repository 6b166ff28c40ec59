"""The proxy's admin API on its own listener, and its per-rollout quotas (issue #29): real proxy, real broker.

- The harness-facing listener routes no admin path: register, status, seal, renew and forget there are 404 (with the
  right admin token), ``/metrics`` too; the admin listener serves them, and no model-call route.
- A rollout over its call quota or its prompt-token quota gets 400 in its dialect naming the quota; the engine is not
  called and no call event is published for the refused call (the calls topic read back); other rollouts are still
  served; the rollout's seal reports ``status: quota_exceeded`` (not an infrastructure failure), and the sandbox
  worker grades such a rollout, its lifecycle event's reason starting ``quota_exceeded:``.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from clawbase.settings import KafkaSettings
from producers.proxy.quota import Quotas
from schemas.events import RewardStatus, RolloutState
from tests.support import proxy_helpers as H
from tests.support import sandbox_helpers as S
from tests.support.proxy_server import admin_url, consume_calls, register, running_proxy, seal
from tests.support.sandbox_stack import by_rollout, run_requests, stack
from tests.support.scripted_engine import ScriptedEngine

pytestmark = pytest.mark.integration

ADMIN = {"Authorization": "Bearer admin"}
PATHS = {"anthropic": "/v1/messages", "chat": "/v1/chat/completions", "responses": "/responses"}


def first_request(dialect: str, stream: bool) -> dict[str, Any]:
    if dialect == "anthropic":
        return H.claude_request([H.claude_first_user()], stream)
    return {"chat": H.qwen_request, "responses": H.codex_request}[dialect]([], stream)


async def call(http: aiohttp.ClientSession, url: str, reg: dict, dialect: str, stream: bool = False):
    key = reg["secret"]
    headers = {"x-api-key": key} if dialect == "anthropic" else {"Authorization": f"Bearer {key}"}
    path = f"{url}/r/{reg['rollout_id']}{PATHS[dialect]}"
    async with http.post(path, json=first_request(dialect, stream), headers=headers) as r:
        return r.status, await r.read()


def assert_dialect_error(dialect: str, raw: bytes, words: str) -> None:
    err = json.loads(raw)
    if dialect == "anthropic":
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
    else:
        assert set(err["error"]) == {"message", "type", "param", "code"}, err
    assert words in err["error"]["message"], err


async def test_the_admin_api_answers_only_on_its_own_listener(kafka_settings: KafkaSettings) -> None:
    async with (
        ScriptedEngine(H.tiny_tokenizer(), ["ok"] * 4) as engine,
        running_proxy(kafka_settings, engine.url) as (proxy, url),
        aiohttp.ClientSession() as http,
    ):
        admin = admin_url(url)
        assert admin != url and admin == proxy.admin_url
        reg = await register(http, url, rollout_id="held")  # the helper goes to the admin listener
        attempts = [
            ("POST", "/admin/rollouts", {"rollout_id": "from-a-rollout"}),
            ("GET", "/admin/rollouts/held", None),
            ("POST", "/admin/rollouts/held/seal", None),
            ("POST", "/admin/rollouts/held/renew", {"lease_s": 5}),
            ("DELETE", "/admin/rollouts/held", None),
            ("GET", "/metrics", None),
        ]
        for method, path, body in attempts:  # with the right token: a rollout that stole it still gets nothing
            async with http.request(method, url + path, json=body, headers=ADMIN) as r:
                assert r.status == 404, (method, path, r.status, await r.text())
        # nothing happened to the registration through the harness-facing port
        assert (await call(http, url, reg, "chat"))[0] == 200
        async with http.get(f"{admin}/admin/rollouts/held", headers=ADMIN) as r:
            state = await r.json()
            assert r.status == 200 and not state["sealed"] and state["calls_served"] == 1, state
        async with http.get(f"{admin}/admin/rollouts/from-a-rollout", headers=ADMIN) as r:
            assert r.status == 404
        # the admin listener: the admin API (token still checked), /metrics, /healthz; no model calls
        async with http.post(f"{admin}/admin/rollouts", json={"rollout_id": "x"}) as r:
            assert r.status == 401
        async with http.get(f"{admin}/metrics") as r:
            assert r.status == 200 and "clawstream_proxy_calls_total" in await r.text()
        for base in (url, admin):
            async with http.get(f"{base}/healthz") as r:
                assert r.status == 200, base
        async with http.post(f"{admin}/r/held/v1/chat/completions", json=first_request("chat", False)) as r:
            assert r.status == 404
        assert (await seal(http, admin, "held"))["sealed"] is True


@pytest.mark.parametrize("dialect", ["anthropic", "chat", "responses"])
async def test_a_rollout_over_its_call_quota_is_refused_in_its_dialect(kafka_settings, dialect) -> None:
    async with (
        ScriptedEngine(H.tiny_tokenizer(), ["ok"] * 20) as engine,
        running_proxy(kafka_settings, engine.url, max_calls_per_rollout=2) as (_proxy, url),
        aiohttp.ClientSession() as http,
    ):
        over = await register(http, url, rollout_id=f"calls-over-{dialect}")
        other = await register(http, url, rollout_id=f"calls-other-{dialect}")
        for stream in (False, True):
            status, raw = await call(http, url, over, dialect, stream)
            assert status == 200, raw
        engine_calls = len(engine.requests)
        for stream in (False, True):  # refused before any keep-alive: a plain status, streaming or not
            status, raw = await call(http, url, over, dialect, stream)
            assert status == 400, raw
            assert_dialect_error(dialect, raw, "max_calls_per_rollout 2")
        assert len(engine.requests) == engine_calls  # the engine never saw the refused calls
        assert (await call(http, url, other, dialect))[0] == 200  # another rollout is still served
        assert (await call(http, url, other, dialect))[0] == 200
        sealed = await seal(http, url, over["rollout_id"])
        assert sealed["status"] == "quota_exceeded" and sealed["infra_failure"] is None, sealed
        assert "max_calls_per_rollout" in sealed["quota_exceeded"] and sealed["calls_served"] == 2, sealed
        assert (await seal(http, url, other["rollout_id"]))["status"] == "ok"
    events = consume_calls(kafka_settings, {over["rollout_id"]}, 3, timeout=8)
    assert [e.seq for e in events] == [0, 1]  # the refused calls published nothing


@pytest.mark.parametrize("dialect", ["anthropic", "chat", "responses"])
async def test_a_rollout_over_its_prompt_token_quota_is_refused(kafka_settings, dialect) -> None:
    async with (
        ScriptedEngine(H.tiny_tokenizer(), ["ok"] * 20) as engine,
        running_proxy(kafka_settings, engine.url) as (proxy, url),
        aiohttp.ClientSession() as http,
    ):
        probe = await register(http, url, rollout_id=f"tok-probe-{dialect}")
        assert (await call(http, url, probe, dialect))[0] == 200
        (measured,) = consume_calls(kafka_settings, {probe["rollout_id"]}, 1)
        prompt = measured.prompt_len
        proxy.quotas = Quotas(max_calls=0, max_prompt_tokens=prompt + prompt // 2)  # one call fits, two do not
        over = await register(http, url, rollout_id=f"tok-over-{dialect}")
        other = await register(http, url, rollout_id=f"tok-other-{dialect}")
        assert (await call(http, url, over, dialect))[0] == 200
        engine_calls = len(engine.requests)
        status, raw = await call(http, url, over, dialect)
        assert status == 400, raw
        assert_dialect_error(dialect, raw, f"max_prompt_tokens_per_rollout {prompt + prompt // 2}")
        assert len(engine.requests) == engine_calls
        assert (await call(http, url, other, dialect))[0] == 200  # its own budget: served
        sealed = await seal(http, url, over["rollout_id"])
        assert sealed["status"] == "quota_exceeded" and "max_prompt_tokens_per_rollout" in sealed["quota_exceeded"]
        assert sealed["usage"] == {"calls": 1, "prompt_tokens": prompt}, sealed
    events = consume_calls(kafka_settings, {over["rollout_id"]}, 2, timeout=8)
    assert [e.seq for e in events] == [0]


async def test_the_sandbox_worker_grades_a_rollout_stopped_by_a_quota(kafka_settings, group_id, tmp_path) -> None:
    """Through the sandbox worker (its admin client on the admin listener): a rollout whose second call is refused by
    the call quota is graded (not an infrastructure failure, never re-run), its lifecycle event saying why."""
    reqs = [S.request("hello", "agentloop", rollout_id="quota-1call")]
    async with stack(kafka_settings, group_id, tmp_path, proxy_overrides={"max_calls_per_rollout": 1}):
        events, rewards = await run_requests(kafka_settings, reqs)
    ev, rw = by_rollout(events, rewards)
    states = [e.state for e in ev["quota-1call"]]
    assert states == [RolloutState.STARTED, RolloutState.HARNESS_EXITED], ev["quota-1call"]
    exited = ev["quota-1call"][-1]
    assert exited.calls_served == 1 and exited.reason.startswith("quota_exceeded: "), exited
    assert "max_calls_per_rollout 1" in exited.reason, exited
    (reward,) = rw["quota-1call"]
    assert reward.status == RewardStatus.OK and reward.reward is not None, reward
