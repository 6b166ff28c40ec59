"""Live dashboard and capture-health summary: the event log, drawn for people as it arrives.

Topics in (read-only, partitions assigned by hand, nothing committed): ``clawstream.rollout.requests``,
``.rollout.events``, ``.calls``, ``.rewards``, ``.trajectories``, ``.weights``, ``.metrics`` (``.deadletter``
counted). Out: HTTP only — the page, its JSON state and Prometheus ``/metrics``. Nothing is written to Kafka.

Modules: ``state`` (the running aggregates, pure), ``feed`` (the Kafka edge: live follower and range reader),
``server`` (aiohttp: page, ``/api/state``, ``/metrics``; :func:`server.start_dashboard` for in-process use),
``health_report`` (``clawstream health`` over a topic range), ``static/`` (the page; plotly.js is served from the
installed ``plotly`` package). Capture-health figures: ``consumers.analytics.health`` (per rollout) and
``consumers.analytics.health_table`` (rows, aggregator).

Run: ``clawstream dashboard [--port 8200] [--topic-prefix P]`` (or ``python -m consumers.analytics.dashboard``),
``clawstream health [--topic-prefix P] [--since 2h] [--json]``. Panels and figures: docs/dashboard.md.
"""
