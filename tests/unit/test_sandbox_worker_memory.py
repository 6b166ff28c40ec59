"""The sandbox worker's per-rollout memory: duplicate detection (producers.sandbox.offsets.SeenRequests) tells a
duplicate or stale record from a redelivery, forgets the oldest rollout ids past its limit, and costs a compact entry
per rollout; a serving worker keeps no outcome per rollout (producers.sandbox.worker: only a count)."""

from __future__ import annotations

import random
import tracemalloc
import uuid
from collections import OrderedDict

from clawbase.settings import KafkaSettings
from producers.sandbox import worker as worker_module
from producers.sandbox.offsets import SeenRequests, open_store
from producers.sandbox.rollout import Outcome
from producers.sandbox.settings import SandboxSettings
from producers.sandbox.worker import SandboxWorker
from schemas.events import RolloutRequest

TOPIC = "clawstream.rollout.requests"


def _topic() -> str:
    return "".join(["clawstream.rollout.", "requests"])  # a fresh string per record, as msg.topic() returns


def test_a_redelivery_is_not_a_duplicate_a_record_at_another_offset_is() -> None:
    seen = SeenRequests(limit=10)
    assert seen.check("r1", 0, (TOPIC, 3), 100) is None  # new
    assert seen.check("r1", 0, (_topic(), 3), 100) is None  # the same record read again (a redelivery)
    dup = seen.check("r1", 0, (TOPIC, 3), 140)
    assert dup == f"duplicate: rollout r1 attempt 0 was already read at {TOPIC}[3]@100", dup
    assert seen.check("r1", 1, (TOPIC, 3), 150) is None  # its re-issue
    assert seen.check("r1", 0, (TOPIC, 3), 100) is None  # attempt 0's own record again: still a redelivery
    assert seen.check("r1", 1, (TOPIC, 4), 150) is not None  # another partition is another record
    assert seen.check("r2", 1, (TOPIC, 1), 20) is None
    stale = seen.check("r2", 0, (TOPIC, 1), 30)
    assert stale == f"stale: rollout r2 attempt 0 after attempt 1 (read at {TOPIC}[1]@20)", stale
    assert len(seen) == 2


def _reference(limit: int):  # noqa: ANN202 - the check as the worker had it, a dict of tuples per rollout id
    table: OrderedDict[str, dict[int, tuple[tuple[str, int], int]]] = OrderedDict()

    def check(rid: str, attempt: int, tp: tuple[str, int], offset: int) -> str | None:
        attempts = table.get(rid, {})
        if attempts.get(attempt) == (tp, offset):
            return None
        if attempt in attempts:
            (t, p), o = attempts[attempt]
            return f"duplicate: rollout {rid} attempt {attempt} was already read at {t}[{p}]@{o}"
        newer = max(attempts, default=-1)
        if newer > attempt:
            (t, p), o = attempts[newer]
            return f"stale: rollout {rid} attempt {attempt} after attempt {newer} (read at {t}[{p}]@{o})"
        table[rid] = {**attempts, attempt: (tp, offset)}  # kept: the store forgets nothing (limit: memory only)
        return None

    return check


def test_the_compact_table_decides_as_the_dict_of_tuples_did() -> None:
    rng = random.Random(7)
    for limit in (3, 1000):
        seen, reference = SeenRequests(limit), _reference(limit)
        for _ in range(5000):
            args = (f"r{rng.randrange(8)}", rng.randrange(4), (TOPIC, rng.randrange(2)), rng.randrange(6))
            assert seen.check(*args) == reference(*args), args


def test_rollout_ids_past_the_memory_limit_are_still_recognised_from_the_store() -> None:
    store: dict[str, bytes] = {}
    seen = SeenRequests(limit=3, store=store)
    for i, rid in enumerate("abcd"):
        assert seen.check(rid, 0, (TOPIC, 0), i) is None
    assert len(seen) == 3 and len([k for k in store if not k.startswith("\x00")]) == 4
    dup = seen.check("a", 0, (TOPIC, 0), 9)  # out of memory, still in the store
    assert dup == f"duplicate: rollout a attempt 0 was already read at {TOPIC}[0]@0", dup
    assert SeenRequests(limit=3, store=store).check("b", 0, (TOPIC, 0), 9) is not None  # a restarted worker too


def test_a_record_below_the_committed_position_is_a_replay_not_a_redelivery() -> None:
    seen = SeenRequests(limit=2, store={})
    assert seen.check("a", 0, (TOPIC, 0), 5) is None
    assert seen.check("a", 0, (TOPIC, 0), 5) is None  # redelivered before its offset was committed: not poison
    seen.committed((TOPIC, 0), 6)
    why = seen.check("a", 0, (TOPIC, 0), 5)  # the group rewound past it: it ran already
    assert why is not None and "below its partition's committed position 6" in why, why
    assert seen.check("b", 0, (TOPIC, 1), 5) is None  # another partition's position is its own


def test_seen_requests_entries_are_compact(tmp_path) -> None:  # noqa: ANN001
    """~250 bytes a rollout id (its id string included) where a dict of tuples with a fresh topic string per entry
    took ~590: SEEN_MAX (100,000) entries hold ~25 MB, not ~59 MB."""
    n = 20_000
    tracemalloc.start()
    try:
        seen = SeenRequests(limit=n, store=open_store(tmp_path))  # on disk: not in the Python heap
        for i in range(n):
            assert seen.check(uuid.uuid4().hex, 0, (_topic(), i % 8), 1_000_000 + i) is None
        per_entry = tracemalloc.get_traced_memory()[0] / n
    finally:
        tracemalloc.stop()
    assert len(seen) == n
    assert per_entry < 320, f"{per_entry:.0f} bytes per rollout id remembered"


async def test_a_serving_worker_counts_outcomes_and_keeps_them_only_when_asked(monkeypatch) -> None:  # noqa: ANN001
    async def execute(req: RolloutRequest, ctx: object) -> Outcome:  # a finished attempt, nothing run
        return Outcome(f"{req.rollout_id}.a0.x", None, None, {"t0": 0.0})

    monkeypatch.setattr(worker_module, "execute", execute)
    # never connects: nothing is published (the worker's producer only tries an address that refuses)
    kafka = KafkaSettings(bootstrap_servers="127.0.0.1:1")
    tp = (TOPIC, 0)
    for keep in (False, True):
        worker = SandboxWorker(SandboxSettings(), kafka, backend=object(), adapters={}, keep_outcomes=keep)  # type: ignore[arg-type]
        try:
            for offset in range(1000):
                req = RolloutRequest(uuid.uuid4().hex, 0, 0, "cpu_builtin", "t", "agentloop", "g", 0, 60.0)
                worker.tracker.start(tp, offset)
                await worker._run_one(req, tp, offset)
        finally:
            worker.publisher.close(0)
        assert worker.finished == 1000 and worker.tracker.commit_point(tp) == 1000
        assert len(worker.outcomes) == (1000 if keep else 0)
