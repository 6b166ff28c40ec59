"""The local Confluent-compatible Schema Registry behind ``clawstream registry up``: Apicurio Registry (in-memory H2
storage), its Quarkus application rebuilt once from Maven Central (``compose/schema-registry/pom.xml``), one JVM
recorded by pid. Module: ``server`` (:class:`LocalRegistry`: provision, up, down, status). Users: the CLI,
``tests/integration/test_schema_registry.py``.
"""

from clawstream.local_registry.server import LocalRegistry

__all__ = ["LocalRegistry"]
