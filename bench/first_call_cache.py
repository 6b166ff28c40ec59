"""Does the first call of a harness's rollout find the shared system prompt and tools in the prefix cache? (#32 item 3)

Per installed real harness (opencode, codex, qwen-code, claude-code, openclaw, gemini-cli, cline, mini-swe-agent;
installed by the project's installer into ``$CLAWSTREAM_HOME/harnesses``, a failed install is skipped and reported), R
rollouts run one after another over two built-in CPU tasks (A, B, A, B, ...), each launched as the sandbox worker
launches it, in its own bubblewrap sandbox (the same workspace and HOME paths inside), through the real serving proxy
and the REAL CPU inference engine (tiny model, prefix cache at its defaults), the rollout registered with a small
``max_tokens`` so it ends fast. All is read back from the calls topic: ``prompt_len`` and ``cached_prompt_tokens`` (the
engine's ``usage.prompt_tokens_details.cached_tokens``) per call, the prompts rebuilt from the delta encoding. Reported
per harness: the first main call's prompt and cached tokens for rollout 1 (cold) and rollouts 2..R split by whether an
earlier rollout ran the same task, the longest common prefix with an earlier first prompt (what a cache could hold), the
later calls' cached fraction, and a diff of two first prompts' decoded text (where they differ).

Run: ``HF_HUB_OFFLINE=1 .venv/bin/python -m bench.first_call_cache [--harnesses opencode codex] [--rollouts 4]``;
writes ``bench/results/first_call_cache.md`` (after every harness). The default run took over 10 minutes on 2
shared cores (each harness's cold first call is a 13-37k-token prefill); ``--harnesses`` splits it. One local
Kafka broker (``LocalKafka`` in a temp home, or ``CLAWSTREAM_KAFKA_BOOTSTRAP_SERVERS``).
"""

from __future__ import annotations

import argparse
import asyncio
import difflib
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from clawbase.kafka.clients import create_topics
from clawbase.settings import KafkaSettings
from producers.harnesses.base import LaunchContext, launch_spec
from producers.harnesses.catalog import ADAPTERS
from producers.harnesses.install import HARNESSES, HarnessInstallError, harness_root, install_harness, installed_spec
from producers.sandbox.base import SandboxError
from producers.sandbox.local_backend import LocalBackend
from producers.sandbox.settings import SandboxSettings
from producers.sandbox.worker import exe_resolver
from producers.tasks.cpu import cpu_suite
from schemas.events import CallEvent, CallKind
from schemas.topics import CATALOG
from streams.trajectory import tree_calls
from streams.tree import rebuild_prompts
from tests.support import proxy_helpers as H
from tests.support import sandbox_helpers as S
from tests.support.inference import Worker
from tests.support.proxy_server import consume_calls, register, running_proxy, seal

OUT = Path(__file__).resolve().parent / "results" / "first_call_cache.md"
ORDER = ["opencode", "codex", "qwen-code", "claude-code", "openclaw", "gemini-cli", "cline", "mini-swe-agent"]
TASKS = ("train-000-write", "train-002-copy")  # two templates: the same system prompt and tools, a different request


@dataclass
class Rollout:
    n: int
    task: str
    seconds: float
    state: str
    calls: list[CallEvent]
    prompts: dict[str, list[int]]  # call_id → full prompt tokens
    same_task: bool = False  # an earlier rollout of this harness ran the same task
    lcp: int = 0  # longest common prefix of the first main prompt with an earlier rollout's first main prompt

    @property
    def first(self) -> CallEvent | None:
        main = [c for c in self.calls if c.call_kind == CallKind.MAIN]
        return main[0] if main else (self.calls[0] if self.calls else None)

    @property
    def first_prompt(self) -> list[int]:
        return self.prompts[self.first.call_id] if self.first else []


@dataclass
class HarnessResult:
    name: str
    version: str = ""
    skipped: str = ""
    rollouts: list[Rollout] = field(default_factory=list)


def version_of(name: str) -> str:
    pkg = HARNESSES[name].package
    if HARNESSES[name].kind == "pip":  # a venv: the spec its install marker records (package==version)
        return (installed_spec(HARNESSES[name], harness_root()) or "?").rpartition("==")[2]
    try:
        return json.loads((harness_root() / name / "node_modules" / pkg / "package.json").read_text())["version"]
    except (OSError, ValueError, KeyError):
        return "?"


def lcp(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


async def one_rollout(kafka, http, url: str, backend: LocalBackend, harness: str, exe: tuple[str, str], n: int, args):
    """One rollout in a fresh isolated sandbox, launched as the sandbox worker launches it (``producers.sandbox.
    rollout``), driven here so that its time limit is ours, not the CPU suite's 60 s (too short on shared cores)."""
    task = next(t for t in cpu_suite().split("train") if t.task_id == TASKS[(n - 1) % len(TASKS)])
    rid = f"fcc-{harness}-{n}-{uuid.uuid4().hex[:8]}"
    reg = await register(http, url, rollout_id=rid, max_tokens=args.max_tokens)
    t0 = time.monotonic()
    box = await backend.create(rid, task)
    try:
        ctx = LaunchContext(
            base_url=box.proxy_base_url(reg["base_url"]),
            secret=reg["secret"],
            workspace=box.workspace,
            home=box.home,
            prompt=task.prompt.replace(task.mount_dir, box.workspace),
            timeout_s=args.timeout,
            python=box.python,
            exe=exe[0],
            clawstream_root=box.clawstream_root,
            contained=box.contained,
        )
        spec = launch_spec(ADAPTERS[harness], ctx)
        for path, content in spec.files.items():
            box.write_text(path, content)
        result = await box.run(spec.argv, spec.env, box.workspace, args.timeout, extra_path=exe[1])
    finally:
        await box.destroy()  # kills whatever the harness left running in the sandbox
    seconds = time.monotonic() - t0
    status = await seal(http, url, rid)
    served = int(status.get("calls_served", 0))
    calls = await asyncio.to_thread(consume_calls, kafka, {rid}, served, 60.0) if served else []
    state = "timed out" if result.timed_out else f"exit {result.exit_code}"
    return Rollout(n, task.task_id, seconds, state, calls, rebuild_prompts(tree_calls(calls)) if calls else {})


async def run_harness(kafka: KafkaSettings, url: str, name: str, args, tmp: Path) -> HarnessResult:
    res = HarnessResult(name)
    settings = SandboxSettings(root=tmp / f"sbx-{name}", isolation="bwrap")
    try:
        await asyncio.to_thread(install_harness, name)
        exe = await exe_resolver(settings)(ADAPTERS[name])  # the worker's own resolution (OpenClaw: Node 24 too)
    except (HarnessInstallError, SandboxError) as exc:
        res.skipped = f"install failed: {exc}"
        return res
    res.version = version_of(name)
    backend = LocalBackend(settings)
    async with aiohttp.ClientSession() as http:
        for i in range(args.rollouts):
            r = await one_rollout(kafka, http, url, backend, name, exe, i + 1, args)
            earlier = res.rollouts
            r.same_task = any(e.task == r.task for e in earlier)
            r.lcp = max((lcp(r.first_prompt, e.first_prompt) for e in earlier), default=0)
            res.rollouts.append(r)
            f = r.first
            print(
                f"{name} rollout {r.n} ({r.task}): {r.state}, {len(r.calls)} calls, {r.seconds:.1f} s; first main "
                + (f"call {f.cached_prompt_tokens}/{f.prompt_len} cached, lcp {r.lcp}" if f else "call: none"),
                flush=True,
            )
    return res


def frac(c: CallEvent) -> float:
    return (c.cached_prompt_tokens or 0) / c.prompt_len if c.prompt_len else 0.0


def stats(rs: list[Rollout]) -> str:
    xs = [frac(r.first) for r in rs if r.first]
    if not xs:
        return "–"
    return f"{statistics.mean(xs):.1%} (min {min(xs):.1%}, n={len(xs)})"


def prompt_diff(tok, a: list[int], b: list[int], limit: int = 24) -> list[str]:
    """The changed lines between two prompts' decoded text (difflib), each cut to 150 characters."""
    lines = difflib.unified_diff(
        tok.decode(a).splitlines(), tok.decode(b).splitlines(), "rollout-a", "rollout-b", n=0, lineterm=""
    )
    out = [ln[:150] for ln in lines if not ln.startswith(("---", "+++"))]
    return out[:limit] + ([f"... {len(out) - limit} more lines"] if len(out) > limit else [])


def report(results: list[HarnessResult], args, wall: float) -> str:
    tok = H.tiny_tokenizer()
    lines = [
        "# First call of every rollout: the prefix cache across rollouts (`bench/first_call_cache.py`)",
        "",
        f"Machine: {platform.platform()}, {os.cpu_count()} CPUs **shared with other agents running tests** (2 cores), "
        f"Python {platform.python_version()}; {time.strftime('%Y-%m-%d', time.gmtime())}; wall {wall / 60:.1f} min.",
        f"Per harness {args.rollouts} rollouts one after another, tasks {' / '.join(TASKS)} alternating "
        "(`builtin:cpu`), each launched as the sandbox worker launches it in its own bubblewrap sandbox (the same "
        "workspace and HOME paths inside every sandbox; ungraded), through the real serving proxy and the real CPU "
        "inference engine (the tiny model, "
        "random weights, prefix cache at its defaults: 2 GiB, 32-token blocks; one engine for all harnesses, whose "
        f"prompts share nothing but the chat template's first tokens), registered with `max_tokens={args.max_tokens}`. "
        "Numbers are read back from the calls topic: each call event's `prompt_len` and `cached_prompt_tokens` (the "
        "engine's `usage.prompt_tokens_details.cached_tokens`); prompts rebuilt from the delta encoding and decoded "
        "with the tiny tokenizer.",
        "",
        "*First call* = the rollout's first `main` call (the one carrying the harness's system prompt and tools; a "
        "`side` call such as opencode's title may come before it). *Same task*: an earlier rollout of this harness ran "
        "the same task; *different task*: only the other task ran before. *LCP* = the longest common prefix (tokens) "
        "of the first prompt with an earlier rollout's first prompt: the most a cache can hold (the engine caches "
        "whole 32-token blocks and always computes the last prompt token). *Later calls* = every other call of "
        "rollouts 1..R, cached ÷ prompt tokens pooled.",
        "",
        "| harness (npm version) | first prompt tokens | rollout 1 (cold) cached | rollouts 2..R, same task: "
        "cached mean (min) | rollouts 2..R, different task: cached mean (min) | LCP ÷ prompt, 2..R min | later "
        "calls cached | calls / rollout | s / rollout |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for res in results:
        if res.skipped:
            lines.append(f"| {res.name} | skipped: {res.skipped[:200]} | | | | | | | |")
            continue
        rs = [r for r in res.rollouts if r.first]
        if not rs:
            lines.append(f"| {res.name} {res.version} | no call served | | | | | | | |")
            continue
        first, rest = rs[0], rs[1:]
        later = [c for r in rs for c in r.calls if r.first and c.call_id != r.first.call_id]
        later_p = sum(c.prompt_len for c in later)
        later_c = sum(c.cached_prompt_tokens or 0 for c in later)
        lcps = [r.lcp / len(r.first_prompt) for r in rest if r.first_prompt]
        f1 = first.first
        assert f1 is not None
        cells = [
            f"{res.name} {res.version}",
            f"{statistics.mean(r.first.prompt_len for r in rs if r.first):,.0f}",
            f"{f1.cached_prompt_tokens} ({frac(f1):.1%})",
            stats([r for r in rest if r.same_task]),
            stats([r for r in rest if not r.same_task]),
            f"{min(lcps):.1%}" if lcps else "–",
            f"{later_c / later_p:.1%} ({len(later)} calls)" if later_p else "–",
            f"{statistics.mean(len(r.calls) for r in res.rollouts):.1f}",
            f"{statistics.mean(r.seconds for r in res.rollouts):.1f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## Per rollout", ""]
    for res in results:
        for r in res.rollouts:
            f = r.first
            desc = f"{f.cached_prompt_tokens}/{f.prompt_len} ({frac(f):.1%}), seq {f.seq}" if f else "no call"
            kinds = ",".join(c.call_kind.value for c in r.calls)
            lines.append(
                f"- {res.name} #{r.n} `{r.task}` ({'same' if r.same_task else 'new'} task): {r.state}, "
                f"{r.seconds:.1f} s, calls [{kinds}]; first main call cached {desc}; LCP with earlier {r.lcp}"
            )
    lines += ["", "## Where two first prompts differ (decoded, `difflib` of lines)", ""]
    for res in results:
        rs = [r for r in res.rollouts if r.first]
        if len(rs) < 2:
            continue
        same = next((r for r in rs[1:] if r.same_task), None)
        pairs = [("different task", rs[0], rs[1])] + ([("same task", rs[0], same)] if same else [])
        for label, a, b in pairs:
            diff = prompt_diff(tok, a.first_prompt, b.first_prompt)
            lines += [f"**{res.name}**, rollout {a.n} vs {b.n} ({label}): {len(diff)} changed lines", "", "```"]
            lines += diff or ["(identical)"]
            lines += ["```", ""]
    return "\n".join(lines) + "\n"


async def main_async(args) -> list[HarnessResult]:
    S.require_bwrap()
    tmp = Path(tempfile.mkdtemp(prefix="bench-fcc-"))
    t0 = time.monotonic()
    bootstrap = os.environ.get("CLAWSTREAM_KAFKA_BOOTSTRAP_SERVERS")
    broker = engine = None
    try:
        if not bootstrap:
            from clawstream.local_kafka import LocalKafka

            broker = LocalKafka(home=tmp / "kafka")
            bootstrap = (await asyncio.to_thread(broker.up, timeout=120, quiet=True)).bootstrap
        kafka = KafkaSettings(bootstrap_servers=bootstrap, topic_prefix=f"fcc-{time.time_ns()}.")
        create_topics(kafka, CATALOG)
        # Default engine settings: prefix cache on (2 GiB); the proxy renders with the same tiny model's tokenizer.
        engine = await asyncio.to_thread(Worker, ["--model", str(H.tiny_model_dir()), "--no-weights"])
        results = []
        async with running_proxy(kafka, engine.url or "", keepalive_s=2.0) as (_proxy, url):
            for name in args.harnesses:
                results.append(await run_harness(kafka, url, name, args, tmp))
                # Written after every harness: a run cut short still leaves what it measured.
                args.out.write_text(report(results, args, time.monotonic() - t0))
                print(f"wrote {args.out} ({name} done)", flush=True)
        return results
    finally:
        if engine is not None:
            engine.stop()  # terminates its process by its Popen handle, then kills it after 30 s
        if broker is not None:
            broker.down()
        shutil.rmtree(tmp, ignore_errors=True)  # the broker's data and any sandbox left behind


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--harnesses", nargs="+", default=ORDER, choices=ORDER)
    parser.add_argument("--rollouts", type=int, default=4, help="rollouts per harness (≥ 2)")
    parser.add_argument("--max-tokens", type=int, default=16, help="the rollouts' registered max_tokens")
    parser.add_argument("--timeout", type=float, default=480.0, help="per rollout, seconds")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    asyncio.run(main_async(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
