"""Scheduler: issues rollout requests for each training step (task × harness instances, G rollouts each), gated
by policy lag; re-issues infrastructure failures; ``--eval`` runs a held-out evaluation and prints a per-harness
score table. ``plan`` is the pure part (step plans, harness ratios, lag gating, re-issues, eval tables),
``service`` the Kafka edge.

Topics: ``clawstream.rewards``, ``clawstream.weights`` in → ``clawstream.rollout.requests`` out.
Run: ``clawstream schedule [--steps N] [--eval]`` or ``python -m producers.scheduler``.
"""
