"""Learner: trains the policy with GRPO/PPO and truncated importance sampling on tree-packed batches and publishes
weight versions.

Modules: ``train`` (the service: sealed batches → step → weight version + offsets in one transaction), ``step``
(pack → π_old → loss → AdamW), ``losses``, ``pack`` (tree packing), ``value`` (PPO value head and pretraining),
``config`` (hyperparameters and settings); ``warmstart/`` (SFT warm start through the real agent loop).

Topics: ``clawstream.batches`` (and ``clawstream.trajectories`` for value pretraining) in → ``clawstream.weights``,
``clawstream.metrics``, ``clawstream.deadletter`` out.
Run: ``clawstream learner --model-dir DIR --weight-store DIR`` or ``python -m learner``.
"""
