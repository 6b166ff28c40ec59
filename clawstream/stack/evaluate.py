"""``clawstream eval``: a model's held-out score per harness, greedy and sampled, with standard errors.

The evaluation runs through the real rollout side of the system, as training does: the model is served by an
inference engine, every rollout is a real harness run in a sandbox talking to the serving proxy, and the task's
grader scores the workspace. The scheduler's eval mode (``producers.scheduler``) publishes one request per task ×
harness × mode (``greedy``: temperature 0; ``sampled``: the training sampling settings) and collects the rewards;
the result is, per harness and mode, the mean reward, its standard error, the solved fraction (reward 1) and n.

Suites: any suite spec (``builtin:cpu``, ``native:DIR``, ``clawgym:DIR``, ``pinchbench:DIR``). ``builtin:cpu`` has 48
held-out tasks; asked for more, the evaluation uses the warm start's extended held-out split
(``warmstart.demos.heldout_tasks``: its first 48 are the suite's, and the SFT data never contains any of
the first 256), written once as a native suite under ``$CLAWSTREAM_HOME/suites/``.

Topics: ``clawstream.rollout.requests`` out; ``clawstream.rewards`` in (under a fresh topic prefix per evaluation;
the engine, proxy and sandbox worker it starts produce calls, lifecycle events and rewards there); at the end
``clawstream.rollout.events`` is read back for the rollouts killed at the task timeout (``extra["timed_out"]``).
Run: ``clawstream eval --model DIR [--harness H ...] [--suite S] [--tasks 256] [--mode greedy --mode sampled]``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import secrets
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from clawbase.errors import ClawstreamError, CodecError
from clawbase.settings import KafkaSettings, clawstream_home
from clawstream.stack.process import Stack
from clawstream.stack.services import run_kafka, stack_for, start_rollout_side
from producers.scheduler.plan import EVAL_MODES, EvalScore, eval_table
from schemas.topics import CATALOG
from warmstart.progress import progress_bar

BUILTIN_CPU = "builtin:cpu"
BUILTIN_HELDOUT = 48  # held-out tasks of builtin:cpu (producers.tasks.cpu.cpu_suite)


@dataclass(frozen=True)
class EvalConfig:
    """What an evaluation runs: harnesses × tasks of a suite split × decoding modes."""

    harnesses: tuple[str, ...] = ("agentloop", "agentloop-anthropic")
    suite: str = BUILTIN_CPU
    split: str = "heldout"
    tasks: int = 256  # 0: every task of the split
    modes: tuple[str, ...] = EVAL_MODES
    temperature: float = 1.0  # sampled mode
    top_p: float = 1.0
    max_tokens: int = 256  # per model call, as the quickstart trains
    concurrency: int = 12  # rollouts at once (sandbox worker); the engine batches their calls
    engine: str = "cpu"
    timeout_s: float = 3600.0
    seed: int = 0  # of the extended builtin:cpu held-out split
    rollout_timeout_s: float | None = None  # every task's timeout instead of its own (a real harness on 2 cores)
    # Base of the per-rollout sampling seeds (task × harness × mode × sample; plan.eval_seed): the evaluations before
    # and after training draw the same noise, so their paired difference is the policy's. None: unseeded.
    sampling_seed: int | None = 0

    def __post_init__(self) -> None:
        bad = [m for m in self.modes if m not in EVAL_MODES]
        if bad or not self.modes:
            raise ClawstreamError(f"eval modes must be among {', '.join(EVAL_MODES)}; got {', '.join(self.modes)}")
        if not self.harnesses:
            raise ClawstreamError("name at least one harness to evaluate")
        if self.tasks < 0:
            raise ClawstreamError(f"--tasks must be >= 0, got {self.tasks}")
        if self.rollout_timeout_s is not None and not self.rollout_timeout_s > 0:
            raise ClawstreamError(f"--rollout-timeout must be > 0 seconds, got {self.rollout_timeout_s}")

    def key(self) -> str:
        """A digest of everything that decides the result except the model (for caching)."""
        fields = {k: v for k, v in asdict(self).items() if k not in ("concurrency", "timeout_s")}
        for name in ("rollout_timeout_s", "sampling_seed"):  # absent as before they existed: old results stay found
            if fields[name] is None:
                del fields[name]
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class EvalResult:
    model: str
    config: EvalConfig
    rows: list[EvalScore]
    seconds: float
    table: str
    extra: dict[str, Any] = field(default_factory=dict)

    def row(self, harness: str, mode: str) -> EvalScore | None:
        return next((r for r in self.rows if r.harness == harness and r.mode == mode), None)

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "config": asdict(self.config),
            "rows": [r.as_dict() for r in self.rows],
            "seconds": round(self.seconds, 1),
            "table": self.table,
            **self.extra,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> EvalResult:
        cfg = {"sampling_seed": None, **data["config"]}  # results from before seeding were unseeded
        config = EvalConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in cfg.items()})
        rows = [EvalScore(**r) for r in data["rows"]]
        extra = {k: data[k] for k in ("per_task", "timed_out") if k in data}
        return cls(data["model"], config, rows, data["seconds"], data["table"], extra)

    def timed_out(self) -> int:
        """Rollouts killed at the task timeout (graded as they stood); 0 for results from before it was counted."""
        return sum(self.extra.get("timed_out", {}).values())

    def task_rewards(self, harness: str, mode: str) -> dict[str, float]:
        """Task id → its graded reward in this cell (empty when the result predates per-task records)."""
        return dict(self.extra.get("per_task", {}).get(f"{harness}/{mode}", {}))


def per_task_rewards(issued: dict[str, Any], final: dict[str, Any]) -> dict[str, dict[str, float]]:
    """``"harness/mode"`` → task id → graded reward (the mean when a task ran more than once), so two evaluations of
    the same tasks can be compared task by task (a paired standard error: ``clawstream.demo.report``)."""
    from producers.scheduler.plan import EVAL_MODE_KEY
    from schemas.events import RewardStatus

    cells: dict[str, dict[str, list[float]]] = {}
    for rid, req in issued.items():
        reward = final.get(rid)
        if reward is None or reward.status != RewardStatus.OK or reward.reward is None:
            continue
        key = f"{req.harness}/{req.metadata.get(EVAL_MODE_KEY, 'sampled')}"
        cells.setdefault(key, {}).setdefault(req.task_id, []).append(reward.reward)
    return {key: {t: sum(v) / len(v) for t, v in sorted(tasks.items())} for key, tasks in cells.items()}


def timed_out_by_cell(issued: Mapping[str, Any], events: Iterable[Any]) -> dict[str, int]:
    """``"harness/mode"`` → how many of the evaluation's rollouts were killed at the task timeout (a rollout once,
    whatever its attempts). A loaded machine's timeout is graded 0 like the policy's own, so a result with many is
    a measurement of the machine, not only of the model (``clawstream.demo.run.cached_eval`` does not keep it)."""
    from producers.scheduler.plan import EVAL_MODE_KEY
    from schemas.events import RolloutState

    timed_out = {e.rollout_id for e in events if e.state == RolloutState.TIMED_OUT and e.rollout_id in issued}
    cells: dict[str, int] = {}
    for rid in sorted(timed_out):
        req = issued[rid]
        key = f"{req.harness}/{req.metadata.get(EVAL_MODE_KEY, 'sampled')}"
        cells[key] = cells.get(key, 0) + 1
    return cells


def read_rollout_events(kafka: KafkaSettings, timeout: float = 60.0) -> list[Any]:
    """Every decodable lifecycle event under ``kafka``'s prefix, from the beginning to the topic's current end."""
    from clawbase.kafka.clients import assign_from_beginning, make_consumer, read_to_end
    from schemas.events import RolloutEvent
    from schemas.topics import ROLLOUT_EVENTS

    consumer = make_consumer(kafka, f"{kafka.topic_prefix}eval-timeouts-{secrets.token_hex(4)}")
    events = []
    try:
        name = kafka.topic(ROLLOUT_EVENTS)
        ends = assign_from_beginning(consumer, name, timeout, missing_ok=True)
        for msg in read_to_end(consumer, name, ends, timeout=timeout):
            try:
                events.append(RolloutEvent.from_bytes(msg.value() or b""))
            except CodecError:  # not this reader's to judge: the consumers dead-letter what they cannot decode
                continue
    finally:
        consumer.close()
    return events


def resolve_suite(cfg: EvalConfig, home: Path | None = None) -> tuple[dict[str, str], str, int]:
    """(suites name → spec for the worker and scheduler, the suite name to evaluate, the task limit)."""
    if cfg.suite == BUILTIN_CPU and cfg.split == "heldout" and (cfg.tasks == 0 or cfg.tasks > BUILTIN_HELDOUT):
        if cfg.tasks == 0:
            return {"cpu_builtin": BUILTIN_CPU}, "cpu_builtin", 0
        return {"cpu_heldout": f"native:{extended_heldout(cfg.tasks, cfg.seed, home)}"}, "cpu_heldout", cfg.tasks
    return {"eval": cfg.suite}, "eval", cfg.tasks


def extended_heldout(n: int, seed: int = 0, home: Path | None = None) -> Path:
    """The first ``n`` tasks of the warm start's held-out split as a native suite directory (written once)."""
    from producers.tasks.native import write_native_task
    from warmstart.demos import heldout_tasks

    root = (home or clawstream_home()) / "suites" / f"cpu-heldout-{n}-seed{seed}"
    if (root / ".complete").exists():
        return root
    partial = root.with_name(root.name + f".partial-{secrets.token_hex(4)}")
    for task in heldout_tasks(n, seed):
        write_native_task(task, partial / task.task_id)
    (partial / ".complete").write_text(f"{n}\n")
    try:
        partial.rename(root)
    except OSError:  # another evaluation wrote it meanwhile: theirs is the same
        import shutil

        shutil.rmtree(partial, ignore_errors=True)
    return root


def run_eval(
    model: Path,
    cfg: EvalConfig,
    *,
    kafka: KafkaSettings | None = None,
    run_dir: Path | None = None,
    label: str = "held-out eval",
    progress: bool = True,
    say: Callable[[str], None] = print,
) -> EvalResult:
    """Evaluate ``model``: start engine + proxy + sandbox worker under a fresh topic prefix, run the scheduler's eval
    mode, stop them. ``kafka``: the broker to use (its prefix is replaced); default: as ``clawstream demo`` finds
    one. Logs and ``eval.json`` go to ``run_dir`` (default ``$CLAWSTREAM_HOME/eval/<time>``)."""
    from producers.scheduler.service import Scheduler
    from producers.scheduler.settings import SchedulerSettings

    if not (Path(model) / "config.json").exists():
        raise ClawstreamError(f"--model {model}: not a model directory (no config.json)")
    stamp = time.strftime("%Y%m%d-%H%M%S") + f"-{secrets.token_hex(2)}"
    run_dir = run_dir or clawstream_home() / "eval" / stamp
    prefix = f"eval-{stamp}."
    settings = run_kafka(prefix, say) if kafka is None else _with_prefix(kafka, prefix)
    suites, suite_name, limit = resolve_suite(cfg)
    stack = stack_for(settings, run_dir / "logs")
    started = time.monotonic()
    try:
        say(
            f"==> {label}: {model} ({', '.join(cfg.harnesses)} × {limit or 'all'} {cfg.split} tasks × "
            f"{' + '.join(cfg.modes)}; logs in {run_dir / 'logs'})"
        )
        start_rollout_side(
            stack,
            Path(model),
            engine=cfg.engine,
            concurrency=cfg.concurrency,
            suites=suites,
            max_batch_size=max(16, cfg.concurrency),
            task_timeout_s=cfg.rollout_timeout_s,
        )
        scheduler = Scheduler(
            SchedulerSettings(
                suite=suite_name,
                suites=suites,
                eval_split=cfg.split,
                eval_limit=limit,
                eval_harnesses=list(cfg.harnesses),
                eval_modes=list(cfg.modes),
                temperature=cfg.temperature,
                top_p=cfg.top_p,
                max_tokens=cfg.max_tokens,
                eval_timeout_s=cfg.timeout_s,
                timeout_s=cfg.rollout_timeout_s,
                eval_seed=cfg.sampling_seed,
            ),
            settings,
        )
        rows = asyncio.run(scheduler.evaluate_scores(_progress(stack, label, progress)))
    finally:
        stack.stop()
    result = EvalResult(str(model), cfg, rows, time.monotonic() - started, eval_table(rows, scheduler.sampling_note()))
    result.extra["per_task"] = per_task_rewards(scheduler.issued, scheduler.outstanding.final)
    result.extra["topic_prefix"] = prefix  # the run's topics stay on the broker: replay, audit, compare reruns
    result.extra["timed_out"] = timed_out_by_cell(scheduler.issued, read_rollout_events(settings))
    if result.timed_out():
        say(f"    ({result.timed_out()} rollouts were killed at the task timeout and graded as they stood)")
    missing = sum(r.pending + r.infra + r.ungraded for r in rows)
    if missing:
        say(f"    ({missing} rollouts without a reward: infra failures, ungraded or timed out; see the logs)")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "eval.json").write_text(json.dumps(result.to_json(), indent=2) + "\n")
    return result


def _with_prefix(kafka: KafkaSettings, prefix: str) -> KafkaSettings:
    from clawbase.kafka.clients import create_topics

    settings = kafka.model_copy(update={"topic_prefix": prefix})
    create_topics(settings, CATALOG)
    return settings


def _progress(stack: Stack, label: str, enabled: bool) -> Callable[[int, int], None]:
    """A progress callback for ``Scheduler.evaluate_scores`` that also notices a service dying."""
    bar: Any = None

    def update(done: int, total: int) -> None:
        nonlocal bar
        stack.check()
        if bar is None:
            bar = progress_bar(total, label, "rollout", enabled=enabled)
        if done > bar.n:
            bar.update(done - bar.n)
        if done >= total and not getattr(bar, "closed", False):
            bar.close()
            bar.closed = True

    return update
