"""A short chaos run (``clawstream chaos``, the real command): the training stack on a fresh 3-broker cluster, each of
learner, proxy, streams, sandbox worker, scheduler and one broker SIGKILLed once (the victims are a shuffled deck:
six kills take each once) at a moment the run's own events choose, each restarted; then the audit of the run's
topics must be CLEAN, with every rollout settled and every sealed batch trained.

The model is the soak's instant engine (``--engine instant``), so the load is on the services and the kills, and the
run fits CI (the 30-minute run with the CPU engine is a bench row: ``python -m bench.faults --chaos 30m``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from clawstream.stack.chaos import DEFAULT_KILL
from clawstream.stack.process import ROOT

pytestmark = [pytest.mark.e2e, pytest.mark.integration]


@pytest.mark.timeout(900)
def test_every_service_killed_once_and_the_audit_is_clean(tmp_path: Path) -> None:
    summary = tmp_path / "chaos.json"
    cmd = [sys.executable, "-m", "clawstream", "chaos", "--engine", "instant", "--kills", str(len(DEFAULT_KILL))]
    cmd += ["--seed", "1", "--work", str(tmp_path / "work"), "--json", str(summary)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("CLAWSTREAM_KAFKA_BOOTSTRAP_SERVERS", None)  # its own cluster, never the session's broker
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=840, check=False)
    out = done.stdout[-6000:] + done.stderr[-3000:]
    print(out)
    assert summary.exists(), out
    result = json.loads(summary.read_text())
    assert done.returncode == 0 and result["clean"], out
    assert result["kills"] == dict.fromkeys(DEFAULT_KILL, 1), result["kills"]
    assert result["drained"] and result["lost"] == 0 and result["duplicated"] == 0, out
    assert result["batches_trained"] == result["batches_sealed"] == result["versions"] >= 1, out
