"""``clawstream chaos``: the CPU training stack on a 3-broker cluster, its services SIGKILLed at random as data flows.

The stack is the demo's (``clawstream.stack.services``): engine (the CPU engine on the shipped warm start, or with
``--engine instant`` the soak's instant one, ``bench.soak_engine``), serving proxy, sandbox worker, streams, learner
and a scheduler that issues steps until the end, on a fresh local 3-node KRaft cluster (``clawstream.local_kafka``)
in the work directory. Victims are drawn from a seeded shuffled deck of the ``--kill`` names (each once before any
twice). Each kill's moment is the run's own state, read from its topics (``chaos_watch``): once the service killed
before it has worked again (a weight version after the learner's restart, a call after the proxy's, a trajectory
after the streams', ...), the victim dies after the n-th next event of its kind (n drawn too): the learner after a
batch is sealed (in its step), the proxy, engine and a broker after model calls, the sandbox worker after attempts
start, the streams after rewards, the scheduler after requests. A kill is a SIGKILL of
the service's process group (a broker: its JVM), then a restart as a supervisor would (a broker: ``LocalKafka.up``
on its data dir and ports). The run lasts ``--for`` (a soak) or ``--kills`` kills; then the scheduler is stopped,
what was issued drains, everything stops and the topics are audited (``consumers.analytics.audit``): events in
(attempts) / out (settled trajectories) / lost / duplicated, kills per service, the longest stretch without progress.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from clawbase.errors import ClawstreamError, KafkaLocalError
from clawbase.kafka.clients import create_topics
from clawbase.kafka.local_state import pid_alive
from clawbase.settings import KafkaSettings, load_settings
from clawstream.local_kafka import LocalKafka
from clawstream.stack.chaos_plan import (
    DEFAULT_KILL,
    VICTIMS,
    ChaosConfig,
    ChaosError,
    ChaosResult,
    Kill,
    parse_duration,
)
from clawstream.stack.chaos_watch import ChaosWatch
from clawstream.stack.process import Service, Stack
from clawstream.stack.services import (
    free_port,
    stack_for,
    start_learner,
    start_rollout_side,
    start_scheduler,
    start_streams,
)
from consumers.analytics.audit import format_report, read_run
from consumers.analytics.reconcile import reconcile
from schemas.topics import CATALOG

__all__ = ["DEFAULT_KILL", "ChaosConfig", "ChaosError", "ChaosResult", "parse_duration", "run_chaos"]
HARNESS_MIX = {"agentloop": 1.0, "agentloop-anthropic": 1.0}  # the demo's (the instant engine answers agentloop)
RESTART_TIMEOUT_S = 240.0


class Chaos:
    """One chaos run: the cluster, the stack, the watch, and the kill loop."""

    def __init__(self, config: ChaosConfig, say: Callable[[str], None]) -> None:
        config.check()
        self.cfg, self.say = config, say
        self.work = config.work or Path(tempfile.mkdtemp(prefix="clawstream-chaos-"))
        self.rng = random.Random(config.seed)
        self.local = LocalKafka(home=self.work / "kafka")
        self.kafka: KafkaSettings | None = None
        self.stack: Stack | None = None
        self.watch: ChaosWatch | None = None
        self.kills: list[Kill] = []
        self.deck: list[str] = []
        self.back: tuple[str, int, float] | None = None  # (event kind, its count at the restart, restart time)
        self.t0 = time.monotonic()
        self.next_line = 0.0

    # ---- the run -----------------------------------------------------------------------------------------------
    def run(self) -> ChaosResult:
        error, drained, drain_s, end = "", False, 0.0, None
        try:
            try:
                self._start()
                self._loop()
                end = time.monotonic()
                drained, drain_s = self._drain()
            except (ClawstreamError, TimeoutError) as exc:
                error, end = f"{type(exc).__name__}: {exc}", end or time.monotonic()
                self.say(f"chaos stopped: {error}")
            finally:
                if self.watch is not None:
                    self.watch.close()
                if self.stack is not None:
                    self.stack.stop()
            return self._result(error, drained, drain_s, end or time.monotonic())
        finally:
            self.local.down()  # every node, whatever ended the run (Ctrl-C and SIGTERM included)

    def _start(self) -> None:
        from warmstart import sft

        model, why = sft.shipped_warm_start()
        if model is None:
            raise ChaosError(f"no warm start to train from: {why}")
        state = self.local.up(brokers=self.cfg.brokers, timeout=180, quiet=True)
        self.say(f"==> {self.cfg.brokers}-broker Kafka on {state.bootstrap} (home {self.local.home})")
        prefix = f"chaos-{time.strftime('%Y%m%d-%H%M%S')}."  # nothing of another run is read as this one's
        self.kafka = load_settings(KafkaSettings, bootstrap_servers=state.bootstrap, topic_prefix=prefix)
        create_topics(self.kafka, CATALOG)
        self.stack = stack_for(self.kafka, self.work / "logs")
        self.stack.env.update(  # a killed member's partitions move after its session: keep it short
            {
                "CLAWSTREAM_SANDBOX_SESSION_TIMEOUT_MS": "10000",
                "CLAWSTREAM_SANDBOX_PROXY_LEASE_S": "6",
                # 20 s: at 10 s a streams worker on a loaded 2-core host is evicted while alive every few minutes
                "CLAWSTREAM_STREAMS_SESSION_TIMEOUT_S": "20",
                # the sandbox worker's seen requests and committed positions: this run's, on this cluster only
                "CLAWSTREAM_SANDBOX_SEEN_DIR": str(self.work / "sandbox-seen"),
            }
        )
        self._start_services(model, self.work / "run")
        self.watch = ChaosWatch(self.kafka)
        self.t0 = time.monotonic()
        self.say(f"==> stack up ({', '.join(s.name for s in self.stack.services)}); logs in {self.work / 'logs'}")

    def _start_services(self, model: Path, run_dir: Path) -> None:
        assert self.stack is not None
        cfg, mix = self.cfg, HARNESS_MIX if self.cfg.engine == "cpu" else None
        engine_url = None
        if cfg.engine == "instant":
            engine = Service(
                "engine",
                ["bench.soak_engine", "--model", str(model), "--port", str(free_port())],
                ready_line=r"instant engine on (http://\S+:\d+)",
                restart=True,
            )
            engine_url = str(self.stack.start(engine).found)
        start_rollout_side(self.stack, model, concurrency=cfg.concurrency, torch_threads=1, engine_url=engine_url)
        start_streams(
            self.stack,
            run_dir,
            group_size=cfg.group_size,
            batch_groups=cfg.tasks_per_step,
            settle_interval_s=0.0,
            harness_mix=mix,
            zero_variance="keep",  # as its recorded runs (bench/results/faults.md): no refills
        )
        start_learner(self.stack, model, run_dir, {"lr": 2e-5, "seed": cfg.seed}, torch_threads=1)
        settings: dict[str, object] = {
            "tasks_per_step": cfg.tasks_per_step,
            "group_size": cfg.group_size,
            "max_tokens": cfg.max_tokens,
            "max_policy_lag": 1,
            "zero_variance": "keep",
            "seed": cfg.seed,
        }
        if mix:
            settings["harness_mix"] = mix
        start_scheduler(self.stack, 1_000_000, settings)  # stopped at the end, not by its steps

    def _elapsed(self) -> float:
        return time.monotonic() - self.t0

    def _over(self) -> bool:
        cfg = self.cfg
        return (cfg.seconds is not None and self._elapsed() >= cfg.seconds) or (
            cfg.kills is not None and len(self.kills) >= cfg.kills
        )

    def _loop(self) -> None:
        while not self._over():
            if not self.deck:
                self.deck = self.rng.sample(list(self.cfg.kill), len(self.cfg.kill))
            victim = self.deck.pop()
            _, kind, most, _ = VICTIMS[victim]
            n = self.rng.randint(1, most)
            trigger = f"the {_nth(n)} {kind} event"
            if not self._wait_for(kind, n, f"{victim} after {trigger}"):
                break  # the time is up
            self._kill(victim, trigger)
        self._wait_for("reward", 0, "the last victim at work again", stop_when_over=False)

    def _wait_for(self, kind: str, n: int, what: str, *, stop_when_over: bool = True) -> bool:
        """Poll until the last victim worked again since its restart (its ``back`` event kind read once more), then
        until ``n`` more events of ``kind`` are read; False when the run's time is up first."""
        watch, stack = self.watch, self.stack
        assert watch is not None and stack is not None
        base, began = None, time.monotonic()
        while True:
            back = self._back_pending()
            if back is None and base is None:
                base = watch.counts[kind]  # the trigger counts from when the last victim is back at work
            if base is not None and watch.counts[kind] >= base + n:
                return True
            if stop_when_over and self.cfg.seconds is not None and self._elapsed() >= self.cfg.seconds:
                return False
            stack.check()
            self._progress_line(what if back is None else f"{back}, then {what}")
            last = max(began, watch.last_progress() or 0.0)
            restarted = self.back[2] if self.back is not None else time.monotonic()
            if time.monotonic() - last > self.cfg.stall_timeout_s or (
                time.monotonic() - restarted > self.cfg.stall_timeout_s
            ):
                raise ChaosError(
                    f"stuck for {self.cfg.stall_timeout_s:.0f} s waiting for {back or what}; logs in "
                    f"{self.work / 'logs'}"
                )
            watch.poll(0.5)

    def _back_pending(self) -> str | None:
        """What the last victim has yet to do to show it works again, or None once it has."""
        if self.back is None or self.watch is None:
            return None
        kind, count, _ = self.back
        if self.watch.counts[kind] > count:
            self.back = None
            return None
        return f"a {kind} event after {self.kills[-1].victim}'s restart"

    def _progress_line(self, waiting: str) -> None:
        if self._elapsed() < self.next_line:
            return
        self.next_line = self._elapsed() + self.cfg.progress_every_s
        assert self.watch is not None
        c, kills = self.watch.counts, Counter(k.victim.split()[0] for k in self.kills)
        self.say(
            f"[{self._elapsed():6.0f} s] requests {c['request']}, calls {c['call']}, rewards {c['reward']}, "
            f"trajectories {c['trajectory']}, batches sealed {c['seal']}, versions {len(self.watch.versions)}; "
            f"kills {sum(kills.values())} ({', '.join(f'{k} {v}' for k, v in sorted(kills.items())) or 'none'}); "
            f"waiting: {waiting}"
        )

    # ---- kills -------------------------------------------------------------------------------------------------
    def _kill(self, victim: str, trigger: str) -> None:
        at = self._elapsed()
        started = time.monotonic()
        if victim == "broker":
            name = self._kill_broker()
        else:
            name = self._kill_service(VICTIMS[victim][0])
        kill = Kill(round(at, 1), name, trigger, round(time.monotonic() - started, 1))
        self.kills.append(kill)
        assert self.watch is not None
        back = VICTIMS[victim][3]
        self.back = (back, self.watch.counts[back], time.monotonic())
        self.say(f"[{at:6.0f} s] killed {name} (SIGKILL) after {trigger}; back in {kill.restart_s:.1f} s")

    def _kill_service(self, name: str) -> str:
        assert self.stack is not None
        service = next(s for s in self.stack.services if s.name == name)
        supervised = service.restarts
        self.stack.kill(service)
        self.stack.restart(service, timeout=RESTART_TIMEOUT_S)
        service.restarts = supervised  # the supervisor's budget counts the deaths it saw, not the chaos's kills
        return "sandbox" if name == "sandbox-worker" else name

    def _kill_broker(self) -> str:
        state = self.local.read_state()
        alive = self.local.alive(state)
        if len(alive) < self.cfg.brokers:
            raise ChaosError(f"only brokers {sorted(alive)} of {self.cfg.brokers} run before a broker kill")
        node = self.rng.choice(sorted(alive))
        role = " (controller)" if self.local.active_controller() == node else ""
        pid = alive[node]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        # gone: the process, and its listeners (its main thread shows as a zombie while the others still close them)
        while (pid_alive(pid) or "LISTEN" in _holders(self.local, node)) and time.monotonic() < deadline:
            time.sleep(0.2)
        self._restart_broker(node)
        return f"broker {node}{role}"

    def _restart_broker(self, node: int) -> None:
        """``LocalKafka.up`` restarts the dead node on its data dir and ports, retried while one is still taken (its
        ports come from the ephemeral range: another socket may hold one as its own local port meanwhile)."""
        deadline = time.monotonic() + RESTART_TIMEOUT_S
        while True:
            try:
                self.local.up(timeout=RESTART_TIMEOUT_S, quiet=True)
                return
            except KafkaLocalError as exc:
                if "is taken by another process" not in str(exc) or time.monotonic() > deadline:
                    raise
                self.say(f"broker {node}: {exc}; sockets on its ports: {_holders(self.local, node)}; again in 2 s")
                time.sleep(2.0)

    # ---- the end -----------------------------------------------------------------------------------------------
    def _drain(self) -> tuple[bool, float]:
        """Issue no more steps, but let the scheduler re-issue what the infrastructure lost: it is restarted with
        ``--steps`` at the steps already issued, resumes from the log, publishes the re-issues owed, waits for every
        outstanding reward and exits. Drained when it has, every started attempt has ended, every requested rollout
        is settled into a trajectory and every sealed batch trained."""
        stack, watch = self.stack, self.watch
        assert stack is not None and watch is not None
        scheduler = next(s for s in stack.services if s.name == "scheduler")
        stack.kill(scheduler)
        scheduler.args[scheduler.args.index("--steps") + 1] = str(watch.steps_issued())
        env = {**scheduler.env, "CLAWSTREAM_SCHEDULER_DRAIN_TIMEOUT_S": str(self.cfg.drain_timeout_s)}
        supervised = scheduler.restarts
        stack.restart(scheduler, timeout=RESTART_TIMEOUT_S, env=env)
        scheduler.restarts = supervised
        self.say(f"[{self._elapsed():6.0f} s] no more steps after {watch.steps_issued()}; draining what was issued")
        began, quiet = time.monotonic(), None  # quiet: since when all is drained but a step's batch is unsealed
        while True:
            if scheduler.proc is not None and scheduler.proc.poll() == 0 and watch.drained():
                quiet = quiet or time.monotonic()
                if watch.sealed_all() or time.monotonic() - quiet > 120:  # a group set aside leaves its step unsealed
                    break
            if time.monotonic() - began > self.cfg.drain_timeout_s + 60:
                self.say(f"not drained within {self.cfg.drain_timeout_s + 60:.0f} s")
                return False, time.monotonic() - began
            stack.check()
            self._progress_line("the drain")
            watch.poll(0.5)
        self.say(f"[{self._elapsed():6.0f} s] drained in {time.monotonic() - began:.0f} s")
        return True, time.monotonic() - began

    def _result(self, error: str, drained: bool, drain_s: float, end: float) -> ChaosResult:
        if self.kafka is None:
            raise ChaosError(error or "the cluster never started")
        report = reconcile(read_run(self.kafka))
        watch = self.watch
        gap, began = watch.longest_stall(self.t0, end) if watch is not None else (0.0, self.t0)
        for kill in self.kills:
            back = self.t0 + kill.at_s + kill.restart_s
            after = [t for t in (watch.progress_times if watch is not None else []) if t > back]
            kill.recover_s = round(after[0] - self.t0 - kill.at_s, 1) if after else None
        return ChaosResult(
            self.cfg,
            end - self.t0,
            self.kills,
            report,
            format_report(report, self.kafka.topic_prefix),
            gap,
            began - self.t0,
            drained,
            drain_s,
            self.work,
            error,
            {**watch.counts, "rollouts": len(watch.requested)} if watch is not None else {},
            {sv.name: sv.restarts for sv in self.stack.services if sv.restarts} if self.stack is not None else {},
        )


def _holders(local: LocalKafka, node: int) -> str:
    """The sockets bound to a node's ports, by state (``/proc/net/tcp*``): who keeps a dead node from its port."""
    state = local.read_state()
    if state is None:
        return "no state"
    ports = {state.nodes[node - 1].port, state.nodes[node - 1].controller_port}
    names = {"01": "ESTABLISHED", "06": "TIME_WAIT", "0A": "LISTEN", "08": "CLOSE_WAIT", "05": "FIN_WAIT2"}
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                local_port, remote_port = int(fields[1].split(":")[1], 16), int(fields[2].split(":")[1], 16)
                if local_port in ports:
                    found.append(f"{local_port}->{remote_port} {names.get(fields[3], fields[3])}")
    return ", ".join(found) or "none"


def _nth(n: int) -> str:
    return {1: "next", 2: "2nd next", 3: "3rd next"}.get(n, f"{n}th next")


def run_chaos(config: ChaosConfig, say: Callable[[str], None] = print, json_out: Path | None = None) -> ChaosResult:
    """Run it, print the audit and the summary (and write the summary as JSON to ``json_out``)."""
    result = Chaos(config, say).run()
    say(result.audit_text)
    say(result.summary())
    if json_out is not None:
        json_out.write_text(json.dumps(result.to_json(), indent=1) + "\n")
    return result
