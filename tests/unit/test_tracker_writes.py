"""The tracker's pure core: events → MLflow writes, the ledger that drops writes MLflow holds, the batch sampling
and the browsable trajectory document (consumers/tracker/writes.py, trajectory_json.py)."""

from __future__ import annotations

from consumers.tracker.trajectory_json import trajectory_document
from consumers.tracker.writes import (
    Batches,
    Ledger,
    MetricWrite,
    TrajectoryWrite,
    VersionWrite,
    metric_writes,
    version_writes,
)
from schemas.events import BatchRecord, BatchRecordKind, Metric, WeightVersion
from tests.support.factories import T0, sample_trajectory


def _batch(step: int, n: int, batch_id: str = "b") -> list[BatchRecord]:
    records = []
    for i in range(n):
        traj = sample_trajectory(f"r-{step}-{i}")
        records.append(
            BatchRecord(
                batch_id,
                step - i,
                T0,
                BatchRecordKind.TRAJECTORY,
                step,
                i,
                rollout_id=traj.rollout_id,
                harness=traj.harness,
                trajectory=traj.to_bytes(),
            )
        )
    seal = BatchRecord(batch_id, step, T0, BatchRecordKind.SEAL, step, n, harness_counts={"agentloop": n})
    return [*records, seal]


def test_the_ledger_drops_what_mlflow_holds_and_doubles() -> None:
    metric = Metric(3, T0, "learner", "train_step", {"loss": 0.5, "reward/agentloop": 0.75}, step=7)
    writes = metric_writes(metric) + metric_writes(metric)
    ledger = Ledger(metrics={("loss", 7)})
    new = ledger.new(writes)
    assert new == [MetricWrite("reward/agentloop", 0.75, 7, T0)]
    ledger.record(new)
    assert ledger.new(writes) == []
    assert metric_writes(Metric(3, T0, "engine", "weights_applied", {"v": 1.0})) == []


def test_a_version_is_written_once_by_its_number() -> None:
    version = WeightVersion(4, T0, "policy", 3, "file:///w/v4", "ab" * 32, batch_id="b-3")
    writes = version_writes(version)
    assert [w.path for w in writes if isinstance(w, VersionWrite)] == ["weights/v000004"]
    assert Ledger(metrics={("policy_version", 3)}, versions={4}).new(writes) == []


def test_a_sealed_batch_gives_staleness_counts_and_the_same_samples_in_any_order() -> None:
    records = _batch(5, 4)
    batches = Batches(samples_per_step=2)
    out = [w for offset, r in enumerate(records) for w in batches.add(offset, r)]
    metrics = {w.key: w.value for w in out if isinstance(w, MetricWrite)}
    assert metrics == {"staleness/mean": 1.5, "staleness/max": 3.0, "batch/trajectories/agentloop": 4.0}
    sampled = sorted(w.path for w in out if isinstance(w, TrajectoryWrite))
    assert len(sampled) == 2 and all(p.startswith("trajectories/step_000005/agentloop-") for p in sampled)
    shuffled = Batches(samples_per_step=2)
    again = [w for offset, r in enumerate([*records[3::-1], records[4]]) for w in shuffled.add(offset, r)]
    assert sorted(w.path for w in again if isinstance(w, TrajectoryWrite)) == sampled


def test_an_open_batch_holds_the_offset_to_resume_from() -> None:
    records = _batch(2, 2)
    batches = Batches()
    assert batches.add(10, records[0]) == [] and batches.add(11, records[1]) == []
    assert batches.first_held_offset() == 10
    assert batches.add(12, records[2]) and batches.first_held_offset() is None


def test_the_trajectory_document_has_conversations_and_the_tree() -> None:
    traj = sample_trajectory()
    doc = trajectory_document(traj, batch_id="b", advantage=0.5, decode=lambda ids: " ".join(map(str, ids)))
    assert doc["conversations"] == [{"text": "1 2 3 10 11 100 101 200 201"}]
    assert [s["parent"] for s in doc["tree"]] == [-1, 0, 1] and doc["tree"][1]["trainable"] is True
    assert doc["reward"] == 1.0 and doc["harness"] == "agentloop" and doc["advantage"] == 0.5
    assert trajectory_document(traj, batch_id="b", advantage=0.0)["tree"][0]["token_ids"] == [1, 2, 3, 10, 11]
