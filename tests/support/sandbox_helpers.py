"""Helpers for the sandbox-worker tests and bench: requests, a scripted agent policy, event collection, leak checks.

``agent_responder`` plays the policy for the built-in agent loops through the scripted engine: on the first call
of a rollout it answers with the write tool call the task needs (right or wrong content, chosen per test), then —
once a ``<tool_response>`` is in the prompt — with the loop's finish tool. It recognises the variant by the tool
names rendered in the prompt (``write_file`` for ``agentloop``, ``Write`` for ``agentloop-anthropic``).
"""

from __future__ import annotations

import os
import re
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from clawbase.kafka.clients import make_consumer, make_producer
from clawbase.settings import KafkaSettings
from producers.harnesses.base import HarnessAdapter
from producers.sandbox.local_backend import MARKER
from producers.sandbox.settings import SandboxSettings
from schemas.events import Dialect, RewardEvent, RolloutEvent, RolloutRequest, now_ms
from schemas.topics import REWARDS, ROLLOUT_EVENTS, ROLLOUT_REQUESTS
from tests.support.scripted_engine import tool_call_text

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
NATIVE_SUITE = FIXTURES / "native_suite"
_QUOTED = re.compile(r'"([^"]+)"')


def request(
    task_id: str,
    harness: str,
    *,
    suite: str = "native",
    timeout_s: float = 60.0,
    step: int = 0,
    rollout_id: str | None = None,
    **kw: Any,
) -> RolloutRequest:
    return RolloutRequest(
        rollout_id=rollout_id or f"r-{uuid.uuid4().hex[:10]}",
        policy_version=0,
        timestamp_ms=now_ms(),
        suite=suite,
        task_id=task_id,
        harness=harness,
        group_id=f"{suite}/{task_id}|{harness}|{step}",
        step=step,
        timeout_s=timeout_s,
        **kw,
    )


def publish(kafka: KafkaSettings, requests: list[RolloutRequest]) -> None:
    producer = make_producer(kafka)
    for req in requests:
        producer.produce(kafka.topic(ROLLOUT_REQUESTS), key=req.rollout_id.encode(), value=req.to_bytes())
    assert producer.flush(30) == 0


def collect(
    kafka: KafkaSettings,
    rollout_ids: set[str],
    timeout: float,
    *,
    until_rewards: int | None = None,
    settle_s: float = 0.0,
) -> tuple[list[RolloutEvent], list[RewardEvent]]:
    """Lifecycle events and rewards of ``rollout_ids`` until ``until_rewards`` (default: one per id) arrived."""
    want = len(rollout_ids) if until_rewards is None else until_rewards
    consumer = make_consumer(kafka, f"c-{uuid.uuid4().hex[:8]}")
    consumer.subscribe([kafka.topic(ROLLOUT_EVENTS), kafka.topic(REWARDS)])
    events: list[RolloutEvent] = []
    rewards: list[RewardEvent] = []
    deadline = time.monotonic() + timeout
    done_at = None
    try:
        while time.monotonic() < deadline:
            msg = consumer.poll(0.2)
            if msg is not None and not msg.error():
                if msg.topic() == kafka.topic(REWARDS):
                    r = RewardEvent.from_bytes(msg.value())
                    if r.rollout_id in rollout_ids:
                        rewards.append(r)
                else:
                    e = RolloutEvent.from_bytes(msg.value())
                    if e.rollout_id in rollout_ids:
                        events.append(e)
            if len(rewards) >= want and done_at is None:
                done_at = time.monotonic()
            if done_at is not None and time.monotonic() - done_at >= settle_s:
                break
    finally:
        consumer.close()
    return events, rewards


def agent_responder(contents: dict[str, str] | None = None) -> Callable[..., str]:
    """Scripted policy for agentloop / agentloop-anthropic: write the first quoted name of the task prompt that is
    in ``contents`` (file name → content) or else the first quoted name with the second quoted string, then finish."""

    def respond(prompt_text: str, _ids: list[int], _body: dict[str, Any]) -> str:
        anthropic = '"name": "Write"' in prompt_text
        if "<tool_response>" in prompt_text:
            if anthropic:
                return tool_call_text("Done", {"message": "ok"})
            return tool_call_text("finish", {"summary": "ok"})
        task = prompt_text.split("<|im_start|>user\n", 1)[-1]
        quoted = _QUOTED.findall(task)
        contents_ = contents or {}
        name = next((q for q in quoted if q in contents_), quoted[0])
        content = contents_.get(name, quoted[1] if len(quoted) > 1 else "")
        if anthropic:
            return tool_call_text("Write", {"file_path": name, "content": content})
        return tool_call_text("write_file", {"path": name, "content": content})

    return respond


def python_adapter(name: str, code: str) -> HarnessAdapter:
    """A fake harness: ``python -c CODE`` in the workspace (hangs, crashes, ... on demand)."""
    return HarnessAdapter(
        name=name,
        description="test harness",
        dialect=Dialect.OPENAI_CHAT,
        command=("${python}", "-c", code),
        env={"KEY": "${secret}"},
    )


def leftover_processes(marker_prefix: str = "") -> list[int]:
    """Live (non-zombie) processes whose environment carries a sandbox marker starting with ``marker_prefix``."""
    needle = f"{MARKER}={marker_prefix}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            env = Path(f"/proc/{entry}/environ").read_bytes()
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and any(part.startswith(needle) for part in env.split(b"\0")):
            found.append(int(entry))
    return found


def processes_with_arg(arg: str) -> list[int]:
    """Live (non-zombie) host processes with ``arg`` as one of their command-line arguments."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if arg.encode() in argv and pid_alive(int(entry)):
            found.append(int(entry))
    return found


def require_bwrap() -> None:
    """Skip (in CI: fail) when bubblewrap cannot build a sandbox here."""
    from producers.sandbox import bwrap
    from tests.support.docker_images import unavailable

    why = bwrap.probe()
    if why is not None:
        unavailable(why)


def pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class ListSink:
    """A rollout EventSink that keeps what the rollout reports (producers.sandbox.rollout.EventSink)."""

    def __init__(self) -> None:
        self.events: list = []
        self.rewards: list = []

    async def event(self, event) -> None:  # noqa: ANN001
        self.events.append(event)

    async def reward(self, reward) -> None:  # noqa: ANN001
        self.rewards.append(reward)


@contextmanager
def docker_engine(group_id: str) -> Iterator[str]:
    """The docker backend's tests: the harness image built if missing, the engine reached (skipped with the reason
    otherwise, failed in CI); yields the test's network name, whose containers and network are removed afterwards."""
    from tests.support.docker_images import ensure_images, unavailable

    ensure_images("harnesses")
    try:
        import docker

        client = docker.from_env()
        client.ping()
    except Exception as exc:  # noqa: BLE001 - docker.errors.DockerException, or the SDK missing
        unavailable(f"the docker SDK cannot reach the engine: {exc}")
    network = f"cs-test-{group_id}"
    try:
        yield network
    finally:
        for c in client.containers.list(all=True, filters={"network": network}, ignore_removed=True):
            c.remove(force=True)
        for n in client.networks.list(names=[network]):
            n.remove()


def docker_settings(root: Path, group_id: str, network: str, admin_url: str) -> SandboxSettings:
    """The docker backend on the harness image, the proxy's admin API reached directly (no relay container)."""
    return SandboxSettings(
        backend="docker",
        proxy_url=admin_url,
        proxy_admin_token="admin",
        docker_proxy_relay=False,
        group_id=group_id,
        root=root,
        docker_image="clawstream/harnesses:latest",
        docker_network=network,
        grader_timeout_s=60,
    )
