"""The training-only partial-credit grader of ``replace`` cannot be gamed by a hostile workspace.

A per-line grader invites games: write every candidate word (one per line) and a naive grader that counts the
wanted lines found in the file gives full marks; delete the file, pad it, or leave it untouched, and a grader that
compares whatever lines exist gives credit for nothing done. Each attack below first beats honest do-nothing on
such a naive grader (so it is an attack), then scores 0 — never above honest do-nothing — on the shipped one
(``producers.tasks.cpu.PARTIAL_GRADE_PY``, run as the sandbox runs it: ``grading_rules`` invocation and parsing).
``test_the_guard_is_what_holds`` runs the shipped grader with its guard line removed: the attacks score again.
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
