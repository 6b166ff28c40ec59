"""Step attempts that outlive the learner (learner.attempts): counted on disk, per batch key, forgotten when done."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clawbase.errors import ClawstreamError
from learner.attempts import StepAttempts


def test_counts_survive_a_new_process_and_are_per_batch(tmp_path: Path) -> None:
    path = tmp_path / "trainer-state" / "step-attempts.json"
    first = StepAttempts(path)
    assert first.start("t[0]@9 b-2") == 1
    assert first.start("t[0]@14 b-3") == 1
    again = StepAttempts(path)  # what a restarted learner reads (each start is on disk before it returns)
    assert again.start("t[0]@9 b-2") == 2
    assert StepAttempts(path).count("t[0]@9 b-2") == 2 and StepAttempts(path).count("u[0]@9 b-2") == 0
    again.forget("t[0]@9 b-2")
    assert json.loads(path.read_text()) == {"t[0]@14 b-3": 1}
    assert not path.with_name(path.name + ".partial").exists()


def test_forgetting_an_unknown_batch_writes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "step-attempts.json"
    StepAttempts(path).forget("t[0]@4 b-1")
    assert not path.exists()


def test_a_damaged_file_names_itself_and_the_fix(tmp_path: Path) -> None:
    path = tmp_path / "step-attempts.json"
    path.write_text("[1, 2")
    with pytest.raises(ClawstreamError, match="step-attempts.json is not a JSON object.*delete it"):
        StepAttempts(path)
