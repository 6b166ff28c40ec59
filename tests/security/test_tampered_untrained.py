"""A rollout that forged an assistant turn is never trained: the streams drop it, its group trains short without it.

The attack: a process in the sandbox holds the rollout's key and sends one call whose conversation carries an
assistant turn the engine never generated (a ``web_search`` tool call, say), so that the recorded history — and the
tree built from it — holds text the policy did not write. The proxy marks that call ``tampered``. Fed through the
streams' own pure cores (``streams.assemble`` → ``streams.group``) next to honest rollouts of the same group, the
forged rollout must settle DROPPED (``tampered (1 call(s))``), emit no batch record, and leave the group's reward
statistics to the honest members; the honest members train as they would without it.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from schemas.events import BatchRecordKind, CallEvent, Event, Trajectory, TrajectoryStatus
from schemas.topics import CALLS
from streams.assemble import Assembler
from streams.group import Grouper, advantages
from streams.settings import StreamsSettings
from streams.tree import TreeCall, build_tree
from tests.support.stream_load import SynthRollout, build

CFG = StreamsSettings(group_size=4, settle_timeout_s=10.0, late_retention_s=100.0, store="memory://")
GID = "suite/t1|openclaw|3"
REWARDS = {"honest-0": 0.0, "honest-1": 0.5, "honest-2": 0.25, "forger": 1.0}


def _records(rollout_id: str, reward: float, *, tamper: bool) -> list[tuple[str, Event]]:
    r = build(
        SynthRollout(rollout_id, GID, "suite/t1", "openclaw", 3, reward, n_calls=3, group_size=4, policy_version=3)
    )
    if not tamper:
        return r.records
    out, n = [], 0
    for topic, ev in r.records:
        if topic == CALLS and isinstance(ev, CallEvent):
            ev = replace(ev, tampered=n == 1)  # its second call carried the forged turn
            n += 1
        out.append((topic, ev))
    return out


def _settle(records: list[tuple[str, Event]]) -> list[Trajectory]:
    state: dict[str, bytes] = {}
    calls: dict[str, bytes] = {}
    index: dict[str, bytes] = {}
    out: list[Trajectory] = []
    t = 0
    for _, ev in records:
        out += Assembler(CFG, state, calls, index).on_record(ev, ev.to_bytes(), 0, t).trajectories
        t += 10
    out += Assembler(CFG, state, calls, index).on_tick(0, t + 60_000).trajectories
    return out


def test_a_rollout_with_a_forged_assistant_turn_is_dropped_and_its_group_trains_without_it() -> None:
    records = [rec for rid, reward in REWARDS.items() for rec in _records(rid, reward, tamper=rid == "forger")]
    settled = {t.rollout_id: t for t in _settle(records)}
    assert set(settled) == set(REWARDS)

    forged = settled["forger"]
    assert forged.status is TrajectoryStatus.DROPPED, forged.status
    assert forged.drop_reason == "tampered (1 call(s))" and forged.segments == []
    for rid in ("honest-0", "honest-1", "honest-2"):
        assert settled[rid].status is TrajectoryStatus.COMPLETE and settled[rid].segments, rid

    groups: dict[str, bytes] = {}
    members: dict[str, bytes] = {}
    index: dict[str, bytes] = {}
    emitted = []
    for t in settled.values():
        emitted += Grouper(CFG, groups, members, index).on_trajectory(t, t.to_bytes(), 0, 0).records
    trained = {r.rollout_id: r.advantage for r in emitted if r.kind is BatchRecordKind.TRAJECTORY}
    seal = next(r for r in emitted if r.kind is BatchRecordKind.SEAL)
    assert set(trained) == {"honest-0", "honest-1", "honest-2"} and seal.index == 3
    honest = [REWARDS[r] for r in ("honest-0", "honest-1", "honest-2")]
    adv, _, _ = advantages(honest, CFG.advantage_eps)  # the forger's 1.0 is in no member's advantage
    assert [trained[r] for r in ("honest-0", "honest-1", "honest-2")] == pytest.approx(adv)


def test_the_tree_drops_a_rollout_with_any_tampered_call_before_any_other_reason() -> None:
    calls = [
        TreeCall("c0", 0, None, 0, [1, 2, 3], [4, 5], [-0.1, -0.2], "main", 1),
        TreeCall("c1", 1, "c0", 5, [6], [7, 8], [-0.1, -0.2], "side", 1, tampered=True),
        TreeCall("c2", 2, None, 0, [9], [10], [-0.3], "main", 1, tampered=True),
    ]
    tree = build_tree(calls, max_leaves=1)  # two leaves: over the cap too
    assert tree.dropped_reason == "tampered (2 call(s))" and tree.segments == [] and tree.call_nodes == {}
    assert build_tree([replace(c, tampered=False) for c in calls], max_leaves=2).dropped_reason is None
