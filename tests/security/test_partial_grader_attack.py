"""The training-only partial-credit grader of ``replace`` cannot be gamed by a hostile workspace.

A per-line grader invites games: write every candidate word (one per line) and a naive grader that counts the
wanted lines found in the file gives full marks; delete the file, pad it, or leave it untouched, and a grader that
compares whatever lines exist gives credit for nothing done. Each attack below first beats honest do-nothing on
such a naive grader (so it is an attack), then scores 0 — never above honest do-nothing — on the shipped one
(``producers.tasks.cpu.PARTIAL_GRADE_PY``, run as the sandbox runs it: ``grading_rules`` invocation and parsing).
``test_the_guard_is_what_holds`` runs the shipped grader with its guard line removed: the attacks score again;
``test_graded_inside_the_sandbox`` grades through `clawstream tasks grade` in a real (bubblewrap) sandbox.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from producers.tasks import cpu
from producers.tasks.model import Task
from warmstart.episodes import grade_workspace


def replace_task() -> Task:
    suite = cpu.cpu_suite(train_grader="partial")
    return next(t for t in suite.split("train") if t.metadata["template"] == "replace")


def target(task: Task) -> tuple[str, list[str], list[str]]:
    checks = json.loads(task.grader.files["checks.json"])
    (check,) = checks
    return check["path"], check["before"], check["lines"]


def naive_score(text: str | None, want: list[str]) -> float:
    """A per-line grader without guards: the fraction of wanted lines found anywhere in the file."""
    if text is None:
        return 0.0
    got = {s.strip() for s in text.splitlines()}
    return sum(line in got for line in want) / len(want)


ATTACKS: dict[str, Callable[[list[str], list[str]], list[str] | None]] = {
    # Every candidate word, one per line: contains the answer whatever it is.
    "every_candidate": lambda before, want: list(dict.fromkeys(before + list(cpu.WORDS))),
    # The untouched lines twice, then every candidate for the changed one.
    "padded": lambda before, want: before + before + list(cpu.WORDS),
    # The original plus the new word appended (old word kept).
    "original_plus_answer": lambda before, want: before + [w for w in want if w not in before],
}


def _run(task: Task, tmp: Path, lines: list[str] | None, name: str) -> tuple[float, str | None]:
    ws = tmp / name
    ws.mkdir()
    path, before, _ = target(task)
    if lines is not None:
        (ws / path).write_text("\n".join(lines) + "\n")
    text = (ws / path).read_text() if (ws / path).exists() else None
    reward, _ = grade_workspace(task, ws)
    return reward, text


def _nothing(task: Task, tmp: Path, name: str = "nothing") -> tuple[float, str | None]:
    _, before, _ = target(task)
    return _run(task, tmp, before, name)


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_attack_beats_nothing_on_a_naive_grader_and_scores_zero_here(attack: str, tmp_path: Path) -> None:
    task = replace_task()
    _, before, want = target(task)
    honest, honest_text = _nothing(task, tmp_path)
    hostile, hostile_text = _run(task, tmp_path, ATTACKS[attack](before, want), attack)
    assert naive_score(hostile_text, want) > naive_score(honest_text, want), "not an attack on the naive grader"
    assert hostile == 0.0 and hostile <= honest


def test_deleting_or_replacing_the_file_scores_zero(tmp_path: Path) -> None:
    task = replace_task()
    path, _, want = target(task)
    deleted, _ = _run(task, tmp_path, None, "deleted")
    ws = tmp_path / "dir"
    ws.mkdir()
    (ws / path).mkdir()  # a directory where the file was
    as_dir, _ = grade_workspace(task, ws)
    ws = tmp_path / "link"
    ws.mkdir()
    (ws / "elsewhere.txt").write_text("\n".join(want) + "\n")
    (ws / path).symlink_to("elsewhere.txt")  # the answer, but not in the file
    linked, _ = grade_workspace(task, ws)
    assert (deleted, as_dir, linked) == (0.0, 0.0, 0.0)


def test_the_guard_is_what_holds(tmp_path: Path) -> None:
    """The shipped grader with its guard removed gives the attacks credit: the guard is the defence."""
    task = replace_task()
    guard = "valid = got is not None and len(got) == len(want) and got != before"
    assert guard in cpu.PARTIAL_GRADE_PY
    weak_py = cpu.PARTIAL_GRADE_PY.replace(guard, "valid = got is not None")
    files = {**task.grader.files, "grade.py": weak_py.encode()}
    weak = dataclasses.replace(task, grader=dataclasses.replace(task.grader, files=files))
    _, before, want = target(task)
    attacked, _ = _run(weak, tmp_path, ATTACKS["padded"](before, want), "padded")
    nothing, _ = _nothing(weak, tmp_path)
    assert attacked > 0.0 and nothing > 0.0  # the unguarded copy pays for padding and for doing nothing


def test_graded_inside_the_sandbox(tmp_path: Path) -> None:
    """The variant is a grader like any other: `clawstream tasks grade` runs it in a fresh sandbox (bubblewrap)."""
    import subprocess
    import sys

    from tests.support.sandbox_helpers import require_bwrap

    require_bwrap()
    task = replace_task()
    path, before, want = target(task)
    wrong = [("peach" if w != "peach" else "pear") if b != w else w for b, w in zip(before, want, strict=True)]
    got = {}
    for name, lines in {"wrong_word": wrong, "every_candidate": ATTACKS["every_candidate"](before, want)}.items():
        ws = tmp_path / name
        ws.mkdir()
        (ws / path).write_text("\n".join(lines) + "\n")
        argv = [
            "-m",
            "clawstream",
            "tasks",
            "grade",
            task.task_id,
            str(ws),
            "--suite",
            "builtin:cpu?train_grader=partial",
        ]
        out = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=300, check=True).stdout
        got[name] = next(line for line in out.splitlines() if line.startswith("reward "))
    assert got["wrong_word"].startswith("reward 0.666667  (OK, grader cpu_lines_partial")
    assert got["every_candidate"].startswith("reward 0.0  (OK, grader cpu_lines_partial")
