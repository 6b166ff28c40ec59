"""`clawstream audit` on the real broker: a run's topics written as the services write them reconcile clean; the
same run with one trajectory batched twice, one batch trained twice and one undecodable reward does not, nor does one
whose learner was killed out of a batch or whose batcher dropped a group short of its seal, and the report names each
(exit 1, human-readable and --json). A real demo run is audited in tests/e2e/test_training_loop.py.
"""

from __future__ import annotations

import dataclasses
import io
import json
import subprocess
import sys

import pytest

from clawbase.kafka.clients import create_topics, make_producer
from clawbase.settings import KafkaSettings
from clawstream.stack.process import ROOT
from consumers.analytics.audit import main as audit
from schemas.dead_letter import dead_letter
from schemas.events import (
    BatchRecord,
    BatchRecordKind,
    RewardEvent,
    RewardStatus,
    RolloutEvent,
    RolloutState,
    WeightVersion,
)
from schemas.topics import BATCHES, CATALOG, DEADLETTER, REWARDS, ROLLOUT_EVENTS, TRAJECTORIES, WEIGHTS
from tests.support.factories import T0, sample_trajectory

pytestmark = pytest.mark.integration


def _run(settings: KafkaSettings, rollouts: int = 4) -> list[tuple[str, str, bytes]]:
    """(topic, key, value) of a two-step run: each rollout started, exited, graded, settled, batched; v1 and v2."""
    out: list[tuple[str, str, bytes]] = []
    for step in (1, 2):
        batch = f"b-{step}"
        for i in range(rollouts):
            rid, aid = f"r-{step}-{i}", f"r-{step}-{i}#0"
            reward = i / rollouts
            for state in (RolloutState.STARTED, RolloutState.HARNESS_EXITED):
                ev = RolloutEvent(
                    rollout_id=rid,
                    policy_version=step - 1,
                    timestamp_ms=T0,
                    attempt_id=aid,
                    state=state,
                    group_id=f"g{step}",
                    harness="agentloop",
                    worker_id="w",
                )
                out.append((ROLLOUT_EVENTS, rid, ev.to_bytes()))
            rew = RewardEvent(
                rollout_id=rid,
                policy_version=step - 1,
                timestamp_ms=T0,
                attempt_id=aid,
                status=RewardStatus.OK,
                grader="native",
                reward=reward,
            )
            out.append((REWARDS, rid, rew.to_bytes()))
            traj = dataclasses.replace(sample_trajectory(rid), attempt_id=aid, reward=reward).to_bytes()
            out.append((TRAJECTORIES, rid, traj))
            rec = BatchRecord(
                batch_id=batch,
                rollout_id=rid,
                policy_version=step - 1,
                timestamp_ms=T0,
                kind=BatchRecordKind.TRAJECTORY,
                step=step,
                index=i,
                advantage=0.0,
                reward=reward,
                trajectory=traj,
            )
            out.append((BATCHES, batch, rec.to_bytes()))
        seal = BatchRecord(
            batch_id=batch,
            policy_version=step - 1,
            timestamp_ms=T0,
            kind=BatchRecordKind.SEAL,
            step=step,
            index=rollouts,
        )
        out.append((BATCHES, batch, seal.to_bytes()))
        out.append((WEIGHTS, "policy", _version(step, batch)))
    return out


def _version(n: int, batch: str) -> bytes:
    return WeightVersion(
        policy_version=n,
        timestamp_ms=T0,
        model_name="policy",
        step=n,
        uri=f"file:///w/v{n}",
        sha256="0" * 64,
        size_bytes=1,
        batch_id=batch,
    ).to_bytes()


def _publish(settings: KafkaSettings, records: list[tuple[str, str, bytes]]) -> None:
    producer = make_producer(settings)
    for topic, key, value in records:
        producer.produce(settings.topic(topic), key=key.encode(), value=value)
    assert producer.flush(30) == 0


def _audit(settings: KafkaSettings, *extra: str) -> tuple[int, str]:
    out = io.StringIO()
    code = audit(["--topic-prefix", settings.topic_prefix, "--bootstrap", settings.bootstrap_servers, *extra], out=out)
    return code, out.getvalue()


def test_a_clean_run_audits_clean_and_each_fault_is_named(kafka_settings: KafkaSettings) -> None:
    create_topics(kafka_settings, CATALOG)
    records = _run(kafka_settings)
    _publish(kafka_settings, records)
    code, report = _audit(kafka_settings)
    assert code == 0 and "CLEAN" in report, report
    assert "attempts 8, settled into trajectories 8, trajectories in batches 8, batches sealed 2, trained 2" in report

    # One trajectory batched a second time (a replayed batcher), one batch trained again, one corrupt reward.
    first_member = next(r for r in records if r[0] == BATCHES)
    again = BatchRecord.from_bytes(first_member[2])
    _publish(
        kafka_settings,
        [
            (BATCHES, "b-3", dataclasses.replace(again, batch_id="b-3", index=0).to_bytes()),
            (
                BATCHES,
                "b-3",
                BatchRecord(
                    batch_id="b-3", policy_version=2, timestamp_ms=T0, kind=BatchRecordKind.SEAL, step=3, index=1
                ).to_bytes(),
            ),
            (WEIGHTS, "policy", _version(3, "b-1")),
            (REWARDS, "r-x", b"\xc3\x01not avro at all"),
        ],
    )
    code, report = _audit(kafka_settings)
    assert code == 1, report
    assert "[duplicated] one batch: attempt r-1-0#0's trajectory is in b-1#0, b-3#0" in report, report
    assert "[trained twice] trained once: batch b-1 trained into [1, 3]" in report, report
    assert f"{kafka_settings.topic(REWARDS)}[" in report.split("undecodable records:")[1], report

    code, raw = _audit(kafka_settings, "--json")
    got = json.loads(raw)
    assert code == 1 and got["clean"] is False
    assert (got["lost"], got["duplicated"], got["trained twice"]) == (0, 1, 1), got
    assert len(got["undecodable"]) == 1


def test_a_killed_step_and_the_batchers_consistency_drop_are_losses(kafka_settings: KafkaSettings) -> None:
    """Dead letters are not all footnotes: the learner killed in b-2's step every time (its version never comes) and
    the batcher dropping a group short of its seal are losses, named by the command with their batch and group."""
    create_topics(kafka_settings, CATALOG)
    records = [r for r in _run(kafka_settings) if r[0] != WEIGHTS or WeightVersion.from_bytes(r[2]).batch_id != "b-2"]
    killed = dead_letter(
        "learner",
        "batch b-2 (t.clawstream.batches[0]@9): attempted 2 times without finishing: the learner was killed",
        "TrainingStepKilled",
        topic=kafka_settings.topic(BATCHES),
        key=b"b-2",
    )
    short = dead_letter(
        "streams.batcher", "group g7: SEAL announces 8 records, 7 arrived", "IncompleteGroup", topic="scored-groups"
    )
    _publish(kafka_settings, [*records, (DEADLETTER, "b-2", killed.to_bytes()), (DEADLETTER, "g7", short.to_bytes())])
    code, report = _audit(kafka_settings)
    assert code == 1, report
    assert "[lost] batch trained: batch b-2 (sealed at " in report, report
    assert "TrainingStepKilled" in report and "rollouts ['r-2-0', 'r-2-1', 'r-2-2', 'r-2-3']" in report, report
    assert "[lost] group batched: group g7 dropped by the batcher (IncompleteGroup" in report, report


def test_the_command_names_a_prefix_with_no_topics(kafka_settings: KafkaSettings) -> None:
    cmd = [sys.executable, "-m", "clawstream", "audit", "--topic-prefix", "nothing-here.", "--bootstrap"]
    done = subprocess.run([*cmd, kafka_settings.bootstrap_servers], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 2, done.stderr
    assert "no topics of the run with prefix 'nothing-here.'" in done.stderr
