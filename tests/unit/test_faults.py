"""The fault seam (clawbase.faults): parsing, arrival counting, and holding a thread until a test releases it."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from clawbase import faults


def test_parse_names_points_actions_and_arrivals() -> None:
    got = faults.parse("learner.after_save@2=crash, streams.commit=hold,x=kill")
    assert got == {
        "learner.after_save": faults.Fault("learner.after_save", "crash", 2),
        "streams.commit": faults.Fault("streams.commit", "hold", 1),
        "x": faults.Fault("x", "kill", 1),
    }
    assert faults.parse("engine.in_call@armed=hold") == {"engine.in_call": faults.Fault("engine.in_call", "hold", 0)}


@pytest.mark.parametrize("bad", ["learner.after_save", "a=explode", "=crash", "a@x=crash", "a@0=hold"])
def test_malformed_spec_names_the_entry_and_the_fix(bad: str) -> None:
    with pytest.raises(faults.FaultSpecError, match="NAME\\[@N\\|@armed\\]=ACTION"):
        faults.parse(bad)


def test_unnamed_points_do_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(faults.ENV, "other.point=crash")
    faults.fault_point("learner.after_save")  # returns: the process is still here
    monkeypatch.delenv(faults.ENV)
    faults.fault_point("other.point")


def test_hold_waits_for_release_on_the_nth_arrival(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(faults.ENV, "unit.hold@2=hold")
    monkeypatch.setenv(faults.DIR_ENV, str(tmp_path))
    monkeypatch.setattr(faults, "_seen", {})
    arrivals: list[int] = []

    def worker() -> None:
        for i in range(3):
            faults.fault_point("unit.hold")
            arrivals.append(i)

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    assert faults.wait_held(tmp_path, "unit.hold", timeout=10) == os.getpid()
    assert arrivals == [0]  # held at the second arrival, before the loop body ran again
    faults.release(tmp_path, "unit.hold")
    thread.join(10)
    assert arrivals == [0, 1, 2]


def test_wait_held_fails_fast_when_the_process_died(tmp_path: Path) -> None:
    class Exited:
        returncode = 3

        def poll(self) -> int:
            return 3

    with pytest.raises(RuntimeError, match="exited \\(3\\) before reaching fault point p"):
        faults.wait_held(tmp_path, "p", timeout=5, alive=Exited())


def test_raise_raises_on_the_nth_arrival_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(faults.ENV, "unit.raise@2=raise")
    monkeypatch.setattr(faults, "_seen", {})
    faults.fault_point("unit.raise")  # the first arrival passes
    with pytest.raises(faults.InjectedFault, match="raise at unit.raise \\(arrival 2\\)"):
        faults.fault_point("unit.raise")
    faults.fault_point("unit.raise")  # and the third


def test_an_armed_point_acts_once_on_the_first_arrival_after_arming(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(faults.ENV, "unit.armed@armed=raise")
    monkeypatch.setenv(faults.DIR_ENV, str(tmp_path))
    monkeypatch.setattr(faults, "_seen", {})
    for _ in range(3):
        faults.fault_point("unit.armed")  # not armed yet: passes however often it is reached
    faults.arm(tmp_path, "unit.armed")
    with pytest.raises(faults.InjectedFault, match="arrival 4"):
        faults.fault_point("unit.armed")
    faults.fault_point("unit.armed")  # the arming is used up
    assert not (tmp_path / "unit.armed.arm").exists()
