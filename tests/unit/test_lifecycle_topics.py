"""Rollout lifecycle transitions and the topic catalog's invariants (pure)."""

from __future__ import annotations

import pytest

from schemas.codec import default_codec
from schemas.events import RolloutState
from schemas.lifecycle import ENDED, LifecycleError, can_transition, transition
from schemas.topics import CALLS, CATALOG, REWARDS, ROLLOUT_EVENTS, co_partition_groups

S = RolloutState


def test_happy_paths() -> None:
    state = transition(None, S.STARTED)
    assert transition(state, S.HARNESS_EXITED) in ENDED
    assert transition(S.STARTED, S.TIMED_OUT) is S.TIMED_OUT
    assert transition(S.HARNESS_EXITED, S.FAILED) is S.FAILED  # grader crash after exit
    assert transition(None, S.FAILED) is S.FAILED  # sandbox creation failure


@pytest.mark.parametrize(
    ("current", "new"),
    [
        (S.STARTED, S.STARTED),
        (S.FAILED, S.STARTED),
        (S.FAILED, S.HARNESS_EXITED),
        (None, S.HARNESS_EXITED),
        (S.TIMED_OUT, S.HARNESS_EXITED),
        (S.HARNESS_EXITED, S.TIMED_OUT),
    ],
)
def test_forbidden(current, new) -> None:
    assert not can_transition(current, new)
    with pytest.raises(LifecycleError, match="allowed"):
        transition(current, new)


def test_catalog_is_consistent() -> None:
    names = [s.name for s in CATALOG]
    assert len(names) == len(set(names)) == 10
    for spec in CATALOG:
        default_codec().entry(spec.value_schema)  # every topic's value schema exists
        assert spec.partitions >= 1
    group = co_partition_groups()["rollout"]
    assert {s.name for s in group} == {CALLS, ROLLOUT_EVENTS, REWARDS}
    assert len({s.partitions for s in group}) == 1
    big = {s.name for s in CATALOG if int(s.configs.get("max.message.bytes", 0)) >= 16 * 1024 * 1024}
    assert CALLS in big
