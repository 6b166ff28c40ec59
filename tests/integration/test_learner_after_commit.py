"""What follows a learner step's commit, and only its commit: TensorBoard scalars once per published step across a
crash before the commit, and the files of attempts no committed version names removed (at start, once the fence is
taken; after each commit), never a published version's (learner/publish.py, learner/version_files.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from clawbase import faults
from clawbase.kafka.clients import bootstrap_servers
from clawbase.settings import KafkaSettings
from learner.attempts import ATTEMPT_FILE
from learner.version_files import attempt_name
from tests.integration.test_learner import ROOT, _produce_batches, _run_learner, _versions
from tests.support.learner_data import small_model

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_model(tmp_path_factory.mktemp("tiny"))


def _scalar_steps(tb: Path, tag: str = "loss") -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    steps: list[int] = []
    for events in sorted(tb.glob("events.out.tfevents.*")):  # one file per learner process
        acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
        acc.Reload()
        steps += [e.step for e in acc.Scalars(tag)] if tag in acc.Tags()["scalars"] else []
    return sorted(steps)


def _attempt_files(store: Path) -> set[str]:
    """Every attempt-named entry of the model's store (weights directories, trainer states, value heads)."""
    model = store / "policy"
    homes = [model, model / "trainer-state", model / "value-heads"]
    return {m.group(1) for home in homes if home.exists() for p in home.iterdir() if (m := ATTEMPT_FILE.match(p.name))}


def test_scalars_follow_the_commit_and_a_crashed_attempts_files_go_at_start(
    kafka_settings: KafkaSettings, model_dir: Path, tmp_path: Path
) -> None:
    _produce_batches(kafka_settings, [("t-1", 1), ("t-2", 2)])
    store, tb = tmp_path / "store", tmp_path / "tb"
    extra = ("--tensorboard-dir", str(tb))
    crashed = _run_learner(kafka_settings, model_dir, store, fault="learner.before_commit@2=crash", extra=extra)
    assert crashed.returncode == faults.CRASH_STATUS, crashed.stderr[-3000:]
    assert _scalar_steps(tb) == [1], crashed.stderr[-3000:]  # step 2's transaction never committed: no scalars
    [left] = {p.parent.name for p in (store / "policy").glob("v000002-*/model.safetensors")}
    assert (store / "policy" / "trainer-state" / f"{left}.pt").exists()

    resumed = _run_learner(kafka_settings, model_dir, store, max_steps=1, extra=extra)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    versions = _versions(kafka_settings, "check-after-commit")
    assert [(v.policy_version, v.batch_id) for v in versions] == [(1, "t-1"), (2, "t-2")]
    assert _scalar_steps(tb) == [1, 2]  # each published step once
    published = {attempt_name(v) for v in versions}
    assert left not in published
    assert _attempt_files(store) == published, resumed.stderr[-3000:]  # the crashed attempt's files are gone
    for v in versions:
        assert os.readlink(store / "policy" / f"v{v.policy_version:06d}") == attempt_name(v)


def test_files_a_zombie_leaves_go_after_the_next_commit(
    kafka_settings: KafkaSettings, model_dir: Path, tmp_path: Path
) -> None:
    """Files under an attempt's name that appear while the learner trains (a fenced learner still writing) are
    removed by the commit that follows, not only at the next start."""
    _produce_batches(kafka_settings, [("z-1", 1)])
    store, folder, log = tmp_path / "store", tmp_path / "faults", tmp_path / "learner.log"
    env = dict(
        os.environ,
        CLAWSTREAM_KAFKA_BOOTSTRAP_SERVERS=bootstrap_servers(kafka_settings),
        CLAWSTREAM_KAFKA_TOPIC_PREFIX=kafka_settings.topic_prefix,
        PYTHONPATH=str(ROOT),
        **faults.fault_env(folder, **{"learner.in_step": "hold"}),
    )
    args = ["--model-dir", str(model_dir), "--weight-store", str(store), "--max-steps", "1", "--idle-exit", "20"]
    with log.open("wb") as out:
        learner = subprocess.Popen(
            [sys.executable, "-m", "learner.train", *args], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT
        )
    zombie = "v000001-1-0badcafe"
    try:
        faults.wait_held(folder, "learner.in_step", alive=learner)  # started (and cleaned) before this
        (store / "policy" / zombie).mkdir(parents=True)
        (store / "policy" / zombie / "model.safetensors").write_bytes(b"a zombie's weights")
        (store / "policy" / "trainer-state" / f"{zombie}.pt").write_bytes(b"a zombie's trainer state")
        (store / "policy" / "trainer-state" / f"{zombie}.pt.partial").write_bytes(b"half of one")
        faults.release(folder, "learner.in_step")
        assert learner.wait(120) == 0, log.read_text()[-3000:]
    finally:
        if learner.poll() is None:
            learner.kill()
            learner.wait(30)
    [v1] = _versions(kafka_settings, "check-zombie-files")
    assert _attempt_files(store) == {attempt_name(v1)}, log.read_text()[-3000:]
    assert (store / "policy" / "v000001" / "model.safetensors").exists()
