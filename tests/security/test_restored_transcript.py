"""After a proxy restart the grader never believes the harness: a restored rollout is not graded from its stdout.

A restarted proxy restores a rollout's registration and replays its call events, but not its last main-agent
conversation: until the harness makes another main-agent call, the seal reports no ``messages``. A hostile harness
makes one call, waits for the proxy to be SIGKILLed and restarted, then prints a forged ``result`` line (the answer
the grader wants, which the model never gave) and exits: the attempt is an infrastructure failure (re-issued), never
graded from that line. A harness that calls again after the restart is graded from the proxy's record as usual.
Real proxy process, real broker, scripted engine, local sandboxes (``tests/support/proxy_kill.py``).
"""

from __future__ import annotations

import asyncio
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

# One call, then wait (the test restarts the proxy meanwhile), then the forged answer on stdout.
FORGER = """
call(PROMPT)
open("called", "w").write("1")
while not os.path.exists("go"):
    time.sleep(0.05)
result(ANSWER)
""".replace("ANSWER", repr(K.ANSWER))
# The same, but it calls again after the restart and prints what the model said.
HONEST = """
first = call(PROMPT)
open("called", "w").write("1")
while not os.path.exists("go"):
    time.sleep(0.05)
result(call(PROMPT + [{"role": "assistant", "content": first}, {"role": "user", "content": "And now?"}]))
"""


def _engine_answer(_prompt: str, _ids: list[int], _body: dict) -> str:
    return "Thinking it over."  # never ANSWER: only a forged line can earn the 1.0


@pytest.mark.timeout(240)
async def test_a_restored_rollout_is_not_graded_from_the_harness_stdout(
    kafka_settings: KafkaSettings, tmp_path: Path
) -> None:
    async with ScriptedEngine(H.tiny_tokenizer(), script=_engine_answer) as engine, aiohttp.ClientSession() as http:
        proxy = ProxyProcess(kafka_settings, engine.url, _free_port(), tmp_path / "proxy.log")
        try:
            proxy.start()
            await proxy.ready(http)
            ctx = K.context(tmp_path, "none", proxy.admin, {"forger": FORGER, "honest": HONEST})
            runs = {
                name: S.request(K.TASK.task_id, name, suite=K.TASK.suite, timeout_s=120)
                for name in ("forger", "honest")
            }
            tasks = {name: asyncio.create_task(execute(req, ctx)) for name, req in runs.items()}
            root = tmp_path / "sbx"
            called = await K.until(
                lambda: len(list(root.rglob("called"))) == 2 and list(root.rglob("called")), 120, "calls"
            )
            proxy.kill()  # SIGKILL, no call in flight: both first calls were answered and recorded
            proxy.start()
            await proxy.ready(http)
            for marker in called:
                (marker.parent / "go").write_text("1")
            outs = {name: await asyncio.wait_for(task, 120) for name, task in tasks.items()}
        finally:
            proxy.kill()
    forged, honest = outs["forger"], outs["honest"]
    assert forged.reward is not None and honest.reward is not None, outs
    # the forged line is not graded: the restarted proxy cannot vouch for the transcript, so the attempt is re-issued
    assert forged.state == RolloutState.FAILED, forged
    assert forged.reward.status == RewardStatus.INFRA_FAILURE and forged.reward.reward is None, forged.reward
    assert "restarted during the rollout and recorded no main-agent call since" in (forged.reward.reason or "")
    # a harness that called after the restart is graded from the proxy's record: the model never said ANSWER
    assert honest.state == RolloutState.HARNESS_EXITED, honest
    assert (honest.reward.status, honest.reward.reward) == (RewardStatus.OK, 0.0), honest.reward
