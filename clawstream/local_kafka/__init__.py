"""The local Apache Kafka 4.x (KRaft) behind ``clawstream kafka up``: one node by default, or a replicated cluster of
N nodes on one host, each a combined broker + controller in its own JVM, assembled from Maven Central jars.

Modules: ``cluster`` (:class:`LocalKafka`: up, down, status, the active controller), ``node`` (one node's
properties, storage format, JVM and log; stopping nodes), ``provision`` (Java and the jars, fetched once with Maven).
The state it records, which is all a client needs, is ``clawbase.kafka.local_state``. Users: the CLI, the stack,
``tests/conftest.py`` and the benchmarks.
"""

from clawstream.local_kafka.cluster import LocalKafka

__all__ = ["LocalKafka"]
