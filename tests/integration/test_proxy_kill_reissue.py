"""A proxy SIGKILLed while a rollout's call is in flight: the attempt is an infrastructure failure, its re-issue graded.

A real proxy process (registrations persisted) in front of the scripted engine, a rollout in a bubblewrap sandbox
(its calls go through the worker's relay). The engine holds every answer; once it has received the rollout's call
(its request list, not a sleep) the proxy is SIGKILLed by pid, started again on the same port and the engine let go.
The harness's call fails and it exits; the seal (from the restored registration) says ``restored``, the relay saw
the proxy close the connection with the request unanswered: the attempt is FAILED with an INFRA_FAILURE reward naming
the lost call, not graded as it stands (on the code before this rule it was graded from what the harness printed).
The re-issue (attempt 1, as the scheduler publishes it) runs against the restarted proxy and is graded as usual.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import aiohttp
import pytest

from clawbase.settings import KafkaSettings
from producers.sandbox.rollout import execute
from schemas.events import RewardStatus, RolloutState
from tests.integration.test_proxy_restart import ProxyProcess, _free_port
from tests.support import proxy_helpers as H
from tests.support import proxy_kill as K
from tests.support import sandbox_helpers as S
from tests.support.scripted_engine import ScriptedEngine

pytestmark = pytest.mark.integration

# One call; its answer printed as the result. A failed call: the harness says so on stdout (forging the answer).
HARNESS = """
try:
    answer = call(PROMPT)
except Exception as exc:
    print("call failed:", exc, file=sys.stderr)
    result(%r)
    sys.exit(1)
open("hello.txt", "w").write("hi")
result(answer)
""".replace("%r", repr(K.ANSWER))


@pytest.mark.timeout(300)
async def test_a_call_lost_to_a_proxy_kill_is_reissued_not_graded(
    kafka_settings: KafkaSettings, tmp_path: Path
) -> None:
    async with ScriptedEngine(H.tiny_tokenizer(), [K.ANSWER] * 4) as engine, aiohttp.ClientSession() as http:
        proxy = ProxyProcess(kafka_settings, engine.url, _free_port(), tmp_path / "proxy.log")
        try:
            proxy.start()
            await proxy.ready(http)
            ctx = K.context(tmp_path, "bwrap", proxy.admin, {"h": HARNESS})
            req = S.request(K.TASK.task_id, "h", suite=K.TASK.suite, timeout_s=120)
            engine.hold = asyncio.Event()
            first = asyncio.create_task(execute(req, ctx))
            await K.until(lambda: engine.requests, 120, "the rollout's call at the engine")
            proxy.kill()  # the call is in flight: the engine holds its answer
            proxy.start()
            await proxy.ready(http)
            engine.hold.set()  # the killed proxy's request finds no one to answer
            lost = await asyncio.wait_for(first, 120)
            again = await asyncio.wait_for(execute(dataclasses.replace(req, attempt=1), ctx), 120)
        finally:
            proxy.kill()
    assert lost.reward is not None and lost.state == RolloutState.FAILED, lost
    assert lost.reward.status == RewardStatus.INFRA_FAILURE and lost.reward.reward is None, lost.reward
    assert "restarted during the rollout and lost a call in flight" in (lost.reward.reason or ""), lost.reward
    assert again.state == RolloutState.HARNESS_EXITED, again
    assert again.reward is not None and (again.reward.status, again.reward.reward) == (RewardStatus.OK, 1.0), again
    assert again.cleanup is not None and again.cleanup.clean and lost.cleanup is not None and lost.cleanup.clean
