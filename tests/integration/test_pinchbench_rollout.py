"""PinchBench through the real serving proxy: the seal reports the conversation, the transcript checks score it.

In process, no broker: scripted engine + the real proxy (call events kept in memory) + the worker's rollout path
with a local sandbox, running task_00_sanity (its check reads only the OpenClaw session transcript) with the two
built-in harnesses (OpenAI Chat and Anthropic Messages): a run that answers scores 1.0, one whose model says nothing
0.0 (the check counts any assistant content, a tool call included, as an answer).
"""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

from producers.harnesses.catalog import ADAPTERS
from producers.proxy.app import Proxy, ProxySettings
from producers.sandbox.local_backend import LocalBackend
from producers.sandbox.proxy_admin import ProxyAdmin
from producers.sandbox.rollout import RolloutContext, execute
from producers.sandbox.settings import SandboxSettings
from producers.tasks.catalog import SuiteCatalog
from schemas.events import RewardStatus
from tests.support import proxy_helpers as H
from tests.support import sandbox_helpers as S
from tests.support.sandbox_helpers import ListSink
from tests.support.scripted_engine import ScriptedEngine

PINCH = S.FIXTURES / "pinchbench"


class MemoryPublisher:
    def __init__(self) -> None:
        self.sent: list[tuple[str, str, bytes]] = []

    async def publish(self, topic: str, key: str, value: bytes, timeout: float) -> None:
        self.sent.append((topic, key, value))

    def close(self) -> None:
        return None


def responder(silent: bool):
    def respond(_prompt_text: str, _ids, _body) -> str:  # noqa: ANN001
        return "" if silent else "Hello, I'm ready!"

    return respond


async def test_seal_conversation_scores_transcript_checks(tmp_path: Path) -> None:
    for silent, want in ((False, 1.0), (True, 0.0)):
        async with ScriptedEngine(H.tiny_tokenizer(), responder(silent)) as engine:
            settings = ProxySettings(
                model=H.tiny_model_dir(), engine_url=engine.url, port=0, admin_token="admin", keepalive_s=0.2
            )
            proxy = Proxy(settings, MemoryPublisher(), "calls", tokenizer=H.tiny_tokenizer())
            runner, admin = web.AppRunner(proxy.app()), web.AppRunner(proxy.admin_app())
            await runner.setup()
            await admin.setup()
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            await web.TCPSite(admin, "127.0.0.1", 0).start()
            proxy.public_url = f"http://127.0.0.1:{runner.addresses[0][1]}"
            admin_url = f"http://127.0.0.1:{admin.addresses[0][1]}"
            try:
                for harness in ("agentloop", "agentloop-anthropic"):
                    sink = ListSink()

                    async def resolve(_adapter):  # noqa: ANN001, ANN202
                        return "", ""

                    sandbox = SandboxSettings(root=tmp_path / "sbx", proxy_url=admin_url, proxy_admin_token="admin")
                    ctx = RolloutContext(
                        backend=LocalBackend(sandbox),
                        proxy=ProxyAdmin(admin_url, "admin"),
                        catalog=SuiteCatalog({"pinch": str(PINCH)}),
                        adapters=ADAPTERS,
                        sink=sink,
                        settings=sandbox,
                        resolve_exe=resolve,
                    )
                    out = await execute(S.request("task_00_sanity", harness, suite="pinch", timeout_s=60), ctx)
                    assert out.cleanup is not None and out.cleanup.clean
                    (reward,) = sink.rewards
                    assert reward.status == RewardStatus.OK, reward
                    assert (harness, reward.reward) == (harness, want)
            finally:
                await runner.cleanup()
                await admin.cleanup()
