"""The registry wire format through a real broker and a real Confluent-compatible registry (Apicurio Registry,
built from Maven Central by clawstream.local_registry): `topics create` registers the schemas, calls records go out in
the registry format and come back through the project's readers, a Go program (franz-go + hamba/avro, nothing of
clawstream) decodes one through the registry, and a breaking schema change is refused at `topics create`."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from clawbase.kafka.clients import make_consumer, make_producer
from clawbase.settings import KafkaSettings
from clawstream.cli import main
from clawstream.local_registry import LocalRegistry
from schemas import registry as wire
from schemas.codec import SCHEMA_DIR, default_codec
from schemas.events import CallEvent
from schemas.registry_compat import IncompatibleSchemaError
from schemas.topics import CALLS, CATALOG
from tests.support.factories import sample_events

GO_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "go_registry_consumer"
pytestmark = pytest.mark.provisioned("registry")


def _need(tool: str) -> None:
    if shutil.which(tool) is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"`{tool}` is missing and CI installs it (.ci/run)")
        pytest.skip(f"`{tool}` is not installed: the registry test needs it")


@pytest.fixture(scope="module")
def registry_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    for tool in ("java", "mvn"):
        _need(tool)
    server = LocalRegistry(home=tmp_path_factory.mktemp("registry-home"))
    url = server.up(port=0, timeout=180, quiet=True)
    try:
        yield url
    finally:
        server.down()


@pytest.fixture
def registry_env(monkeypatch: pytest.MonkeyPatch, registry_url: str, topic_prefix: str) -> Iterator[None]:
    monkeypatch.setenv("CLAWSTREAM_WIRE_FORMAT", "registry")
    monkeypatch.setenv("CLAWSTREAM_SCHEMA_REGISTRY_URL", registry_url)
    monkeypatch.setenv("CLAWSTREAM_KAFKA_TOPIC_PREFIX", topic_prefix)
    default_codec.cache_clear()
    yield
    default_codec.cache_clear()


def _topics_create(bootstrap: str, prefix: str, *extra: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["topics", "create", "--bootstrap", bootstrap, "--prefix", prefix, *extra])
    return result.exit_code, result.output + (str(result.exception) if result.exception else "")


def _go_decode(bootstrap: str, topic: str, url: str, tmp_path: Path) -> dict:
    _need("go")
    exe = tmp_path / "go_registry_consumer"
    subprocess.run(["go", "build", "-o", str(exe), "."], cwd=GO_DIR, check=True, timeout=300)
    out = subprocess.run(
        [str(exe), "-brokers", bootstrap, "-topic", topic, "-registry", url, "-timeout", "60s"],
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_calls_in_registry_format_through_broker_registry_and_a_go_consumer(
    registry_env: None, registry_url: str, kafka_bootstrap: str, topic_prefix: str, tmp_path: Path
) -> None:
    code, output = _topics_create(kafka_bootstrap, topic_prefix)
    assert code == 0, output
    subject = f"{topic_prefix}{CALLS}-value"
    assert f"schema   {subject} id " in output
    client = wire.RegistryClient(registry_url)
    assert client._call("GET", f"/config/{subject}")["compatibilityLevel"] == "BACKWARD"
    assert len(client._call("GET", f"/subjects/{subject}/versions")) == 8  # call_event v0..v6, then the current

    kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap, topic_prefix=topic_prefix)
    calls = [e for e in sample_events() if isinstance(e, CallEvent)]
    producer = make_producer(kafka)
    for call in calls:
        producer.produce(kafka.topic(CALLS), key=call.rollout_id.encode(), value=call.to_bytes())  # env: registry
    producer.produce(kafka.topic(CALLS), key=b"old", value=calls[0].to_bytes(wire_free_codec()))  # a migration
    assert producer.flush(30) == 0

    consumer = make_consumer(kafka, f"{topic_prefix}reader", **{"auto.offset.reset": "earliest"})
    consumer.subscribe([kafka.topic(CALLS)])
    values: list[bytes] = []
    while len(values) < len(calls) + 1:
        msg = consumer.poll(30)
        assert msg is not None, f"only {len(values)} records came back"
        assert msg.error() is None, msg.error()
        values.append(msg.value())
    consumer.close()
    assert sorted(v[:1] for v in values) == sorted([b"\x00"] * len(calls) + [b"\xc3"])
    back = [CallEvent.from_bytes(v) for v in values]  # the project's reader: default codec, both formats
    assert sorted(b.to_bytes() for b in back) == sorted([c.to_bytes() for c in calls] + [calls[0].to_bytes()])

    go = _go_decode(kafka_bootstrap, kafka.topic(CALLS), registry_url, tmp_path)
    registry_format = [v for v in values if v[:1] == b"\x00"]
    first = next(v for v in registry_format if default_codec().decode(v)[1]["call_id"] == go["record"]["call_id"])
    assert go["schema"] == "io.clawstream.CallEvent" and go["schema_id"] == int.from_bytes(first[1:5], "big")
    _, ours = default_codec().decode(first)
    compared = 0
    for name, value in ours.items():
        if isinstance(value, (str, int)) and not isinstance(value, bool):
            assert go["record"][name] == value, name
            compared += 1
        elif isinstance(value, bytes):
            assert base64.b64decode(go["record"][name]) == value, name  # packed token arrays, byte for byte
            compared += 1
    assert compared >= 10


def wire_free_codec():  # noqa: ANN201 - a single-object writer beside the registry-format default
    from schemas.codec import AvroCodec

    return AvroCodec()


def test_breaking_schema_change_is_refused_at_topics_create(
    registry_env: None, registry_url: str, kafka_bootstrap: str, topic_prefix: str, tmp_path: Path
) -> None:
    broken = tmp_path / "schemas"
    shutil.copytree(SCHEMA_DIR, broken, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    raw = json.loads((broken / "call_event.avsc").read_text())
    raw["fields"].append({"name": "harness_build", "type": "string", "doc": "added without a default"})
    (broken / "call_event.avsc").write_text(json.dumps(raw))

    code, output = _topics_create(kafka_bootstrap, topic_prefix, "--schema-dir", str(broken))
    assert code != 0
    assert "call_event.avsc" in output and "CallEvent.harness_build" in output and "default" in output, output
    assert "fix:" in output
    # The local check answers first; the registry, asked on its own, refuses the same change.
    client = wire.RegistryClient(registry_url)
    calls = [(f"{topic_prefix}{CALLS}", next(s for s in CATALOG if s.name == CALLS))]
    wire.register_catalog(client, calls, SCHEMA_DIR)
    with pytest.raises(IncompatibleSchemaError, match="the schema registry refuses call_event.avsc"):
        wire.register_catalog(client, calls, broken)
