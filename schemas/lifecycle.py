"""Rollout lifecycle: the states of one rollout attempt and the transitions allowed between them.

A rollout attempt starts (sandbox up, harness launched) and then ends exactly one way: the harness exits by
itself (any exit code: the work may still be done, so it is graded), it is killed at its wall-clock limit, or the
infrastructure fails (sandbox, proxy, Kafka, grader), which is never scored. A graded attempt can still turn into an
infrastructure failure when its grader crashes. Pure: no Kafka import.
"""

from __future__ import annotations

from clawbase.errors import ClawstreamError
from schemas.events import RolloutState

# None = no event yet. A sandbox that cannot even be created fails before STARTED.
ALLOWED: dict[RolloutState | None, frozenset[RolloutState]] = {
    None: frozenset({RolloutState.STARTED, RolloutState.FAILED}),
    RolloutState.STARTED: frozenset({RolloutState.HARNESS_EXITED, RolloutState.TIMED_OUT, RolloutState.FAILED}),
    RolloutState.HARNESS_EXITED: frozenset({RolloutState.FAILED}),  # grader crash after a clean exit
    RolloutState.TIMED_OUT: frozenset({RolloutState.FAILED}),
    RolloutState.FAILED: frozenset(),
}

# States after which the harness no longer runs (the rollout can be sealed and graded).
ENDED: frozenset[RolloutState] = frozenset({RolloutState.HARNESS_EXITED, RolloutState.TIMED_OUT, RolloutState.FAILED})


class LifecycleError(ClawstreamError):
    """A transition the lifecycle does not allow (e.g. STARTED twice, or anything after FAILED)."""


def can_transition(current: RolloutState | None, new: RolloutState) -> bool:
    return new in ALLOWED[current]


def transition(current: RolloutState | None, new: RolloutState) -> RolloutState:
    """Return ``new`` if the move is allowed, else raise :class:`LifecycleError` naming both states."""
    if not can_transition(current, new):
        allowed = ", ".join(sorted(s.value for s in ALLOWED[current])) or "nothing (terminal)"
        raise LifecycleError(
            f"rollout cannot go from {current.value if current else 'start'} to {new.value}; allowed: {allowed}"
        )
    return new
