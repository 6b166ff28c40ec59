"""The rollout-shaped scenario of ``bench.engine``: one agent rollout's calls against a real engine server over HTTP.

Shapes (measured on real harness requests, issue #11): a first call of ~35k prompt tokens (Claude Code's system
prompt + tool schemas), then 20 calls that each extend the previous prompt by the previous answer and a tool result
(~150-800 new tokens per call), then one OpenClaw-style branch: a prompt that rewrites the history 138 tokens
before the end of the previous prompt. Every call is greedy with ``ignore_eos`` and a fixed ``max_tokens``, so
the same requests reach every engine (the answers, fed back as in a rollout, are each engine's own). A second
client measures the time to the first token of a 10-token request while a fresh 35k-token prefill runs.

Servers: the project's CPU engine (``python -m consumers.inference.server --no-weights``) with prefix caching on
or off, and the real vLLM CPU server (``consumers.inference.vllm_server``). Peak memory is the server process
tree's resident-set high-water mark (``VmHWM`` of each process, summed), read from /proc after the run.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FIRST_PROMPT = 35_000
CALLS = 20
BRANCH_BACK = 138


@dataclass
class Scenario:
    first: list[int]
    additions: list[list[int]]  # tool-result tokens appended after each answer, one per follow-up call
    branch: list[int]  # replaces the last BRANCH_BACK tokens of the final prompt
    short: list[int]  # the 10-token request
    fresh: list[int]  # a different 35k prompt, prefilled while the short request waits
    max_tokens: int


def scenario(
    vocab: int, *, seed: int = 0, first: int = FIRST_PROMPT, calls: int = CALLS, max_tokens: int = 32
) -> Scenario:
    """Token ids below ``vocab - 16`` (clear of the tokenizer's added tokens), all drawn from one seeded stream."""
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(0, vocab - 16) for _ in range(n)]

    additions = [ids(rng.randint(150, 800) - max_tokens) for _ in range(calls)]
    return Scenario(ids(first), additions, ids(300), ids(10), ids(first), max_tokens)


@dataclass
class Call:
    name: str
    prompt_tokens: int
    cached_tokens: int | None
    latency_s: float

    @property
    def prefilled(self) -> int | None:
        return None if self.cached_tokens is None else self.prompt_tokens - self.cached_tokens


@dataclass
class EngineRun:
    engine: str
    calls: list[Call] = field(default_factory=list)
    short_ttft_s: float | None = None
    fresh_prefill_s: float | None = None
    peak_rss_mb: float | None = None
    startup_s: float | None = None
    error: str | None = None


def complete(url: str, prompt: list[int], max_tokens: int, timeout_s: float = 3600) -> tuple[list[int], int | None]:
    """One greedy /v1/completions call with a token-id prompt; returns (generated ids, cached prompt tokens)."""
    body = {
        "model": "policy",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    request = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        answer = json.load(response)
    details = (answer.get("usage") or {}).get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens")
    return list(answer["choices"][0]["token_ids"]), cached if cached is not None else (0 if details == {} else None)


def run_rollouts(
    urls: dict[str, str], s: Scenario, calls: dict[str, int], pids: dict[str, int], say: Any = print
) -> dict[str, list[Call]]:
    """Per engine: call 1, then ``calls[engine]`` follow-ups (each the previous prompt + its answer + a tool result),
    then the branch. Interleaved — call k goes to every engine before call k+1 goes to any — so a load spike on
    this shared machine hits all engines alike; after each call the next waits until that engine is quiet."""
    prompts = {e: list(s.first) for e in urls}
    out: dict[str, list[Call]] = {e: [] for e in urls}
    for k in range(max(calls.values()) + 1):
        for engine, url in urls.items():
            if k > calls[engine]:
                continue
            prompt = prompts[engine]
            t0 = time.perf_counter()
            answer, cached = complete(url, prompt, s.max_tokens)
            out[engine].append(Call(f"call {k + 1}", len(prompt), cached, time.perf_counter() - t0))
            wait_quiet(pids[engine])
            say(
                f"    {engine} call {k + 1}: {len(prompt)} prompt tokens, cached {cached}, "
                f"{out[engine][-1].latency_s:.2f} s"
            )
            if k < calls[engine]:
                prompts[engine] = prompt + answer + s.additions[k]
    for engine, url in urls.items():
        prompt = prompts[engine]
        branched = prompt[: len(prompt) - BRANCH_BACK] + s.branch
        t0 = time.perf_counter()
        _, cached = complete(url, branched, s.max_tokens)
        out[engine].append(Call("branch", len(branched), cached, time.perf_counter() - t0))
        wait_quiet(pids[engine])
        say(f"    {engine} branch: {len(branched)} prompt tokens, cached {cached}, {out[engine][-1].latency_s:.2f} s")
    return out


def short_during_prefill(url: str, s: Scenario) -> tuple[float, float]:
    """Start the fresh 35k prefill, then (once it is surely running) time a 10-token, 1-answer-token request."""
    long_done: list[float] = []

    def long_call() -> None:
        t0 = time.perf_counter()
        complete(url, s.fresh, 1)
        long_done.append(time.perf_counter() - t0)

    thread = threading.Thread(target=long_call)
    thread.start()
    wait_running(url)  # the long request is admitted and prefilling (it takes tens of seconds)
    t0 = time.perf_counter()
    complete(url, s.short, 1)
    ttft = time.perf_counter() - t0
    thread.join()
    return ttft, long_done[0]


RUNNING = ("clawstream_engine_requests_running", "vllm:num_requests_running")


def wait_running(url: str, timeout_s: float = 120) -> None:
    """Until the server's /metrics shows a running request (both engines export one such gauge)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
            for line in response.read().decode().splitlines():
                if line.startswith(RUNNING) and float(line.rsplit(" ", 1)[1]) > 0:
                    return
        time.sleep(0.05)
    raise RuntimeError(f"no request running at {url} after {timeout_s} s")


def tree_pids(pid: int) -> list[int]:
    """The process and its descendants."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        try:
            todo.extend(int(c) for c in Path(f"/proc/{p}/task/{p}/children").read_text().split())
        except OSError:
            continue
    return found


def tree_peak_rss_mb(pid: int) -> float:
    """Sum of VmHWM over the process and its descendants (kB in /proc → MB)."""
    total = 0
    for p in tree_pids(pid):
        try:
            status = Path(f"/proc/{p}/status").read_text()
            total += int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM")))
        except (OSError, StopIteration):
            continue
    return total / 1024


def _cpu_ticks(pids: list[int]) -> int:
    total = 0
    for p in pids:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime + stime
        except (OSError, IndexError):
            continue
    return total


def wait_quiet(pid: int, timeout_s: float = 15.0) -> float:
    """Until the server's process tree uses < 10 % of a core over 0.2 s (vLLM's engine busy-polls a core for ~1 s
    after each request; the next engine's call must not share the machine with that). Returns the seconds waited."""
    pids = tree_pids(pid)
    t0 = time.monotonic()
    last = _cpu_ticks(pids)
    while time.monotonic() - t0 < timeout_s:
        time.sleep(0.2)
        now = _cpu_ticks(pids)
        if now - last <= 2:  # ticks are 1/100 s: ≤ 0.02 s of CPU in 0.2 s
            break
        last = now
    return time.monotonic() - t0


def start_cpu_engine(
    model_dir: Path, port: int, prefix_cache_gib: float, max_model_len: int, log: Path
) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable,
        "-m",
        "consumers.inference.server",
        "--model",
        str(model_dir),
        "--port",
        str(port),
        "--no-weights",
        "--prefix-cache-gib",
        str(prefix_cache_gib),
        "--max-model-len",
        str(max_model_len),
        "--metrics-interval-s",
        "0",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with open(log, "wb") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"CPU engine exited with {process.returncode}: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2):
                return process
        except OSError:
            time.sleep(0.3)
    process.kill()
    raise RuntimeError("CPU engine did not start within 300 s")


ENGINES = ("cpu", "cpu-nocache", "vllm")


def measure(
    engines: list[str], model_dir: Path, s: Scenario, calls: dict[str, int], workdir: Path, say: Any = print
) -> list[EngineRun]:
    """Start every engine on ``model_dir``, run the rollout on all of them interleaved, then each one's
    short-during-prefill check alone; stop them. An engine that fails is reported, the others still run."""
    from consumers.inference.vllm_server import free_port, is_installed, serve

    runs = {engine: EngineRun(engine) for engine in engines}
    urls: dict[str, str] = {}
    pids: dict[str, int] = {}
    stops: list[Any] = []
    max_model_len = 1 << 16
    try:
        for engine in engines:
            t0 = time.perf_counter()
            try:
                if engine == "vllm":
                    if not is_installed():
                        raise RuntimeError("vLLM is not installed (`clawstream vllm install`)")
                    server = serve(model_dir, 0, max_model_len=max_model_len, kv_cache_gib=2.0, progress=say)
                    stops.append(server.stop)
                    urls[engine], pids[engine] = server.url, server.process.pid
                else:
                    port = free_port()
                    process = start_cpu_engine(
                        model_dir, port, 2.0 if engine == "cpu" else 0.0, max_model_len, workdir / f"{engine}.log"
                    )
                    stops.append(process.kill)
                    urls[engine], pids[engine] = f"http://127.0.0.1:{port}", process.pid
                runs[engine].startup_s = time.perf_counter() - t0
                say(f"  {engine}: ready after {runs[engine].startup_s:.0f} s")
            except Exception as exc:  # one engine failing must not lose the others' numbers
                runs[engine].error = f"{type(exc).__name__}: {exc}"
                say(f"  {engine} failed to start: {runs[engine].error}")
        for engine, got in run_rollouts(urls, s, {e: calls[e] for e in urls}, pids, say).items():
            runs[engine].calls = got
        for engine, url in urls.items():
            run = runs[engine]
            for other in pids.values():
                wait_quiet(other)
            run.short_ttft_s, run.fresh_prefill_s = short_during_prefill(url, s)
            say(
                f"    {engine}: 10-token request during a {len(s.fresh)}-token prefill: {run.short_ttft_s:.2f} s "
                f"(the prefill: {run.fresh_prefill_s:.1f} s)"
            )
            run.peak_rss_mb = tree_peak_rss_mb(pids[engine])
    finally:
        for stop in stops:
            stop()
    return [runs[e] for e in engines]


def _median(values: list[float]) -> float:
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def report(runs: list[EngineRun], s: Scenario) -> list[str]:
    """Markdown: per-engine summary, then the per-call table side by side."""
    lines = [
        "## Rollout-shaped scenario: prefix caching on, off, and real vLLM",
        "",
        f"One agent rollout as the real harnesses send it: call 1 has a {len(s.first):,}-token prompt, each of the "
        f"{len(s.additions)} follow-ups appends the previous answer ({s.max_tokens} tokens, greedy, eos ignored) "
        f"and a tool result (150-800 new tokens per call in all), then one OpenClaw-style branch rewrites the "
        f"history {BRANCH_BACK} tokens before the end. Same requests to every engine over HTTP (`/v1/completions`, "
        "token-id prompts). Prefilled = prompt tokens not served from the prefix cache (`usage.prompt_tokens_"
        "details.cached_tokens`). All engines run at once and the calls are interleaved (call k goes to every "
        "engine before call k+1, each once the previous engine is quiet again: vLLM busy-polls a core for ~1 s after "
        "each request), so load on this shared machine hits them alike. The cache-off engine runs only "
        "the first follow-ups (each re-reads the whole history). 'Short request': a 10-token prompt, 1 answer "
        "token, sent while another 35k-token prompt is being prefilled (each engine alone).",
        "",
        "| engine | start-up | call 1 | calls ≥ 2: median (max) | branch | prefilled ≥ 2 (median) | hit rate ≥ 2 "
        "| short request during a 35k prefill | peak RSS |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run in runs:
        if run.error and not run.calls:
            lines.append(f"| {run.engine} | not measured: {run.error} |||||||| ")
            continue
        follow = [c for c in run.calls[1:] if c.name != "branch"]
        branch = next((c for c in run.calls if c.name == "branch"), None)
        pre = [c.prefilled for c in follow if c.prefilled is not None]
        hits = sum(c.cached_tokens or 0 for c in follow) / max(1, sum(c.prompt_tokens for c in follow))
        lines.append(
            f"| {run.engine} | {run.startup_s or 0:.0f} s | {run.calls[0].latency_s:.2f} s | "
            f"{_median([c.latency_s for c in follow]):.2f} s ({max(c.latency_s for c in follow):.2f} s) | "
            f"{branch.latency_s if branch else float('nan'):.2f} s | {_median(pre) if pre else float('nan'):.0f} | "
            f"{hits:.1%} | {run.short_ttft_s if run.short_ttft_s is not None else float('nan'):.2f} s | "
            f"{run.peak_rss_mb or 0:.0f} MB |"
        )
    by = {r.engine: r for r in runs if r.calls}
    if "cpu" in by and "cpu-nocache" in by:
        n = len(by["cpu-nocache"].calls) - 2  # follow-ups both ran
        on = _median([c.latency_s for c in by["cpu"].calls[1 : 1 + n]])
        off = _median([c.latency_s for c in by["cpu-nocache"].calls[1 : 1 + n]])
        lines += [
            "",
            f"Calls 2..{n + 1}, same prompts: cache off {off:.2f} s, on {on:.2f} s: "
            f"**{off / on:.0f}× faster** with prefix caching.",
        ]
    if "cpu" in by and "vllm" in by:
        ours = _median([c.latency_s for c in by["cpu"].calls[1:] if c.name != "branch"])
        theirs = _median([c.latency_s for c in by["vllm"].calls[1:] if c.name != "branch"])
        lines += ["", f"Calls ≥ 2: CPU engine {ours:.2f} s, vLLM {theirs:.2f} s (vLLM / ours = {theirs / ours:.2f})."]
    lines += [
        "",
        "Per call (latency s / prefilled tokens):",
        "",
        "| call | prompt tokens | " + " | ".join(r.engine for r in runs if r.calls) + " |",
        "|---|---:|" + "---:|" * len([r for r in runs if r.calls]),
    ]
    longest = max((r for r in runs if r.calls), key=lambda r: len(r.calls), default=None)
    for i, call in enumerate(longest.calls if longest else []):
        cells = []
        for run in (r for r in runs if r.calls):
            match = (
                next((c for c in run.calls if c.name == call.name), None)
                if call.name == "branch"
                else (run.calls[i] if i < len(run.calls) and run.calls[i].name == call.name else None)
            )
            cells.append("—" if match is None else f"{match.latency_s:.2f} / {match.prefilled}")
        lines.append(f"| {call.name} | {call.prompt_tokens:,} | " + " | ".join(cells) + " |")
    return lines
