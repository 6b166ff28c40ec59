"""Proxy replicas behind one public URL serve one rollout alternately, and through HAProxy survive a kill (#31 item 1).

Two real proxy processes (``python -m producers.proxy``) with ``replica_id`` a and b and one public URL, in front of
the scripted engine, on the real broker; a third, single proxy on another topic prefix is the reference, given the
same calls. Alternating: the rollout is registered at a, its four calls go a, b, a, b, it is sealed at b and
forgotten (finished) at a. Every call gets 200; the calls topic holds seq 0-3 once each, each call's parent is the
call before (delta encoded, never rendered in full again) and every prompt equals the reference proxy's; the seal
reports 4 calls; a registers the finished attempt again: 409 finished; a call with a wrong key at the replica not
holding the rollout is 401 and moves nothing (its takeovers metric unchanged).
HAProxy (compose/haproxy.cfg, the balancer of the compose `scale` profile) in front of both: once the rollout's
second call's event is on the calls topic, the replica the balancer sent it to is SIGKILLed by pid; the third call
through the balancer gets 200 from the other replica, seq 2 follows on, the seal through the balancer reports 3.
While no replica is up HAProxy answers 503 itself: the sandbox worker's admin client retries it until one is.
Every process started here is SIGKILLed by pid at the end.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from clawbase.kafka.clients import create_topics
from clawbase.settings import KafkaSettings
from producers.sandbox.proxy_admin import ProxyAdmin
from schemas.events import CallEvent
from schemas.topics import CATALOG
from tests.integration.test_proxy_restart import TOKEN, ProxyProcess, _admin, _call, _free_port, _prompts, _register
from tests.support import proxy_helpers as H
from tests.support.proxy_server import consume_calls
from tests.support.scripted_engine import ScriptedEngine, tool_call_text

pytestmark = pytest.mark.integration

HAPROXY_CFG = Path(__file__).resolve().parents[2] / "compose" / "haproxy.cfg"
ANSWERS = [  # by the number of assistant turns already in the prompt: every proxy gets the same answers
    tool_call_text("write_file", {"file_path": f"step{k}.txt", "content": str(k)}) for k in range(4)
] + ["Done: four files written."]


def _answer(prompt_text: str, _ids: list[int], _body: dict[str, Any]) -> str:
    return ANSWERS[min(prompt_text.count("<|im_start|>assistant\n") - 1, len(ANSWERS) - 1)]


def _replica(kafka: KafkaSettings, engine_url: str, name: str, log: Path, public_url: str) -> ProxyProcess:
    proxy = ProxyProcess(kafka, engine_url, _free_port(), log)
    proxy.env = {"CLAWSTREAM_PROXY_REPLICA_ID": name, "CLAWSTREAM_PROXY_PUBLIC_URL": public_url}
    return proxy


async def _takeovers(http: aiohttp.ClientSession, proxy: ProxyProcess) -> float:
    async with http.get(f"{proxy.admin}/metrics") as r:
        match = re.search(r"^clawstream_proxy_takeovers_total (\S+)$", await r.text(), re.M)
    assert match, "no takeovers metric"
    return float(match.group(1))


async def _calls(
    http: aiohttp.ClientSession, urls: list[str], rid: str, secret: str, between: Any = None
) -> list[dict[str, Any]]:
    """One call per URL, each extending the conversation before; ``between(k)`` runs before call k."""
    history: list[dict[str, Any]] = []
    out = []
    for k, url in enumerate(urls):
        if between is not None:
            await between(k)
        status, body = await _call(http, url, rid, secret, history)
        assert status == 200, (k, url, body)
        out.append(body)
        history += H.qwen_followup(body, f"result {k}")
    return out


def _assert_same_chain(calls: list[CallEvent], ref: list[CallEvent], n: int) -> None:
    assert [e.seq for e in calls] == [e.seq for e in ref] == list(range(n))
    assert _prompts(calls) == _prompts(ref)  # rendered as one proxy renders them
    for k in range(1, n):
        assert calls[k].parent_call_id == calls[k - 1].call_id, k
        assert "full_render" not in calls[k].flags, k
        assert calls[k].shared_prefix_len == ref[k].shared_prefix_len > 0, k
    for got, want in zip(calls, ref, strict=True):
        assert got.generated_tokens.tolist() == want.generated_tokens.tolist()


async def test_two_replicas_serve_one_rollout_alternately(
    kafka_settings: KafkaSettings, kafka_bootstrap: str, tmp_path: Path
) -> None:
    ref_kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap, topic_prefix=f"{kafka_settings.topic_prefix}ref.")
    create_topics(ref_kafka, CATALOG)
    rid, params = "r-alt", {"attempt_id": "r-alt.a0", "attempt": 0, "lease_s": 30, "seed": 3}
    async with ScriptedEngine(H.tiny_tokenizer(), script=_answer) as engine:
        public = "http://balancer.invalid:8100"
        a = _replica(kafka_settings, engine.url, "a", tmp_path / "a.log", public)
        b = _replica(kafka_settings, engine.url, "b", tmp_path / "b.log", public)
        ref = ProxyProcess(ref_kafka, engine.url, _free_port(), tmp_path / "ref.log")
        try:
            for p in (a, b, ref):
                p.start()
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
                for p in (a, b, ref):
                    await p.ready(http)
                reg = await _register(http, a.admin, rid, **params)
                assert reg["base_url"] == f"{public}/r/{rid}"
                # Registered at a, held by a: b refuses a second registration of the id (409, a's attempt).
                status, held = await _admin(http, "POST", f"{b.admin}/admin/rollouts", json={"rollout_id": rid})
                assert status == 409 and held["attempt_id"] == params["attempt_id"], held
                await _calls(http, [a.url, b.url, a.url, b.url], rid, reg["secret"])
                before = await _takeovers(http, a)
                status, body = await _call(http, a.url, rid, "not-the-secret", [])
                assert status == 401, body
                assert await _takeovers(http, a) == before  # a stray key moves nothing
                status, sealed = await _admin(http, "POST", f"{b.admin}/admin/rollouts/{rid}/seal")
                assert status == 200, sealed
                assert (sealed["calls_served"], sealed["status"], sealed["infra_failure"]) == (4, "ok", None)
                query = {"attempt_id": params["attempt_id"], "finished": "1"}
                status, _ = await _admin(http, "DELETE", f"{a.admin}/admin/rollouts/{rid}", params=query)
                assert status == 200
                status, body = await _admin(
                    http, "POST", f"{b.admin}/admin/rollouts", json={"rollout_id": rid, "attempt": 0}
                )
                assert status == 409 and body.get("finished") is True, body
                assert await _takeovers(http, a) >= 2 and await _takeovers(http, b) >= 2

                ref_reg = await _register(http, ref.admin, rid, **params)
                await _calls(http, [ref.url] * 4, rid, ref_reg["secret"])
        finally:
            for p in (a, b, ref):
                p.kill()
    calls = consume_calls(kafka_settings, {rid}, 4, timeout=60)
    _assert_same_chain(calls, consume_calls(ref_kafka, {rid}, 4, timeout=60), 4)
    assert {e.attempt_id for e in calls} == {params["attempt_id"]}


class Balancer:
    """HAProxy with compose/haproxy.cfg in front of two replicas; killed by pid."""

    def __init__(self, a: ProxyProcess, b: ProxyProcess, log: Path) -> None:
        self.port, self.admin_port = _free_port(), _free_port()
        self.url, self.admin = f"http://127.0.0.1:{self.port}", f"http://127.0.0.1:{self.admin_port}"
        self.env = {
            "CLAWSTREAM_LB_HARNESS_BIND": f"127.0.0.1:{self.port}",
            "CLAWSTREAM_LB_ADMIN_BIND": f"127.0.0.1:{self.admin_port}",
            "CLAWSTREAM_LB_PROXY_1": f"127.0.0.1:{a.port}",
            "CLAWSTREAM_LB_PROXY_2": f"127.0.0.1:{b.port}",
            "CLAWSTREAM_LB_ADMIN_1": f"127.0.0.1:{a.admin_port}",
            "CLAWSTREAM_LB_ADMIN_2": f"127.0.0.1:{b.admin_port}",
        }
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, haproxy: str) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [haproxy, "-db", "-f", str(HAPROXY_CFG)], env={**os.environ, **self.env}, stdout=out, stderr=out
            )

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)


def _haproxy() -> str:
    path = shutil.which("haproxy") or ("/usr/sbin/haproxy" if os.path.exists("/usr/sbin/haproxy") else None)
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("haproxy is not installed (CI installs Debian's haproxy: .ci/run)")
        pytest.skip("haproxy is not installed (apt-get install haproxy)")
    return path


async def test_a_replica_killed_behind_the_balancer_costs_no_call(
    kafka_settings: KafkaSettings, tmp_path: Path
) -> None:
    haproxy = _haproxy()
    rid, params = "r-lb", {"attempt_id": "r-lb.a0", "attempt": 0, "lease_s": 30, "seed": 4}
    async with ScriptedEngine(H.tiny_tokenizer(), script=_answer) as engine:
        public = "http://balancer.invalid:8100"
        replicas = [_replica(kafka_settings, engine.url, n, tmp_path / f"{n}.log", public) for n in ("a", "b")]
        lb = Balancer(*replicas, tmp_path / "haproxy.log")
        try:
            for p in replicas:
                p.start()
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
                for p in replicas:
                    await p.ready(http)
                lb.start(haproxy)
                for _ in range(200):  # its listeners open
                    try:
                        async with http.get(f"{lb.admin}/healthz"):
                            break
                    except aiohttp.ClientError:
                        await asyncio.sleep(0.05)
                reg = await _register(http, lb.admin, rid, **params)
                killed: list[int] = []

                async def kill_the_holder(k: int) -> None:
                    if k != 2:
                        return
                    # The state chosen: the second call's event is on the calls topic; its replica is the holder.
                    assert [e.seq for e in consume_calls(kafka_settings, {rid}, 2, timeout=60)] == [0, 1]
                    served = [await _served(http, p) for p in replicas]
                    holder = replicas[served.index(max(served))]
                    os.kill(holder.procs[-1].pid, signal.SIGKILL)
                    holder.procs[-1].wait(30)
                    killed.append(replicas.index(holder))

                await _calls(http, [lb.url] * 3, rid, reg["secret"], between=kill_the_holder)
                assert killed, "no replica was killed"
                status, sealed = await _admin(http, "POST", f"{lb.admin}/admin/rollouts/{rid}/seal")
                assert status == 200 and (sealed["calls_served"], sealed["status"]) == (3, "ok"), sealed
                survivor = replicas[1 - killed[0]]
                assert await _takeovers(http, survivor) >= 1
        finally:
            lb.kill()
            for p in replicas:
                p.kill()
    calls = consume_calls(kafka_settings, {rid}, 4, timeout=20)
    assert [e.seq for e in calls] == [0, 1, 2]  # nothing lost, nothing doubled
    assert calls[2].parent_call_id == calls[1].call_id and "full_render" not in calls[2].flags


async def _served(http: aiohttp.ClientSession, proxy: ProxyProcess) -> float:
    async with http.get(f"{proxy.admin}/metrics") as r:
        text = await r.text()
    return sum(float(m) for m in re.findall(r"^clawstream_proxy_calls_total\{[^}]*\} (\S+)$", text, re.M))


async def test_admin_calls_wait_through_the_balancers_503_while_no_replica_is_up(
    kafka_settings: KafkaSettings, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """HAProxy answers 503 (its own HTML page) while no replica is up, as right after a replica was killed: the
    sandbox worker's admin client waits and retries (as for a refused connection) instead of failing the attempt;
    the registration goes through once a replica is up."""
    haproxy = _haproxy()
    async with ScriptedEngine(H.tiny_tokenizer(), script=_answer) as engine:
        replicas = [
            _replica(kafka_settings, engine.url, n, tmp_path / f"{n}.log", "http://balancer.invalid:8100")
            for n in ("a", "b")
        ]
        lb = Balancer(*replicas, tmp_path / "haproxy.log")
        try:
            lb.start(haproxy)
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
                for _ in range(200):  # its listeners open, answering 503: no replica is up
                    try:
                        async with http.get(f"{lb.admin}/healthz") as r:
                            assert r.status == 503
                            break
                    except aiohttp.ClientConnectorError:
                        await asyncio.sleep(0.05)
                caplog.set_level("WARNING", logger="clawstream.rollout")
                caplog.clear()
                admin = ProxyAdmin(lb.admin, TOKEN, 15, connect_retries=100)
                task = asyncio.ensure_future(admin.register("r-wait", attempt_id="r-wait.a0", attempt=0, lease_s=30))
                while "503" not in caplog.text:  # the balancer's 503 seen and retried: the call waits
                    assert not task.done(), task
                    await asyncio.sleep(0.05)
                replicas[0].start()
                await replicas[0].ready(http)
                registered = await asyncio.wait_for(task, 60)
                assert registered["rollout_id"] == "r-wait" and registered["secret"]
        finally:
            lb.kill()
            for p in replicas:
                p.kill()
