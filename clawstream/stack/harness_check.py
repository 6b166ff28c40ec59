"""``clawstream harness check NAME|FILE``: run one harness on built-in tasks and say whether its traffic trains.

One process runs the stack around the harness: the scripted engine (``warmstart.scripted_engine``, reporting a
prefix cache's cached tokens) answering as the scripted teacher (``warmstart.teacher``: it solves the tasks through
the harness's own tools where it knows them; any other harness gets one call of a listing tool it declares, then a
final answer), the real serving proxy and one sandbox worker (local sandboxes) running the real harness. It
publishes two rollout requests for each of ``tasks`` built-in CPU tasks, reads the calls topic back until every
rollout is graded, and prints the verdict of ``producers.harnesses.check_report`` (thresholds: its
``CheckSettings``). Exit status 1 on a failing verdict, 2 when the check could not run.

Topics (under a fresh prefix ``hcheck-<hex>.``): ``rollout.requests`` out; ``calls``, ``rewards`` in. Run (a broker:
``clawstream kafka up``)::

    clawstream harness check opencode
    clawstream harness check ./my-agent.toml --tasks 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
import secrets
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from aiohttp import web
from confluent_kafka import TopicPartition

from clawbase.errors import ClawstreamError
from clawbase.kafka.clients import create_topics, make_consumer, make_producer
from clawbase.kafka.publisher import KafkaPublisher
from clawbase.settings import KafkaSettings, add_kafka_arguments, kafka_settings, load_settings
from producers.harnesses.base import HarnessAdapter
from producers.harnesses.catalog import all_adapters, resolve
from producers.harnesses.check_report import CheckCall, CheckSettings, Verdict, verdict
from producers.harnesses.install import install_adapter
from producers.proxy.app import Proxy, ProxySettings
from producers.sandbox.settings import SandboxSettings
from producers.sandbox.worker import SandboxWorker
from producers.tasks.native import write_native_task
from schemas.events import CallEvent, RewardEvent, RolloutEvent, RolloutRequest, RolloutState
from schemas.topics import CALLS, CATALOG, REWARDS, ROLLOUT_EVENTS, ROLLOUT_REQUESTS
from warmstart.demos import train_tasks
from warmstart.scripted_engine import ScriptedEngine, tool_call_text
from warmstart.sft import SHIPPED_DIR
from warmstart.teacher import FINAL, TITLE, TOOLS, Teacher

LISTING = re.compile(r"^(ls|list.*|glob|read_?dir|list_?files|find)$", re.I)


def probe_responder(log: list[str]):  # noqa: ANN201 - a Responder
    """For a harness the teacher does not know: one call of a listing tool it declares (required string arguments
    ``"."``), then the final answer; a tool-less call (a title) gets a title."""

    def respond(prompt_text: str, _ids: list[int], _body: dict[str, Any]) -> str:
        if "<tools>" not in prompt_text:
            log.append("side")
            return TITLE
        if prompt_text.count("<tool_response>"):
            log.append("final")
            return FINAL
        tools = []
        block = prompt_text[prompt_text.rfind("<tools>") + len("<tools>") :]  # the last: the first is prose
        for line in block.partition("</tools>")[0].splitlines():
            try:
                fn = json.loads(line).get("function") or json.loads(line)
            except (ValueError, AttributeError):
                continue
            if isinstance(fn, dict) and "name" in fn:
                tools.append(fn)
        if not tools:
            return FINAL
        tool = next((t for t in tools if LISTING.match(t["name"])), tools[0])
        params = tool.get("parameters") or {}
        args = {
            k: "."
            for k in params.get("required", [])
            if (params.get("properties", {}).get(k) or {}).get("type", "string") == "string"
        }
        log.append(f"probe {tool['name']}")
        return tool_call_text(tool["name"], args)

    return respond


def _collect(
    kafka: KafkaSettings, ids: set[str], timeout: float
) -> tuple[dict[str, list[CallEvent]], set[str], dict[str, str]]:
    """Every call of ``ids`` until each has a reward, then the calls topic to its end (a reward follows the calls);
    and how each rollout ended (its lifecycle events)."""
    consumer = make_consumer(kafka, f"hcheck-{secrets.token_hex(4)}", **{"auto.offset.reset": "earliest"})
    calls_topic, rewards_topic, events_topic = kafka.topic(CALLS), kafka.topic(REWARDS), kafka.topic(ROLLOUT_EVENTS)
    consumer.subscribe([calls_topic, rewards_topic, events_topic])
    calls: dict[str, list[CallEvent]] = defaultdict(list)
    graded: set[str] = set()
    ended: dict[str, str] = {}
    deadline = time.monotonic() + timeout
    ends: dict[int, int] | None = None
    try:
        while time.monotonic() < deadline:
            if ends is None and graded >= ids:
                meta = consumer.list_topics(calls_topic, timeout=10).topics[calls_topic].partitions
                ends = {p: consumer.get_watermark_offsets(TopicPartition(calls_topic, p), timeout=10)[1] for p in meta}
            if ends is not None:
                pos = {
                    tp.partition: tp.offset for tp in consumer.position([TopicPartition(calls_topic, p) for p in ends])
                }
                if all(pos.get(p, -1) >= end or end == 0 for p, end in ends.items()):
                    break
            msg = consumer.poll(0.5)
            if msg is None or msg.error():
                continue
            if msg.topic() == calls_topic:
                call = CallEvent.from_bytes(msg.value())
                if call.rollout_id in ids:
                    calls[call.rollout_id].append(call)
            elif msg.topic() == events_topic:
                event = RolloutEvent.from_bytes(msg.value())
                if event.rollout_id in ids and event.state != RolloutState.STARTED:
                    ended[event.rollout_id] = _outcome(event)
            else:
                reward = RewardEvent.from_bytes(msg.value())
                if reward.rollout_id in ids:
                    graded.add(reward.rollout_id)
    finally:
        consumer.close()
    return calls, graded, ended


def _outcome(event: RolloutEvent) -> str:
    if event.state == RolloutState.HARNESS_EXITED:
        return f"exit {event.exit_code}"
    return event.state.value.lower().replace("_", " ") + (f" ({event.reason})" if event.reason else "")


def _check_call(c: CallEvent) -> CheckCall:
    return CheckCall(
        c.call_id,
        c.seq,
        c.parent_call_id,
        c.shared_prefix_len,
        c.new_tokens.tolist(),
        c.generated_tokens.tolist(),
        c.call_kind.value,
        c.dialect.value,
        c.cached_prompt_tokens,
    )


async def run_check(
    adapter: HarnessAdapter, kafka: KafkaSettings, settings: CheckSettings, model_dir: Path = SHIPPED_DIR
) -> Verdict:
    """Run ``adapter`` on ``settings.tasks`` tasks × 2 rollouts through the real proxy and sandbox worker."""
    from transformers import AutoTokenizer

    await asyncio.to_thread(install_adapter, adapter)
    create_topics(kafka, CATALOG)
    tasks = train_tasks(settings.tasks)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    work = Path(tempfile.mkdtemp(prefix="clawstream-hcheck-"))
    for task in tasks:
        write_native_task(task, work / "tasks" / task.task_id)
    log: list[str] = []
    responder = (
        Teacher(adapter.name, tasks, work / "sandboxes").respond if adapter.name in TOOLS else probe_responder(log)
    )
    token = secrets.token_hex(16)
    ids = {f"hcheck-{adapter.name}-{t.task_id}-{i}-{secrets.token_hex(3)}": t.task_id for t in tasks for i in range(2)}
    async with ScriptedEngine(tokenizer, responder, policy_version=0, prefix_cache=True) as engine:
        proxy_settings = ProxySettings(model=model_dir, engine_url=engine.url, port=0, admin_token=token)
        publisher = KafkaPublisher(kafka, proxy_settings.publish_timeout_s)
        proxy = Proxy(proxy_settings, publisher, kafka.topic(CALLS), tokenizer=tokenizer)
        runner, admin = web.AppRunner(proxy.app()), web.AppRunner(proxy.admin_app())
        await runner.setup()
        await admin.setup()
        try:
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            await web.TCPSite(admin, "127.0.0.1", 0).start()
            proxy.public_url = f"http://127.0.0.1:{runner.addresses[0][1]}"
            proxy.admin_url = f"http://127.0.0.1:{admin.addresses[0][1]}"
            sandbox = SandboxSettings(
                proxy_url=proxy.admin_url,
                proxy_admin_token=token,
                group_id=f"hcheck-{secrets.token_hex(4)}",
                root=work / "sandboxes",
                task_timeout_s=settings.rollout_timeout_s,  # a real harness outlives builtin:cpu's 60 s on a busy host
                concurrency=2,
                suites={"cpu": f"native:{work / 'tasks'}"},
            )
            stop = asyncio.Event()
            adapters = {**all_adapters(), adapter.name: adapter}
            worker = asyncio.create_task(SandboxWorker(sandbox, kafka, adapters=adapters).run(stop))
            _publish(kafka, ids, adapter.name, settings.rollout_timeout_s)
            try:
                calls, graded, ended = await asyncio.to_thread(_collect, kafka, set(ids), settings.timeout_s)
            finally:
                stop.set()
                await asyncio.wait({worker}, timeout=60)
        finally:
            await runner.cleanup()
            await admin.cleanup()
            publisher.close()
    if graded < set(ids):
        raise ClawstreamError(
            f"harness check: {len(set(ids) - graded)} rollouts not graded in {settings.timeout_s:.0f} s"
        )
    rollouts = {rid: [_check_call(c) for c in calls.get(rid, [])] for rid in ids}
    return verdict(adapter.name, adapter.dialect.value, rollouts, ids, tokenizer.decode, settings, ended)


def _publish(kafka: KafkaSettings, ids: dict[str, str], harness: str, timeout_s: float) -> None:
    producer = make_producer(kafka)
    now = int(time.time() * 1000)
    for rid, task_id in ids.items():
        req = RolloutRequest(
            rollout_id=rid,
            policy_version=0,
            timestamp_ms=now,
            suite="cpu",
            task_id=task_id,
            harness=harness,
            group_id=f"cpu/{task_id}|{harness}|0",
            step=0,
            timeout_s=timeout_s,
        )
        producer.produce(kafka.topic(ROLLOUT_REQUESTS), key=rid.encode(), value=req.to_bytes())
    if producer.flush(30) != 0:
        raise ClawstreamError("harness check: could not publish the rollout requests (is the broker up?)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="clawstream harness check", description=__doc__.split("\n")[0])
    p.add_argument("harness", help="a harness name (built in or added) or an adapter file (.toml)")
    p.add_argument("--tasks", type=int, help="built-in CPU tasks, two rollouts each (CheckSettings.tasks: 2)")
    p.add_argument("--model-dir", type=Path, default=SHIPPED_DIR, help="tokenizer + chat template (%(default)s)")
    add_kafka_arguments(p)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        settings = load_settings(CheckSettings, **({"tasks": a.tasks} if a.tasks else {}))
        adapter = resolve(a.harness)
        kafka = kafka_settings(a).model_copy(update={"topic_prefix": f"hcheck-{secrets.token_hex(4)}."})
        result = asyncio.run(run_check(adapter, kafka, settings, a.model_dir))
    except ClawstreamError as exc:
        print(f"harness check: {exc}", file=sys.stderr)
        return 2
    print("\n".join(result.lines()))
    return 1 if result.failed else 0


if __name__ == "__main__":
    sys.exit(main())
