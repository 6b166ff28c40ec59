"""The learner service on 2 data-parallel gloo ranks (learner/train_ranks.py) on the real broker: its versions equal
the 1-rank step's on the same batches, and a step that raises stops the group, whose restart trains the batch once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from clawbase import faults
from clawbase.kafka.clients import bootstrap_servers
from clawbase.settings import KafkaSettings
from learner.config import LearnerConfig
from learner.precision import load_policy
from learner.step import ScoredTree, train_step
from policy.weight_store import trainer_state_path, verify_file
from schemas.events import Trajectory, WeightVersion
from tests.integration.test_learner import _produce_batches, _versions
from tests.support.learner_data import batch_records, small_model

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_model(tmp_path_factory.mktemp("tiny"))


def _trees(batch_id: str, step: int) -> list[ScoredTree]:
    """The batch's trees as the learner decodes them (the records _produce_batches wrote)."""
    trees = []
    for rec in batch_records(batch_id, step, 4, seed=step)[:-1]:
        traj = Trajectory.from_bytes(rec.trajectory)
        trees.append(ScoredTree(traj.segments, rec.advantage, rec.reward, rec.harness or traj.harness))
    return trees


def _run(
    settings: KafkaSettings, model_dir: Path, store: Path, fault: str | None = None
) -> subprocess.CompletedProcess:
    env = dict(
        os.environ,
        CLAWSTREAM_KAFKA_BOOTSTRAP_SERVERS=bootstrap_servers(settings),
        CLAWSTREAM_KAFKA_TOPIC_PREFIX=settings.topic_prefix,
        CLAWSTREAM_LEARNER_TORCH_THREADS="1",
        PYTHONPATH=str(ROOT),
    )
    env.pop(faults.ENV, None)
    if fault:
        env.update(faults.fault_env(store.parent / "faults", **dict([fault.split("=")])))
    cmd = [sys.executable, "-m", "learner.train_ranks", "--nproc", "2", "--model-dir", str(model_dir)]
    cmd += ["--weight-store", str(store), "--max-steps", "2", "--idle-exit", "20", "--hp", "lr=1e-3"]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)


def _check_v2(version: WeightVersion, model_dir: Path) -> None:
    """v2 equals two 1-rank steps on b-1 and b-2 with the learner's AdamW."""
    from safetensors.torch import load_file

    config = LearnerConfig(lr=1e-3)
    model = load_policy(model_dir)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.lr, betas=config.betas, weight_decay=config.weight_decay
    )
    for batch_id, step in (("b-1", 1), ("b-2", 2)):
        train_step(model, optimizer, _trees(batch_id, step), config)
    published = load_file(str(verify_file(version)))
    diff = max(float((published[k] - v).abs().max()) for k, v in model.state_dict().items() if k in published)
    moved = max(float((v - initial[k]).abs().max()) for k, v in model.state_dict().items())
    print(f"2-rank service v2 vs 1-rank steps: max abs {diff:.2e} (the steps moved weights up to {moved:.2e})")
    assert moved > 100 * 1e-5 and diff < 1e-5


def test_two_ranks_publish_the_versions_of_one(kafka_settings: KafkaSettings, model_dir: Path, tmp_path: Path) -> None:
    _produce_batches(kafka_settings, [("b-1", 1), ("b-2", 2)])
    store = tmp_path / "store"
    result = _run(kafka_settings, model_dir, store)
    assert result.returncode == 0, result.stderr[-3000:]
    versions = _versions(kafka_settings, "check-ranks")
    assert [(v.policy_version, v.batch_id) for v in versions] == [(1, "b-1"), (2, "b-2")]
    assert trainer_state_path(store, "policy", 2).exists()  # rank 0 keeps AdamW's state for the resume
    _check_v2(versions[-1], model_dir)


def test_a_step_that_raises_stops_the_group_and_the_restart_trains_the_batch_once(
    kafka_settings: KafkaSettings, model_dir: Path, tmp_path: Path
) -> None:
    """b-2's step raises on both ranks after its optimizer step: the group exits non-zero with v1 published; the
    restarted group resumes v1 (rank 0 loads it and broadcasts it) and publishes b-2 once, equal to 1-rank steps."""
    _produce_batches(kafka_settings, [("b-1", 1), ("b-2", 2)])
    store = tmp_path / "store"
    failed = _run(kafka_settings, model_dir, store, fault="learner.in_step@2=raise")
    assert failed.returncode != 0 and "fault injection: raise at learner.in_step" in failed.stderr + failed.stdout
    assert [(v.policy_version, v.batch_id) for v in _versions(kafka_settings, "check-raise-1")] == [(1, "b-1")]
    restarted = _run(kafka_settings, model_dir, store)
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    versions = _versions(kafka_settings, "check-raise-2")
    assert [(v.policy_version, v.batch_id) for v in versions] == [(1, "b-1"), (2, "b-2")]
    _check_v2(versions[-1], model_dir)
