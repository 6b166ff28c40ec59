"""A rollout through a real proxy process that is SIGKILLed and restarted while the rollout runs.

For ``tests/integration/test_proxy_kill_reissue.py`` and ``tests/security/test_restored_transcript.py``: the proxy is
``python -m producers.proxy`` (``tests.integration.test_proxy_restart.ProxyProcess``: registrations persisted, so a
restart restores them), the engine the scripted one, the rollout :func:`producers.sandbox.rollout.execute` with a
local sandbox. The harness is scripted Python (``python -c``) that makes main-agent calls (it sends tools) with the
registration's secret; the task's grader gives 1.0 when the transcript's last ``result`` holds :data:`ANSWER`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

from producers.harnesses.base import Dialect, HarnessAdapter
from producers.harnesses.catalog import ADAPTERS
from producers.sandbox.local_backend import LocalBackend
from producers.sandbox.proxy_admin import ProxyAdmin
from producers.sandbox.rollout import RolloutContext
from producers.sandbox.settings import SandboxSettings
from producers.tasks.model import Grader, Task
from tests.integration.test_proxy_restart import TOKEN
from tests.support import sandbox_helpers as S

ANSWER = "the answer is 42"
# Reads the transcript file: 1.0 when its last ``result`` record holds ANSWER, else 0.0.
GRADER = (
    "import json, sys\n"
    "t = json.load(open(sys.argv[1]))\n"
    "res = [r['result'] for r in t if isinstance(r, dict) and isinstance(r.get('result'), str)]\n"
    f"print(1.0 if res and {ANSWER!r} in res[-1] else 0.0)\n"
)
TASK = Task(
    "probe",
    "answer",
    "What is the answer?",
    60.0,
    {},
    Grader("answer", {}, ("${python}", "-c", GRADER, "${transcript}"), output="reward_float"),
)

# The harness's model call (OpenAI Chat, not streamed, with a tool: a main-agent call); ``call(messages)`` → answer.
CALL = """
import json, os, sys, time, urllib.request
TOOLS = [{"type": "function", "function": {"name": "noop", "description": "does nothing",
          "parameters": {"type": "object", "properties": {}}}}]
def call(messages):
    body = json.dumps({"model": "policy", "messages": messages, "tools": TOOLS, "stream": False}).encode()
    req = urllib.request.Request(os.environ["BASE"] + "/v1/chat/completions", body,
                                 {"Authorization": "Bearer " + os.environ["KEY"], "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)["choices"][0]["message"]["content"] or ""
def result(text):
    print(json.dumps({"type": "result", "subtype": "success", "result": text}), flush=True)
PROMPT = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "What is the answer?"}]
"""


def adapter(name: str, code: str) -> HarnessAdapter:
    """A scripted harness: :data:`CALL` then ``code``, with the proxy's base URL and the secret in its environment."""
    return HarnessAdapter(
        name=name,
        description="test harness",
        dialect=Dialect.OPENAI_CHAT,
        command=("${python}", "-c", CALL + code),
        env={"KEY": "${secret}", "BASE": "${base_url}"},
    )


class OneTask:
    """The catalog of :data:`TASK` alone (what ``execute`` asks of a catalog)."""

    def task(self, suite: str, task_id: str) -> Task:
        assert (suite, task_id) == (TASK.suite, TASK.task_id), (suite, task_id)
        return TASK


def context(tmp: Path, isolation: str, admin: str, harnesses: dict[str, str]) -> RolloutContext:
    """A rollout context on the local backend (``isolation``), the proxy process's admin URL, the scripted
    ``harnesses``."""
    if isolation == "bwrap":
        S.require_bwrap()
    settings = SandboxSettings(
        root=tmp / "sbx",
        isolation=isolation,
        kill_grace_s=0.5,
        grader_timeout_s=30,
        proxy_url=admin,
        proxy_admin_token=TOKEN,
        proxy_lease_s=30,
    )

    async def resolve(_adapter: Any) -> tuple[str, str]:
        return "", ""

    return RolloutContext(
        backend=LocalBackend(settings),
        proxy=ProxyAdmin(admin, TOKEN),
        catalog=OneTask(),  # type: ignore[arg-type]
        adapters={**ADAPTERS, **{name: adapter(name, code) for name, code in harnesses.items()}},
        sink=S.ListSink(),
        settings=settings,
        resolve_exe=resolve,
    )


async def until(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll ``predicate`` (the system's state) every 50 ms until it is truthy; its value."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not (value := predicate()):
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)
    return value
