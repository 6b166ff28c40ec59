"""The MLflow tracker: a run's topics into one MLflow run, as a consumer of the event log.

Topics in (the run's prefix): ``clawstream.metrics`` (the learner's per-step values), ``clawstream.weights`` (each
version), ``clawstream.batches`` (each trained batch: staleness, harness counts, sampled trajectories). Nothing is
produced; MLflow is written to: one run per topic prefix (tag ``clawstream.prefix``) with the run's params, every
per-step metric at its step, each weight version as a model version (sha256 and URI; the weights are not copied),
2 trajectories per step as browsable JSON artifacts and, with ``--run-dir``, the demo's before/after table and plot.
Writes are keyed by (metric, step), artifact path and version and checked against what MLflow holds, and offsets
are committed after the writes: a killed and restarted tracker logs every step exactly once.

* ``settings`` — ``TrackerSettings`` (env ``CLAWSTREAM_TRACKER_*``).
* ``writes`` — events → MLflow writes and the ledger that drops the ones already made (pure).
* ``trajectory_json`` — a sampled trajectory as a browsable JSON document (pure).
* ``mlflow_edge`` — the MLflow client: the run, what it holds, the writes, the weight versions, the report.
* ``consumer`` — the loop (decode → writes → MLflow → commit) and the command line.

Run: ``clawstream track --mlflow http://HOST:PORT --prefix PREFIX`` or ``python -m consumers.tracker``;
``clawstream demo --track URI`` starts it beside the demo. Needs ``pip install 'clawstream[track]'``.
docs/event_log.md: pointing MLflow at a run.
"""
