"""Weight-version checks and targets without Kafka: URI, sha256, tensor names/shapes, the CPU-engine swap, the vLLM
adapter's requests (against a real in-process aiohttp server that records them), and GPU telemetry's absence."""

from __future__ import annotations

import asyncio
import hashlib
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from aiohttp import web
from safetensors.torch import save_file

from consumers.inference.engine import Engine, SamplingParams
from consumers.inference.telemetry import gpu_readings
from consumers.inference.vllm_adapter import VllmCall, VllmWeightsTarget, reload_calls
from consumers.inference.vllm_server import EXTENSION_CLS
from consumers.inference.weight_follower import EngineWeightsTarget
from policy.weight_store import WeightsRejected, load_checked, resolve_uri, verify_file
from schemas.events import WeightVersion
from tests.support.tiny_model import EOS, greedy_reference, tiny_model


def _save(tensors: dict[str, torch.Tensor], path: Path) -> WeightVersion:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    data = path.read_bytes()
    return WeightVersion(
        policy_version=1,
        timestamp_ms=0,
        model_name="tiny",
        step=1,
        uri=path.as_uri(),
        sha256=hashlib.sha256(data).hexdigest(),
        size_bytes=len(data),
    )


def _weights(seed: int) -> dict[str, torch.Tensor]:
    sd = tiny_model(seed).state_dict()
    sd.pop("lm_head.weight")  # tied to the embeddings: stored once, as save_pretrained does
    return sd


def test_resolve_uri() -> None:
    assert resolve_uri("file:///tmp/w%20x/a.safetensors") == Path("/tmp/w x/a.safetensors")
    assert resolve_uri("/abs/a.safetensors") == Path("/abs/a.safetensors")
    for uri in ("s3://bucket/a.safetensors", "relative/a.safetensors", "file://otherhost/a"):
        with pytest.raises(WeightsRejected) as info:
            resolve_uri(uri)
        assert info.value.kind == "unsupported_uri"


def test_verify_file_checks_existence_size_and_sha256(tmp_path: Path) -> None:
    event = _save(_weights(1), tmp_path / "v1" / "model.safetensors")
    assert verify_file(event) == tmp_path / "v1" / "model.safetensors"
    cases = {
        "checksum_mismatch": WeightVersion(**{**event.__dict__, "sha256": "0" * 64}),
        "size_mismatch": WeightVersion(**{**event.__dict__, "size_bytes": event.size_bytes + 1}),
        "missing_file": WeightVersion(**{**event.__dict__, "uri": (tmp_path / "nope.safetensors").as_uri()}),
    }
    for kind, bad in cases.items():
        with pytest.raises(WeightsRejected) as info:
            verify_file(bad)
        assert info.value.kind == kind


def test_load_checked_rejects_wrong_names_and_shapes(tmp_path: Path) -> None:
    model = tiny_model(0)
    good = _weights(1)
    assert set(load_checked(resolve_uri(_save(good, tmp_path / "ok.safetensors").uri), model)) == set(good)
    both = {**good, "lm_head.weight": good["model.embed_tokens.weight"].clone()}
    load_checked(resolve_uri(_save(both, tmp_path / "both.safetensors").uri), model)  # tied names twice: fine
    bad_cases = {
        "shape_mismatch": {**good, "model.norm.weight": torch.ones(33)},
        "unexpected_tensor": {**good, "model.extra.weight": torch.ones(2)},
        "missing_tensor": {k: v for k, v in good.items() if k != "model.norm.weight"},
        "tied_mismatch": {**good, "lm_head.weight": torch.zeros_like(good["model.embed_tokens.weight"])},
    }
    for kind, tensors in bad_cases.items():
        with pytest.raises(WeightsRejected) as info:
            load_checked(resolve_uri(_save(tensors, tmp_path / f"{kind}.safetensors").uri), model)
        assert info.value.kind == kind, kind
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(WeightsRejected) as info:
        load_checked(tmp_path / "junk.safetensors", model)
    assert info.value.kind == "bad_file"


def test_engine_target_swaps_weights_between_steps(tmp_path: Path) -> None:
    model, new = tiny_model(0), tiny_model(1)
    engine = Engine(model, eos_token_ids=[EOS], policy_version=0)
    engine.start()
    try:
        target = EngineWeightsTarget(engine)
        event = _save(_weights(1), tmp_path / "v1" / "model.safetensors")
        report = target.apply(target.prepare(event), event)
        assert target.policy_version == 1 and report.apply_s >= 0
        done = threading.Event()
        box: list = []
        engine.submit(
            [[3, 4, 5]],
            SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
            lambda r: (box.append(r), done.set()),
        )
        assert done.wait(30)
        assert box[0].policy_version == 1 and box[0].outputs[0].token_ids == greedy_reference(new, [3, 4, 5], 6)
        assert torch.equal(model.lm_head.weight, new.lm_head.weight)  # tied head followed the embeddings
    finally:
        engine.stop()


def test_gpu_readings_with_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``pynvml`` importable (a stand-in module here; the real one was checked on an H200), readings appear;
    an NVMLError at init leaves them out."""
    import types

    from consumers.inference import telemetry

    fake = types.SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlDeviceGetCount=lambda: 1,
        nvmlDeviceGetHandleByIndex=lambda i: f"gpu{i}",
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(used=3.0e9, total=1.5e11),
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=42),
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(telemetry, "_nvml", None)
    monkeypatch.setattr(telemetry, "_handles", [])
    assert telemetry.gpu_readings() == {
        "gpu0_mem_used_bytes": 3.0e9,
        "gpu0_mem_total_bytes": 1.5e11,
        "gpu0_util_pct": 42.0,
    }

    def no_driver() -> None:
        raise RuntimeError("NVML Shared Library Not Found")  # stands in for pynvml.NVMLError

    monkeypatch.setattr(fake, "nvmlInit", no_driver)
    monkeypatch.setattr(telemetry, "_nvml", None)
    monkeypatch.setattr(telemetry, "_handles", [])
    assert telemetry.gpu_readings() == {}


def test_gpu_readings_are_omitted_without_nvml() -> None:
    try:
        import pynvml  # type: ignore[import-not-found]  # noqa: F401
    except ImportError:
        assert gpu_readings() == {}
    else:  # nvidia-ml-py installed: readings only if a GPU answers, never an exception
        assert isinstance(gpu_readings(), dict)


# ---- vLLM adapter --------------------------------------------------------------------------------------------
def _server_info(device: str = "cpu", extension: str = EXTENSION_CLS) -> dict:
    """The part of vLLM 0.32's ``GET /server_info?config_format=json`` answer the adapter reads."""
    config = {"device_config": {"device": device}, "parallel_config": {"worker_extension_cls": extension}}
    return {"vllm_config": config, "vllm_env": {}, "system_env": {}}


class _RecordingServer:
    """A real aiohttp server on a background loop that records every request (method, path + query, JSON body) and
    answers as vLLM 0.32 does where the adapter reads the answer (``/server_info``, ``/reset_prefix_cache``)."""

    def __init__(
        self,
        fail_path: str | None = None,
        *,
        info: dict | None = None,
        status: dict[str, int] | None = None,
        answers: dict[str, object] | None = None,
    ) -> None:
        self.requests: list[tuple[str, str, dict | None]] = []
        self.fail_path = fail_path
        self.status = status or {}
        self.answers = {
            "/server_info": info or _server_info(),
            "/reset_prefix_cache": {"success": True},
            **(answers or {}),
        }
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.url = ""

    async def _handle(self, request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else None
        self.requests.append((request.method, request.path_qs, body))
        if request.path == self.fail_path:
            return web.json_response({"error": "reload failed"}, status=500)
        if request.path in self.status:
            return web.json_response({"detail": "Not Found"}, status=self.status[request.path])
        return web.json_response(self.answers.get(request.path, {"ok": True}))

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        host, port = self.runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"

    def __enter__(self) -> _RecordingServer:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def version_dir(tmp_path: Path) -> Iterator[tuple[WeightVersion, Path]]:
    path = tmp_path / "step-000001" / "model.safetensors"
    yield _save(_weights(1), path), path.parent


INFO = ("GET", "/server_info?config_format=json", None)


def test_reload_calls_in_order(tmp_path: Path) -> None:
    calls = reload_calls(tmp_path, refresh_tied=True, version=7)
    assert [c.path for c in calls] == [
        "/pause?mode=wait",
        "/collective_rpc",
        "/collective_rpc",
        "/reset_prefix_cache",
        "/update_weight_version",
        "/resume",
    ]
    assert calls[1] == VllmCall(
        "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(tmp_path)}}
    )
    assert calls[2] == VllmCall("/collective_rpc", {"method": "clawstream_refresh_tied_weights"})
    assert calls[4] == VllmCall("/update_weight_version", {"new_version": "7"})
    assert [c.path for c in reload_calls(tmp_path, pause=False)] == ["/collective_rpc", "/reset_prefix_cache"]


def test_vllm_target_sends_the_documented_requests(version_dir: tuple[WeightVersion, Path]) -> None:
    """A CPU vLLM with clawstream's worker extension (what `clawstream vllm serve` starts): the full sequence."""
    event, directory = version_dir
    with _RecordingServer() as server:
        target = VllmWeightsTarget(server.url + "/", policy_version=0, timeout_s=10)
        report = target.apply(target.prepare(event), event)
        target.apply(target.prepare(event), event)  # the server is asked what it is once
    sequence = [
        ("POST", "/pause?mode=wait", None),
        ("POST", "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(directory)}}),
        ("POST", "/collective_rpc", {"method": "clawstream_refresh_tied_weights"}),
        ("POST", "/reset_prefix_cache", None),
        ("POST", "/update_weight_version", {"new_version": "1"}),
        ("POST", "/resume", None),
    ]
    assert server.requests == [INFO, *sequence, *sequence]
    assert target.policy_version == 1 and report.wait_s >= 0


def test_vllm_target_on_gpu_without_extension_skips_the_refresh(version_dir: tuple[WeightVersion, Path]) -> None:
    event, _ = version_dir
    with _RecordingServer(info=_server_info("cuda", "")) as server:
        target = VllmWeightsTarget(server.url, timeout_s=10)
        target.apply(target.prepare(event), event)
    assert [(r[1], (r[2] or {}).get("method")) for r in server.requests] == [
        ("/server_info?config_format=json", None),
        ("/pause?mode=wait", None),
        ("/collective_rpc", "reload_weights"),
        ("/reset_prefix_cache", None),
        ("/update_weight_version", None),
        ("/resume", None),
    ]


def test_vllm_target_refuses_servers_it_cannot_reload(version_dir: tuple[WeightVersion, Path]) -> None:
    """A CPU server without the extension (stale tied head) or without dev endpoints: refused before any POST."""
    event, _ = version_dir
    for kwargs, needle in [
        ({"info": _server_info("cpu", "")}, "worker extension"),
        ({"status": {"/server_info": 404}}, "VLLM_SERVER_DEV_MODE=1"),
    ]:
        with _RecordingServer(**kwargs) as server:
            target = VllmWeightsTarget(server.url, timeout_s=10)
            with pytest.raises(WeightsRejected) as info:
                target.prepare(event)
        assert info.value.kind == "vllm_unsupported" and needle in info.value.reason
        assert server.requests == [INFO] and target.policy_version == 0


def test_vllm_target_fails_closed_and_checks_before_calling(version_dir: tuple[WeightVersion, Path]) -> None:
    event, directory = version_dir
    with _RecordingServer(fail_path="/collective_rpc") as server:
        target = VllmWeightsTarget(server.url, timeout_s=10)
        with pytest.raises(WeightsRejected) as info:
            target.apply(target.prepare(event), event)
        assert info.value.kind == "vllm_error" and "500" in info.value.reason
        assert [r[1] for r in server.requests] == [INFO[1], "/pause?mode=wait", "/collective_rpc"]  # left paused
        assert target.policy_version == 0
        server.requests.clear()
        with pytest.raises(WeightsRejected) as info:
            target.prepare(WeightVersion(**{**event.__dict__, "sha256": "f" * 64}))
        assert info.value.kind == "checksum_mismatch"
        (directory / "other.safetensors").write_bytes(b"x")
        with pytest.raises(WeightsRejected) as info:
            target.prepare(event)
        assert info.value.kind == "bad_layout" and server.requests == []
    with _RecordingServer(answers={"/reset_prefix_cache": {"success": False}}) as server:  # blocks still in use
        target = VllmWeightsTarget(server.url, timeout_s=10)
        (directory / "other.safetensors").unlink()
        with pytest.raises(WeightsRejected) as info:
            target.apply(target.prepare(event), event)
        assert "reset_prefix_cache" in info.value.reason and server.requests[-1][1] == "/reset_prefix_cache"
    with pytest.raises(WeightsRejected) as info:  # server gone
        VllmWeightsTarget(server.url, timeout_s=2)._send(VllmCall("/resume"))
    assert info.value.kind == "vllm_unreachable"
