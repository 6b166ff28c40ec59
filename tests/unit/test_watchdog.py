"""clawbase.watchdog: a call that hangs past its deadline ends the process with the stack's restart code."""

from __future__ import annotations

import subprocess
import sys
import time

from clawbase import watchdog
from clawstream.stack.process import RESTART_EXIT


def test_a_call_past_its_deadline_exits_for_a_restart_and_one_in_time_does_not() -> None:
    assert watchdog.RESTART_EXIT == RESTART_EXIT
    with watchdog.deadline("quick", 5):
        pass  # returned in time: the timer is cancelled, nothing happens
    code = "from clawbase.watchdog import deadline\nimport time\nwith deadline('hang', 0.3):\n    time.sleep(30)\n"
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20)
    assert proc.returncode == RESTART_EXIT, proc.stderr
    assert time.monotonic() - t0 < 15 and "hang did not return within 0 s" in proc.stderr
