"""Thin adapter that applies clawstream weight versions to a running vLLM server over its HTTP API.

Topics: none directly; ``consumers.inference.weight_follower.WeightsFollower`` feeds it ``clawstream.weights`` events
when the
worker runs with ``--engine vllm --engine-url URL`` (the worker then serves no completions itself: clients talk to
vLLM's own ``/v1/completions``). UNTESTED AGAINST A REAL vLLM: no vLLM runs on the development machines; the unit
tests check the exact requests against a real in-process HTTP server that records them.

The mechanism (documented in vLLM's docs/features/sleep_mode.md, "Online Serving": "``POST /collective_rpc``
... ``{"method":"reload_weights"}`` -- load weights in-place"), with the development endpoints enabled::

    VLLM_SERVER_DEV_MODE=1 vllm serve MODEL_DIR --logprobs-mode processed_logprobs

For each new version the adapter checks the file (sha256) on its side -- the vLLM host must see the same path,
i.e. shared storage -- and then sends, in order:

1. ``POST /pause?mode=wait`` -- stop admitting requests and let in-flight ones finish on the old weights
   (vllm/entrypoints/serve/dev/rlhf/api_router.py ``pause_generation``; the same semantics as the CPU engine);
2. ``POST /collective_rpc`` ``{"method": "reload_weights", "kwargs": {"weights_path": DIR}}`` -- every worker
   reloads the checkpoint directory DIR in place. The ``weights_path`` keyword of the workers' ``reload_weights``
   is what NVIDIA NeMo-RL's remote vLLM weight synchronizer sends; older vLLM releases whose ``reload_weights``
   takes no path would need ``update_config`` first, which this adapter does not do;
3. ``POST /reset_prefix_cache`` -- cached prefixes were computed with the old weights;
4. ``POST /resume``.

vLLM loads every ``*.safetensors`` in DIR, so each version must live in a directory of its own (the adapter
refuses a directory holding other safetensors files). If step 2 or 3 fails, the server is left paused on purpose
(fail closed: a partial reload must not serve rollouts whose log-probs would be attributed to the wrong policy);
an operator resumes it. Responses from vLLM do not carry our ``policy_version``: the worker's own ``GET /health``
answers with the applied version in its ``X-Policy-Version`` header, and each switch is in the "weights_applied"
metric.
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

from consumers.inference.weight_follower import ApplyReport
from policy.weight_store import WeightsRejected, verify_file
from schemas.events import WeightVersion

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VllmCall:
    """One HTTP request to the vLLM server."""

    path: str  # with query string, relative to the server root (the dev endpoints are not under /v1)
    body: dict[str, Any] | None = field(default=None)
    method: str = "POST"


def reload_calls(weights_dir: Path, *, pause: bool = True) -> list[VllmCall]:
    """The requests that move a vLLM server to the checkpoint in ``weights_dir`` (see the module docstring)."""
    calls = [VllmCall("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(weights_dir)}}),
             VllmCall("/reset_prefix_cache")]  # fmt: skip
    if pause:
        calls = [VllmCall("/pause?mode=wait"), *calls, VllmCall("/resume")]
    return calls


class VllmWeightsTarget:
    """A :class:`consumers.inference.weight_follower.WeightsTarget` that reloads a vLLM server's weights from shared
    storage."""

    def __init__(self, base_url: str, *, policy_version: int = 0, timeout_s: float = 600.0, pause: bool = True):
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.pause = pause
        self._policy_version = policy_version

    @property
    def policy_version(self) -> int:
        return self._policy_version

    def prepare(self, event: WeightVersion) -> Path:
        path = verify_file(event)
        others = sorted(p.name for p in path.parent.glob("*.safetensors") if p != path)
        if others:
            raise WeightsRejected(
                "bad_layout",
                f"vLLM loads every *.safetensors in {path.parent}, which also holds {', '.join(others[:3])}: "
                "publish each version in a directory of its own",
            )
        return path.parent

    def apply(self, prepared: Path, event: WeightVersion) -> ApplyReport:
        calls = reload_calls(prepared, pause=self.pause)
        started = time.monotonic()
        waited = 0.0
        for i, call in enumerate(calls):
            t0 = time.monotonic()
            try:
                self._send(call)
            except WeightsRejected:
                if i > 0 and self.pause:
                    log.error("vLLM at %s is left PAUSED after a failed reload to version %d; check it and "
                              "POST %s/resume once it serves consistent weights", self.base_url,
                              event.policy_version, self.base_url)  # fmt: skip
                raise
            if call.path.startswith("/pause"):
                waited = time.monotonic() - t0
        self._policy_version = event.policy_version
        return ApplyReport(wait_s=waited, apply_s=time.monotonic() - started - waited)

    def _send(self, call: VllmCall) -> None:
        data = None if call.body is None else json.dumps(call.body).encode()
        request = urllib.request.Request(self.base_url + call.path, data=data, method=call.method)
        if data is not None:
            request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                response.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:500]
            raise WeightsRejected("vllm_error", f"{call.method} {call.path} returned {exc.code}: {detail}") from exc
        except (urllib.error.URLError, OSError) as exc:
            raise WeightsRejected(
                "vllm_unreachable", f"{call.method} {self.base_url}{call.path} failed: {exc}"
            ) from exc
