"""The project's exception hierarchy: one root, one subclass per kind of failure a caller may handle.

Library errors are wrapped with ``raise ... from exc`` so the original stays in the traceback.
"""

from __future__ import annotations


class ClawstreamError(Exception):
    """Root of every error clawstream raises on purpose."""


class ConfigError(ClawstreamError):
    """A setting is missing or invalid; the message names the field and the fix."""


class KafkaLocalError(ClawstreamError):
    """The local Apache Kafka broker could not be provisioned, started, reached or stopped."""


class CodecError(ClawstreamError):
    """Bytes could not be encoded or decoded as an Avro single-object-encoded event."""


class UnknownSchemaError(CodecError):
    """The fingerprint in a single-object-encoded record names no schema this codec knows."""


class CorruptRecordError(CodecError):
    """The bytes are not a well-formed single-object-encoded record (bad marker, truncated or garbled body)."""


class TopicError(ClawstreamError):
    """Topics could not be created or do not match the catalog (for example, a partition-count mismatch)."""
