"""What a chaos run is asked for and what it reports (``clawstream chaos``, ``clawstream.stack.chaos``): the victims
and the events that place their kills, the run's settings, each kill, and the result with the audit's verdict, as
lines for a terminal and as JSON for the fault matrix (``bench/faults.py``). No processes, no Kafka client.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from clawbase.errors import ClawstreamError
from consumers.analytics.reconcile import AuditReport

# victim → (the stack's service name, the event kind its kill follows, the most such events it may wait for, the
# kind of event that shows it working again after its restart: the next kill waits for one)
VICTIMS: dict[str, tuple[str, str, int, str]] = {
    "learner": ("learner", "seal", 1, "version"),  # a batch sealed: the learner reads it and steps
    "proxy": ("proxy", "call", 6, "call"),  # model calls recorded: rollouts mid-conversation
    "engine": ("engine", "call", 6, "call"),
    "sandbox": ("sandbox-worker", "started", 4, "reward"),  # attempts started: harnesses running in the worker
    "streams": ("streams", "reward", 4, "trajectory"),  # rollouts graded: the streams settling them
    "scheduler": ("scheduler", "request", 1, "request"),  # a step's requests published
    "broker": ("", "call", 6, "reward"),  # one node of the cluster, restarted on its data dir
}
DEFAULT_KILL = ("learner", "proxy", "streams", "sandbox", "scheduler", "broker")


class ChaosError(ClawstreamError):
    """The chaos run could not go on: a service did not come back, or the run made no progress."""


@dataclass(frozen=True)
class ChaosConfig:
    kill: tuple[str, ...] = DEFAULT_KILL
    seconds: float | None = None  # run this long (a soak) ...
    kills: int | None = None  # ... or until this many kills, whichever comes first
    seed: int = 0
    engine: str = "cpu"  # cpu | instant
    brokers: int = 3
    tasks_per_step: int = 2
    group_size: int = 4
    concurrency: int = 8
    max_tokens: int = 128
    stall_timeout_s: float = 600.0  # no trigger event and no progress for this long: the run is stuck
    drain_timeout_s: float = 600.0
    progress_every_s: float = 30.0
    work: Path | None = None

    def check(self) -> None:
        unknown = sorted(set(self.kill) - set(VICTIMS))
        if unknown:
            raise ChaosError(f"--kill: unknown service(s) {unknown}; pick from {', '.join(VICTIMS)}")
        if self.seconds is None and self.kills is None:
            raise ChaosError("give --for DURATION or --kills N (or both): the run needs an end")
        if "broker" in self.kill and self.brokers < 3:
            raise ChaosError("--kill broker needs --brokers 3 (or more): a single broker's death stops the run")
        if self.engine not in ("cpu", "instant"):
            raise ChaosError(f"--engine {self.engine!r}: cpu or instant")


@dataclass
class Kill:
    at_s: float  # seconds into the run
    victim: str  # e.g. "learner", "broker 2 (controller)"
    trigger: str  # the state it followed
    restart_s: float  # from the kill until the service (a broker: the cluster) was ready again
    recover_s: float | None = None  # from the kill until the run's next progress after the restart


@dataclass
class ChaosResult:
    config: ChaosConfig
    seconds: float  # the chaos window (start of the stack to the scheduler's stop)
    kills: list[Kill]
    report: AuditReport
    audit_text: str
    longest_stall_s: float
    stall_at_s: float
    drained: bool
    drain_s: float
    work: Path
    error: str = ""
    events: dict[str, int] = field(default_factory=dict)
    supervised: dict[str, int] = field(default_factory=dict)  # deaths the supervisor restarted (not the kills)

    @property
    def by_service(self) -> Counter[str]:
        return Counter(k.victim.split()[0] for k in self.kills)

    def tally(self) -> dict[str, int]:
        t = self.report.tally()
        return {
            "in": self.report.attempts,
            "out": self.report.settled,
            "lost": t["lost"],
            "duplicated": t["duplicated"] + t["trained twice"],
        }

    @property
    def clean(self) -> bool:
        return self.report.clean and not self.error

    def stall_after(self) -> str:
        before = [k for k in self.kills if k.at_s <= self.stall_at_s + 0.5]
        return f"after the {before[-1].victim} kill at {before[-1].at_s:.0f} s" if before else "before any kill"

    def to_json(self) -> dict[str, object]:
        return {
            "clean": self.clean,
            "error": self.error,
            "seconds": round(self.seconds, 1),
            **self.tally(),
            "kills": dict(self.by_service),
            "timeline": [vars(k) for k in self.kills],
            "longest_stall_s": round(self.longest_stall_s, 1),
            "longest_recover_s": max((k.recover_s or 0.0 for k in self.kills), default=0.0),
            "stall_at_s": round(self.stall_at_s, 1),
            "stall_after": self.stall_after(),
            "drained": self.drained,
            "drain_s": round(self.drain_s, 1),
            "batches_sealed": self.report.batches_sealed,
            "batches_trained": self.report.batches_trained,
            "versions": self.report.versions,
            "short_groups": len(self.report.short_groups),  # groups trained without some members (the audit's list)
            "rollouts": self.events.get("rollouts", 0),  # requested: attempts beyond these were re-runs or re-issues
            "events": self.events,
            "supervisor_restarts": self.supervised,
            "seed": self.config.seed,
            "work": str(self.work),
        }

    def summary(self) -> str:
        t = self.tally()
        kills = ", ".join(f"{name} {n}" for name, n in sorted(self.by_service.items())) or "none"
        return "\n".join(
            [
                f"chaos: {self.seconds / 60:.1f} min, {len(self.kills)} kills ({kills}), seed {self.config.seed}",
                f"audit {'CLEAN' if self.report.clean else 'VIOLATIONS'}"
                + (f"; the run stopped early: {self.error}" if self.error else ""),
                f"events in {t['in']} (attempts) / out {t['out']} (settled trajectories) / lost {t['lost']} / "
                f"duplicated {t['duplicated']}; batches sealed {self.report.batches_sealed}, trained "
                f"{self.report.batches_trained}; weight versions {self.report.versions}",
                f"longest stall {self.longest_stall_s:.1f} s (from {self.stall_at_s:.0f} s, {self.stall_after()})",
                f"drained: {'yes' if self.drained else 'NO'} in {self.drain_s:.0f} s; restarted by the supervisor "
                f"(deaths other than the kills): {self.supervised or 'none'}; logs in {self.work / 'logs'}",
            ]
        )


def parse_duration(text: str) -> float:
    """``90``, ``90s``, ``30m``, ``1h`` → seconds."""
    units = {"s": 1, "m": 60, "h": 3600}
    try:
        if text and text[-1] in units:
            return float(text[:-1]) * units[text[-1]]
        return float(text)
    except ValueError:
        raise ChaosError(f"--for {text!r}: a duration like 90s, 30m or 1h") from None
