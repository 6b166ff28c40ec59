"""The REAL Claude Code runs a multi-call rollout through the real proxy into a real engine (the CPU engine, then real
vLLM on CPU), both with prefix caching at their defaults: its second main call is ≥ 95 % cached.

A random policy gets a second main call that extends the first one's history through Claude Code's own
output-token-limit recovery (the rollout is registered with ``max_tokens=8``; Claude Code re-sends the history plus
its cut answer up to 3 times, then exits 1). Asserted: ≥ 2 MAIN calls; call 2's cached fraction ≥ 0.95; Claude
Code's own session transcript reports the same cached and prompt counts; exit 0, or 1 for exactly that reason.
How and why, in full: docs/harnesses.md#claude-codes-output-limit-recovery-the-prefix-cache-test.

Across rollouts: two Claude Code rollouts of one task, one after the other, each in its own isolated local sandbox
(bubblewrap: the same workspace and HOME paths inside), into one CPU engine: the second rollout's first call is
≥ 90 % cached (its system prompt names cwd and HOME early, so with per-rollout paths it was 0–2.5 %).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import time
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from consumers.inference import vllm_server
from producers.harnesses.base import LaunchContext, launch_spec
from producers.harnesses.catalog import ADAPTERS
from producers.harnesses.install import HarnessInstallError, install_harness
from producers.sandbox.local_backend import LocalBackend, default_path
from producers.sandbox.settings import SandboxSettings
from producers.tasks.cpu import cpu_suite
from schemas.events import CallEvent, CallKind
from tests.support import proxy_helpers as H
from tests.support import sandbox_helpers as S
from tests.support.inference import Worker
from tests.support.proxy_server import admin_url, consume_calls, register, running_proxy

pytestmark = pytest.mark.integration

ROLLOUT_MAX_TOKENS = 8  # the proxy caps every call here: the answer stops with stop_reason "max_tokens"
MIN_CACHED = 0.95
PROMPT = "Say hello."
RESUME_PROMPT = "Continue."
LIMIT_MESSAGE = "output token maximum"  # Claude Code's result text once its max_tokens recovery gave up


# ---- the harness ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def claude_exe() -> str:
    if shutil.which("npm") is None:
        pytest.skip("claude-code: npm is not on PATH, cannot install the real harness")
    try:
        return str(install_harness("claude-code"))
    except HarnessInstallError as exc:
        pytest.skip(f"claude-code: install failed: {exc}")


@dataclass
class Run:
    returncode: int
    result: dict[str, Any]  # the --output-format json result object
    stderr: str
    seconds: float


async def run_claude(
    exe: str, base_url: str, secret: str, box: Path, prompt: str, timeout_s: float, extra: tuple[str, ...] = ()
) -> Run:
    """One ``claude -p`` run as the claude-code adapter launches it, in a scrubbed environment (like the local
    sandbox's: PATH, HOME, TMPDIR, LANG, USER + the adapter's variables), stdin closed, its own process group."""
    home, workspace, tmp = box / "home", box / "workspace", box / "tmp"
    for d in (home, workspace, tmp):
        d.mkdir(parents=True, exist_ok=True)
    ctx = LaunchContext(
        base_url=base_url,
        secret=secret,
        workspace=str(workspace),
        home=str(home),
        prompt=prompt,
        timeout_s=timeout_s,
        exe=exe,
    )
    spec = launch_spec(ADAPTERS["claude-code"], ctx)
    env = {
        "PATH": default_path(),
        "HOME": str(home),
        "TMPDIR": str(tmp),
        "LANG": "C.UTF-8",
        "USER": "sandbox",
        **spec.env,
    }
    t0 = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        *spec.argv,
        *extra,
        cwd=str(workspace),
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        raise AssertionError(f"claude -p did not finish within {timeout_s:.0f} s") from None
    finally:
        if proc.returncode is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = out.decode(errors="replace").strip()
    try:
        result = json.loads(text.splitlines()[-1]) if text else {}
    except ValueError:
        result = {}
    assert result.get("type") == "result", f"no JSON result (exit {proc.returncode}): {text[-2000:]}\n{err[-2000:]!r}"
    return Run(proc.returncode, result, err.decode(errors="replace"), time.monotonic() - t0)


def transcript_usage(home: Path, session_id: str) -> list[dict[str, Any]]:
    """``usage`` of every model answer Claude Code stored in its session transcript, in order (its own API-error
    messages, which it makes up without a call, left out). Claude Code stores an answer one content block per entry,
    each with the answer's message id and usage (a random policy's ``</think>`` makes a thinking block and a text
    block: two entries, one call), so entries are taken once per message id."""
    (path,) = (home / ".claude" / "projects").glob(f"*/{session_id}.jsonl")
    usages: dict[str, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        entry = json.loads(line)
        if entry.get("type") == "assistant" and not entry.get("isApiErrorMessage"):
            message = entry["message"]
            first = usages.setdefault(message["id"], message["usage"])
            assert first == message["usage"], ("one answer's entries disagree on its usage", first, message["usage"])
    return list(usages.values())


# ---- one rollout ----------------------------------------------------------------------------------------------------
@dataclass
class Outcome:
    runs: list[Run]
    calls: list[CallEvent]  # every call event of the rollout, in seq order
    usages: list[dict[str, Any]]  # Claude Code's stored usage per answer, in order
    status: dict[str, Any]  # the proxy's rollout status at the seal

    @property
    def main(self) -> list[CallEvent]:
        return [c for c in self.calls if c.call_kind == CallKind.MAIN]


async def rollout(kafka, engine_url: str, exe: str, box: Path, harness_timeout_s: float) -> Outcome:
    rid = f"cc-cache-{uuid.uuid4().hex[:10]}"
    async with running_proxy(kafka, engine_url, keepalive_s=2.0) as (_proxy, url), aiohttp.ClientSession() as http:
        reg = await register(http, url, rollout_id=rid, max_tokens=ROLLOUT_MAX_TOKENS)
        runs = [await run_claude(exe, reg["base_url"], reg["secret"], box, PROMPT, harness_timeout_s)]
        session = runs[0].result["session_id"]
        status = await _status(http, url, rid)
        if status["calls_served"] == 1 and runs[0].returncode == 0:
            # The policy ended its first turn (<|im_end|> sampled), so no recovery call: continue the session.
            runs.append(
                await run_claude(
                    exe, reg["base_url"], reg["secret"], box, RESUME_PROMPT, harness_timeout_s, ("--resume", session)
                )
            )
        seal_url = f"{admin_url(url)}/admin/rollouts/{rid}/seal"
        async with http.post(seal_url, headers={"Authorization": "Bearer admin"}) as r:
            assert r.status == 200, await r.text()
            status = await r.json()
    calls = await asyncio.to_thread(consume_calls, kafka, {rid}, status["calls_served"], 60.0)
    return Outcome(runs, calls, transcript_usage(box / "home", session), status)


async def _status(http: aiohttp.ClientSession, url: str, rid: str) -> dict[str, Any]:
    async with http.get(f"{admin_url(url)}/admin/rollouts/{rid}", headers={"Authorization": "Bearer admin"}) as r:
        assert r.status == 200, await r.text()
        return await r.json()


def check(outcome: Outcome, engine: str) -> None:
    calls, main = outcome.calls, outcome.main
    print(
        f"\n[{engine}] Claude Code runs: "
        + "; ".join(
            f"exit {r.returncode} in {r.seconds:.1f} s, is_error={r.result.get('is_error')}, "
            f"result={str(r.result.get('result'))[:90]!r}"
            for r in outcome.runs
        )
    )
    for c in calls:
        frac = (c.cached_prompt_tokens or 0) / c.prompt_len
        print(
            f"[{engine}] call {c.seq} {c.call_kind.value}: prompt {c.prompt_len} tokens, cached "
            f"{c.cached_prompt_tokens} ({frac:.2%}), new {len(c.new_tokens)}, generated {len(c.generated_tokens)} "
            f"({c.finish_reason}), engine {c.engine_ms / 1000:.2f} s, total {c.total_ms / 1000:.2f} s"
        )

    # The rollout: every call served and recorded, at least two main calls, the second extends the first.
    assert outcome.status["status"] == "ok" and outcome.status["errors"] == {}, outcome.status
    assert len(calls) == outcome.status["calls_served"], (len(calls), outcome.status)
    assert len(main) >= 2, f"only {len(main)} main call(s): {[(c.seq, c.call_kind) for c in calls]}"
    first, second = main[0], main[1]
    extends = second.parent_call_id == first.call_id and second.shared_prefix_len >= first.prompt_len
    assert extends, ("call 2 does not extend call 1", second.parent_call_id, second.shared_prefix_len, first.prompt_len)

    # The engine's prefix cache: call 2 re-uses (nearly) all of call 1.
    assert second.cached_prompt_tokens is not None, "the engine reported no cached tokens"
    fraction = second.cached_prompt_tokens / second.prompt_len
    assert fraction >= MIN_CACHED, f"call 2: {second.cached_prompt_tokens}/{second.prompt_len} cached ({fraction:.2%})"

    # Claude Code received the cached counts, per call (its transcript) and summed (its JSON result).
    assert len(outcome.usages) == len(calls), (len(outcome.usages), len(calls))
    for c, usage in zip(calls, outcome.usages, strict=True):
        assert usage["cache_read_input_tokens"] == c.cached_prompt_tokens, (c.seq, usage, c.cached_prompt_tokens)
        assert usage["input_tokens"] + usage["cache_read_input_tokens"] == c.prompt_len, (c.seq, usage)
        assert usage["output_tokens"] == len(c.generated_tokens), (c.seq, usage)
    total_read = sum(r.result["usage"]["cache_read_input_tokens"] for r in outcome.runs)
    assert total_read == sum(c.cached_prompt_tokens or 0 for c in calls), (total_read, [r.result for r in outcome.runs])

    # The harness: exit 0, or 1 because its max_tokens recovery gave up (see the module docstring); nothing else.
    for r in outcome.runs:
        assert r.result.get("api_error_status") is None, r.result
        if r.returncode != 0:
            gave_up = r.returncode == 1 and r.result["is_error"] and LIMIT_MESSAGE in r.result["result"]
            assert gave_up, (r.returncode, r.result, r.stderr[-2000:])
        else:
            assert not r.result["is_error"], r.result


# ---- the two engines ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir() -> Path:
    return H.tiny_model_dir()  # the proxy renders with this model's tokenizer too


@pytest.fixture
def cpu_engine(model_dir: Path) -> Iterator[str]:
    worker = Worker(["--model", str(model_dir), "--no-weights"])  # default settings: prefix cache on, 2 GiB
    try:
        yield worker.url or ""
    finally:
        worker.stop()


@pytest.fixture
def vllm_engine(model_dir: Path, tmp_path: Path) -> Iterator[str]:
    if not vllm_server.is_installed():
        reason = (
            f"vLLM is not installed in {vllm_server.venv_dir()}: run `make vllm` (or `clawstream vllm "
            "install`) to run Claude Code through the proxy into a real vLLM"
        )
        warnings.warn(reason, pytest.PytestWarning, stacklevel=1)  # the warnings summary prints it without -rs
        pytest.skip(reason)
    # Claude Code's prompt is ~37k tokens with this tokenizer; 64k leaves room. KV: 4 KiB a token, 64k = 256 MiB.
    server = vllm_server.serve(
        model_dir,
        0,
        max_model_len=65536,
        kv_cache_gib=1,
        log_path=tmp_path / "vllm.log",
        startup_timeout_s=900,
        progress=print,
    )
    try:
        yield server.url
    finally:
        server.stop()


@pytest.mark.timeout(1200)
@pytest.mark.long  # `make test` checks Claude Code's prompt in this engine's cache across rollouts, below
async def test_claude_code_second_call_cached_cpu_engine(kafka_settings, cpu_engine, claude_exe, tmp_path) -> None:
    outcome = await rollout(kafka_settings, cpu_engine, claude_exe, tmp_path / "box", harness_timeout_s=900)
    check(outcome, "cpu")


@pytest.mark.timeout(2700)
@pytest.mark.provisioned("vllm")
# Claude Code's first 37k-token prefill takes vLLM-CPU ~5 min on 2 cores (7-8 min with the server's start): `make
# test` checks its prompt in the CPU engine's cache across rollouts here, and vLLM's prefix cache in test_vllm_real.py
@pytest.mark.long
async def test_claude_code_second_call_cached_vllm(kafka_settings, vllm_engine, claude_exe, tmp_path) -> None:
    outcome = await rollout(kafka_settings, vllm_engine, claude_exe, tmp_path / "box", harness_timeout_s=1500)
    check(outcome, "vllm")


# ---- across rollouts: isolated local sandboxes share their paths, so the engine's prefix cache hits ----------------
MIN_CACHED_ACROSS = 0.90


async def sandboxed_rollout(
    kafka, http: aiohttp.ClientSession, url: str, backend: LocalBackend, exe: str
) -> list[CallEvent]:
    """One Claude Code rollout in a fresh isolated local sandbox, as the sandbox worker launches it; its call events."""
    task = cpu_suite().split("train")[2]
    rid = f"cc-across-{uuid.uuid4().hex[:10]}"
    reg = await register(http, url, rollout_id=rid, max_tokens=ROLLOUT_MAX_TOKENS)
    box = await backend.create(rid, task)
    try:
        ctx = LaunchContext(
            base_url=box.proxy_base_url(reg["base_url"]),
            secret=reg["secret"],
            workspace=box.workspace,
            home=box.home,
            prompt=task.prompt,
            timeout_s=900,
            python=box.python,
            exe=exe,
            clawstream_root=box.clawstream_root,
            contained=box.contained,
        )
        spec = launch_spec(ADAPTERS["claude-code"], ctx)
        for path, content in spec.files.items():
            box.write_text(path, content)
        result = await box.run(spec.argv, spec.env, box.workspace, 900)
    finally:
        report = await box.destroy()
    assert report.clean, report
    assert not result.timed_out, result
    seal_url = f"{admin_url(url)}/admin/rollouts/{rid}/seal"
    async with http.post(seal_url, headers={"Authorization": "Bearer admin"}) as r:
        assert r.status == 200, await r.text()
        status = await r.json()
    assert status["calls_served"] >= 1, (status, result.stdout[-1500:], result.stderr[-1500:])
    return await asyncio.to_thread(consume_calls, kafka, {rid}, status["calls_served"], 60.0)


@pytest.mark.timeout(1800)
async def test_claude_code_second_rollout_cached_isolated_local(
    kafka_settings, cpu_engine, claude_exe, tmp_path
) -> None:
    S.require_bwrap()
    backend = LocalBackend(SandboxSettings(root=tmp_path / "sbx", isolation="bwrap"))
    async with (
        running_proxy(kafka_settings, cpu_engine, keepalive_s=2.0) as (_proxy, url),
        aiohttp.ClientSession() as http,
    ):
        first = await sandboxed_rollout(kafka_settings, http, url, backend, claude_exe)
        second = await sandboxed_rollout(kafka_settings, http, url, backend, claude_exe)
    for n, calls in ((1, first), (2, second)):
        for c in sorted(calls, key=lambda c: c.seq):
            print(
                f"\n[across rollouts] rollout {n} call {c.seq} {c.call_kind.value}: prompt {c.prompt_len}, cached "
                f"{c.cached_prompt_tokens} ({(c.cached_prompt_tokens or 0) / c.prompt_len:.2%})"
            )
    b = min(second, key=lambda c: c.seq)  # the second rollout's very first call, whatever its kind
    fraction = (b.cached_prompt_tokens or 0) / b.prompt_len
    assert b.cached_prompt_tokens is not None, "the engine reported no cached tokens"
    assert fraction >= MIN_CACHED_ACROSS, f"rollout 2's first call: {b.cached_prompt_tokens}/{b.prompt_len} cached"
