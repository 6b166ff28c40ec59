"""The topic catalog: every clawstream topic, its key, value schema, partition count and configs.

``calls``, ``rollout.events`` and ``rewards`` are co-partitioned (same partition count, all keyed by rollout id)
so the Faust assembler can join them per partition. ``proxy.registrations`` is compacted (the latest record per
rollout id; a tombstone forgets one). Pure: creation lives in
``clawbase.kafka.clients``; what a topic spec is, in ``clawbase.kafka.topic_spec``.
"""

from __future__ import annotations

from clawbase.kafka.topic_spec import MAX_MESSAGE_BYTES, TopicSpec
from clawbase.kafka.topic_spec import co_partition_groups as _groups

__all__ = ["CATALOG", "BY_NAME", "MAX_MESSAGE_BYTES", "ROLLOUT_PARTITIONS", "TopicSpec", "co_partition_groups"]

# Partitions of the rollout-keyed topics: enough to spread a few hundred concurrent rollouts over several
# stream workers. Changing it after topics exist breaks co-partitioning; `topics create` refuses mismatches.
ROLLOUT_PARTITIONS = 8

_BIG = {"max.message.bytes": str(MAX_MESSAGE_BYTES + 1024 * 1024)}
_WEEK_MS = str(7 * 24 * 3600 * 1000)


ROLLOUT_REQUESTS = "clawstream.rollout.requests"
ROLLOUT_EVENTS = "clawstream.rollout.events"
CALLS = "clawstream.calls"
REWARDS = "clawstream.rewards"
TRAJECTORIES = "clawstream.trajectories"
BATCHES = "clawstream.batches"
WEIGHTS = "clawstream.weights"
METRICS = "clawstream.metrics"
DEADLETTER = "clawstream.deadletter"
PROXY_REGISTRATIONS = "clawstream.proxy.registrations"

CATALOG: tuple[TopicSpec, ...] = (
    TopicSpec(
        ROLLOUT_REQUESTS,
        "rollout_id",
        "RolloutRequest",
        ROLLOUT_PARTITIONS,
        {"retention.ms": _WEEK_MS},
        description="scheduler → sandbox workers",
    ),
    TopicSpec(
        ROLLOUT_EVENTS,
        "rollout_id",
        "RolloutEvent",
        ROLLOUT_PARTITIONS,
        {"retention.ms": _WEEK_MS},
        "rollout",
        "sandbox worker → streams (lifecycle)",
    ),
    TopicSpec(
        CALLS,
        "rollout_id",
        "CallEvent",
        ROLLOUT_PARTITIONS,
        {**_BIG, "retention.ms": _WEEK_MS},
        "rollout",
        "proxy → streams (one model call)",
    ),
    TopicSpec(
        REWARDS,
        "rollout_id",
        "RewardEvent",
        ROLLOUT_PARTITIONS,
        {"retention.ms": _WEEK_MS},
        "rollout",
        "sandbox worker / judges → streams",
    ),
    TopicSpec(
        TRAJECTORIES,
        "rollout_id",
        "Trajectory",
        ROLLOUT_PARTITIONS,
        {**_BIG, "retention.ms": _WEEK_MS},
        description="streams → grouper, analytics, replay",
    ),
    # One partition: a batch's records and its seal stay in order, and the learner reads batches in order.
    TopicSpec(
        BATCHES, "batch_id", "BatchRecord", 1, {**_BIG, "retention.ms": _WEEK_MS}, description="streams → learner"
    ),
    TopicSpec(
        WEIGHTS,
        "model_name",
        "WeightVersion",
        1,
        {"retention.ms": "-1"},
        description="learner → inference workers, scheduler (full history kept)",
    ),
    TopicSpec(METRICS, "source", "Metric", 1, {"retention.ms": _WEEK_MS}, description="all → analytics"),
    TopicSpec(
        DEADLETTER,
        "original key",
        "DeadLetter",
        1,
        {**_BIG, "retention.ms": "-1"},
        description="any → operators (rejected records + reason)",
    ),
    # Compacted: the latest state of each rollout's proxy registration; a restarted proxy reads it whole at start.
    TopicSpec(
        PROXY_REGISTRATIONS,
        "rollout_id",
        "ProxyRegistration",
        1,
        {"cleanup.policy": "compact"},
        description="proxy → proxy (its registrations, restored after a restart)",
    ),
)

BY_NAME: dict[str, TopicSpec] = {spec.name: spec for spec in CATALOG}


def co_partition_groups(catalog: tuple[TopicSpec, ...] = CATALOG) -> dict[str, list[TopicSpec]]:
    return _groups(catalog)
