"""The policy model every service shares: the chat template and its control tokens, the tiny Qwen3-architecture
model and its byte-level BPE tokenizer (built from a seeded synthetic corpus), and the weight store (one directory
per weight version, safetensors + sha256, verified before use).

Topics: none. Run: ``clawstream model init --out DIR`` (or ``python -m policy.tiny_model``).
Layer: above ``schemas``/``clawstream`` base, below every service; imports no Kafka client.
"""
