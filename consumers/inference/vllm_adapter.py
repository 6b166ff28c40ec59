"""Thin adapter that applies clawstream weight versions to a running vLLM server over its HTTP API.

Topics: none directly; ``consumers.inference.weight_follower.WeightsFollower`` feeds it ``clawstream.weights`` events
when the worker runs with ``--engine vllm --engine-url URL`` (the worker then serves no completions itself: clients
talk to vLLM's own ``/v1/completions``).

For each new version the adapter checks the file (sha256; the vLLM host must see the same path), asks the server once
what it is (``GET /server_info?config_format=json``), then sends: ``POST /pause?mode=wait`` (RL route; in-flight
requests finish on the old weights, new ones queue) → ``POST /collective_rpc`` ``reload_weights`` of the version's
directory (development endpoints, ``VLLM_SERVER_DEV_MODE=1``: vLLM 0.32's RL weight-sync routes load no checkpoint
directory) → only with clawstream's worker extension, ``POST /collective_rpc`` ``clawstream_refresh_tied_weights``
(a CPU reload leaves a tied output head stale; a CPU server without the extension is refused, reason
``vllm_unsupported``) → ``POST /reset_prefix_cache`` → ``POST /update_weight_version`` → ``POST /resume``.

Each version must live in a directory of its own (vLLM loads every ``*.safetensors`` in it). A failure after the
pause leaves the server paused on purpose (fail closed). Why each step, the measurements and the tests (a real vLLM
0.32 in tests/integration/test_vllm_real.py; the exact requests in the unit tests):
docs/vllm_cpu.md#weight-updates-the-adapters-request-sequence.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from consumers.inference.vllm_server import EXTENSION_CLS
from consumers.inference.weight_follower import ApplyReport
from policy.weight_fetch import verified_file
from policy.weight_store import WeightsRejected
from schemas.events import WeightVersion

log = logging.getLogger(__name__)

TESTED_VLLM_VERSION = "0.32.0"
REFRESH_METHOD = "clawstream_refresh_tied_weights"


@dataclass(frozen=True)
class VllmCall:
    """One HTTP request to the vLLM server."""

    path: str  # with query string, relative to the server root (the dev and RL endpoints are not under /v1)
    body: dict[str, Any] | None = field(default=None)
    method: str = "POST"


@dataclass(frozen=True)
class ServerInfo:
    """What the adapter needs to know about a vLLM server (from ``GET /server_info``)."""

    device: str  # "cpu", "cuda", ...
    extension: bool  # clawstream's worker extension is loaded


def reload_calls(
    weights_dir: Path, *, pause: bool = True, refresh_tied: bool = False, version: int | None = None
) -> list[VllmCall]:
    """The requests that move a vLLM server to the checkpoint in ``weights_dir`` (see the module docstring)."""
    calls = [VllmCall("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(weights_dir)}})]
    if refresh_tied:
        calls.append(VllmCall("/collective_rpc", {"method": REFRESH_METHOD}))
    calls.append(VllmCall("/reset_prefix_cache"))
    if version is not None:
        calls.append(VllmCall("/update_weight_version", {"new_version": str(version)}))
    if pause:
        calls = [VllmCall("/pause?mode=wait"), *calls, VllmCall("/resume")]
    return calls


def parse_server_info(info: dict[str, Any]) -> ServerInfo:
    """Device and extension from ``GET /server_info?config_format=json`` (vLLM 0.32's layout)."""
    config = info.get("vllm_config")
    if not isinstance(config, dict):
        raise WeightsRejected("vllm_error", "GET /server_info?config_format=json has no 'vllm_config' object")
    device = str((config.get("device_config") or {}).get("device") or "unknown")
    extension_cls = str((config.get("parallel_config") or {}).get("worker_extension_cls") or "")
    return ServerInfo(device=device, extension=extension_cls == EXTENSION_CLS)


class VllmWeightsTarget:
    """A :class:`consumers.inference.weight_follower.WeightsTarget` that reloads a vLLM server's weights from shared
    storage."""

    def __init__(self, base_url: str, *, policy_version: int = 0, timeout_s: float = 600.0, pause: bool = True):
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.pause = pause
        self._policy_version = policy_version
        self._server: ServerInfo | None = None

    @property
    def policy_version(self) -> int:
        return self._policy_version

    def server_info(self) -> ServerInfo:
        """Asked once, before the first swap; refuses a server this adapter cannot reload correctly."""
        if self._server is None:
            try:
                info = self._send(VllmCall("/server_info?config_format=json", method="GET"))
            except WeightsRejected as exc:
                if "returned 404" in exc.reason:
                    raise WeightsRejected(
                        "vllm_unsupported",
                        f"{self.base_url} has no development endpoints (/server_info, /collective_rpc, "
                        "/reset_prefix_cache): start vLLM with VLLM_SERVER_DEV_MODE=1 (`clawstream vllm serve` does)",
                    ) from exc
                raise
            server = parse_server_info(info if isinstance(info, dict) else {})
            if server.device == "cpu" and not server.extension:
                raise WeightsRejected(
                    "vllm_unsupported",
                    f"{self.base_url} is a CPU vLLM without clawstream's worker extension: its in-place reload "
                    "leaves a tied output head on the old weights. Start it with `clawstream vllm serve`, or add "
                    f"--worker-extension-cls {EXTENSION_CLS} with consumers/inference/vllm_worker on PYTHONPATH",
                )
            self._server = server
        return self._server

    def prepare(self, event: WeightVersion) -> Path:
        path = verified_file(event)
        others = sorted(p.name for p in path.parent.glob("*.safetensors") if p != path)
        if others:
            raise WeightsRejected(
                "bad_layout",
                f"vLLM loads every *.safetensors in {path.parent}, which also holds {', '.join(others[:3])}: "
                "publish each version in a directory of its own",
            )
        self.server_info()
        return path.parent

    def apply(self, prepared: Path, event: WeightVersion) -> ApplyReport:
        server = self.server_info()
        calls = reload_calls(prepared, pause=self.pause, refresh_tied=server.extension, version=event.policy_version)
        started = time.monotonic()
        waited = 0.0
        for i, call in enumerate(calls):
            t0 = time.monotonic()
            try:
                answer = self._send(call)
                if call.path == "/reset_prefix_cache" and not (isinstance(answer, dict) and answer.get("success")):
                    raise WeightsRejected("vllm_error", f"POST /reset_prefix_cache answered {answer!r}, not success")
            except WeightsRejected:
                if i > 0 and self.pause:
                    log.error(
                        "vLLM at %s is left PAUSED after a failed reload to version %d; check it and "
                        "POST %s/resume once it serves consistent weights",
                        self.base_url,
                        event.policy_version,
                        self.base_url,
                    )
                raise
            if call.path.startswith("/pause"):
                waited = time.monotonic() - t0
        self._policy_version = event.policy_version
        return ApplyReport(wait_s=waited, apply_s=time.monotonic() - started - waited)

    def _send(self, call: VllmCall) -> Any:
        """Send one request; return its JSON answer (None for an empty body)."""
        data = None if call.body is None else json.dumps(call.body).encode()
        request = urllib.request.Request(self.base_url + call.path, data=data, method=call.method)
        if data is not None:
            request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                raw = response.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:500]
            raise WeightsRejected("vllm_error", f"{call.method} {call.path} returned {exc.code}: {detail}") from exc
        except (urllib.error.URLError, OSError) as exc:
            raise WeightsRejected(
                "vllm_unreachable", f"{call.method} {self.base_url}{call.path} failed: {exc}"
            ) from exc
        if not raw.strip():
            return None
        try:
            return json.loads(raw)
        except ValueError:
            return raw.decode(errors="replace")
