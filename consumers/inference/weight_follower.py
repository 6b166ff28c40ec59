"""Weight versions for inference workers: follow ``clawstream.weights``, verify, apply, report.

Topics: ``clawstream.weights`` (``WeightVersion``) in → ``clawstream.metrics`` (``Metric`` "weights_applied")
and ``clawstream.deadletter`` (``DeadLetter`` for a version that was rejected) out.

:class:`WeightsFollower` runs one thread with a confluent-kafka consumer. Every worker must see every version, so
it does not share a consumer group: it assigns itself all partitions of the topic from the beginning (the topic
keeps its full history), reads up to the end offsets present at startup, applies only the newest version for its
model name (falling back to the next newest when that one is rejected), then applies each newer version as it
arrives. Nothing is committed. Poison goes to the dead-letter topic and the follower goes on serving
(docs/faults.md#poison): undecodable records (a tombstone too); after the catch-up, a version below the one served
or the served one with another sha256. The served version again with its sha256 is skipped and logged.

Applying a version (``WeightVersion.uri`` + ``sha256``): resolve the URI (``file://``, an absolute path, or
``http(s)://`` fetched into a local cache by ``policy.weight_fetch``), check the file exists and its sha256, load
the safetensors and check every tensor's name and shape against the served model (missing, unknown or mis-shaped
tensors reject the file; tied weights may appear once) -- all before the served weights are touched -- then hand it
to the target (:class:`EngineWeightsTarget` for the CPU engine, which swaps between decode steps, see
``consumers.inference.engine``; ``consumers.inference.vllm_adapter`` for a vLLM server). A rejected version keeps
the old weights, is logged with its reason and position (``topic[partition]@offset``) and goes to the dead-letter
topic with the original key and value. An applied one publishes a "weights_applied" metric with the swap latency
split into load (read + verify), drain wait (in-flight requests finishing on the old weights) and apply (copy) time,
plus GPU readings when NVML is present.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from confluent_kafka import Message

from clawbase.errors import ClawstreamError, CodecError
from clawbase.kafka.clients import (
    assign_from_beginning,
    make_consumer,
    make_producer,
    produce_reliably,
    read_to_end,
    where,
)
from clawbase.settings import KafkaSettings
from consumers.inference.engine import Engine, SwapOutcome, WeightSwap
from consumers.inference.telemetry import gpu_readings
from policy.weight_fetch import verified_file
from policy.weight_store import WeightsRejected, copy_into, load_checked
from schemas.dead_letter import dead_letter_of
from schemas.events import Metric, WeightVersion, now_ms
from schemas.topics import DEADLETTER, METRICS, WEIGHTS

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ApplyReport:
    wait_s: float  # until the target could switch (in-flight requests draining)
    apply_s: float  # the switch itself


class WeightsTarget(Protocol):
    """Where verified weights go. ``prepare`` may be slow (runs on the follower thread, old weights keep serving);
    ``apply`` blocks until the new version serves, raising to keep the old one."""

    @property
    def policy_version(self) -> int: ...

    def prepare(self, event: WeightVersion) -> Any: ...

    def apply(self, prepared: Any, event: WeightVersion) -> ApplyReport: ...


class EngineWeightsTarget:
    """Applies verified weights to a CPU :class:`Engine` between decode steps (see ``consumers.inference.engine``)."""

    def __init__(self, engine: Engine, *, stop: threading.Event | None = None) -> None:
        self.engine = engine
        self._stop = stop or threading.Event()

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    def prepare(self, event: WeightVersion) -> dict[str, torch.Tensor]:
        return load_checked(verified_file(event), self.engine.model)

    def apply(self, prepared: dict[str, torch.Tensor], event: WeightVersion) -> ApplyReport:
        finished = threading.Event()
        box: list[SwapOutcome] = []

        def done(outcome: SwapOutcome) -> None:
            box.append(outcome)
            finished.set()

        self.engine.request_swap(WeightSwap(event.policy_version, lambda m: copy_into(m, prepared), done))
        while not finished.wait(0.5):
            if self._stop.is_set():
                raise ClawstreamError("stopping before the swap was applied")
        outcome = box[0]
        if outcome.error is not None:
            raise WeightsRejected("apply_failed", f"applying version {event.policy_version} failed: {outcome.error}")
        return ApplyReport(outcome.wait_s, outcome.apply_s)


# ---- Kafka ----------------------------------------------------------------------------------------------------------
class Reporter:
    """Publishes the worker's metrics and dead letters (one idempotent producer, thread-safe)."""

    def __init__(self, kafka: KafkaSettings, source: str) -> None:
        self.kafka = kafka
        self.source = source
        self.producer = make_producer(kafka)

    def metric(
        self,
        name: str,
        policy_version: int,
        values: dict[str, float],
        *,
        labels: dict[str, str] | None = None,
        step: int | None = None,
    ) -> None:
        event = Metric(policy_version, now_ms(), self.source, name, values, step=step, labels=labels or {})
        produce_reliably(self.producer, self.kafka.topic(METRICS), self.source.encode(), event.to_bytes())
        self.producer.poll(0)

    def dead_letter(self, msg: Message, reason: str, error_type: str, policy_version: int | None) -> None:
        event = dead_letter_of(msg, self.source, reason, error_type, policy_version=policy_version)
        produce_reliably(self.producer, self.kafka.topic(DEADLETTER), msg.key(), event.to_bytes())
        self.producer.flush(10)

    def flush(self, timeout: float = 10.0) -> None:
        self.producer.flush(timeout)


class WeightsFollower:
    """Follows ``clawstream.weights`` for one model name and applies new versions to a :class:`WeightsTarget`."""

    def __init__(
        self,
        kafka: KafkaSettings,
        target: WeightsTarget,
        *,
        model_name: str,
        reporter: Reporter,
        extra_values: Callable[[], dict[str, float]] = gpu_readings,
        poll_timeout: float = 0.5,
    ) -> None:
        self.kafka = kafka
        self.target = target
        self.model_name = model_name
        self.reporter = reporter
        self.extra_values = extra_values
        self.poll_timeout = poll_timeout
        self.topic = kafka.topic(WEIGHTS)
        self.caught_up = threading.Event()  # set once the startup catch-up is done
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.applied: list[int] = []
        self.rejected: list[tuple[int, str]] = []
        self.skipped: list[int] = []  # live duplicates of the served version
        self.serving: WeightVersion | None = None  # the last version applied (None: the engine's own start weights)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="weights-follower", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        backoff = 1.0
        while not self._stop.is_set():
            try:
                self.run()
                return
            except Exception as exc:  # e.g. a just-created topic without a leader yet: retry, keep serving
                log.warning(
                    "weights follower failed (%s: %s); retrying in %.0fs, still serving version %d",
                    type(exc).__name__,
                    exc,
                    backoff,
                    self.target.policy_version,
                )
                log.debug("weights follower failure", exc_info=True)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 30.0)

    def run(self) -> None:
        # Group id only because librdkafka wants one; partitions are assigned by hand and nothing is committed.
        consumer = make_consumer(self.kafka, f"inference-worker-{uuid.uuid4().hex[:12]}")
        try:
            ends = assign_from_beginning(consumer, self.topic, 30)
            log.info(
                "following %s from the beginning (end offsets at startup: %s)",
                self.topic,
                ", ".join(f"{self.topic}[{p}]@{o}" for p, o in ends.items()),
            )
            self._catch_up(consumer, ends)
            self.caught_up.set()
            while not self._stop.is_set():
                msg = consumer.poll(self.poll_timeout)
                if msg is None:
                    continue
                if msg.error() is not None:
                    log.warning("consumer error on %s: %s", self.topic, msg.error())
                    continue
                event = self._decode(msg)
                if event is not None and self._in_order(msg, event):
                    self._handle(msg, event)
        finally:
            consumer.close()
            self.reporter.flush()

    def _catch_up(self, consumer: Any, ends: dict[int, int]) -> None:
        """Read what the topic held at startup; apply the newest version for our model (older ones as fallback)."""
        candidates: list[tuple[Message, WeightVersion]] = []
        # No deadline: past the server's catch_up_timeout_s (its port stays closed until then) the engine serves the
        # version it has while this catches up, however long it takes.
        for msg in read_to_end(
            consumer, self.topic, ends, timeout=None, poll_timeout=self.poll_timeout, stop=self._stop.is_set
        ):
            event = self._decode(msg, quiet=True)
            if event is not None:
                candidates.append((msg, event))
        candidates.sort(key=lambda pair: pair[1].policy_version, reverse=True)
        for msg, event in candidates:
            if event.policy_version <= self.target.policy_version:
                break
            if self._handle(msg, event):
                break

    def _in_order(self, msg: Message, event: WeightVersion) -> bool:
        """Whether a live version is newer than the one served; a duplicate is skipped, one going backwards or
        claiming the served version with another file is dead-lettered."""
        served = self.target.policy_version
        if event.policy_version > served:
            return True
        known = self.serving.sha256 if self.serving is not None and self.serving.policy_version == served else None
        if event.policy_version == served and known in (None, event.sha256):
            log.warning("skipping version %d at %s: a duplicate of the version served", served, where(msg))
            self.skipped.append(served)
            return False
        if event.policy_version == served:
            reason = f"version {served} again with another sha256 ({event.sha256}, serving {known}): not applied"
            kind = "conflicting_version"
        else:
            reason = f"version {event.policy_version} goes backwards: serving {served}"
            kind = "version_backwards"
        log.warning("rejected weights at %s (%s): %s", where(msg), kind, reason)
        self.reporter.dead_letter(msg, reason, kind, event.policy_version)
        self.rejected.append((event.policy_version, kind))
        return False

    def _decode(self, msg: Message, *, quiet: bool = False) -> WeightVersion | None:
        try:
            if msg.value() is None:
                raise CodecError("a tombstone (no value), not a WeightVersion")
            event = WeightVersion.from_bytes(msg.value())
        except (CodecError, TypeError, ValueError, KeyError) as exc:
            log.warning("undecodable record at %s: %s", where(msg), exc)
            self.reporter.dead_letter(msg, f"undecodable WeightVersion: {exc}", type(exc).__name__, None)
            return None
        if event.model_name != self.model_name:
            if not quiet:
                log.debug("ignoring %s: model %s is not ours (%s)", where(msg), event.model_name, self.model_name)
            return None
        return event

    def _handle(self, msg: Message, event: WeightVersion) -> bool:
        """Verify and apply one version; on rejection keep the old weights and dead-letter it. Returns success."""
        old = self.target.policy_version
        log.info(
            "applying weights version %d (step %d) from %s: %s", event.policy_version, event.step, where(msg), event.uri
        )
        started = time.monotonic()
        try:
            prepared = self.target.prepare(event)
            loaded = time.monotonic()
            report = self.target.apply(prepared, event)
        except Exception as exc:
            kind = exc.kind if isinstance(exc, WeightsRejected) else type(exc).__name__
            log.warning(
                "rejected weights version %d at %s (%s): %s; still serving version %d",
                event.policy_version,
                where(msg),
                kind,
                exc,
                old,
            )
            self.reporter.dead_letter(msg, str(exc), kind, event.policy_version)
            self.rejected.append((event.policy_version, kind))
            return False
        total = time.monotonic() - started
        values = {
            "swap_latency_s": total,
            "load_s": loaded - started,
            "drain_wait_s": report.wait_s,
            "apply_s": report.apply_s,
            "publish_to_applied_s": max(0.0, (now_ms() - event.timestamp_ms) / 1000.0),
            "size_bytes": float(event.size_bytes),
            "previous_version": float(old),
            **self.extra_values(),
        }
        self.reporter.metric(
            "weights_applied",
            event.policy_version,
            values,
            step=event.step,
            labels={"model": self.model_name, "uri": event.uri, "sha256": event.sha256},
        )
        self.reporter.flush()
        self.applied.append(event.policy_version)
        self.serving = event
        log.info(
            "now serving weights version %d (swap %.3fs: load %.3fs, drain %.3fs, apply %.3fs)",
            event.policy_version,
            total,
            values["load_s"],
            report.wait_s,
            report.apply_s,
        )
        return True
