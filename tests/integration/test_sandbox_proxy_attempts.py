"""A rollout id's proxy registration belongs to one attempt: real proxy (real broker for its call events), the sandbox
worker's own admin client (``ProxyAdmin``), model calls through the registration's secret.

* ``test_another_attempts_seal_renew_and_forget_leave_the_registration_alone``: attempt A holds the registration;
  seal, renew and forget under attempt B's id are 409 naming A (never a 500), and afterwards A's registration is
  intact — not sealed, its secret still served. Unscoped calls (older clients) keep working.
* ``test_a_live_lease_holds_the_rollout_and_a_lapsed_one_is_revoked_by_attempt``: while A renews its lease, a second
  registration of the id is refused (``RolloutHeld``) and A keeps serving; once A's lease lapsed (its worker died),
  B's registration revokes A's — and A's late cleanup (seal, forget) ends nothing of B's. When B is forgotten as
  finished, the same request attempt is refused (finished) and a re-issue (next attempt number) registers.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import pytest

from producers.sandbox.proxy_admin import ProxyAdmin, ProxyError, RolloutHeld
from tests.support import proxy_helpers as H
from tests.support.proxy_server import admin_url, register, running_proxy
from tests.support.scripted_engine import ScriptedEngine

pytestmark = pytest.mark.integration
ADMIN = {"Authorization": "Bearer admin"}


async def chat(http: aiohttp.ClientSession, url: str, rid: str, secret: str) -> int:
    """One model call with the registration's secret; the HTTP status."""
    path = f"{url}/r/{rid}/v1/chat/completions"
    headers = {"Authorization": f"Bearer {secret}"}
    async with http.post(path, json=H.qwen_request([], stream=False), headers=headers) as r:
        await r.read()
        return r.status


async def admin_call(
    http: aiohttp.ClientSession, method: str, url: str, attempt_id: str | None = None
) -> tuple[int, dict[str, Any]]:
    params = {"attempt_id": attempt_id} if attempt_id else {}
    async with http.request(method, url, params=params, headers=ADMIN) as r:
        return r.status, await r.json(content_type=None)


async def status_of(http: aiohttp.ClientSession, url: str, rid: str) -> tuple[int, dict[str, Any]]:
    return await admin_call(http, "GET", f"{admin_url(url)}/admin/rollouts/{rid}")


async def test_another_attempts_seal_renew_and_forget_leave_the_registration_alone(kafka_settings) -> None:
    async with (
        ScriptedEngine(H.tiny_tokenizer(), ["one", "two", "three", "four"]) as engine,
        running_proxy(kafka_settings, engine.url) as (_proxy, url),
        aiohttp.ClientSession() as http,
    ):
        a = await register(http, url, rollout_id="r", attempt_id="r.a0.A")
        assert await chat(http, url, "r", a["secret"]) == 200
        base = f"{admin_url(url)}/admin/rollouts/r"
        for method, path in (("POST", f"{base}/seal"), ("POST", f"{base}/renew"), ("DELETE", base)):
            status, body = await admin_call(http, method, path, attempt_id="r.a0.B")
            assert status == 409, (method, path, status, body)
            assert body["attempt_id"] == "r.a0.A" and "held by attempt r.a0.A, not r.a0.B" in body["error"]
        client = ProxyAdmin(admin_url(url), "admin", 15)
        with pytest.raises(ProxyError, match="409"):
            await client.seal("r", "r.a0.B")
        await client.forget("r", "r.a0.B", finished=True)
        assert not await client.renew("r", "r.a0.B", 30)
        status, body = await status_of(http, url, "r")
        assert status == 200 and body["attempt_id"] == "r.a0.A" and not body["sealed"], body
        assert await chat(http, url, "r", a["secret"]) == 200  # A's registration still serves
        # its own attempt ends it; an unknown rollout is a 404, whatever the attempt
        sealed = await client.seal("r", "r.a0.A")
        assert sealed["calls_served"] == 2 and sealed["status"] == "ok"
        await client.forget("r", "r.a0.A")
        assert (await status_of(http, url, "r"))[0] == 404
        assert (await admin_call(http, "POST", f"{base}/seal", attempt_id="r.a0.A"))[0] == 404
        # an older client's calls, unscoped, still seal and forget whatever attempt holds the id
        await register(http, url, rollout_id="old", attempt_id="old.a0.X")
        assert (await admin_call(http, "POST", f"{admin_url(url)}/admin/rollouts/old/seal"))[0] == 200
        assert (await admin_call(http, "DELETE", f"{admin_url(url)}/admin/rollouts/old"))[0] == 200


async def test_a_live_lease_holds_the_rollout_and_a_lapsed_one_is_revoked_by_attempt(kafka_settings) -> None:
    async with (
        ScriptedEngine(H.tiny_tokenizer(), ["one", "two", "three", "four"]) as engine,
        running_proxy(kafka_settings, engine.url) as (_proxy, url),
        aiohttp.ClientSession() as http,
    ):
        client = ProxyAdmin(admin_url(url), "admin", 15)
        a = await client.register("r", attempt_id="r.a0.A", attempt=0, lease_s=30)
        with pytest.raises(RolloutHeld) as held:  # A's worker renews its lease: B must not take the rollout over
            await client.register("r", attempt_id="r.a0.B", attempt=0, lease_s=30)
        assert held.value.attempt_id == "r.a0.A" and not held.value.finished
        assert await chat(http, url, "r", a["secret"]) == 200
        # A's worker dies: its lease (shortened here by one last renewal) lapses
        assert await client.renew("r", "r.a0.A", 0.2)
        deadline = time.monotonic() + 10
        while (await status_of(http, url, "r"))[1]["live"]:
            assert time.monotonic() < deadline, "A's lease never lapsed"
            await asyncio.sleep(0.05)
        b = await client.register("r", attempt_id="r.a0.B", attempt=0, lease_s=30)  # revokes A's registration
        assert await chat(http, url, "r", a["secret"]) == 401
        assert await chat(http, url, "r", b["secret"]) == 200
        # A's late cleanup ends nothing of B's
        with pytest.raises(ProxyError, match="409"):
            await client.seal("r", "r.a0.A")
        await client.forget("r", "r.a0.A", finished=True)
        status, body = await status_of(http, url, "r")
        assert body["attempt_id"] == "r.a0.B" and body["live"] and not body["sealed"], body
        assert await chat(http, url, "r", b["secret"]) == 200
        # B finishes (reward out): the same request attempt is not registered again; a re-issue is
        assert (await client.seal("r", "r.a0.B"))["calls_served"] == 2
        await client.forget("r", "r.a0.B", finished=True)
        with pytest.raises(RolloutHeld) as done:
            await client.register("r", attempt_id="r.a0.C", attempt=0, lease_s=30)
        assert done.value.finished and done.value.attempt_id == "r.a0.B"
        again = await client.register("r", attempt_id="r.a1.D", attempt=1, lease_s=30)
        assert await chat(http, url, "r", again["secret"]) == 200
        # malformed leases are 400s
        for body_ in ({"rollout_id": "z", "lease_s": -1}, {"rollout_id": "z", "attempt": "first"}):
            async with http.post(f"{admin_url(url)}/admin/rollouts", json=body_, headers=ADMIN) as r:
                assert r.status == 400 and "bad registration" in (await r.json())["error"], body_


async def test_admin_calls_wait_for_a_restarting_proxy_instead_of_failing_the_attempt(
    kafka_settings, caplog: pytest.LogCaptureFixture
) -> None:
    """A proxy restarting (refusing connections) must not burn a request's attempts in seconds: the registration
    waits for it, bounded by ``connect_retries``."""
    from clawstream.stack.services import free_port

    port, admin_port = free_port(), free_port()
    url, admin = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}"
    with pytest.raises(ProxyError, match="ClientConnectorError"):  # the bound: no retries, fails at once
        await ProxyAdmin(admin, "admin", 15, connect_retries=0).register("r", attempt_id="r.a0.A", attempt=0)
    caplog.set_level("WARNING", logger="clawstream.rollout")
    caplog.clear()
    task = asyncio.ensure_future(
        ProxyAdmin(admin, "admin", 15, connect_retries=100).register("r", attempt_id="r.a0.A", attempt=0, lease_s=30)
    )
    deadline = time.monotonic() + 10
    while "unreachable" not in caplog.text:  # refused at least once: the proxy is down, the call waits
        assert not task.done() and time.monotonic() < deadline, task
        await asyncio.sleep(0.05)
    async with (
        ScriptedEngine(H.tiny_tokenizer(), ["one"]) as engine,
        running_proxy(kafka_settings, engine.url, port=port, admin_port=admin_port),
        aiohttp.ClientSession() as http,
    ):
        registered = await asyncio.wait_for(task, 30)
        assert registered["secret"]
        assert await chat(http, url, "r", registered["secret"]) == 200
