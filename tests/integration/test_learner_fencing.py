"""A fenced learner's files: whatever a zombie learner writes after a second instance with its transactional.id
took over, the published version's bytes and its trainer state stay as published, and a trainer state changed
after publication is refused on resume (policy/weight_store.py: attempt-unique paths, checksummed companions)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from clawbase import faults
from clawbase.kafka.clients import bootstrap_servers
from clawbase.settings import KafkaSettings
from policy.weight_store import sha256_file, verify_file
from tests.integration.test_learner import ROOT, _produce_batches, _run_learner, _versions
from tests.support.learner_data import small_model

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_model(tmp_path_factory.mktemp("tiny"))


def _zombie(settings: KafkaSettings, model_dir: Path, store: Path, folder: Path, log: Path) -> subprocess.Popen:
    """A learner that holds inside b-1's step (its optimizer step done, nothing saved) until released; another
    learning rate than ``_run_learner``'s, so that its weights differ from the fresh learner's."""
    env = dict(
        os.environ,
        CLAWSTREAM_KAFKA_BOOTSTRAP_SERVERS=bootstrap_servers(settings),
        CLAWSTREAM_KAFKA_TOPIC_PREFIX=settings.topic_prefix,
        PYTHONPATH=str(ROOT),
        **faults.fault_env(folder, **{"learner.in_step": "hold"}),
    )
    args = ["--model-dir", str(model_dir), "--weight-store", str(store), "--max-steps", "1", "--idle-exit", "20"]
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "learner.train", *args, "--hp", "lr=3e-3"],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def test_a_fenced_learner_cannot_change_a_published_version(
    kafka_settings: KafkaSettings, model_dir: Path, tmp_path: Path
) -> None:
    _produce_batches(kafka_settings, [("b-1", 1), ("b-2", 2)])
    store, folder, log = tmp_path / "store", tmp_path / "faults", tmp_path / "zombie.log"
    zombie = _zombie(kafka_settings, model_dir, store, folder, log)
    try:
        faults.wait_held(folder, "learner.in_step", alive=zombie)
        fresh = _run_learner(kafka_settings, model_dir, store, max_steps=1)  # same transactional.id: fences it
        assert fresh.returncode == 0, fresh.stderr[-3000:]
        [v1] = _versions(kafka_settings, "check-fenced-a")
        published = verify_file(v1)
        before = published.read_bytes()
        faults.release(folder, "learner.in_step")  # the zombie saves its v1 and tries to publish it
        assert zombie.wait(120) != 0, log.read_text()[-3000:]
    finally:
        if zombie.poll() is None:
            zombie.kill()
            zombie.wait(30)
    assert "fenced" in log.read_text().lower(), log.read_text()[-3000:]
    assert verify_file(v1) == published and published.read_bytes() == before and sha256_file(published) == v1.sha256
    attempts = sorted(p.parent.name for p in (store / "policy").glob("v000001-*/model.safetensors"))
    assert len(attempts) == 2 and published.parent.name in attempts, attempts  # the zombie's own, unpublished
    assert os.readlink(store / "policy" / "v000001") == published.parent.name

    # The zombie's trainer state copied over the published one: the weights' header records the published sha256.
    states = store / "policy" / "trainer-state"
    [zombie_attempt] = [a for a in attempts if a != published.parent.name]
    tampered = states / f"{published.parent.name}.pt"
    tampered.write_bytes((states / f"{zombie_attempt}.pt").read_bytes())
    resumed = _run_learner(kafka_settings, model_dir, store, max_steps=1)
    assert resumed.returncode == 2, resumed.stderr[-3000:]
    assert f"error: {tampered} has sha256 {sha256_file(tampered)}, but the published weights {published}" in (
        resumed.stderr
    ), resumed.stderr[-3000:]
    assert "Restore it from a backup, or delete it to resume with fresh optimizer moments" in resumed.stderr
    assert [v.policy_version for v in _versions(kafka_settings, "check-fenced-b")] == [1]  # nothing more trained
