"""The policy model every service shares: the chat template and its control tokens, the tiny Qwen3-architecture
model and its byte-level BPE tokenizer (built from a seeded synthetic corpus), and the weight store (one directory
per weight version, safetensors + sha256, verified before use).

Topics: none. Run: ``clawstream model init --out DIR`` (or ``python -m policy.tiny_model``).
Layer: above ``schemas``/``clawstream`` base, below every service; imports no Kafka client.

:data:`DEFAULT_MODEL_NAME` is the one default name of the policy model everywhere it is named: the name the
inference engine serves (``clawstream infer --served-model-name``), the ``model`` the proxy asks the engine for
(``clawstream proxy --engine-model``) and the learner's ``WeightVersion.model_name`` (the key of
``clawstream.weights``, which the engine follows). Left at their defaults, the three agree without any flag.
"""

DEFAULT_MODEL_NAME = "policy"
