"""Red team: every hostile-harness attack on the grader, the proxy and the worker, in one live stack; results table.

One local Apache Kafka broker, the serving proxy (``producers.proxy.app``), the scripted model and a sandbox worker
(bubblewrap isolation) each run as their own process (``clawstream.stack``); the worker knows the hostile harnesses
of ``bench.redteam_harnesses`` besides the catalog's. Each attack runs as a rollout request on the broker next to
its honest twin (same task, same workspace shape, harmless content, or a harness that does nothing): the row
gives the hostile reward, the honest one and what else the attack was after (a stalled neighbour, the worker's
file descriptors, a host file's mode, a ``tampered`` call event). The proxy-fairness attack (one rollout keeping
eight maximum-size bodies in flight) is driven over HTTP from here, with a neighbour rollout's call latency measured
idle and under the attack side by side. The forged-``result``-after-a-restart attack kills and restarts the proxy.
With a Docker Engine answering (``compose/engine-setup.sh``; images ``clawstream/harnesses``), the grader attacks
run again with the worker on the docker backend. Peak RSS (VmHWM) of the worker and the proxy is recorded.

Run: ``.venv/bin/python -m bench.redteam [--quick] [--no-docker] [--out bench/results/redteam.md]``
(``--quick``: fewer latency samples and variants, no docker, to see it work).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import secrets
import shutil
import subprocess
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from confluent_kafka import OFFSET_BEGINNING, TopicPartition  # noqa: E402

from bench.redteam_harnesses import (  # noqa: E402
    CLAWGYM,
    DOCKER_ATTACKS,
    GRADER_ATTACKS,
    HELLO,
    OTHER_ATTACKS,
    SUITES,
    Endpoints,
    flood,
    pct,
)
from clawbase.kafka.clients import make_consumer  # noqa: E402
from clawstream.stack.process import Service, Stack  # noqa: E402
from clawstream.stack.services import free_port, run_kafka, stack_for  # noqa: E402
from schemas.events import CallEvent, RewardEvent, RewardStatus, RolloutEvent  # noqa: E402
from schemas.topics import CALLS  # noqa: E402
from tests.support import proxy_helpers as H  # noqa: E402
from tests.support import sandbox_helpers as S  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "redteam.md"
# --- processes --------------------------------------------------------------------------------------------------------


def status_kb(pid: int, key: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def fd_count(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


class FdPeak:
    """The most fds ``pid`` held, sampled every 20 ms from a thread."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self.stop = pid, fd_count(pid), threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(0.02):
            self.peak = max(self.peak, fd_count(self.pid))

    def done(self) -> int:
        self.stop.set()
        self.thread.join()
        return self.peak


@dataclass
class Live:
    stack: Stack
    kafka: Any
    model: Path
    token: str
    public: str
    admin: str
    proxy: Service
    worker: Service | None = None
    group: str = ""
    notes: list[str] = field(default_factory=list)
    rss: dict[str, int] = field(default_factory=dict)


def say(what: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {what}", flush=True)


def start(tmp: Path, prefix: str) -> Live:
    kafka = run_kafka(prefix)
    model = H.tiny_model_dir()
    stack = stack_for(kafka, tmp / "logs")
    engine = stack.start(
        Service("engine", ["bench.redteam_harnesses", "engine", "--model", str(model)], ready_line=r"engine on (\S+)")
    )
    token, port, admin_port = secrets.token_hex(16), free_port(), free_port()
    public, admin = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}"
    args = ["--model", str(model), "--engine-url", str(engine.found), "--port", str(port), "--admin-port"]
    proxy = stack.start(
        Service(
            "proxy",
            ["producers.proxy.app", *args, str(admin_port)],
            env={"CLAWSTREAM_PROXY_ADMIN_TOKEN": token},
            ready_url=f"{admin}/metrics",
        )
    )
    return Live(stack, kafka, model, token, public, admin, proxy, group=f"{prefix}sandbox-workers")


def start_worker(live: Live, tmp: Path, backend: str, canary: Path) -> None:
    env = {
        "CLAWSTREAM_SANDBOX_PROXY_URL": live.admin,
        "CLAWSTREAM_SANDBOX_PROXY_ADMIN_TOKEN": live.token,
        "CLAWSTREAM_SANDBOX_GROUP_ID": live.group,
        "CLAWSTREAM_SANDBOX_SUITES": json.dumps(SUITES),
        "CLAWSTREAM_SANDBOX_ROOT": str(tmp / f"sandboxes-{backend}"),
        "CLAWSTREAM_SANDBOX_CONCURRENCY": "8",
        "CLAWSTREAM_SANDBOX_SESSION_TIMEOUT_MS": "6000",
        "CLAWSTREAM_SANDBOX_KILL_GRACE_S": "0.5",
        "CLAWSTREAM_SANDBOX_GRADER_TIMEOUT_S": "60",
        "CLAWSTREAM_SANDBOX_INSTALL_HARNESSES": "false",
        "CLAWSTREAM_SANDBOX_MAX_WORKSPACE_BYTES": str(1 << 30),
        "CLAWSTREAM_SANDBOX_DISK_CHECK_INTERVAL_S": "0.05",
        "CLAWSTREAM_SANDBOX_BACKEND": backend,
        "CANARY": str(canary),
    }
    if backend == "docker":
        env |= {
            "CLAWSTREAM_SANDBOX_DOCKER_IMAGE": "clawstream/harnesses:latest",
            "CLAWSTREAM_SANDBOX_DOCKER_NETWORK": docker_network(live),
            "CLAWSTREAM_SANDBOX_DOCKER_PROXY_RELAY": "false",
        }
    live.worker = live.stack.start(
        Service(f"worker-{backend}", ["bench.redteam_harnesses", "worker"], env=env, ready_line="worker running")
    )


def stop_worker(live: Live) -> None:
    assert live.worker is not None and live.worker.proc is not None
    live.rss[live.worker.name] = status_kb(live.worker.proc.pid, "VmHWM")
    live.worker.proc.terminate()
    live.worker.proc.wait(90)
    live.stack.services.remove(live.worker)
    live.worker = None


def docker_network(live: Live) -> str:
    return f"cs-{live.group.split('sandbox')[0].strip('-.')}"


def docker_answers() -> bool:
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def docker_cleanup(network: str) -> None:
    ids = subprocess.run(
        ["docker", "ps", "-aq", "--filter", f"network={network}"], capture_output=True, text=True
    ).stdout.split()
    if ids:
        subprocess.run(["docker", "rm", "-f", *ids], capture_output=True)
    subprocess.run(["docker", "network", "rm", network], capture_output=True)


# --- rollouts ---------------------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    reward: RewardEvent | None
    events: list[RolloutEvent]
    rollout_id: str = ""

    @property
    def score(self) -> str:
        r = self.reward
        if r is None:
            return "no reward"
        flag = " (grader_error_by_rollout)" if r.grader_error_by_rollout else ""
        if r.reward is not None:
            return f"{r.reward:.3f}{flag}"
        why = (r.reason or "").replace("|", "/").replace("\n", " ")
        return f"{r.status.value}{flag}: {why[:140]}"

    @property
    def key(self) -> tuple[Any, ...]:
        return (None,) if self.reward is None else (self.reward.status, self.reward.reward)

    @property
    def harness_s(self) -> float | None:
        at = {e.state.value: e.timestamp_ms for e in self.events}
        if "STARTED" in at and self.reward is not None:
            return (self.reward.timestamp_ms - at["STARTED"]) / 1000
        return None


async def rollouts(live: Live, runs: dict[str, tuple[tuple[str, str], str]], timeout: float = 240) -> dict:
    """Publish one request per label (task, harness) and wait for every reward; label → Outcome."""
    reqs = {
        label: S.request(task, harness, suite=suite, timeout_s=90) for label, ((suite, task), harness) in runs.items()
    }
    S.publish(live.kafka, list(reqs.values()))
    ids = {r.rollout_id for r in reqs.values()}
    events, rewards = await asyncio.to_thread(S.collect, live.kafka, ids, timeout, settle_s=1.0)
    out = {}
    for label, req in reqs.items():
        mine = [r for r in rewards if r.rollout_id == req.rollout_id]
        mine_events = [e for e in events if e.rollout_id == req.rollout_id]
        out[label] = Outcome(mine[-1] if mine else None, mine_events, req.rollout_id)
    return out


def tampered_calls(live: Live, rollout_ids: set[str]) -> dict[str, list[bool]]:
    """Each rollout's call events' ``tampered`` flags, read from the calls topic."""
    consumer = make_consumer(live.kafka, f"redteam-{uuid.uuid4().hex[:8]}")
    topic = live.kafka.topic(CALLS)
    parts = consumer.list_topics(topic, timeout=30).topics[topic].partitions
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in parts])
    found: dict[str, list[bool]] = {rid: [] for rid in rollout_ids}
    idle_since = time.monotonic()
    try:
        while time.monotonic() - idle_since < 3.0:
            msg = consumer.poll(0.3)
            if msg is None or msg.error():
                continue
            idle_since = time.monotonic()
            event = CallEvent.from_bytes(msg.value())
            if event.rollout_id in found:
                found[event.rollout_id].append(bool(getattr(event, "tampered", False)))
    finally:
        consumer.close()
    return found


# --- the attacks ------------------------------------------------------------------------------------------------------


def row(attack: str, what: str, hostile: Outcome, honest: Outcome, extra: str = "") -> list[str]:
    same = hostile.reward is not None and hostile.key == honest.key
    if attack != "restart":  # an INFRA_FAILURE is never trained on nor counted: a hidden failure, not a held attack
        same = same and hostile.reward is not None and hostile.reward.status == RewardStatus.OK
    if attack.startswith("chmod"):  # held: graded (counted, not INFRA_FAILURE), never above the readable file's grade
        h, t = hostile.reward, honest.reward
        same = h is not None and t is not None and h.status == t.status == RewardStatus.OK
        same = same and h is not None and t is not None and (h.reward or 0.0) <= (t.reward or 0.0)
    verdict = "held" if same else "**BROKEN**"
    return [attack, what, hostile.score, honest.score, verdict, extra]


async def grader_rows(live: Live, names: list[str], backend: str, neighbour: bool) -> list[list[str]]:
    runs: dict[str, tuple[tuple[str, str], str]] = {"nothing@clawgym": (CLAWGYM, "nothing")}
    for name in names:
        _what, task, twin = GRADER_ATTACKS[name]
        runs[name], runs[f"{name}:twin"] = (task, name.split("@")[0]), (task, twin)
    if neighbour:
        runs["neighbour"] = (HELLO, "agentloop")
    got = await rollouts(live, runs)
    rows = []
    for name in names:
        extra, stalled = "", False
        if name == "fifo_out" and neighbour:
            n = got["neighbour"]
            extra = f"neighbour agentloop beside it: {n.score} in {n.harness_s or float('nan'):.1f} s"
            stalled = n.reward is None or n.reward.reward != 1.0
        if name == "chmod":
            extra = "twin: the same wrong file left readable; held: graded OK, never above the twin"
        rows.append(row(f"{name} ({backend})", GRADER_ATTACKS[name][0], got[name], got[f"{name}:twin"], extra))
        if name == "fifo_out" and neighbour and stalled:
            rows[-1][4] = "**BROKEN**"
    baseline = got["nothing@clawgym"].score
    rows.append([f"nothing ({backend})", "does nothing on task_0078: the honest baseline", baseline, "", "", ""])
    return rows


async def other_rows(live: Live, canary: Path) -> list[list[str]]:
    mode = oct(canary.stat().st_mode & 0o777)
    runs = {name: (task, name) for name, (_w, task, _t) in OTHER_ATTACKS.items()}
    runs |= {f"{name}:twin": (task, twin) for name, (_w, task, twin) in OTHER_ATTACKS.items()}
    got = await rollouts(live, runs)
    after = oct(canary.stat().st_mode & 0o777)
    alive = live.worker is not None and live.worker.proc is not None and live.worker.proc.poll() is None
    tampered = tampered_calls(live, {got[k].rollout_id for k in ("tamper", "tamper:twin")})
    extras = {
        "quota_swap": f"host file outside the sandbox: mode {mode} before, {after} after",
        "tamper": "call events tampered: hostile {}, honest {}".format(
            tampered[got["tamper"].rollout_id], tampered[got["tamper:twin"].rollout_id]
        ),
        "deep_bodies": f"sandbox worker alive after: {alive}",
    }
    rows = [row(n, w, got[n], got[f"{n}:twin"], extras.get(n, "")) for n, (w, _t, _tw) in OTHER_ATTACKS.items()]
    for r in rows:
        if (r[0] == "quota_swap" and after != mode) or not alive:
            r[4] = "**BROKEN**"
    return rows


async def fd_row(live: Live, idle_neighbour: Outcome) -> list[str]:
    assert live.worker is not None and live.worker.proc is not None
    pid = live.worker.proc.pid
    before = fd_count(pid)
    peak = FdPeak(pid)
    flood_req = S.request("hello", "fd_flood", timeout_s=90)
    S.publish(live.kafka, [flood_req])
    await asyncio.sleep(4.0)  # the sandbox starts and opens its connections
    got = await rollouts(live, {"neighbour": (HELLO, "agentloop")})
    _ev, rw = await asyncio.to_thread(S.collect, live.kafka, {flood_req.rollout_id}, 120, settle_s=0.5)
    top = peak.done()
    await asyncio.sleep(2.0)
    after = fd_count(pid)
    n = got["neighbour"]
    extra = (
        f"worker fds {before} before, peak {top}, {after} after; neighbour agentloop during the flood: {n.score} in "
        f"{n.harness_s or float('nan'):.1f} s (alone: {idle_neighbour.score} in {idle_neighbour.harness_s or 0:.1f} s)"
    )
    flood_out = Outcome(rw[-1] if rw else None, [])
    nothing = (await rollouts(live, {"nothing": (HELLO, "nothing")}))["nothing"]
    out = row("fd_flood", "6: 3 × 3,500 connections held on the sandbox's proxy address", flood_out, nothing, extra)
    if n.reward is None or n.reward.reward != 1.0 or after > before + 8:
        out[4] = "**BROKEN**"
    return out


RESTARTED = (
    "proxy SIGKILLed and restarted after both calls; INFRA_FAILURE is re-issued (a new attempt), never trained on "
    "as it stands, and the grader never read the harness's stdout"
)


async def restart_row(live: Live, wait_s: float) -> list[str]:
    """Attack 9: both rollouts make their call, the proxy is killed and restarted, then one prints a forged result."""
    assert live.proxy.proc is not None
    live.rss["proxy"] = status_kb(live.proxy.proc.pid, "VmHWM")
    reqs = {k: S.request("task_00_sanity", k, suite="pinchbench", timeout_s=90) for k in ("restart", "restart.honest")}
    S.publish(live.kafka, list(reqs.values()))
    await asyncio.sleep(min(6.0, wait_s / 2))  # both sandboxes up, each call served (WAIT_S later they finish)
    live.stack.kill(live.proxy)
    live.stack.restart(live.proxy)
    ev, rw = await asyncio.to_thread(S.collect, live.kafka, {r.rollout_id for r in reqs.values()}, 240, settle_s=1.0)

    def outcome(k: str) -> Outcome:
        rid = reqs[k].rollout_id
        mine = [r for r in rw if r.rollout_id == rid]
        return Outcome(mine[-1] if mine else None, [e for e in ev if e.rollout_id == rid])

    what = "9: after a proxy restart, a stream-json result line claiming an answer the model never gave"
    return row("restart", what, outcome("restart"), outcome("restart.honest"), RESTARTED)


# --- report -----------------------------------------------------------------------------------------------------------


def render(rows: list[list[str]], fl: dict[str, Any], live: Live, took: float, head: str) -> str:
    idle50, idle99 = pct(fl["idle"], 0.5) * 1000, pct(fl["idle"], 0.99) * 1000
    busy50, busy99 = pct(fl["busy"], 0.5) * 1000, pct(fl["busy"], 0.99) * 1000
    ratio = busy99 / idle99 if idle99 else float("nan")
    out = [
        "# Red team: the policy as the attacker",
        "",
        f"`python -m bench.redteam` on {platform.node()} ({os.cpu_count()} cores), {time.strftime('%Y-%m-%d %H:%M')}"
        f"; {took / 60:.1f} min. {head}",
        "",
        "Each attack ran as a rollout on one live stack (local Apache Kafka broker, serving proxy, scripted model, "
        "sandbox worker: separate processes) beside its honest twin on the same task. *held*: the hostile harness "
        "got exactly the honest twin's grade.",
        "",
        "| attack | what the harness does | hostile | honest | verdict | also measured |",
        "|---|---|---:|---:|---|---|",
        *("| " + " | ".join(r) + " |" for r in rows),
        "",
        "## Attack 5: one rollout keeps eight maximum-size bodies in flight",
        "",
        f"Bodies of {fl['body_mb']} MiB (4,000 messages of text; 280,000 one-character messages), eight at a time, "
        f"re-sent as each is answered; a neighbour rollout's calls one after another, {len(fl['idle'])} idle and "
        f"{len(fl['busy'])} under the attack, in the same run. The attacker's answers: {fl['statuses']}.",
        "",
        "| neighbour call latency | p50 (ms) | p99 (ms) | max (ms) |",
        "|---|---:|---:|---:|",
        f"| idle | {idle50:.1f} | {idle99:.1f} | {max(fl['idle']) * 1000:.1f} |",
        f"| under attack | {busy50:.1f} | {busy99:.1f} | {max(fl['busy']) * 1000:.1f} |",
        "",
        f"p99 under attack / idle p99: **{ratio:.2f}×** (target ≤ 2×: {'met' if ratio <= 2 else '**not met**'}).",
        "",
        "## Peak resident memory (VmHWM)",
        "",
        *(f"- {name}: {kb / 1024:.0f} MiB" for name, kb in live.rss.items()),
        "",
        *live.notes,
        "",
    ]
    return "\n".join(out)


async def run(args: argparse.Namespace, tmp: Path) -> str:
    t0 = time.monotonic()
    live = start(tmp, f"redteam-{uuid.uuid4().hex[:6]}-")
    canary = tmp / "host" / "canary.txt"
    canary.parent.mkdir()
    canary.write_text("a host file\n")
    canary.chmod(0o644)
    try:
        start_worker(live, tmp, "local", canary)
        say("a neighbour (agentloop on native/hello) alone")
        idle_neighbour = (await rollouts(live, {"n": (HELLO, "agentloop")}))["n"]
        say("grader attacks (bwrap)")
        names = ["json_py", "fifo_out", "chmod"] if args.quick else list(GRADER_ATTACKS)
        rows = await grader_rows(live, names, "bwrap", neighbour=True)
        say("deep nesting, forged transcript, quota-walk swap")
        rows += await other_rows(live, canary)
        say("relay fd flood")
        rows.append(await fd_row(live, idle_neighbour))
        say("proxy flood: eight maximum-size bodies in flight")
        fl = await flood(Endpoints(live.public, live.admin, live.token), 15 if args.quick else 60)
        say("proxy restart, then a forged result line")
        rows.append(await restart_row(live, 12))
        stop_worker(live)
        if not args.no_docker and not args.quick and docker_answers():
            say("grader attacks (docker)")
            start_worker(live, tmp, "docker", canary)
            try:
                rows += await grader_rows(live, list(DOCKER_ATTACKS), "docker", neighbour=False)
            finally:
                stop_worker(live)
                docker_cleanup(docker_network(live))
        else:
            live.notes.append("The docker backend was not run (--quick, --no-docker or no Docker Engine answering).")
        assert live.proxy.proc is not None
        live.rss["proxy (after its restart)"] = status_kb(live.proxy.proc.pid, "VmHWM")
    finally:
        live.stack.stop()
    return render(rows, fl, live, time.monotonic() - t0, args.head)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.redteam", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="three grader attacks, 15 latency samples, no docker")
    parser.add_argument("--no-docker", action="store_true", help="the local (bubblewrap) backend only")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--head", default="", help="a sentence for the report's first paragraph (what code ran)")
    parser.add_argument("--append", type=Path, help="markdown appended to the report (e.g. rows from older code)")
    args = parser.parse_args()
    if shutil.which("bwrap") is None:
        raise SystemExit("bubblewrap (bwrap) is needed: the attacks run in isolated sandboxes")
    tmp = Path(tempfile.mkdtemp(prefix="cs-redteam-"))
    try:
        text = asyncio.run(run(args, tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if args.append is not None:
        text += "\n" + args.append.read_text()
    args.out.write_text(text)
    print(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
