"""Step attempts that outlive the learner (learner.attempts): kept on disk per batch key, forgotten when done, and a
dead process's attempt judged out-of-memory only on evidence."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from clawbase.errors import ClawstreamError
from learner import attempts as A
from learner.attempts import DEATHS, StepAttempts, record_oom


def _dead_pid() -> int:
    """The pid of a process that has exited (a learner that died)."""
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(proc.stdout)


def _left_by(path: Path, pid: int, key: str = "t[0]@9 b-2", **fields: object) -> None:
    """The attempts file a process ``pid`` left when it died in ``key``'s training."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({key: {"starts": 1, "pid": pid, **fields}}))


def test_attempts_survive_a_new_process_and_are_per_batch(tmp_path: Path) -> None:
    path = tmp_path / "trainer-state" / "step-attempts.json"
    first = StepAttempts(path)
    assert first.start("t[0]@9 b-2") == 1
    assert first.start("t[0]@14 b-3") == 1
    again = StepAttempts(path)  # what a restarted learner reads (each start is on disk before it returns)
    assert again.start("t[0]@9 b-2") == 2
    assert StepAttempts(path).count("t[0]@9 b-2") == 2 and StepAttempts(path).count("u[0]@9 b-2") == 0
    again.forget("t[0]@9 b-2")
    assert list(json.loads(path.read_text())) == ["t[0]@14 b-3"]
    assert json.loads(path.read_text())["t[0]@14 b-3"]["pid"] == os.getpid()
    assert not path.with_name(path.name + ".partial").exists()


def test_a_death_without_evidence_is_not_out_of_memory(tmp_path: Path) -> None:
    path = tmp_path / "step-attempts.json"
    _left_by(path, _dead_pid())
    judged = StepAttempts(path)
    assert judged.count("t[0]@9 b-2") == 1 and judged.ooms("t[0]@9 b-2") is None
    assert json.loads(path.read_text())["t[0]@9 b-2"]["pid"] == 0  # judged once: a second restart judges nothing


def test_the_supervisors_record_makes_it_out_of_memory_once(tmp_path: Path) -> None:
    path = tmp_path / "step-attempts.json"
    pid = _dead_pid()
    _left_by(path, pid, estimate="≈ 9.00 GiB of the 8.00 GiB it may use")
    record = record_oom(tmp_path / DEATHS, pid, f"kernel: Out of memory: Killed process {pid} (python)")
    judged = StepAttempts(path).ooms("t[0]@9 b-2")
    assert judged is not None and judged.ooms == 1 and judged.evidence.startswith("kernel: Out of memory")
    assert judged.estimate == "≈ 9.00 GiB of the 8.00 GiB it may use" and not record.exists()
    assert StepAttempts(path).ooms("t[0]@9 b-2").ooms == 1  # type: ignore[union-attr] - not judged again


def test_the_cgroups_counter_risen_since_the_start_is_evidence(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """The learner's own evidence on restart: its memory cgroup's oom_kill counter rose during the dead attempt."""
    cgroup = A.memory_cgroup(os.getpid())
    if cgroup is None:
        pytest.skip("no memory cgroup visible in /proc/self/cgroup")
    base = tmp_path / "cg" / cgroup.lstrip("/")
    base.mkdir(parents=True)
    (base / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    monkeypatch.setattr(A, "CGROUP_ROOT", tmp_path / "cg")
    path = tmp_path / "step-attempts.json"
    _left_by(path, _dead_pid(), cgroup=cgroup, oom_kills=0)
    judged = StepAttempts(path).ooms("t[0]@9 b-2")
    assert judged is not None and f"memory cgroup {cgroup} counted 1 OOM kill(s)" in judged.evidence
    _left_by(path, _dead_pid(), cgroup=cgroup, oom_kills=1)  # unchanged since the start: a plain kill
    assert StepAttempts(path).ooms("t[0]@9 b-2") is None


def test_an_older_files_bare_counts_are_starts(tmp_path: Path) -> None:
    path = tmp_path / "step-attempts.json"
    path.write_text(json.dumps({"t[0]@9 b-2": 2}))
    assert StepAttempts(path).count("t[0]@9 b-2") == 2 and StepAttempts(path).ooms("t[0]@9 b-2") is None


def test_forgetting_an_unknown_batch_writes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "step-attempts.json"
    StepAttempts(path).forget("t[0]@4 b-1")
    assert not path.exists()


def test_a_damaged_file_names_itself_and_the_fix(tmp_path: Path) -> None:
    path = tmp_path / "step-attempts.json"
    path.write_text("[1, 2")
    with pytest.raises(ClawstreamError, match="step-attempts.json is not a JSON object.*delete it"):
        StepAttempts(path)


def test_unpublished_attempts_files_are_removed_and_published_ones_kept(tmp_path: Path) -> None:
    model = tmp_path / "policy"
    published, dead = "v000001-10-00aa11bb", "v000002-11-22cc33dd"
    for name in (published, dead, "v000003-12-44ee55ff"):
        (model / name).mkdir(parents=True)
        (model / name / "model.safetensors").write_bytes(b"w")
    (model / "v000001").symlink_to(published, target_is_directory=True)
    (model / "v000000").mkdir()  # a version written before attempts had names: never touched
    for home in ("trainer-state", "value-heads"):
        (model / home).mkdir()
    kept = [model / "trainer-state" / f"{published}.pt", model / "value-heads" / f"{published}.safetensors"]
    gone = [model / "trainer-state" / f"{dead}.pt", model / "trainer-state" / f"{dead}.pt.partial"]
    gone += [model / "value-heads" / f"{dead}.safetensors"]
    for path in [*kept, *gone, model / "trainer-state" / A.FILE_NAME]:
        path.write_bytes(b"x")
    removed = A.remove_unpublished(model, {published})
    assert sorted(removed) == sorted([model / dead, model / "v000003-12-44ee55ff", *gone])
    assert all(p.exists() for p in kept) and (model / "v000001" / "model.safetensors").exists()
    assert (model / "v000000").is_dir() and (model / "trainer-state" / A.FILE_NAME).exists()
    assert A.remove_unpublished(model, {published}) == []
    assert A.remove_unpublished(model, set()) == []  # the link's target is published, whatever the caller read
    assert A.remove_unpublished(tmp_path / "no-such-model", set()) == []
