"""Several demo runs side by side (e.g. three seeds of one recipe): the before/after table, the plot, the commands.

In: each run's ``summary.json`` (``$CLAWSTREAM_HOME/demo/<run>/``, written by ``clawstream demo``). Out: a markdown
table per harness and mode with every run's held-out gain ± paired s.e. and the mean over runs (± the s.e. of that
mean across runs), each run's command line rebuilt from its recorded config, and a PNG: training reward per step per
harness and run (left), held-out gain per harness, mode and run with ±1 s.e. (right). No Kafka; plain values.

Run: ``clawstream demo-seeds RUN [RUN ...] --out DIR`` (DIR/seeds.md, DIR/seeds.png).
"""

from __future__ import annotations

import json
import math
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clawbase.errors import ClawstreamError
from clawstream.demo import families

# DemoConfig field → the `clawstream demo` flag that sets it (the ones a run's recipe is made of).
FLAGS = {
    "model": "--model",
    "harnesses": "--harnesses",
    "steps": "--steps",
    "tasks_per_step": "--tasks-per-step",
    "group_size": "--group-size",
    "lr": "--lr",
    "seed": "--seed",
    "curriculum": "--curriculum",
    "train_grader": "--train-grader",
    "eval_tasks": "--eval-tasks",
    "concurrency": "--concurrency",
    "rollout_timeout_s": "--rollout-timeout",
    "timeout_s": "--timeout",
    "engine": "--engine",
    "train_temperature": "--train-temperature",
    "eval_temperature": "--eval-temperature",
    "zero_variance": "--zero-variance",
}


@dataclass(frozen=True)
class Run:
    name: str
    summary: dict[str, Any]

    @property
    def config(self) -> dict[str, Any]:
        return dict(self.summary.get("config") or {})

    @property
    def rows(self) -> list[dict[str, Any]]:
        return list(self.summary.get("before_after") or [])

    def row(self, harness: str, mode: str) -> dict[str, Any] | None:
        return next((r for r in self.rows if r["harness"] == harness and r["mode"] == mode), None)


def load_run(path: Path) -> Run:
    """The run in directory ``path`` (its summary.json); a clear error where it is missing or has no evaluation."""
    summary_path = path / "summary.json"
    if not summary_path.exists():
        raise ClawstreamError(f"{path}: no summary.json (not a finished `clawstream demo` run; --resume it first)")
    try:
        summary = json.loads(summary_path.read_text())
    except json.JSONDecodeError as exc:
        raise ClawstreamError(f"{summary_path}: not JSON ({exc})") from exc
    if not summary.get("before_after"):
        raise ClawstreamError(f"{path}: no held-out before/after in summary.json (run with --eval-tasks > 0)")
    return Run(path.name, summary)


def command(cfg: dict[str, Any]) -> str:
    """The `clawstream demo` command line that runs this recorded config again."""
    parts = ["clawstream", "demo"]
    for field, flag in FLAGS.items():
        value = cfg.get(field)
        if value is None or value == "":  # unset (a string flag's default is "")
            continue
        if field == "model":  # recorded absolute; shown from the working directory where it lies below it
            value = _relative(Path(value))
        if isinstance(value, list | tuple):
            value = ",".join(str(v) for v in value)
        parts += [flag, f"{value:g}" if isinstance(value, float) else str(value)]
    for mode in cfg.get("eval_modes") or ():
        parts += ["--eval-mode", mode]
    for hp in cfg.get("hp") or ():
        parts += ["--hp", hp]
    if "zero_variance" not in cfg:  # recorded before the flag: its groups were kept
        parts += ["--zero-variance", "keep"]
    if cfg.get("logit_scale_lr") not in (None, 0.0) and not any(
        h.startswith("logit_scale_lr=") for h in cfg.get("hp") or ()
    ):
        parts += ["--hp", f"logit_scale_lr={cfg['logit_scale_lr']:g}"]
    return shlex.join(parts)


def _relative(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def mean_over_runs(gains: list[float]) -> tuple[float, float | None]:
    """(mean, its s.e. across runs: sample s.d. / sqrt(n)); no s.e. from one run."""
    mean = sum(gains) / len(gains)
    if len(gains) < 2:
        return mean, None
    var = sum((g - mean) ** 2 for g in gains) / (len(gains) - 1)
    return mean, math.sqrt(var / len(gains))


def _pm(value: float | None, se: float | None, signed: bool = True) -> str:
    if value is None:
        return "n/a"
    text = f"{value:+.3f}" if signed else f"{value:.3f}"
    return text + (f" ± {se:.3f}" if se is not None else "")


def keys(runs: list[Run]) -> list[tuple[str, str]]:
    """(harness, mode) pairs in the first run's order, then any the others add."""
    seen: list[tuple[str, str]] = []
    for run in runs:
        for r in run.rows:
            if (r["harness"], r["mode"]) not in seen:
                seen.append((r["harness"], r["mode"]))
    return seen


def table(runs: list[Run]) -> str:
    """Markdown: per harness and mode, each run's before → after (gain ± paired s.e., * where > 2 s.e.), and the
    mean gain over the runs ± its s.e. across runs."""
    head = "| harness | mode | n | " + " | ".join(f"seed {r.config.get('seed')} ({r.name})" for r in runs)
    lines = [head + " | mean gain over runs |", "|---|---|---|" + "---|" * len(runs) + "---|"]
    for harness, mode in keys(runs):
        cells, gains, ns = [], [], set()
        for run in runs:
            row = run.row(harness, mode)
            if row is None or row.get("gain") is None:
                cells.append("n/a")
                continue
            gains.append(row["gain"])
            ns.add(row.get("n_paired") or row.get("n_after"))
            mark = " *" if row.get("significant") else ""
            cells.append(f"{row['before']:.3f} → {row['after']:.3f} ({_pm(row['gain'], row['gain_se'])}{mark})")
        mean, se = mean_over_runs(gains) if gains else (None, None)
        n = "/".join(str(x) for x in sorted(ns, key=str)) or "n/a"
        lines.append(f"| {harness} | {mode} | {n} | " + " | ".join(cells) + f" | {_pm(mean, se)} |")
    return "\n".join(lines)


def report(runs: list[Run]) -> str:
    """The table, then every run's command."""
    modes = dict.fromkeys(mode for _, mode in keys(runs))
    results = [(run.summary.get("before") or {}, run.summary.get("after") or {}) for run in runs]
    per_family = families.family_tables(results, modes)
    out = [table(runs), "", "`*`: gain > 2 paired s.e."] + (["", per_family] if per_family else [])
    out += ["", "Commands:", "", "```"]
    out += [f"{command(run.config)}   # {run.name}" for run in runs]
    out.append("```")
    return "\n".join(out)


def plot(path: Path, runs: list[Run]) -> Path:
    """PNG: training reward per step per harness and run (left); held-out gain ± 1 s.e. per harness, mode, run
    (right)."""
    import matplotlib

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    for run in runs:
        curves: dict[str, list[tuple[int, float]]] = {}
        for m in sorted(run.summary.get("trained") or [], key=lambda m: m.get("step") or 0):
            for key, value in (m.get("values") or {}).items():
                if key.startswith("reward/") and key != "reward/mean":
                    curves.setdefault(key.removeprefix("reward/"), []).append((m.get("step") or 0, value))
        for harness, points in sorted(curves.items()):
            left.plot(
                [s for s, _ in points],
                [v for _, v in points],
                marker="o",
                label=f"{harness} seed {run.config.get('seed')}",
            )
    left.set(xlabel="training step", ylabel="mean reward of the step's rollouts", ylim=(0, 1), title="Training reward")
    left.grid(alpha=0.3)
    left.legend(loc="best", fontsize=7)
    pairs = keys(runs)
    width = 0.8 / max(1, len(runs))
    for i, run in enumerate(runs):
        rows = [run.row(h, m) for h, m in pairs]
        xs = [k + (i - (len(runs) - 1) / 2) * width for k in range(len(pairs))]
        right.bar(
            xs,
            [(r or {}).get("gain") or 0.0 for r in rows],
            width,
            yerr=[(r or {}).get("gain_se") or 0.0 for r in rows],
            capsize=3,
            label=f"seed {run.config.get('seed')}",
        )
    right.axhline(0, color="black", linewidth=0.8)
    right.set_xticks(range(len(pairs)), [f"{h}\n{m}" for h, m in pairs], fontsize=8)
    right.set(ylabel="held-out gain, after − before (± 1 paired s.e.)", title="Held-out gain per run")
    right.legend(loc="best", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
