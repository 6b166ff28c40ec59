"""Router benchmark: replay recorded model calls through N simulated engines under each routing policy (#31).

Each engine has a bounded LRU block cache (``--cache-tokens`` per engine, 32-token blocks keyed by the chain of tokens
before them, as the CPU engine's) and serves its FIFO queue one call at a time: prefill ∝ uncached prompt tokens,
decode ∝ completion tokens. Closed loop: rollouts start ``--stagger-ms`` apart in recorded order; each call is issued
``--think-ms`` after the previous one of its rollout finished. For N = 2, 4, 8: ``affinity``, ``round_robin`` and
``least_loaded`` (``producers.proxy.router``), plus one engine holding the whole pool's cache (N × cache) as the
hit-rate baseline. Reported: hit rate (cached / prompt tokens), p50/p99 latency, the busiest engine's share of calls.

Traces: the committed ones under bench/data/ (default; what they are: bench/results/router.md), ``--trace FILE``
(JSON lines, ``.xz`` allowed, each a call with ``rollout_id``, ``timestamp_ms``, ``seq`` and either
``prompt_token_ids`` + ``completion_tokens`` or the calls topic's delta fields ``call_id``, ``parent_call_id``,
``shared_prefix_len``, ``new_tokens``, ``generated_tokens``), or a calls topic on a broker
(``--bootstrap HOST:PORT --prefix P``).

Run: ``.venv/bin/python -m bench.router`` (writes bench/results/router.md; ~1 min on 2 cores).
"""

from __future__ import annotations

import argparse
import heapq
import json
import lzma
import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from producers.proxy.router import POLICIES, BlockIndex, Router, block_keys
from streams.tree import TreeCall, TreeError, rebuild_prompts

DATA = Path(__file__).parent / "data"
TRACES = {
    "harness": DATA / "router_harness_calls.jsonl.xz",
    "agentloop": DATA / "router_agentloop_calls.jsonl.xz",
}
RESULTS = Path(__file__).parent / "results" / "router.md"
SKIPPED: list[str] = []  # rollouts whose prompts could not be rebuilt


@dataclass
class Call:
    prompt: list[int]
    completion: list[int]  # generated ids (or zeros of the recorded length): the engine caches prompt + completion


@dataclass
class Rollout:
    rollout_id: str
    first_ms: int
    calls: list[Call] = field(default_factory=list)


# ---- traces -------------------------------------------------------------------------------------------------------
def rollouts_from_records(records: Iterable[dict[str, Any]]) -> list[Rollout]:
    """Calls grouped by rollout, ordered by seq; prompts rebuilt from the delta encoding where needed."""
    by_rollout: dict[str, list[dict[str, Any]]] = {}
    for rec in records:
        by_rollout.setdefault(str(rec["rollout_id"]), []).append(rec)
    out = []
    for rid, recs in by_rollout.items():
        recs.sort(key=lambda r: r["seq"])
        if "prompt_token_ids" in recs[0]:
            calls = [Call(list(r["prompt_token_ids"]), [0] * int(r["completion_tokens"])) for r in recs]
        else:
            tree = [
                TreeCall(r["call_id"], r["seq"], r["parent_call_id"], r["shared_prefix_len"], r["new_tokens"],
                         r["generated_tokens"], [0.0] * len(r["generated_tokens"]), "main", 0)
                for r in recs
            ]  # fmt: skip
            try:
                prompts = rebuild_prompts(tree)
            except TreeError:  # a test's deliberately inconsistent calls (or a partial read): not replayable
                SKIPPED.append(rid)
                continue
            calls = [Call(prompts[r["call_id"]], list(r["generated_tokens"])) for r in recs]
        out.append(Rollout(rid, min(int(r["timestamp_ms"]) for r in recs), calls))
    return sorted(out, key=lambda r: (r.first_ms, r.rollout_id))


def read_jsonl(path: Path) -> list[Rollout]:
    opener = lzma.open if path.suffix == ".xz" else open
    with opener(path, "rt") as f:
        return rollouts_from_records(json.loads(line) for line in f if line.strip())


def read_topic(bootstrap: str, prefix: str) -> list[Rollout]:
    """A calls topic read to its end with the project's reader (a throw-away, never-committing consumer)."""
    from clawbase.settings import KafkaSettings
    from consumers.analytics.reader import open_reader, read_range, watermarks
    from schemas.events import CallEvent

    settings = KafkaSettings(bootstrap_servers=bootstrap, topic_prefix=prefix)
    consumer, ref = open_reader(settings, "calls")
    try:
        marks = watermarks(consumer, ref.name)
        starts, ends = {p: lo for p, (lo, _) in marks.items()}, {p: hi for p, (_, hi) in marks.items()}
        records = []
        for msg in read_range(consumer, ref.name, starts, ends):
            e = CallEvent.from_bytes(msg.value())
            records.append(
                {"rollout_id": e.rollout_id, "timestamp_ms": e.timestamp_ms, "seq": e.seq, "call_id": e.call_id,
                 "parent_call_id": e.parent_call_id, "shared_prefix_len": e.shared_prefix_len,
                 "new_tokens": e.new_tokens.tolist(), "generated_tokens": e.generated_tokens.tolist()}
            )  # fmt: skip
    finally:
        consumer.close()
    return rollouts_from_records(records)


# ---- the simulator ------------------------------------------------------------------------------------------------
@dataclass
class Params:
    block: int = 32
    cache_tokens: int = 131_072  # per engine
    prefill_ms_per_token: float = 0.1  # 10k prompt tokens/s
    decode_ms_per_token: float = 20.0
    think_ms: float = 1000.0  # the harness and its tools between two calls
    stagger_ms: float = 500.0
    imbalance: float = 0.5  # affinity's bound (producers.proxy.router.Router)
    slack: int = 2


@dataclass
class Result:
    hit_rate: float
    p50_ms: float
    p99_ms: float
    shares: list[float]


def simulate(rollouts: list[Rollout], n: int, policy: str, p: Params, cache_scale: int = 1) -> Result:
    names = [f"e{i}" for i in range(n)]
    capacity = p.cache_tokens * cache_scale // p.block
    router = Router(names, policy, p.block, capacity, imbalance=p.imbalance, slack=p.slack)
    caches = {name: BlockIndex(capacity) for name in names}  # what each engine really holds
    queues: dict[str, deque[tuple[int, int, float]]] = {name: deque() for name in names}
    busy = dict.fromkeys(names, False)
    events: list[tuple[float, int, str, int, int, str]] = []  # (time, order, kind, rollout, call, engine)
    order = 0

    def push(t: float, kind: str, r: int, c: int, engine: str = "") -> None:
        nonlocal order
        heapq.heappush(events, (t, order, kind, r, c, engine))
        order += 1

    cached = prompt_tokens = 0
    latencies: list[float] = []
    calls_per = dict.fromkeys(names, 0)

    def start(engine: str, now: float) -> None:
        nonlocal cached, prompt_tokens
        r, c, issued = queues[engine].popleft()
        call = rollouts[r].calls[c]
        hit = min(caches[engine].matched(block_keys(call.prompt, p.block)) * p.block, max(len(call.prompt) - 1, 0))
        cached += hit
        prompt_tokens += len(call.prompt)
        caches[engine].add(block_keys(call.prompt, p.block))
        busy[engine] = True
        service = (len(call.prompt) - hit) * p.prefill_ms_per_token + len(call.completion) * p.decode_ms_per_token
        push(now + service, "done", r, c, engine)
        latencies.append(now + service - issued)

    for r, _ in enumerate(rollouts):
        push(r * p.stagger_ms, "issue", r, 0)
    while events:
        now, _, kind, r, c, engine = heapq.heappop(events)
        rollout = rollouts[r]
        if kind == "issue":
            engine = router.route(rollout.rollout_id, rollout.calls[c].prompt)
            calls_per[engine] += 1
            queues[engine].append((r, c, now))
            if not busy[engine]:
                start(engine, now)
            continue
        call = rollout.calls[c]
        caches[engine].add(block_keys(call.prompt + call.completion, p.block))
        router.done(engine, call.prompt + call.completion)
        busy[engine] = False
        if queues[engine]:
            start(engine, now)
        if c + 1 < len(rollout.calls):
            push(now + p.think_ms, "issue", r, c + 1)
        else:
            router.forget(rollout.rollout_id)
    total = sum(calls_per.values())
    lat = sorted(latencies)
    return Result(
        cached / prompt_tokens if prompt_tokens else 0.0,
        statistics.median(lat),
        lat[min(len(lat) - 1, int(0.99 * len(lat)))],
        [calls_per[name] / total for name in names],
    )


# ---- the report ---------------------------------------------------------------------------------------------------
def table(name: str, rollouts: list[Rollout], skipped: int, p: Params, sizes: list[int]) -> tuple[str, list[str]]:
    ncalls = sum(len(r.calls) for r in rollouts)
    tokens = sum(len(c.prompt) for r in rollouts for c in r.calls)
    lines = [
        f"### {name}: {len(rollouts)} rollouts, {ncalls} calls, {tokens:,} prompt tokens",
        "",
        f"Rollouts skipped (prompts not rebuildable from the delta encoding): {skipped}.",
        "",
        "| N | policy | hit rate | vs 1 engine | p50 latency (s) | p99 latency (s) | busiest engine's share |",
        "|---|---|---|---|---|---|---|",
    ]
    verdicts = []
    for n in sizes:
        base = simulate(rollouts, 1, "round_robin", p, cache_scale=n)
        lines.append(f"| {n} | 1 engine, {n} × cache | {base.hit_rate:.1%} | 1.00 | {base.p50_ms / 1000:.2f} "
                     f"| {base.p99_ms / 1000:.2f} | 100 % |")  # fmt: skip
        got = {}
        for policy in POLICIES:
            res = got[policy] = simulate(rollouts, n, policy, p)
            rel = res.hit_rate / base.hit_rate if base.hit_rate else 0.0
            lines.append(f"| {n} | {policy} | {res.hit_rate:.1%} | {rel:.2f} | {res.p50_ms / 1000:.2f} "
                         f"| {res.p99_ms / 1000:.2f} | {max(res.shares):.0%} (fair {1 / n:.0%}) |")  # fmt: skip
        aff, rr = got["affinity"].hit_rate, got["round_robin"].hit_rate
        verdicts.append(
            f"{name}, N={n}: affinity {aff / base.hit_rate:.2f} of 1 engine (goal ≥ 0.90: "
            f"{'met' if aff >= 0.9 * base.hit_rate else 'NOT met'}), {aff / rr if rr else float('inf'):.2f}× "
            f"round robin" + (f" (goal at N=8 ≥ 1.5×: {'met' if aff >= 1.5 * rr else 'NOT met'})" if n == 8 else "")
        )
    return "\n".join(lines), verdicts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.router", description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, help="a JSON-lines trace (default: the committed ones)")
    parser.add_argument("--bootstrap", help="read the calls topic of --prefix from this broker instead")
    parser.add_argument("--prefix", default="", help="topic prefix of the run to read (with --bootstrap)")
    parser.add_argument("--engines", default="2,4,8", help="comma-separated pool sizes")
    parser.add_argument("--cache-tokens", type=int, default=Params.cache_tokens, help="per engine")
    parser.add_argument("--think-ms", type=float, default=Params.think_ms)
    parser.add_argument("--stagger-ms", type=float, default=Params.stagger_ms)
    parser.add_argument("--imbalance", type=float, default=Params.imbalance, help="affinity's load bound")
    parser.add_argument("--slack", type=int, default=Params.slack, help="affinity's load bound, in calls")
    parser.add_argument("--out", type=Path, default=RESULTS, help="the markdown report ('-' for none)")
    args = parser.parse_args(argv)
    p = Params(
        cache_tokens=args.cache_tokens,
        think_ms=args.think_ms,
        stagger_ms=args.stagger_ms,
        imbalance=args.imbalance,
        slack=args.slack,
    )
    traces, skipped = {}, {}
    if args.bootstrap:
        sources: dict[str, Any] = {f"calls topic {args.prefix}": lambda: read_topic(args.bootstrap, args.prefix)}
    elif args.trace:
        sources = {args.trace.name: lambda: read_jsonl(args.trace)}
    else:
        sources = {name: lambda path=path: read_jsonl(path) for name, path in TRACES.items()}
    for name, read in sources.items():
        SKIPPED.clear()
        traces[name] = read()
        skipped[name] = len(SKIPPED)
    sizes = [int(x) for x in args.engines.split(",")]
    sections, verdicts = [], []
    for name, rollouts in traces.items():
        text, v = table(name, rollouts, skipped[name], p, sizes)
        print(text + "\n", flush=True)
        sections.append(text)
        verdicts += v
    print("\n".join(verdicts))
    if str(args.out) != "-":
        params = (f"cache {p.cache_tokens:,} tokens per engine in {p.block}-token blocks; prefill "
                  f"{p.prefill_ms_per_token} ms/token, decode {p.decode_ms_per_token} ms/token, one call at a time "
                  f"per engine; think {p.think_ms:.0f} ms; rollouts start {p.stagger_ms:.0f} ms apart; "
                  f"affinity's bound: load ≤ (1 + {p.imbalance}) × mean + {p.slack}")  # fmt: skip
        args.out.write_text(
            RESULTS_HEAD + f"\nParameters: {params}.\n\n" + "\n\n".join(sections) + "\n\n## Against the goal\n\n"
            + "\n".join(f"* {v}" for v in verdicts) + "\n"
        )  # fmt: skip
    return 0


RESULTS_HEAD = """# Router benchmark (`python -m bench.router`, issue #31)

Recorded calls replayed through N simulated engines (bounded LRU block caches, FIFO queues, a linear latency
model) under each routing policy of `producers/proxy/router.py`; the baseline is ONE engine holding the whole pool's
cache. Simulated, not measured on engines: the hit rates follow from the traces and the cache sizes, the latencies
only from the model's constants. The router is not wired into the proxy yet (docs/scaling.md).

The traces (bench/data/, calls-topic records: delta-encoded prompt ids, generated ids, rollout, seq, timestamp):

* **harness** (`router_harness_calls.jsonl.xz`): the calls topics of one earlier run of the integration tests
  (real harnesses through the real proxy: 52 Anthropic Messages, 51 OpenAI Chat and 15 OpenAI Responses calls, the
  dialects of Claude Code; Qwen Code, opencode, OpenClaw; Codex), decoded from that run's broker log segments (the
  broker was gone) and kept where a topic's largest prompt is 10k–45k tokens and it has ≤ 60 calls, which drops
  the load and fuzz tests' synthetic topics; some kept topics may be tests' harness-shaped requests rather than a
  harness process. 51 rollouts, 118 calls (median prompt 17k tokens); 5 rollouts (a test's deliberately
  inconsistent parents) cannot be rebuilt and are skipped. Each test registers its own few rollouts, so rollouts
  are short (median 2 calls, at most 4) and concurrency comes from the replay, not from the run.
* **agentloop** (`router_agentloop_calls.jsonl.xz`): one `bench.soak` run's calls topic: 512 rollouts of the
  built-in agent loop on the CPU suite (the quickstart's harness) against the scripted engine (instant answers),
  2 calls each, median prompt 488 tokens, the system prompt shared across rollouts.

Neither is a GPU cluster's trace; a demo run's calls topic can be replayed with `--bootstrap/--prefix`.
"""

if __name__ == "__main__":
    raise SystemExit(main())
