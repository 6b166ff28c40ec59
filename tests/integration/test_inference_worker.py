"""The CPU inference worker as a real HTTP server (a ``python -m consumers.inference.server`` subprocess on a free
port): vLLM response shapes, sampling semantics, errors; and weight versions through the real Kafka broker
(swap while requests are in flight, a corrupted version dead-lettered, the "weights_applied" metric)."""

from __future__ import annotations

import asyncio
import hashlib
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from confluent_kafka import OFFSET_BEGINNING, TopicPartition
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from clawbase.kafka.clients import make_consumer, make_producer
from clawbase.settings import KafkaSettings
from policy.tiny_model import init_tiny_model
from schemas.events import DeadLetter, Metric, WeightVersion, now_ms
from schemas.topics import DEADLETTER, METRICS, WEIGHTS
from tests.support.inference import Worker

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CHOICE_FIELDS = {
    "index",
    "text",
    "logprobs",
    "finish_reason",
    "stop_reason",
    "token_ids",
    "prompt_logprobs",
    "prompt_token_ids",
}


# ---- fixtures and helpers --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("models") / "tiny"
    init_tiny_model(
        out, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, progress=None
    )
    return out


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> tuple[Any, Any]:
    return AutoModelForCausalLM.from_pretrained(model_dir).eval(), AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def worker(model_dir: Path) -> Iterator[Worker]:
    w = Worker(["--model", str(model_dir), "--no-weights", "--max-batch-size", "16"])
    yield w
    w.stop()


async def _post(session: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, dict[str, Any], Any]:
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        return resp.status, dict(resp.headers), await resp.json()


def _greedy(model: Any, prompt: list[int], max_new_tokens: int, eos: int | None) -> list[int]:
    """``model.generate(do_sample=False)``; with ``eos=None`` nothing stops it before ``max_new_tokens``."""
    config = GenerationConfig(
        do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=[] if eos is None else eos, pad_token_id=0
    )
    out = model.generate(
        torch.tensor([prompt]), attention_mask=torch.ones((1, len(prompt)), dtype=torch.long), generation_config=config
    )
    return out[0, len(prompt) :].tolist()


def _prompts(tokenizer: Any, n: int) -> list[list[int]]:
    texts = [
        "list the files in src",
        "count the lines of notes.txt",
        "read config.json",
        "hello",
        "write a summary of the report",
        "rename data.csv to old.csv",
        "what is 7 + 5?",
        "fix the failing test",
    ]
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for t in texts[:n]
    ]


# ---- HTTP: shapes and sampling --------------------------------------------------------------------------------
async def test_concurrent_requests_have_vllm_shapes(worker: Worker, reference: tuple[Any, Any]) -> None:
    _, tokenizer = reference
    prompts = _prompts(tokenizer, 8)
    bodies = [
        {
            "model": "tiny",
            "prompt": p,
            "max_tokens": 12 + i,
            "temperature": 1.0,
            "logprobs": 2,
            "return_token_ids": True,
            "seed": i,
        }
        for i, p in enumerate(prompts)
    ]
    async with aiohttp.ClientSession() as session:
        results = await asyncio.gather(*(_post(session, worker.url, b) for b in bodies))  # type: ignore[arg-type]
    for (status, headers, body), prompt in zip(results, prompts, strict=True):
        assert status == 200, body
        assert headers["X-Policy-Version"] == "0" and body["policy_version"] == 0
        # "tiny" (the model directory's name) is accepted; the answer names the served model, "policy" by default
        assert body["object"] == "text_completion" and body["id"].startswith("cmpl-") and body["model"] == "policy"
        assert isinstance(body["created"], int) and "system_fingerprint" in body
        assert body["engine_telemetry"] is None  # on the CPU: no GPU readings
        [choice] = body["choices"]
        assert set(choice) == CHOICE_FIELDS and choice["index"] == 0
        assert choice["finish_reason"] in ("stop", "length") and choice["prompt_token_ids"] == prompt
        ids = choice["token_ids"]
        cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert isinstance(cached, int) and 0 <= cached < len(prompt)
        assert body["usage"] == {
            "prompt_tokens": len(prompt),
            "completion_tokens": len(ids),
            "total_tokens": len(prompt) + len(ids),
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        lp = choice["logprobs"]
        assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids)
        assert all(math.isfinite(x) and x <= 0 for x in lp["token_logprobs"])
        assert all(1 <= len(top) <= 3 for top in lp["top_logprobs"])  # sampled + top 2
        assert choice["text"] == tokenizer.decode(ids, skip_special_tokens=True)


async def test_seed_reproduces_and_greedy_matches_generate(worker: Worker, reference: tuple[Any, Any]) -> None:
    model, tokenizer = reference
    prompts = _prompts(tokenizer, 4)
    seeded = {
        "prompt": prompts[0],
        "max_tokens": 24,
        "temperature": 1.0,
        "seed": 1234,
        "return_token_ids": True,
        "ignore_eos": True,
    }
    greedy = [{"prompt": p, "max_tokens": 20, "temperature": 0, "return_token_ids": True} for p in prompts]
    async with aiohttp.ClientSession() as session:
        results = await asyncio.gather(
            _post(session, worker.url, seeded),
            _post(session, worker.url, seeded),  # type: ignore[arg-type]
            _post(session, worker.url, {**seeded, "seed": 4321}),  # type: ignore[arg-type]
            *(_post(session, worker.url, g) for g in greedy),  # type: ignore[arg-type]
        )
    first, again, other = (r[2]["choices"][0]["token_ids"] for r in results[:3])
    assert first == again and first != other
    eos = tokenizer.eos_token_id
    for (status, _, body), prompt in zip(results[3:], prompts, strict=True):
        assert status == 200
        assert body["choices"][0]["token_ids"] == _greedy(model, prompt, 20, eos)


async def test_n_stop_token_ids_and_max_tokens(worker: Worker, reference: tuple[Any, Any]) -> None:
    model, tokenizer = reference
    [prompt, other] = _prompts(tokenizer, 2)
    ref = _greedy(model, prompt, 10, None)
    stop_at = max(i for i, t in enumerate(ref) if t not in ref[:i])  # the last first occurrence of a token
    async with aiohttp.ClientSession() as session:
        n_status, _, n_body = await _post(
            session, worker.url, {"prompt": [prompt, other], "n": 3, "max_tokens": 5, "return_token_ids": True}
        )
        _, _, stop_body = await _post(
            session,
            worker.url,
            {
                "prompt": prompt,
                "max_tokens": 10,
                "temperature": 0,
                "ignore_eos": True,
                "stop_token_ids": [ref[stop_at]],
                "return_token_ids": True,
            },
        )
        _, _, len_body = await _post(session, worker.url, {"prompt": prompt, "max_tokens": 7, "ignore_eos": True})
    assert n_status == 200 and [c["index"] for c in n_body["choices"]] == list(range(6))
    assert [c["prompt_token_ids"] for c in n_body["choices"]] == [prompt] * 3 + [other] * 3
    assert n_body["usage"]["prompt_tokens"] == len(prompt) + len(other)  # each prompt once, not n times
    stop = stop_body["choices"][0]
    assert stop["finish_reason"] == "stop" and stop["stop_reason"] == ref[stop_at]
    assert stop["token_ids"] == ref[: stop_at + 1]
    assert len_body["choices"][0]["finish_reason"] == "length" and len_body["usage"]["completion_tokens"] == 7


async def test_malformed_requests_get_openai_errors(worker: Worker) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{worker.url}/v1/completions", data=b"{not json") as resp:
            assert resp.status == 400
            body = await resp.json()
            assert body["error"]["type"] == "BadRequestError" and body["error"]["code"] == 400
        for bad, param in (
            [{"max_tokens": 3}, "prompt"],
            [{"prompt": [1], "stream": True}, "stream"],
            [{"prompt": [1], "logprobs": 99}, "logprobs"],
            [{"prompt": [10**9]}, "prompt"],
        ):
            status, headers, body = await _post(session, worker.url, bad)
            assert status == 400 and set(body["error"]) == {"message", "type", "param", "code"}
            assert body["error"]["param"] == param and headers["Content-Type"].startswith("application/json")
        status, _, body = await _post(session, worker.url, {"model": "nope", "prompt": [1]})
        assert status == 404 and body["error"]["type"] == "NotFoundError"
        async with session.get(f"{worker.url}/v1/models") as resp:
            models = await resp.json()
            assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["policy", "tiny"]
        async with session.get(f"{worker.url}/health") as resp:
            assert resp.status == 200 and resp.headers["X-Policy-Version"] == "0"


def _scrape(text: str) -> dict[str, float]:
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


async def test_cached_prompt_tokens_per_response_and_in_metrics(worker: Worker) -> None:
    """Each response reports its cached prompt tokens (vLLM's usage.prompt_tokens_details); /metrics counts them
    and exposes the engine's prefix-cache counters. With the engine's prefix cache on, a repeated long prompt is
    served mostly from the cache (the last prompt token is always computed)."""
    prompt = [(i * 37) % 1500 + 10 for i in range(300)]
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{worker.url}/metrics") as resp:
            assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
            before = _scrape(await resp.text())
        first, second = [await _post(session, worker.url, body) for _ in range(2)]
        async with session.get(f"{worker.url}/metrics") as resp:
            after = _scrape(await resp.text())
    cached = [r[2]["usage"]["prompt_tokens_details"]["cached_tokens"] for r in (first, second)]
    assert all(isinstance(c, int) and 0 <= c < len(prompt) for c in cached)

    def delta(name: str) -> float:
        return after[f"clawstream_engine_{name}"] - before[f"clawstream_engine_{name}"]

    assert delta("requests_total") == 2 and delta("prompt_tokens_total") == 2 * len(prompt)
    assert delta("cached_prompt_tokens_total") == sum(cached)
    for name in (
        "prefix_cache_queries_total",
        "prefix_cache_hits_total",
        "prefix_cache_hit_rate",
        "generation_tokens_total",
        "requests_running",
        "policy_version",
    ):
        assert f"clawstream_engine_{name}" in after, name
    if delta("prefix_cache_queries_total") > 0:  # the engine has a prefix cache
        assert cached[1] >= len(prompt) // 2 and delta("prefix_cache_hits_total") >= cached[1]


async def test_a_client_that_goes_away_is_aborted(worker: Worker) -> None:
    long = {"prompt": [1, 2, 3], "max_tokens": 4000, "ignore_eos": True}
    async with aiohttp.ClientSession() as session:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(_post(session, worker.url, long), timeout=0.5)
    deadline = time.monotonic() + 10
    while "client went away: aborted cmpl-" not in worker.log() and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert "client went away: aborted cmpl-" in worker.log()


# ---- weight versions through Kafka ---------------------------------------------------------------------------
def _publish_version(
    settings: KafkaSettings,
    model_dir: Path,
    out: Path,
    version: int,
    *,
    noise: float,
    sha256: str | None = None,
    uri: str | None = None,
) -> Path:
    """Write perturbed weights to ``out/vN/model.safetensors`` and publish its WeightVersion."""
    path = out / f"v{version}" / "model.safetensors"
    path.parent.mkdir(parents=True)
    tensors = load_file(str(model_dir / "model.safetensors"))
    generator = torch.Generator().manual_seed(version)
    save_file(
        {k: (v + noise * torch.randn(v.shape, generator=generator)).contiguous() for k, v in tensors.items()}, str(path)
    )
    data = path.read_bytes()
    event = WeightVersion(
        policy_version=version,
        timestamp_ms=now_ms(),
        model_name="tiny",
        step=version,
        uri=uri or path.as_uri(),
        sha256=sha256 or hashlib.sha256(data).hexdigest(),
        size_bytes=len(data),
    )
    producer = make_producer(settings)
    producer.produce(settings.topic(WEIGHTS), key=b"tiny", value=event.to_bytes())
    assert producer.flush(30) == 0
    return path


def _read_topic(settings: KafkaSettings, topic: str, want: Any, timeout: float = 60.0) -> list[Any]:
    consumer = make_consumer(settings, f"t-{time.monotonic_ns()}")
    consumer.assign([TopicPartition(settings.topic(topic), 0, OFFSET_BEGINNING)])
    found: list[Any] = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and not want(found):
            msg = consumer.poll(0.5)
            if msg is not None and msg.error() is None:
                found.append(msg)
    finally:
        consumer.close()
    return found


async def _until_version(session: aiohttp.ClientSession, url: str, prompt: list[int], version: int) -> dict:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        status, _, body = await _post(
            session, url, {"prompt": prompt, "max_tokens": 16, "temperature": 0, "return_token_ids": True}
        )
        assert status == 200
        if body["policy_version"] >= version:
            return body
        await asyncio.sleep(0.3)
    raise AssertionError(f"version {version} never served")


async def test_weight_versions_swap_under_load_and_bad_ones_are_dead_lettered(
    kafka_settings: KafkaSettings, model_dir: Path, reference: tuple[Any, Any], tmp_path: Path
) -> None:
    old_model, tokenizer = reference
    eos = tokenizer.eos_token_id
    env = {
        "CLAWSTREAM_KAFKA_BOOTSTRAP_SERVERS": kafka_settings.bootstrap_servers or "",
        "CLAWSTREAM_KAFKA_TOPIC_PREFIX": kafka_settings.topic_prefix,
    }
    w = Worker(
        ["--model", str(model_dir), "--served-model-name", "tiny", "--worker-id", "it-1", "--metrics-interval-s", "0"],
        env,
    )
    try:
        prompts = _prompts(tokenizer, 8)
        async with aiohttp.ClientSession() as session:
            bodies = [
                {"prompt": p, "max_tokens": 120, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
                for p in prompts
            ]
            in_flight = [asyncio.create_task(_post(session, w.url, b)) for b in bodies]  # type: ignore[arg-type]
            await asyncio.sleep(0.3)
            published = time.monotonic()
            v1_path = _publish_version(kafka_settings, model_dir, tmp_path, 1, noise=0.05)
            results = await asyncio.gather(*in_flight)
            new_body = await _until_version(session, w.url, prompts[0], 1)
            switched = time.monotonic() - published

            new_model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
            new_model.load_state_dict(load_file(str(v1_path)), strict=False)
            new_model.tie_weights()
            # Every response is wholly from the version it reports (no mid-sequence swap), and none failed.
            for (status, headers, body), prompt in zip(results, prompts, strict=True):
                assert status == 200, body
                assert headers["X-Policy-Version"] == str(body["policy_version"])
                ref_model = old_model if body["policy_version"] == 0 else new_model
                assert body["choices"][0]["token_ids"] == _greedy(ref_model, prompt, 120, None)
            assert any(r[2]["policy_version"] == 0 for r in results)  # the swap waited for in-flight requests
            new_ref = _greedy(new_model, prompts[0], 16, eos)
            assert new_body["choices"][0]["token_ids"] == new_ref != _greedy(old_model, prompts[0], 16, eos)

            [applied] = [
                Metric.from_bytes(m.value()) for m in _read_topic(kafka_settings, METRICS, lambda f: len(f) >= 1)
            ]
            assert applied.name == "weights_applied" and applied.policy_version == 1
            assert applied.source == "inference-worker/it-1" and applied.labels["uri"] == v1_path.as_uri()
            assert 0 < applied.values["swap_latency_s"] < switched + 1
            assert applied.values["drain_wait_s"] >= 0 and applied.values["previous_version"] == 0

            # A corrupted file (sha256 does not match) and a missing file: dead-lettered, version 1 kept.
            _publish_version(kafka_settings, model_dir, tmp_path, 2, noise=0.05, sha256="0" * 64)
            _publish_version(
                kafka_settings, model_dir, tmp_path, 3, noise=0.05, uri=(tmp_path / "missing.safetensors").as_uri()
            )
            letters = [
                DeadLetter.from_bytes(m.value()) for m in _read_topic(kafka_settings, DEADLETTER, lambda f: len(f) >= 2)
            ]
            assert [(d.policy_version, d.error_type) for d in letters] == [
                (2, "checksum_mismatch"),
                (3, "missing_file"),
            ]
            assert letters[0].original_topic == kafka_settings.topic(WEIGHTS) and letters[0].original_offset == 1
            assert letters[0].original_key == b"tiny" and "sha256" in letters[0].reason
            assert WeightVersion.from_bytes(letters[0].original_value).policy_version == 2  # type: ignore[arg-type]
            probe = {"prompt": prompts[0], "max_tokens": 16, "temperature": 0, "return_token_ids": True}
            status, headers, body = await _post(session, w.url, probe)
            assert body["policy_version"] == 1 and headers["X-Policy-Version"] == "1"
            assert body["choices"][0]["token_ids"] == new_ref
        assert "rejected weights version 2" in w.log() and "checksum_mismatch" in w.log()
    finally:
        w.stop()
    assert "clawstream.weights[0]@0" in w.log()  # consumer positions are logged as topic[partition]@offset


def test_restarted_worker_applies_the_newest_good_version(
    kafka_settings: KafkaSettings, model_dir: Path, tmp_path: Path
) -> None:
    _publish_version(kafka_settings, model_dir, tmp_path, 1, noise=0.05)
    _publish_version(kafka_settings, model_dir, tmp_path, 2, noise=0.05)
    _publish_version(kafka_settings, model_dir, tmp_path, 3, noise=0.05, sha256="1" * 64)  # newest is corrupt
    env = {
        "CLAWSTREAM_KAFKA_BOOTSTRAP_SERVERS": kafka_settings.bootstrap_servers or "",
        "CLAWSTREAM_KAFKA_TOPIC_PREFIX": kafka_settings.topic_prefix,
    }
    w = Worker(["--model", str(model_dir), "--served-model-name", "tiny", "--metrics-interval-s", "0"], env)
    try:
        [applied] = [Metric.from_bytes(m.value()) for m in _read_topic(kafka_settings, METRICS, lambda f: len(f) >= 1)]
        assert applied.policy_version == 2  # 3 rejected, 1 skipped as older: only the newest good one is applied
        [letter] = [DeadLetter.from_bytes(m.value()) for m in _read_topic(kafka_settings, DEADLETTER, bool)]
        assert letter.policy_version == 3 and letter.error_type == "checksum_mismatch"
    finally:
        w.stop()
