"""The supervisor (clawstream/stack/process.py) records an out-of-memory death only on evidence: a SIGKILLed service
whose memory cgroup's oom_kill counter rose since its start gets a verdict for its next start (learner.attempts); a
SIGKILL alone gets none. The cgroup files are a copy under a temporary root (the test cannot OOM-kill on demand)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from clawstream.stack.process import Service, Stack, StackError
from learner import attempts as A


def _killed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, oom: bool) -> Path:
    cgroup = A.memory_cgroup(os.getpid())
    if cgroup is None:
        pytest.skip("no memory cgroup visible in /proc/self/cgroup")
    events = tmp_path / "cg" / cgroup.lstrip("/") / "memory.events"
    events.parent.mkdir(parents=True)
    events.write_text("oom 0\noom_kill 0\n")
    monkeypatch.setattr(A, "CGROUP_ROOT", tmp_path / "cg")
    deaths = tmp_path / "deaths"
    stack = Stack(tmp_path / "logs")
    service = stack.start(Service("learner", ["http.server", "0", "--bind", "127.0.0.1"], deaths=deaths))
    assert service.proc is not None and service.oom_kills == 0
    if oom:
        events.write_text("oom 1\noom_kill 1\n")
    os.kill(service.proc.pid, signal.SIGKILL)
    service.proc.wait(30)
    with pytest.raises(StackError, match="learner died with -9"):
        stack.check()
    return deaths / f"{service.proc.pid}.json"


def test_a_sigkill_with_the_cgroups_oom_kill_risen_is_recorded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    record = _killed(tmp_path, monkeypatch, oom=True)
    verdict = json.loads(record.read_text())
    assert verdict["cause"] == "oom" and "counted 1 OOM kill(s)" in verdict["evidence"], verdict


def test_a_sigkill_alone_is_no_evidence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert not _killed(tmp_path, monkeypatch, oom=False).exists()
