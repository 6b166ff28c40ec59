"""The quickstart's results for people: the before/after table, the PNG plot (with the per-version held-out evidence
of ``evidence.py`` where the run measured it), TensorBoard scalars, summary.json.

Inputs are plain values (the learner's ``train_step`` metrics, two ``EvalResult``s), no Kafka. The gain's standard
error is paired where both results record each task's reward (the same tasks before and after): the s.e. of the
mean per-task difference over the tasks graded in both (``se_kind`` "paired"). Otherwise (a result cached before
per-task records) it is sqrt(se_before² + se_after²), as if independent: conservative (``se_kind`` "independent").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from clawstream.stack.evaluate import EvalResult
from schemas.events import Metric


def gain(before: Any, after: Any) -> tuple[float | None, float | None]:
    """(after − before, its standard error) of two EvalScore rows; None where a mean or an error is missing."""
    if before is None or after is None or before.mean is None or after.mean is None:
        return None, None
    if before.stderr is None or after.stderr is None:
        return after.mean - before.mean, None
    return after.mean - before.mean, math.hypot(before.stderr, after.stderr)


def paired_gain(before: dict[str, float], after: dict[str, float]) -> tuple[float | None, float | None, int]:
    """(mean of after − before over the tasks in both, its standard error, how many tasks); None without two."""
    common = sorted(before.keys() & after.keys())
    diffs = [after[t] - before[t] for t in common]
    if len(diffs) < 2:
        return None, None, len(diffs)
    mean = sum(diffs) / len(diffs)
    var = sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1)
    return mean, math.sqrt(var / len(diffs)), len(diffs)


def _pm(mean: float | None, se: float | None, signed: bool = False) -> str:
    if mean is None:
        return "n/a"
    text = f"{mean:+.3f}" if signed else f"{mean:.3f}"
    return text + (f" ± {se:.3f}" if se is not None else "")


def before_after_rows(before: EvalResult, after: EvalResult) -> list[dict[str, Any]]:
    rows = []
    for b in before.rows:
        a = after.row(b.harness, b.mode)
        g, g_se = gain(b, a)
        pg, pg_se, n_paired = paired_gain(before.task_rewards(b.harness, b.mode), after.task_rewards(b.harness, b.mode))
        paired = pg is not None and pg_se is not None
        if paired:  # the same tasks: the task-to-task spread cancels out of the difference
            g, g_se = pg, pg_se
        rows.append(
            {
                "harness": b.harness,
                "mode": b.mode,
                "n_before": b.graded,
                "n_after": a.graded if a else 0,
                "before": b.mean,
                "before_se": b.stderr,
                "after": a.mean if a else None,
                "after_se": a.stderr if a else None,
                "gain": g,
                "gain_se": g_se,
                "se_kind": "paired" if paired else "independent",
                "n_paired": n_paired,
                "solved_before": b.solved,
                "solved_after": a.solved if a else None,
                "significant": g is not None and g_se is not None and g > 2 * g_se,
            }
        )
    return rows


def before_after_table(before: EvalResult, after: EvalResult) -> str:
    """Markdown: per harness and mode, held-out mean reward ± s.e. before and after, the gain ± s.e., solved."""
    lines = ["| harness | mode | n | before | after | gain | solved before → after |", "|---|---|---|---|---|---|---|"]
    for r in before_after_rows(before, after):
        solved = (
            f"{r['solved_before']:.1%} → {r['solved_after']:.1%}"
            if r["solved_before"] is not None and r["solved_after"] is not None
            else "n/a"
        )
        mark = " (> 2 s.e.)" if r["significant"] else ""
        lines.append(
            f"| {r['harness']} | {r['mode']} | {r['n_after']} | {_pm(r['before'], r['before_se'])} | "
            f"{_pm(r['after'], r['after_se'])} | {_pm(r['gain'], r['gain_se'], signed=True)}{mark} | "
            f"{solved} |"
        )
    return "\n".join(lines)


def reward_curves(trained: Sequence[Metric]) -> dict[str, list[tuple[int, float]]]:
    """Harness → [(step, mean reward of that step's training rollouts)] from the learner's metrics."""
    curves: dict[str, list[tuple[int, float]]] = {}
    for m in sorted(trained, key=lambda m: m.step or 0):
        for key, value in m.values.items():
            if key.startswith("reward/") and key != "reward/mean":
                curves.setdefault(key.removeprefix("reward/"), []).append((m.step or 0, value))
    return curves


def plot(
    path: Path,
    trained: Sequence[Metric],
    before: EvalResult | None,
    after: EvalResult | None,
    evidence: Sequence[dict[str, Any]] | None = None,
) -> Path:
    """PNG: training reward per harness per step (left) and held-out reward before/after per harness and mode with
    ±1 s.e. error bars (right); with ``evidence`` (summary.json's rows) a second row: each version's held-out
    correct-episode log-likelihood change and greedy slice (``evidence.draw``)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed, none is assumed
    import matplotlib.pyplot as plt

    rows = 2 if evidence else 1
    fig, axes = plt.subplots(rows, 2, figsize=(12, 4.5 * rows), gridspec_kw={"width_ratios": [3, 2]}, squeeze=False)
    (left, right) = axes[0]
    if evidence:
        from clawstream.demo.evidence import draw

        draw(axes[1][0], axes[1][1], evidence)
    for harness, points in sorted(reward_curves(trained).items()):
        left.plot([s for s, _ in points], [r for _, r in points], marker="o", label=harness)
    left.set(
        xlabel="training step",
        ylabel="mean reward of the step's rollouts",
        ylim=(0, 1),
        title="Reward per harness per step (training rollouts)",
    )
    left.xaxis.get_major_locator().set_params(integer=True)
    left.grid(alpha=0.3)
    left.legend(loc="best")
    if before is not None and after is not None:
        rows = before_after_rows(before, after)
        labels = [f"{r['harness']}\n{r['mode']}" for r in rows]
        xs = list(range(len(rows)))
        width = 0.38
        for offset, key, name in ((-width / 2, "before", "before (warm start)"), (width / 2, "after", "after RL")):
            values = [r[key] if r[key] is not None else 0.0 for r in rows]
            errors = [r[f"{key}_se"] or 0.0 for r in rows]
            right.bar([x + offset for x in xs], values, width, yerr=errors, capsize=3, label=name)
        right.set_xticks(xs, labels, fontsize=8)
        n = max((r["n_after"] for r in rows), default=0)
        right.set(
            ylabel="held-out mean reward (± 1 s.e.)", ylim=(0, 1), title=f"Held-out before / after ({n} tasks per bar)"
        )
        right.legend(loc="upper left", fontsize=8)
    else:
        right.set_axis_off()
        right.text(0.5, 0.5, "no held-out evaluation in this run", ha="center", va="center")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def tensorboard_eval(log_dir: Path, before: EvalResult, after: EvalResult, last_step: int) -> bool:
    """Held-out scalars ``eval/<mode>/<harness>`` (mean, s.e., solved) at step 0 (before) and ``last_step`` (after)
    beside the learner's scalars; False when TensorBoard is not installed."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return False
    writer = SummaryWriter(str(log_dir / "eval"))
    try:
        for result, step in ((before, 0), (after, last_step)):
            for r in result.rows:
                if r.mean is None:
                    continue
                writer.add_scalar(f"eval/{r.mode}/{r.harness}/mean_reward", r.mean, step)
                if r.stderr is not None:
                    writer.add_scalar(f"eval/{r.mode}/{r.harness}/stderr", r.stderr, step)
                if r.solved is not None:
                    writer.add_scalar(f"eval/{r.mode}/{r.harness}/solved", r.solved, step)
    finally:
        writer.close()
    return True
