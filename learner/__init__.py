"""Learner: trains the policy with GRPO/PPO and truncated importance sampling on tree-packed batches and publishes
weight versions.

Modules: ``train`` (the service: sealed batches → step → weight version + offsets in one transaction), ``step``
(pack → π_old → loss → AdamW), ``losses`` (GRPO/PPO: clipped surrogate, TIS / masked IS, value loss, k3 KL),
``aggregation`` (per-token loss → scalar; the shared input checks), ``pack`` (tree packing into micro-batch rows),
``forward`` (running the model on packed rows: tree mask, per-token logprobs under each call's sampling settings,
the LM head in checkpointed chunks), ``precision`` (loading the policy with fp32 master weights),
``prefix_share`` (the context a row's trees begin with, packed once), ``tree_split`` (trees over the token budget as
one chain row per path), ``segment_sampling`` (a trainable segment's recorded sampling settings), ``logit_scale``
(a learned logit scale folded into the final norm after every step), ``value`` (PPO value head and pretraining),
``attempts`` (step attempts that outlive the process), ``config`` (hyperparameters and settings); ``warmstart/``
(SFT warm start through the real agent loop).

Topics: ``clawstream.batches`` (and ``clawstream.trajectories`` for value pretraining) in → ``clawstream.weights``,
``clawstream.metrics``, ``clawstream.deadletter`` out.
Run: ``clawstream learner --model-dir DIR --weight-store DIR`` or ``python -m learner``.
"""
