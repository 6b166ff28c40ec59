"""The agent skeleton's guard (streams.agent.core): a pure core that raises on a record dead-letters that record
with the reason, and the agent goes on — one bad record never wedges a stage."""

from __future__ import annotations

from streams.agent import Emit, Reject, core


def test_a_raising_core_becomes_a_dead_letter_with_the_reason() -> None:
    def boom(record: object, event: object, now: int) -> list[Emit]:
        raise KeyError("g7\x000")

    (action,) = core("batcher", boom, object(), object(), 0)
    assert isinstance(action, Reject)
    assert action.error_type == "KeyError" and "the batcher core raised: KeyError" in action.reason


def test_a_core_that_returns_is_passed_through() -> None:
    actions = [Reject("late", "LateRecord")]
    assert core("grouper", lambda *_: actions, 1, 2) is actions
