"""The demo's stack restarts a service that exits asking for it (a streams worker evicted from its group closes
dirty with ``streams.eos.EVICTED_EXIT``) and still stops the run on any other death."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from clawstream.stack.process import RESTART_EXIT, Service, Stack, StackError
from streams.eos import EVICTED_EXIT

pytestmark = pytest.mark.integration


def _exited(service: Service) -> int:
    assert service.proc is not None
    return service.proc.wait(30)


def test_a_service_exiting_with_restart_me_is_restarted_and_others_stop_the_run(tmp_path: Path) -> None:
    assert RESTART_EXIT == EVICTED_EXIT  # the streams worker's dirty close asks the stack for a restart
    stack = Stack(tmp_path / "logs")
    try:
        evicted = stack.start(Service("streams", ["tests.support.exit_once", str(tmp_path / "a"), str(RESTART_EXIT)]))
        assert _exited(evicted) == RESTART_EXIT
        stack.check()  # restarts it instead of raising
        assert evicted.restarts == 1 and evicted.proc is not None
        deadline = time.monotonic() + 30
        while "running again" not in (tmp_path / "logs" / "streams.log").read_text():
            assert evicted.proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        stack.check()
        broken = stack.start(Service("learner", ["tests.support.exit_once", str(tmp_path / "b"), "1"]))
        assert _exited(broken) == 1
        with pytest.raises(StackError, match="learner died with 1"):
            stack.check()
    finally:
        stack.stop()


def test_a_started_service_appends_to_the_log_of_an_earlier_run(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "scheduler.log").write_text("step 19: refill 0 ... before the resume\nrunning again\n")
    (tmp_path / "a").write_text("ran once\n")  # exit_once then logs "running again" and waits
    stack = Stack(logs)
    try:
        args = ["tests.support.exit_once", str(tmp_path / "a"), "0"]
        service = Service("scheduler", args, ready_line="running again")
        stack.start(service)
        text = (logs / "scheduler.log").read_text()
        assert text.startswith("step 19: refill 0 ... before the resume\n")  # kept, not truncated
        assert text.count("running again") == 2  # ready on this start's own line, not the old one
    finally:
        stack.stop()
