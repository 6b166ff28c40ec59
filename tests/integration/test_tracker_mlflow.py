"""The MLflow tracker against a real ``mlflow server`` (SQLite store, started here) and a real broker: a run's
params, per-step metrics, weight versions, sampled trajectories and report files land in one MLflow run, and a
tracker SIGKILLed after a write but before its offsets' commit, then restarted, logs every step exactly once.

Skips, with the reason, when MLflow is not installed (``pip install -e '.[track]'``); in CI (``CI=true``) where
``make install`` installs it, that is a failure.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from clawbase import faults
from clawbase.kafka.clients import bootstrap_servers, make_producer, produce_reliably
from clawbase.settings import KafkaSettings
from schemas.events import BatchRecord, BatchRecordKind, Metric, WeightVersion
from schemas.topics import BATCHES, METRICS, WEIGHTS
from tests.support.factories import T0, sample_trajectory

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
STEPS = 6
PER_BATCH = 3  # trajectories per batch; 2 of them sampled
KEYS = ("loss", "reward/agentloop", "reward/agentloop-anthropic", "clip_frac", "is_weight_mean", "update_kl")
ALL_KEYS = (*KEYS, "policy_version", "staleness/mean", "staleness/max", "batch/trajectories/agentloop")
CI = os.environ.get("CI", "").strip().lower() in {"1", "true", "yes", "on"}


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def mlflow_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    try:
        import mlflow  # noqa: F401
    except ImportError:
        if CI:
            pytest.fail("MLflow is not installed, and CI installs it (make install: the 'track' extra)")
        pytest.skip("MLflow is not installed: pip install -e '.[track]'")
    home, port = tmp_path_factory.mktemp("mlflow"), _free_port()
    log = (home / "server.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
        + ["--backend-store-uri", f"sqlite:///{home / 'db.sqlite'}", "--artifacts-destination", str(home / "art")],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its uvicorn workers in its group: killed with it
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2).read()
                break
            except OSError:
                assert server.poll() is None, (home / "server.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "mlflow server did not answer /health in 180 s"
                time.sleep(0.2)
        yield url
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
        log.close()


def _produce_run(kafka: KafkaSettings) -> None:
    """What a run of STEPS steps leaves on its topics: per step the learner's metric, its version and the batch."""
    producer = make_producer(kafka)
    for step in range(1, STEPS + 1):
        batch_id = f"b-{step}"
        for i in range(PER_BATCH):
            traj = sample_trajectory(f"r-{step}-{i}")
            traj.step, traj.harness = step, ("agentloop", "agentloop-anthropic")[i % 2]
            record = BatchRecord(
                batch_id, step - 1, T0, BatchRecordKind.TRAJECTORY, step, i, rollout_id=traj.rollout_id
            )
            record.harness, record.reward, record.advantage, record.trajectory = traj.harness, 1.0, 0.5, traj.to_bytes()
            produce_reliably(producer, kafka.topic(BATCHES), batch_id.encode(), record.to_bytes())
        seal = BatchRecord(batch_id, step, T0, BatchRecordKind.SEAL, step, PER_BATCH, harness_counts={"agentloop": 2})
        produce_reliably(producer, kafka.topic(BATCHES), batch_id.encode(), seal.to_bytes())
        values = {key: step + i / 10 for i, key in enumerate(KEYS)}
        metric = Metric(step, T0 + step, "learner", "train_step", values, step=step)
        produce_reliably(producer, kafka.topic(METRICS), b"learner", metric.to_bytes())
        version = WeightVersion(
            step, T0 + step, "policy", step, f"file:///w/v{step}", f"{step:064x}", batch_id=batch_id
        )
        produce_reliably(producer, kafka.topic(WEIGHTS), b"policy", version.to_bytes())
    producer.flush(30)


def _tracker(url: str, run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "consumers.tracker", "--mlflow", url, "--run-dir", str(run_dir)]


def _environment(kafka: KafkaSettings, **extra: str) -> dict[str, str]:
    return dict(
        os.environ,
        CLAWSTREAM_KAFKA_BOOTSTRAP_SERVERS=bootstrap_servers(kafka),
        CLAWSTREAM_KAFKA_TOPIC_PREFIX=kafka.topic_prefix,
        PYTHONPATH=str(ROOT),
        **extra,
    )


def _run(client, prefix: str):  # noqa: ANN001, ANN202 - MLflow's client and run
    experiment = client.get_experiment_by_name("clawstream")
    if experiment is None:
        return None
    runs = client.search_runs([experiment.experiment_id], filter_string=f"tags.`clawstream.prefix` = '{prefix}'")
    assert len(runs) <= 1, f"{len(runs)} MLflow runs for one prefix"
    return runs[0] if runs else None


def _steps(client, run_id: str, key: str) -> list[int]:  # noqa: ANN001
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def _points(client, run_id: str) -> set[tuple[str, int]]:  # noqa: ANN001
    return {(key, step) for key in ALL_KEYS for step in _steps(client, run_id, key)}


def test_a_killed_tracker_logs_every_step_once(kafka_settings: KafkaSettings, mlflow_url: str, tmp_path: Path) -> None:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_url, registry_uri=mlflow_url)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "state.json").write_text(json.dumps({"config": {"steps": STEPS, "lr": 2e-5, "harnesses": ["a", "b"]}}))
    (run_dir / "before_after.md").write_text("| harness | before | after |\n|---|---|---|\n| agentloop | 0.6 | 0.8 |\n")
    (run_dir / "learning.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    _produce_run(kafka_settings)
    folder = tmp_path / "faults"

    # The first tracker holds right after its STEPS-th write reached MLflow, its chunk's offsets not committed.
    env = _environment(kafka_settings, **faults.fault_env(folder, **{f"tracker.after_log@{STEPS}": "hold"}))
    log = (tmp_path / "tracker-1.log").open("w")
    first = subprocess.Popen(_tracker(mlflow_url, run_dir), env=env, stdout=log, stderr=log)
    try:
        pid = faults.wait_held(folder, "tracker.after_log", timeout=240, alive=first)
        run = _run(client, kafka_settings.topic_prefix)
        assert run is not None
        logged = _points(client, run.info.run_id)
        assert 0 < len(logged) < len(ALL_KEYS) * STEPS, sorted(logged)  # mid-run, by MLflow's own account
        os.kill(pid, signal.SIGKILL)
        assert first.wait(30) == -signal.SIGKILL
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
        log.close()

    second = subprocess.run(
        [*_tracker(mlflow_url, run_dir), "--once"],
        env=_environment(kafka_settings),
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = (tmp_path / "tracker-1.log").read_text()[-2000:] + second.stdout[-3000:] + second.stderr[-3000:]
    assert second.returncode == 0, out
    run = _run(client, kafka_settings.topic_prefix)
    assert run is not None and run.info.status == "FINISHED", out
    run_id = run.info.run_id
    every = list(range(1, STEPS + 1))
    for key in ALL_KEYS:
        assert _steps(client, run_id, key) == every, f"{key}: {_steps(client, run_id, key)}\n{out}"
    versions = client.search_model_versions(f"run_id = '{run_id}'")
    assert sorted(int(v.tags["policy_version"]) for v in versions) == every, out
    assert {v.tags["sha256"] for v in versions} == {f"{s:064x}" for s in every}
    for step in every:
        sampled = client.list_artifacts(run_id, f"trajectories/step_{step:06d}")
        assert len(sampled) == 2, [f.path for f in sampled]
    doc = json.loads(Path(client.download_artifacts(run_id, sampled[0].path, str(tmp_path))).read_text())
    assert doc["step"] == STEPS and doc["tree"] and doc["conversations"]
    assert {f.path for f in client.list_artifacts(run_id, "report")} == {
        "report/before_after.md",
        "report/learning.png",
    }
    params = run.data.params
    assert params["demo.lr"] == "2e-05" and params["model_name"] == "policy" and params["commit"]

    # Once more with every offset committed at the end (a demo's final pass after its live tracker): it ends, and
    # writes nothing.
    third = subprocess.run(
        [*_tracker(mlflow_url, run_dir), "--once"],
        env=_environment(kafka_settings),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert third.returncode == 0, third.stdout[-3000:] + third.stderr[-3000:]
    assert _points(client, run_id) == {(k, s) for k in ALL_KEYS for s in every}
    assert all(_steps(client, run_id, key) == every for key in ALL_KEYS)
