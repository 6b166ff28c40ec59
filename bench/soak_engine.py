"""The soak's model: the tests' scripted engine as a service process, answering instantly, following the weights.

The only test double of the soak (``bench.soak``): a real aiohttp server speaking the engine protocol the proxy
calls (``/v1/completions`` with token ids), answering the built-in agent loop as the sandbox tests' scripted policy
does (``tests.support.sandbox_helpers.agent_responder``: write the task's file, then finish — 2 calls per rollout),
through the model's real tokenizer, with no model behind it, so the load is on the services and not on the model. It
keeps nothing per request (the scripted engine's request log is cleared as it goes: a soak must not measure its
double's memory) and follows ``clawstream.weights`` like a real engine, reporting the newest published version as
the one serving, so the batcher's staleness rule sees what it would with a real engine.

Run: ``python -m bench.soak_engine --model DIR [--port 0]`` (Kafka from ``CLAWSTREAM_KAFKA_*``); prints
``instant engine on http://HOST:PORT`` when it answers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import threading
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from confluent_kafka import OFFSET_BEGINNING, TopicPartition  # noqa: E402

from clawbase.kafka.clients import make_consumer  # noqa: E402
from clawbase.settings import kafka_settings  # noqa: E402
from schemas.events import WeightVersion  # noqa: E402
from schemas.topics import WEIGHTS  # noqa: E402
from tests.support.sandbox_helpers import agent_responder  # noqa: E402
from tests.support.scripted_engine import ScriptedEngine  # noqa: E402


class InstantEngine(ScriptedEngine):
    """The scripted engine, keeping no per-request record."""

    def next_text(self, prompt_text: str, prompt_ids: list[int], body: dict[str, Any]) -> str:
        self.requests.clear()  # appended just before this call; the soak never reads it
        return super().next_text(prompt_text, prompt_ids, body)


def follow_weights(engine: InstantEngine, stop: threading.Event) -> None:
    """Set ``engine.policy_version`` to the newest published weight version, as the CPU engine's follower does."""
    kafka = kafka_settings()
    consumer = make_consumer(kafka, f"{kafka.topic_prefix}instant-engine", log_level=2)
    topic = kafka.topic(WEIGHTS)
    meta = consumer.list_topics(topic, timeout=30).topics[topic]
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in sorted(meta.partitions)])
    try:
        while not stop.is_set():
            msg = consumer.poll(0.5)
            if msg is None or msg.error():
                continue
            with contextlib.suppress(Exception):  # a record it cannot read changes nothing
                engine.policy_version = max(engine.policy_version, WeightVersion.from_bytes(msg.value()).policy_version)
    finally:
        consumer.close()


async def serve(model: str, host: str, port: int) -> None:
    from transformers import AutoTokenizer

    engine = InstantEngine(
        AutoTokenizer.from_pretrained(model), agent_responder(), policy_version=0, host=host, port=port
    )
    stop = threading.Event()
    follower = threading.Thread(target=follow_weights, args=(engine, stop), daemon=True)
    follower.start()
    async with engine:
        print(f"instant engine on {engine.url}", flush=True)
        try:
            await asyncio.Event().wait()  # until SIGTERM
        finally:
            stop.set()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak_engine", description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="model directory (its tokenizer)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args.model, args.host, args.port))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
