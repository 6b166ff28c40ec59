"""A group's records replayed after ``late_retention_s`` on the real broker re-open nothing (real streams worker).

Two rollouts of one group settle, group and are batched; once the retention is over (0.5 s here, so the test needs
no long wait) every one of their records is produced again. The worker dead-letters them as late: no second
trajectory, no second group, no second batch. The pure cores' version: ``tests/unit/test_replay_tombstones.py``.
"""

from __future__ import annotations

import pytest

from schemas.events import BatchRecord, BatchRecordKind, DeadLetter
from schemas.topics import BATCHES, DEADLETTER, TRAJECTORIES
from tests.support.stream_harness import Collector, Worker, produce
from tests.support.stream_load import SynthRollout, build

pytestmark = pytest.mark.integration
SETTINGS = {
    "store": "memory://",
    "settle_interval_s": 0.3,
    "settle_timeout_s": 3.0,
    "late_retention_s": 0.5,
    "tick_interval_s": 0.1,
    "commit_interval_s": 0.2,
    "session_timeout_s": 6.0,
    "group_size": 2,
    "batch_groups": 1,
    "max_policy_lag": 100,
}


def pair() -> list[SynthRollout]:
    head = {"group_id": "replay/t|cc|1", "task_id": "replay/t", "harness": "cc", "step": 1, "n_calls": 2}
    head["group_size"] = 2
    return [build(SynthRollout(rollout_id=f"replay-{k}", reward_value=float(k), **head)) for k in (0, 1)]  # type: ignore[arg-type]


def wait(col: Collector, done, seconds: float) -> None:  # noqa: ANN001
    for _ in range(int(seconds / 0.5)):
        if done():
            return
        col.poll(0.5)


@pytest.mark.timeout(240)
def test_records_replayed_after_the_retention_reopen_nothing(kafka_settings, tmp_path) -> None:  # noqa: ANN001
    worker = Worker(kafka_settings, tmp_path, **SETTINGS)
    col = Collector(kafka_settings, "replay-collector")
    rollouts = pair()
    records = [rec for r in rollouts for rec in r.records]
    worker.start()
    try:
        produce(kafka_settings, records)
        wait(col, lambda: col.count(BATCHES) >= 3, 120)
        assert col.count(TRAJECTORIES) == 2 and col.count(BATCHES) == 3, worker.log_tail()
        col.poll(2.0)  # the retention (0.5 s) passes: the rollouts and the group are compacted to tombstones
        produce(kafka_settings, records)  # every record of the group, replayed
        wait(col, lambda: col.count(DEADLETTER) >= len(records), 60)
        col.poll(2.0)  # a re-opened rollout would settle 0.3 s after its last record
        late = [DeadLetter.from_bytes(o.value) for o in col.got[DEADLETTER]]
        assert len(late) == len(records) and all("late" in d.reason for d in late), [d.reason for d in late]
        assert col.count(TRAJECTORIES) == 2, "a replayed rollout settled a second time"
        seals = [BatchRecord.from_bytes(o.value) for o in col.got[BATCHES]]
        assert [s.kind for s in seals].count(BatchRecordKind.SEAL) == 1, "a replayed group was batched again"
    finally:
        worker.stop()
        col.close()
