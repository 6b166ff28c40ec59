"""Kafka plumbing every service stands on: client configs, reading a topic to its end, dead letters, an asyncio
publisher that waits for delivery, and the local single-node Apache Kafka broker.

Modules: ``clients`` (configs, bootstrap resolution, ``read_to_end``, topic creation), ``dead_letter`` (build and
produce dead letters), ``publisher`` (asyncio producer used by the proxy, sandbox worker and scheduler), ``local``
(provision, format and run the local broker behind ``clawstream kafka up``).
"""
