"""clawbase: the ground every clawstream service stands on.

The root exception and its hierarchy (``errors``), settings and ``CLAWSTREAM_HOME`` (``settings``), Kafka client
plumbing (``kafka``: configs, bootstrap resolution, reading to the end, topic creation, an asyncio publisher, the
local broker) and the fault-injection seam (``faults``). It imports nothing else of the project: the contracts in
``schemas`` stand on it, every stage above them. The application shell (CLI, demo, stack) is ``clawstream``.
"""
