"""Custom analytics consumers to copy: subscribe to a topic with confluent-kafka, decode with the project's codec.

``harness_report`` — per-harness prefix reuse and mean reward of ``clawstream.trajectories`` (README.md here).
Topics: ``clawstream.trajectories`` in, stdout out. Run: ``python -m consumers.analytics.examples.harness_report``.
"""
