"""Analytics: tools that read the event log for people, and the pattern for custom analytics consumers.

Topics: any topic of the catalog (``schemas/topics.py``), under any prefix, read-only; nothing here commits consumer
offsets, and only ``replay`` writes to Kafka (a copy under a new topic prefix).

* ``records`` — decode any record to a JSON-ready dict; shared by every tool here. ``reader`` — read a range of a
  topic without a consumer group. ``columns`` — Avro schema → typed Arrow columns (for Parquet).
* ``tail`` — ``clawstream tail TOPIC``: records as JSON lines (by offset, time or the last N; ``--rollout``,
  ``--follow``). ``export`` — ``clawstream export TOPIC --format jsonl|parquet --out PATH`` over a range.
* ``replay`` — ``clawstream replay``: copy a range of recorded topics into a new prefix (sealed batches whole), for
  off-policy experiments; ``replay_plan`` — its decisions, pure.
* ``health`` — capture health of one rollout (forks, re-renders, masked tokens, ...); ``health_table`` — rows per
  (harness, template), the streaming aggregator and the table of ``clawstream health``.
* ``dashboard/`` — ``clawstream dashboard`` (live page, ``/metrics``) and ``clawstream health``.
* ``examples/`` — a ~30-line custom consumer (per-harness prefix reuse and mean reward of the trajectories topic),
  the pattern to copy.

Run: ``clawstream {tail,export,replay,health,dashboard} --help`` or ``python -m consumers.analytics {tail,export}``;
``python -m consumers.analytics.examples.harness_report``. How to read the log: docs/event_log.md; replay:
docs/replay.md; dashboard and capture health: docs/dashboard.md.
"""
