"""Analytics: tools that read the event log for people, and the pattern for custom analytics consumers.

Topics: any topic of the catalog (``schemas/topics.py``), under any prefix; read-only. Nothing here commits consumer
offsets or writes to Kafka.

* ``records`` — decode any record to a JSON-ready dict (token arrays as counts or lists, decoded text with a
  model's tokenizer, nested trajectories, error records for undecodable bytes); shared by every tool here.
* ``tail`` — ``clawstream tail TOPIC``: records as JSON lines; start by offset, time or the last N; ``--rollout``,
  ``--follow``.
* ``export`` — ``clawstream export TOPIC --format jsonl|parquet --out PATH`` over an offset or time range.
* ``examples/`` — a ~30-line custom consumer (per-harness prefix reuse and mean reward of the trajectories topic),
  the pattern to copy.

Run: ``clawstream tail --help``, ``clawstream export --help`` or ``python -m consumers.analytics {tail,export}``;
``python -m consumers.analytics.examples.harness_report``. How to read the log: docs/event_log.md.
"""
