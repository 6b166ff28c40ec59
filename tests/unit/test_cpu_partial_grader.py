"""builtin:cpu's training-only per-line grader of ``replace`` (``builtin:cpu?train_grader=partial``).

Graded as the sandbox grades (``grading_rules`` invocation and parsing, the grader a subprocess): a wrong word in
the right place scores above doing nothing and below the answer; the held-out split (what evaluations run) keeps
its graders byte for byte — pinned to their digest before the variant existed.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from producers.tasks import cpu
from producers.tasks.catalog import load_suite
from producers.tasks.model import Suite, Task, TaskError
from warmstart.episodes import grade_workspace

# sha256 over the held-out tasks' graders (id, file names and bytes, argv, name) and of grade.py, computed on the
# suite before the training variant was added.
HELDOUT_GRADERS_SHA256 = "7da89cf587e3a5a9e62922f32d4f29c7b591e0406eb4ef8a97c7428c78ae325d"
GRADE_PY_SHA256 = "53469b933b7d9919db1479d7363d47aa214e9a50557156dd0493490f22ceb5fa"


def heldout_digest(suite: Suite) -> str:
    h = hashlib.sha256()
    for t in sorted(suite.tasks.values(), key=lambda t: t.task_id):
        if t.split == "heldout":
            for k in sorted(t.grader.files):
                h.update(t.task_id.encode() + k.encode() + t.grader.files[k])
            h.update(repr(t.grader.argv).encode() + t.grader.name.encode())
    return h.hexdigest()


def test_evaluation_graders_are_byte_identical() -> None:
    plain, partial = cpu.cpu_suite(), cpu.cpu_suite(train_grader="partial")
    assert heldout_digest(plain) == heldout_digest(partial) == HELDOUT_GRADERS_SHA256
    assert hashlib.sha256(cpu.GRADE_PY.encode()).hexdigest() == GRADE_PY_SHA256
    assert plain.split("heldout") == partial.split("heldout")
    loaded = load_suite("builtin:cpu?train_grader=partial", "cpu_builtin")
    assert loaded.split("heldout") == load_suite("builtin:cpu", "cpu_builtin").split("heldout")


def test_only_the_train_splits_replace_tasks_change() -> None:
    plain, partial = cpu.cpu_suite(), cpu.cpu_suite(train_grader="partial")
    changed = {t.task_id for t in partial.split("train") if t != plain.tasks[t.task_id]}
    replaces = {t.task_id for t in plain.split("train") if t.metadata["template"] == "replace"}
    assert changed == replaces and replaces
    assert {partial.tasks[i].grader.name for i in changed} == {"cpu_lines_partial"}


def _replace_pair() -> tuple[Task, Task]:
    partial = next(t for t in cpu.cpu_suite(train_grader="partial").split("train") if t.task_id.endswith("replace"))
    return cpu.cpu_suite().tasks[partial.task_id], partial


def _grade(task: Task, ws: Path, lines: list[str] | None) -> float:
    ws.mkdir(exist_ok=True)
    (check,) = json.loads(_replace_pair()[1].grader.files["checks.json"])
    for rel, data in task.files.items():
        (ws / rel).write_bytes(data)
    if lines is None:
        (ws / check["path"]).unlink()
    else:
        (ws / check["path"]).write_text("\n".join(lines) + "\n")
    reward, _ = grade_workspace(task, ws)
    return reward


def test_per_line_credit_orders_nothing_partial_answer(tmp_path: Path) -> None:
    exact, partial = _replace_pair()
    (check,) = json.loads(partial.grader.files["checks.json"])
    before, want = check["before"], check["lines"]
    wrong = [("peach" if w != "peach" else "pear") if b != w else w for b, w in zip(before, want, strict=True)]
    cases = {"nothing": before, "wrong_word": wrong, "answer": want, "deleted": None}
    got = {name: _grade(partial, tmp_path / f"p-{name}", lines) for name, lines in cases.items()}
    assert got == {"nothing": 0.0, "wrong_word": pytest.approx(2 / 3), "answer": 1.0, "deleted": 0.0}
    # The evaluation grader on the same workspaces: a wrong rewrite is worth what doing nothing is.
    old = {name: _grade(exact, tmp_path / f"e-{name}", lines) for name, lines in cases.items()}
    assert old == {"nothing": 0.5, "wrong_word": 0.5, "answer": 1.0, "deleted": 0.0}


@pytest.mark.parametrize("spec", ["builtin:cpu?train_grader=lines", "builtin:cpu?grader=partial"])
def test_unknown_options_name_what_is_known(spec: str) -> None:
    with pytest.raises(TaskError, match="known"):
        load_suite(spec)
