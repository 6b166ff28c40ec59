"""The CPU quickstart (``make demo`` / ``clawstream demo``): everything that runs end to end today, on a local broker.

Steps: start (or reuse) the local Apache Kafka broker, create the topic catalog, build the tiny Qwen3-architecture
model (once), push one event of every type through the broker and read it back, then list the pipeline stages and
whether each is built yet. It grows with the pipeline: each stage that lands adds its step here.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from pathlib import Path

from clawstream.kafka_clients import create_topics, make_consumer, make_producer
from clawstream.kafka_local import LocalKafka
from clawstream.settings import KafkaSettings, clawstream_home, load_settings
from schemas.events import ALL_EVENTS, Metric, now_ms
from schemas.topics import CATALOG

# (stage, module, state) — the honest map of what exists; update when a stage lands.
STAGES: list[tuple[str, str, str]] = [
    ("contracts + codec", "schemas/", "built"),
    ("local Kafka broker", "clawstream/kafka_local.py", "built"),
    ("tiny model builder", "learner/model_init.py", "built"),
    ("prefix tree (pure)", "streams/tree.py", "built"),
    ("inference engine (vLLM protocol)", "consumers/inference_worker.py", "not built yet (issue: policy serving)"),
    ("serving proxy", "producers/proxy.py", "not built yet (issue: serving proxy)"),
    ("sandbox worker + scheduler", "producers/sandbox_worker.py", "not built yet (issue: sandbox workers)"),
    ("stream processors", "streams/app.py", "not built yet (issue: Faust stream processors)"),
    ("learner", "learner/train.py", "not built yet (issue: learner)"),
]


def _step(title: str, fn: Callable[[], str]) -> None:
    started = time.monotonic()
    print(f"==> {title} ...", flush=True)
    detail = fn()
    print(f"    {detail} ({time.monotonic() - started:.1f}s)", flush=True)


def run_demo(model_dir: Path | None = None) -> None:
    state_holder: dict[str, str] = {}

    def broker() -> str:
        settings = KafkaSettings()
        if settings.bootstrap_servers:
            state_holder["bootstrap"] = settings.bootstrap_servers
            return f"using configured cluster {settings.bootstrap_servers}"
        state = LocalKafka().up()
        state_holder["bootstrap"] = state.bootstrap
        return f"Apache Kafka on {state.bootstrap} (pid {state.pid}); stop it with `clawstream kafka down`"

    _step("local Apache Kafka broker", broker)
    settings = load_settings(KafkaSettings, bootstrap_servers=state_holder["bootstrap"])

    def topics() -> str:
        outcome = create_topics(settings)
        created = sum(1 for v in outcome.values() if v == "created")
        return f"{len(outcome)} topics ready ({created} created)"

    _step("topic catalog", topics)

    model_dir = model_dir or clawstream_home() / "models" / "tiny-qwen3"

    def model() -> str:
        if (model_dir / "config.json").exists():
            return f"reusing {model_dir}"
        from learner.model_init import init_tiny_model

        init_tiny_model(model_dir, seed=0, progress=lambda _msg: None)
        return f"built {model_dir}"

    _step("tiny Qwen3-architecture model", model)

    def roundtrip() -> str:
        rid = f"demo-{uuid.uuid4().hex[:8]}"
        producer = make_producer(settings)
        topic_of = {spec.value_schema: settings.topic(spec.name) for spec in CATALOG}
        probe = Metric(policy_version=0, timestamp_ms=now_ms(), source="demo", name="hello", values={"ok": 1.0},
                       rollout_id=rid)  # fmt: skip
        producer.produce(topic_of["Metric"], key=b"demo", value=probe.to_bytes())
        if producer.flush(30):
            raise RuntimeError("the broker did not acknowledge the demo record")
        consumer = make_consumer(settings, f"demo-{rid}")
        consumer.subscribe([topic_of["Metric"]])
        deadline = time.monotonic() + 30
        try:
            while time.monotonic() < deadline:
                msg = consumer.poll(0.5)
                if msg is not None and not msg.error() and Metric.from_bytes(msg.value()).rollout_id == rid:
                    return (
                        f"Metric event produced and read back (Avro single-object, {len(msg.value())} bytes); "
                        f"{len(ALL_EVENTS)} event types in the catalog"
                    )
        finally:
            consumer.close()
        raise RuntimeError("the demo record did not come back within 30 s")

    _step("event round trip through Kafka", roundtrip)

    print("\nPipeline stages:")
    for stage, module, state in STAGES:
        print(f"  {'✔' if state == 'built' else '·'} {stage:34} {module:32} {state}")
