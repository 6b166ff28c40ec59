"""The contracts: Avro value schemas (``*.avsc``, the source of truth), the single-object codec, typed events,
the rollout lifecycle and the topic catalog. Nothing here imports a Kafka client."""
