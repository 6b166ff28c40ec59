"""Kafka plumbing every service stands on: client configs, reading a topic to its end, topic creation, an asyncio
publisher that waits for delivery, and where the local broker runs (its recorded state).

Modules: ``clients`` (configs, bootstrap resolution, ``read_to_end``, ``produce_reliably``, ``create_topics``),
``topic_spec`` (what a topic is; the largest record; the replication rule), ``publisher`` (asyncio producer used by
the proxy, sandbox worker and scheduler), ``local_state`` (the state ``clawstream kafka up`` records: which local
nodes run, where; the launcher is ``clawstream.local_kafka``).
Knows no clawstream topic: the catalog is ``schemas.topics``; the dead-letter builder ``schemas.dead_letter``.
"""
