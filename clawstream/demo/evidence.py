"""Per-version evidence of skill while the quickstart trains: each published weight version's held-out log-likelihood
of scripted correct episodes and greedy solve rate on a small fixed slice (``warmstart.heldout_evidence``).

In the demo a background process (one torch thread, niced: the engine and the learner own the cores) loads each
version the learner publishes, checked against the sha256 of its ``clawstream.weights`` event, and measures it; the
warm start is version 0, the base every change is paired against. When it falls behind it measures the newest version
and skips the rest, saying so. The watcher (``watch.py``) hands it the weights events and prints its lines. Written to
the run directory: ``evidence.jsonl`` (one line per version: the numbers and every episode's values) and
``evidence.png`` (the curve); summary.json's ``evidence``.

Topics: none here (the watcher reads ``clawstream.weights``). For a model or a finished run::

    clawstream model evidence --model DIR [--versions RUN_DIR]    # or python -m clawstream.demo.evidence
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import queue
import re
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

JSONL = "evidence.jsonl"
PNG = "evidence.png"
NICE = 10  # the worker yields the cores to the engine and the learner while they are busy


def read_rows(run_dir: Path) -> list[dict[str, Any]]:
    """The rows of ``run_dir/evidence.jsonl`` (none when absent), the last row of each version kept, by version."""
    path = run_dir / JSONL
    rows: dict[int, dict[str, Any]] = {}
    if path.exists():
        for text in path.read_text().splitlines():
            if text.strip():
                row = json.loads(text)
                rows[row["version"]] = row
    return [rows[v] for v in sorted(rows)]


class Measurer:
    """The model, the fixed slices and the warm start's record; measures one version at a time (in one process)."""

    def __init__(self, model_dir: Path, run_dir: Path, ll_tasks: int, greedy_tasks: int, seed: int) -> None:
        from warmstart import heldout_evidence as he

        self.he, self.run_dir = he, run_dir
        self.model, self.tokenizer = he.load_model(model_dir)
        self.slices = he.build_slices(self.tokenizer, ll_tasks, greedy_tasks, seed)
        self.base_state = {k: v.clone() for k, v in self.model.state_dict().items()}
        self.done = {r["version"]: r for r in read_rows(run_dir)}
        base = self.done.get(0)
        self.base = base["record"] if base is not None else None

    def measure(self, version: int, weights: Path | None = None, sha256: str | None = None) -> dict[str, Any]:
        """Measure ``version`` (0: the model directory itself), append its row to evidence.jsonl, return the row."""
        if self.base is None and version != 0:
            self.measure(0)
        if weights is None:
            self.model.load_state_dict(self.base_state)
        else:
            self.he.load_version(self.model, weights, sha256)
        record = self.he.measure(self.model, self.tokenizer, self.slices)
        if version == 0:
            self.base = record
        assert self.base is not None
        summary = self.he.compare(record, self.base)
        row = {"version": version, "time": time.time(), **summary, "record": record}
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with (self.run_dir / JSONL).open("a") as out:
            out.write(json.dumps(row) + "\n")
        self.done[version] = row
        return row


def pick(items: Sequence[Any], done: Any) -> tuple[Any, list[int]]:
    """Of the versions waiting, (the newest not yet measured, the older ones skipped for it); (None, []) when none."""
    todo = sorted({v for v in items if v is not None and v[0] not in done})
    return (todo[-1], [v[0] for v in todo[:-1]]) if todo else (None, [])


def _work(args: tuple[Path, Path, int, int, int], inbox: Any, outbox: Any) -> None:
    """The worker process: versions (version, weights URI, sha256) in, ('row'|'skip'|'error', ...) out; None ends
    it after the newest version waiting."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the demo's to handle: it ends this process
    os.nice(NICE)
    import torch
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(1)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        measurer = Measurer(*args)
        if 0 not in measurer.done:
            outbox.put(("row", measurer.measure(0)))
    except Exception as exc:  # reported and ended: the demo goes on without evidence
        outbox.put(("error", f"evidence worker could not start: {exc!r}"))
        return
    ending = False
    while not ending:
        items = [inbox.get()]
        while True:
            try:
                items.append(inbox.get_nowait())
            except queue.Empty:
                break
        ending = None in items
        newest, skipped = pick(items, measurer.done)
        if newest is None:
            continue
        version, uri, sha256 = newest
        if skipped:
            outbox.put(("skip", skipped, version))
        try:
            from policy.weight_store import resolve_uri

            outbox.put(("row", measurer.measure(version, resolve_uri(uri), sha256)))
        except Exception as exc:  # one bad version is reported; the next may be fine
            outbox.put(("error", f"evidence v{version} failed: {exc!r}"))


class Evidence:
    """The demo's side of the worker: ``submit`` each weights event, ``poll`` for printed lines, ``finish`` at the
    end (waits for the newest version, then writes the curve)."""

    def __init__(self, model: Path, run_dir: Path, *, ll_tasks: int, greedy_tasks: int, seed: int) -> None:
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: nothing of the demo's threads or clients
        self.run_dir = run_dir
        self.inbox: Any = ctx.Queue()
        self.outbox: Any = ctx.Queue()
        self.rows: dict[int, dict[str, Any]] = {r["version"]: r for r in read_rows(run_dir)}
        self.skipped: list[int] = []
        self.process = ctx.Process(
            target=_work,
            args=((model, run_dir, ll_tasks, greedy_tasks, seed), self.inbox, self.outbox),
            name="clawstream-evidence",
            daemon=True,  # never outlives the demo, however it ends
        )
        self.process.start()

    def submit(self, event: Any) -> None:
        """A published weight version (``schemas.events.WeightVersion``) to measure."""
        if event.policy_version not in self.rows:
            self.inbox.put((event.policy_version, event.uri, event.sha256))

    def poll(self) -> list[str]:
        """The lines of whatever the worker finished since the last call (never waits)."""
        lines = []
        while True:
            try:
                message = self.outbox.get_nowait()
            except queue.Empty:
                return lines
            lines.append(self._take(message))

    def _take(self, message: tuple[Any, ...]) -> str:
        from warmstart.heldout_evidence import line

        kind = message[0]
        if kind == "row":
            row = message[1]
            self.rows[row["version"]] = row
            return line(row["version"], row)
        if kind == "skip":
            self.skipped += message[1]
            names = ", ".join(f"v{v}" for v in message[1])
            return f"evidence: behind, skipping {names}; measuring v{message[2]}"
        return str(message[1])

    def finish(self, say: Callable[[str], None], timeout_s: float = 900.0) -> list[dict[str, Any]]:
        """Wait (at most ``timeout_s``) for the versions submitted so far (the newest at least), printing their lines;
        the rows by version."""
        self.inbox.put(None)
        deadline = time.monotonic() + timeout_s
        while self.process.is_alive() and time.monotonic() < deadline:
            for text in self.poll():
                say(f"==> {text}")
            self.process.join(0.5)
        for text in self.poll():
            say(f"==> {text}")
        if self.process.is_alive():
            say(f"==> evidence: the worker did not finish within {timeout_s:.0f} s; stopped")
        self.close()
        return [self.rows[v] for v in sorted(self.rows)]

    def close(self) -> None:
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(10)


def curve(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows without their per-episode records: what summary.json keeps."""
    return [{k: v for k, v in r.items() if k != "record"} for r in rows]


def plot(path: Path, rows: Sequence[dict[str, Any]], title: str = "") -> Path:
    """PNG: per version, the change of the held-out correct episodes' log-likelihood vs the warm start (± 1 paired
    s.e.), the greedy slice's mean reward and solve rate, and the log-likelihood change per task family."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right, fams) = plt.subplots(1, 3, figsize=(15, 3.6))
    draw(left, right, rows)
    draw_families(fams, rows)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def draw(left: Any, right: Any, rows: Sequence[dict[str, Any]]) -> None:
    """The two panels of :func:`plot` on given axes (the demo's learning.png draws them too)."""
    xs = [r["version"] for r in rows]
    n = rows[0]["ll_episodes"] if rows else 0
    left.errorbar(
        xs, [r["ll_change"] or 0.0 for r in rows], yerr=[r["ll_change_se"] or 0.0 for r in rows], marker="o", capsize=3
    )
    left.axhline(0, color="grey", lw=0.8)
    left.set(
        xlabel="weight version (0 = warm start)",
        ylabel="Δ log-lik per episode (± 1 paired s.e.)",
        title=f"Held-out correct episodes ({n}): log-likelihood vs warm start",
    )
    greedy = [r for r in rows if r.get("greedy_reward") is not None]
    if greedy:
        g = greedy[0]["greedy_episodes"]
        right.plot([r["version"] for r in greedy], [r["greedy_reward"] for r in greedy], marker="o", label="reward")
        right.plot([r["version"] for r in greedy], [r["greedy_solved"] for r in greedy], marker="s", label="solved")
        right.legend(loc="best", fontsize=8)
        right.set(ylim=(0, 1), title=f"Greedy on a fixed held-out slice ({g} episodes)")
    right.set(xlabel="weight version (0 = warm start)")
    for ax in (left, right):
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3)


def family_changes(rows: Sequence[dict[str, Any]]) -> list[dict[str, dict[str, Any]]]:
    """Each row's per-family log-likelihood change; rows written before it was recorded get it from their episodes."""
    from warmstart.heldout_evidence import by_family

    base = next((r.get("record") for r in rows if r["version"] == 0), None)
    out = []
    for r in rows:
        if "ll_change_by_family" in r:
            out.append(r["ll_change_by_family"])
        elif base is not None and "record" in r:
            out.append(by_family(base["ll"], r["record"]["ll"]))
        else:
            out.append({})
    return out


def draw_families(ax: Any, rows: Sequence[dict[str, Any]]) -> None:
    """One line per task family: the mean change of its held-out correct episodes' log-likelihood per version."""
    per_row = family_changes(rows)
    for fam in sorted({f for fams in per_row for f in fams}):
        pts = [(r["version"], fams[fam]["change"]) for r, fams in zip(rows, per_row, strict=True) if fam in fams]
        pts = [(v, c) for v, c in pts if c is not None]
        if pts:
            ax.plot([v for v, _ in pts], [c for _, c in pts], marker=".", label=fam)
    ax.axhline(0, color="grey", lw=0.8)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="best", fontsize=7, ncol=2)
    ax.set(
        xlabel="weight version (0 = warm start)",
        ylabel="Δ log-lik per episode",
        title="By task family: which skill moves",
    )
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)


# ---- the demo's hooks (clawstream/demo/run.py) ---------------------------------------------------------------------
def start_evidence(cfg: Any, run_dir: Path, model: Path, say: Callable[[str], None]) -> Evidence | None:
    """The worker for a run with ``--evidence on`` (None with off)."""
    if not cfg.evidence:
        return None
    say(
        f"==> evidence per version: {cfg.evidence_tasks} held-out correct episodes x 2 dialects (log-likelihood), "
        f"{cfg.evidence_greedy_tasks} x 2 greedy, in a background process ({run_dir / JSONL})"
    )
    return Evidence(model, run_dir, ll_tasks=cfg.evidence_tasks, greedy_tasks=cfg.evidence_greedy_tasks, seed=cfg.seed)


def finish_evidence(evidence: Evidence | None, run_dir: Path, summary: Any, say: Callable[[str], None]) -> None:
    """After RL: the newest version's evidence awaited, the curve drawn to evidence.png and put in summary.json."""
    if evidence is None:
        return
    rows = evidence.finish(say)
    if not rows:
        return
    png = plot(run_dir / PNG, rows, title=f"run {run_dir.name}")
    summary.update(evidence=curve(rows), evidence_skipped=sorted(evidence.skipped))
    say(f"==> evidence curve: {png} ({len(rows)} versions; {len(evidence.skipped)} skipped while behind)")


# ---- clawstream model evidence ---------------------------------------------------------------------------------------
def published_versions(run_dir: Path) -> list[tuple[int, Path]]:
    """(version, weights file) of every published version of a demo run (its weight store's ``vNNNNNN`` links)."""
    store = run_dir / "weights" / "policy"
    found = [(int(p.name[1:]), p / "model.safetensors") for p in store.glob("v*") if re.fullmatch(r"v\d{6}", p.name)]
    return sorted((v, w) for v, w in found if w.is_file())


def main(argv: list[str] | None = None) -> int:
    from warmstart.heldout_evidence import GREEDY_TASKS, LL_TASKS, line

    p = argparse.ArgumentParser(prog="clawstream model evidence", description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, required=True, help="the model directory (a run's warm start: version 0)")
    p.add_argument(
        "--versions",
        type=Path,
        metavar="RUN_DIR",
        help="also every published version of this demo run (RUN_DIR/weights/policy/vNNNNNN); rows go to "
        "RUN_DIR/evidence.jsonl (versions already there are kept), the curve to RUN_DIR/evidence.png",
    )
    p.add_argument("--tasks", type=int, default=LL_TASKS, help="held-out correct episodes, x 2 dialects (%(default)s)")
    p.add_argument("--greedy-tasks", type=int, default=GREEDY_TASKS, help="greedy slice, x 2 dialects (%(default)s)")
    p.add_argument("--seed", type=int, default=0, help="the held-out split's seed (the run's --seed) (%(default)s)")
    p.add_argument("--out", type=Path, help="where evidence.jsonl/.png go without --versions (default: print only)")
    a = p.parse_args(argv)
    if not (a.model / "config.json").exists():
        p.error(f"--model {a.model}: not a model directory (no config.json)")
    out = a.versions or a.out or Path(os.devnull)
    if out == Path(os.devnull):
        import tempfile

        out = Path(tempfile.mkdtemp(prefix="clawstream-evidence-"))
    measurer = Measurer(a.model, out, a.tasks, a.greedy_tasks, a.seed)
    versions = [(0, None), *published_versions(a.versions)] if a.versions else [(0, None)]
    for version, weights in versions:
        row = measurer.done.get(version) or measurer.measure(version, weights)
        print(line(version, row), flush=True)
    rows = read_rows(out)
    if a.versions or a.out:
        print(f"rows: {out / JSONL}; curve: {plot(out / PNG, rows, title=str(a.versions or a.model))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
