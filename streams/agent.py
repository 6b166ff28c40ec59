"""The one skeleton every Faust agent of the app runs: decode → handle → dead-letter → send, record by record.

A :class:`Stage` says what an agent reads, how its records decode and what the pure core makes of each (``handle``;
``on_tick`` for the records of its tick topic, which are not decoded). :func:`add_agent` turns it into the Faust
agent: each record is processed inside ``eos.processing`` (exactly-once: no commit in the middle of a record, see
``streams.eos``), a record that does not decode goes to the dead-letter topic (:func:`decode_or_dead_letter`) and is
skipped, and the handler's :data:`Action` list is carried out in order — outputs (:class:`Emit`, :class:`Forward`)
and dead letters of the record being processed (:class:`Reject`). No topics of its own; the wiring is
``streams.app``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import faust
from faust.types import EventT, StreamT

from schemas.codec import default_codec
from schemas.dead_letter import dead_letter
from schemas.events import Event
from streams import eos
from streams.codec import EVENT_TYPES

log = logging.getLogger(__name__)
T = TypeVar("T")


def now_ms() -> int:
    return int(time.time() * 1000)


def decode(value: bytes | None) -> Event:
    """Single-object Avro bytes → typed event; raises on anything else (the caller dead-letters it)."""
    if value is None:
        raise ValueError("empty record value")
    name, record = default_codec().decode(value)
    return EVENT_TYPES[name].from_record(record)


def where(event: EventT) -> str:
    msg = event.message
    return f"{msg.topic}[{msg.partition}]@{msg.offset}"


async def send_dead_letter(
    deadletter: faust.TopicT, event: EventT, source: str, reason: str, error_type: str, rollout_id: str | None = None
) -> None:
    """Send the event's record to the dead-letter topic, keyed like the original (built by the shared builder)."""
    msg = event.message
    log.warning("%s: %s → dead letter (%s): %s", source, where(event), error_type, reason)
    record = dead_letter(
        source,
        reason,
        error_type,
        topic=msg.topic,
        partition=msg.partition,
        offset=msg.offset,
        key=msg.key,
        value=msg.value,
        rollout_id=rollout_id,
    )
    await deadletter.send(key=msg.key, value=record.to_bytes())


async def decode_or_dead_letter(
    deadletter: faust.TopicT, event: EventT, source: str, decoder: Callable[[bytes], T]
) -> T | None:
    """The event's value decoded, or None once it went to the dead-letter topic (the agent skips it)."""
    try:
        return decoder(event.message.value)
    except Exception as exc:  # noqa: BLE001 - any undecodable record goes to the dead-letter topic, never stops the agent
        await send_dead_letter(deadletter, event, source, str(exc), type(exc).__name__)
        return None


@dataclass(frozen=True)
class Emit:
    """Send ``records`` to ``channel``, each keyed by its attribute ``key`` (as text), to ``partition`` if given."""

    channel: faust.TopicT
    records: Sequence[Event]
    key: str
    partition: int | None = None


@dataclass(frozen=True)
class Forward:
    """Send the record being processed, its original bytes, to ``channel`` under ``key``."""

    channel: faust.TopicT
    key: bytes


@dataclass(frozen=True)
class Reject:
    """Send the record being processed to the dead-letter topic; then log ``note`` (info), if any, with where it was."""

    reason: str
    error_type: str
    rollout_id: str | None = None
    note: str | None = None


Action = Emit | Forward | Reject


@dataclass(frozen=True)
class Stage(Generic[T]):
    """One agent: what it reads, how its records decode, what the core makes of them."""

    name: str  # the Faust agent's name
    help: str  # the agent's description (Faust shows it)
    source: str  # names the stage in its dead letters
    channel: faust.TopicT  # what it reads (the tick topic, if any, among it)
    decoder: Callable[[str], Callable[[bytes], T]]  # input topic → the decoder of its records
    handle: Callable[[T, EventT, int], Sequence[Action]]  # decoded record, its event, now (ms) → actions
    ticks: str | None = None  # the tick topic's name: its records go to ``on_tick`` undecoded
    on_tick: Callable[[int, int], Sequence[Action]] | None = None  # partition, now (ms) → actions


async def send_all(channel: faust.TopicT, records: Sequence[Event], key: str, partition: int | None = None) -> None:
    for rec in records:
        await channel.send(key=str(getattr(rec, key)).encode(), value=rec.to_bytes(), partition=partition)


async def perform(deadletter: faust.TopicT, event: EventT, source: str, actions: Sequence[Action]) -> None:
    """Carry out a record's actions, in order."""
    for action in actions:
        if isinstance(action, Emit):
            await send_all(action.channel, action.records, action.key, action.partition)
        elif isinstance(action, Forward):
            await action.channel.send(key=action.key, value=event.message.value)
        else:
            await send_dead_letter(deadletter, event, source, action.reason, action.error_type, action.rollout_id)
            if action.note is not None:
                log.info("%s at %s", action.note, where(event))


def core(source: str, call: Callable[..., Sequence[Action]], *args: Any) -> Sequence[Action]:
    """The pure core's actions for one record; if it raises, the record goes to the dead-letter topic with the
    reason and the agent goes on (an exception here once wedged the batcher: every later SEAL raised the same)."""
    try:
        return call(*args)
    except Exception as exc:  # noqa: BLE001 - one bad record must never stop the stage
        log.exception("%s: the core raised on a record", source)
        return [Reject(f"the {source} core raised: {exc!r}"[:2000], type(exc).__name__)]


def add_agent(app: faust.App, deadletter: faust.TopicT, stage: Stage[Any]) -> Any:
    """Declare the stage's Faust agent on ``app`` (returns the agent)."""

    async def agent(stream: StreamT) -> None:
        eos.start_agent(app)
        async for event in stream.events():
            async with eos.processing(app):
                msg, now = event.message, now_ms()
                if stage.on_tick is not None and msg.topic == stage.ticks:
                    actions = core(stage.source, stage.on_tick, msg.partition, now)
                else:
                    record = await decode_or_dead_letter(deadletter, event, stage.source, stage.decoder(msg.topic))
                    if record is None:
                        continue
                    actions = core(stage.source, stage.handle, record, event, now)
                await perform(deadletter, event, stage.source, actions)

    agent.__doc__ = stage.help
    return app.agent(stage.channel, name=stage.name)(agent)
