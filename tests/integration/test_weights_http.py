"""Weight versions without a shared filesystem (issue #31 item 4): the learner's read-only HTTP server of its weight
store (``learner.weights_http``), the engines' verified fetch into a local cache (``policy.weight_fetch``), and a
real CPU inference worker (subprocess) applying a version published with an ``http://`` URI through the real broker.
"""

from __future__ import annotations

import hashlib
import http.client
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from clawbase.kafka.clients import make_producer
from clawbase.settings import KafkaSettings
from learner.weights_http import WeightsServer, local_copy, published_uri
from policy.tiny_model import init_tiny_model
from policy.weight_fetch import cache_path, verified_file
from policy.weight_store import WeightsRejected, save_state_dict, trainer_state_path
from schemas.events import Metric, WeightVersion, now_ms
from schemas.topics import METRICS, WEIGHTS
from tests.integration.test_inference_worker import _read_topic
from tests.support.inference import Worker

pytestmark = pytest.mark.integration
MODEL = "tiny"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("models") / "tiny"
    init_tiny_model(
        out, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, progress=None
    )
    return out


@pytest.fixture
def store(tmp_path: Path) -> Path:
    return tmp_path / "store"


@pytest.fixture
def server(store: Path) -> Iterator[WeightsServer]:
    store.mkdir(parents=True, exist_ok=True)
    s = WeightsServer(store, host="127.0.0.1", port=0)
    yield s
    s.close()


def _version(model_dir: Path, store: Path, version: int, base: str | None) -> WeightVersion:
    """Perturbed weights saved as the learner saves them, and the event it would publish."""
    tensors = load_file(str(model_dir / "model.safetensors"))
    g = torch.Generator().manual_seed(version)
    noisy = {k: (v + 0.05 * torch.randn(v.shape, generator=g)).contiguous() for k, v in tensors.items()}
    saved = save_state_dict(noisy, store, MODEL, version)
    return WeightVersion(
        policy_version=version,
        timestamp_ms=now_ms(),
        model_name=MODEL,
        step=version,
        uri=published_uri(saved, store, base),
        sha256=saved.sha256,
        size_bytes=saved.size_bytes,
    )


def _get(port: int, path: str, method: str = "GET") -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path)
        return conn.getresponse().status
    finally:
        conn.close()


def test_a_version_is_fetched_verified_and_cached(model_dir: Path, store: Path, server: WeightsServer, tmp_path: Path):
    base = f"http://127.0.0.1:{server.port}"
    event = _version(model_dir, store, 1, base)
    assert event.uri == f"{base}/{MODEL}/v000001/model.safetensors"
    cache = tmp_path / "engine-cache"  # another directory: what an engine on another host has
    got = verified_file(event, cache)
    assert (
        got == cache_path(cache, event)
        and got.read_bytes() == (store / MODEL / "v000001/model.safetensors").read_bytes()
    )
    server.close()  # the cached, verified copy is used as is: no second download
    assert verified_file(event, cache) == got
    # The learner resuming reads its own store, not its own server.
    assert (
        local_copy(event, store).uri.startswith("file://")
        and local_copy(replace(event, uri="file:///x"), store).uri == "file:///x"
    )


def test_a_wrong_or_unreachable_file_is_rejected_and_leaves_nothing(
    model_dir: Path, store: Path, server: WeightsServer, tmp_path: Path
) -> None:
    base = f"http://127.0.0.1:{server.port}"
    event, cache = _version(model_dir, store, 1, base), tmp_path / "engine-cache"
    with pytest.raises(WeightsRejected) as bad:
        verified_file(replace(event, sha256="0" * 64), cache)
    assert bad.value.kind == "checksum_mismatch"
    with pytest.raises(WeightsRejected) as short:
        verified_file(replace(event, size_bytes=event.size_bytes + 1), cache)
    assert short.value.kind == "size_mismatch"
    with pytest.raises(WeightsRejected) as missing:
        verified_file(replace(event, uri=f"{base}/{MODEL}/v000002/model.safetensors"), cache)
    assert missing.value.kind == "fetch_failed" and "404" in missing.value.reason
    assert [p for p in cache.rglob("*") if p.is_file()] == []  # no partial or wrong file anywhere in the cache
    server.close()
    with pytest.raises(WeightsRejected) as down:
        verified_file(event, cache)
    assert down.value.kind == "fetch_failed"


def test_the_server_serves_version_files_only(model_dir: Path, store: Path, server: WeightsServer, tmp_path: Path):
    _version(model_dir, store, 1, None)
    state = trainer_state_path(store, MODEL, 1)
    state.parent.mkdir(parents=True)
    state.write_bytes(b"optimizer moments")
    outside = tmp_path / "secret.safetensors"
    outside.write_bytes(b"not yours")
    (store / MODEL / "v000009").mkdir()
    (store / MODEL / "v000009" / "model.safetensors").symlink_to(outside)
    port = server.port
    assert _get(port, f"/{MODEL}/v000001/model.safetensors") == 200
    assert _get(port, f"/{MODEL}/v000001/model.safetensors", "HEAD") == 200
    for path in (
        "/",
        f"/{MODEL}/",
        f"/{MODEL}/trainer-state/v000001.pt",
        f"/{MODEL}/v000009/model.safetensors",  # a symlink out of the store
        f"/{MODEL}/v000001/../../../secret.safetensors",
        "/%2e%2e/secret.safetensors",
    ):
        assert _get(port, path) == 404, path
    assert _get(port, f"/{MODEL}/v000001/model.safetensors", "PUT") == 405
    assert _get(port, f"/{MODEL}/v000001/model.safetensors", "DELETE") == 405
    assert (store / MODEL / "v000001" / "model.safetensors").is_file()


def test_an_engine_applies_a_version_published_over_http(
    kafka_settings: KafkaSettings, model_dir: Path, store: Path, server: WeightsServer, tmp_path: Path
) -> None:
    """The engine's weight follower gets v1 by its http:// URI into its own CLAWSTREAM_HOME and serves it."""
    event = _version(model_dir, store, 1, f"http://127.0.0.1:{server.port}")
    engine_home = tmp_path / "engine-home"
    env = {
        "CLAWSTREAM_KAFKA_BOOTSTRAP_SERVERS": kafka_settings.bootstrap_servers or "",
        "CLAWSTREAM_KAFKA_TOPIC_PREFIX": kafka_settings.topic_prefix,
        "CLAWSTREAM_HOME": str(engine_home),
    }
    producer = make_producer(kafka_settings)
    producer.produce(kafka_settings.topic(WEIGHTS), key=MODEL.encode(), value=event.to_bytes())
    assert producer.flush(30) == 0
    w = Worker(["--model", str(model_dir), "--served-model-name", MODEL, "--metrics-interval-s", "0"], env)
    try:
        [applied] = [Metric.from_bytes(m.value()) for m in _read_topic(kafka_settings, METRICS, lambda f: len(f) >= 1)]
        assert applied.name == "weights_applied" and applied.policy_version == 1
        assert applied.labels["uri"] == event.uri
    finally:
        w.stop()
    fetched = cache_path(engine_home / "weights-cache", event)
    assert hashlib.sha256(fetched.read_bytes()).hexdigest() == event.sha256
