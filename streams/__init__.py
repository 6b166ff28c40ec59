"""Stream processors (Faust): rollouts' calls, lifecycle and reward → settled prefix-tree trajectories → GRPO groups
→ harness-mixed training batches, exactly once.

Modules: ``app`` (the Faust app: wiring only), ``agent`` (the one skeleton every agent runs), ``assemble`` (calls ⋈
lifecycle ⋈ reward per rollout) with ``rollout`` (the settle rule) and ``trajectory`` (the settled Trajectory),
``tree`` (pure per-rollout prefix tree and filtering), ``group`` (GRPO groups and advantages), ``batch`` (mixed
batches and seals), ``state`` (types shared by the stages and the tick loop), ``eos`` (exactly-once fixes for
faust-streaming), ``codec``, ``settings``.

Topics: ``clawstream.calls``, ``clawstream.rollout.events``, ``clawstream.rewards``,
``clawstream.rollout.requests``, ``clawstream.weights`` in → ``clawstream.trajectories``, ``clawstream.batches``,
``clawstream.metrics``, ``clawstream.deadletter`` out.
Run: ``clawstream streams worker`` or ``python -m streams worker``.
"""
