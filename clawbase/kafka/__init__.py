"""Kafka plumbing every service stands on: client configs, reading a topic to its end, topic creation, an asyncio
publisher that waits for delivery, and the local Apache Kafka broker (one node, or a replicated cluster).

Modules: ``clients`` (configs, bootstrap resolution, ``read_to_end``, ``produce_reliably``, ``create_topics``),
``topic_spec`` (what a topic is; the largest record; the replication rule), ``publisher`` (asyncio producer used by
the proxy, sandbox worker and scheduler), ``local`` (provision, format and run the local broker or cluster behind
``clawstream kafka up``).
Knows no clawstream topic: the catalog is ``schemas.topics``; the dead-letter builder ``schemas.dead_letter``.
"""
