"""A restarted proxy's registrations, rebuilt from the compacted registrations topic and the rollouts' call events.

:func:`plan_restore` takes the latest :class:`~schemas.events.ProxyRegistration` per rollout id (tombstones
removed) and keeps this proxy's own: live ones to restore, finished attempts to remember, expired ones to forget.
:func:`replay_calls` rebuilds one live registration's rendering state from its own call events (its attempt id,
received after its registration), in ``seq`` order: each call's prompt ids (``parent``'s prompt + generated ids cut
to ``shared_prefix_len``, then ``new_tokens``), generated ids, answer key (the generated ids decoded and parsed as
the proxy parsed them) and conversation digest go back into a :class:`~producers.proxy.render.RolloutRenderer`,
so the next call is rendered, delta-encoded, numbered (``seq``, ``calls_served``) and checked for forged assistant
turns (every answer's key is known again) as if the proxy had never died, its quotas count on from the calls and
prompt tokens (each event's ``prompt_len``) it had admitted, and its ``tampered`` count from the events'. A
rollout whose events do not add up (a ``seq`` missing or doubled, an unknown parent, a prompt of the wrong length,
an event without its conversation digest) is not served: :attr:`Replayed.infra_failure` names why.
The secret is never stored: :func:`secret_sha256` and :func:`secret_matches` (constant-time) check a presented key.
Pure: no Kafka, no aiohttp; reading and writing the topics is ``producers.proxy.registry``.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from producers.proxy.conversation import Message, ToolCall
from producers.proxy.nesting import ECHO_DEPTH
from producers.proxy.render import RolloutRenderer, TemplateRenderer
from producers.proxy.tool_parse import parse_turn
from schemas.events import CallEvent, CallKind, ProxyRegistration


def secret_sha256(secret: str) -> str:
    """Hex sha256 of a rollout secret: what the registrations topic holds instead of the secret."""
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).hexdigest()


def secret_matches(presented: str, sha256_hex: str) -> bool:
    """Whether ``presented`` is the secret whose sha256 is ``sha256_hex`` (constant-time compare)."""
    return bool(presented and sha256_hex) and hmac.compare_digest(secret_sha256(presented), sha256_hex)


# The depth past which the proxy serves a model's tool call as text: its default max_json_depth (64) less ECHO_DEPTH.
DEFAULT_ANSWER_DEPTH = 64 - ECHO_DEPTH


def answer(template: TemplateRenderer, generated_ids: list[int], max_depth: int = DEFAULT_ANSWER_DEPTH) -> Message:
    """The answer the proxy returned for ``generated_ids``, decoded and parsed as the proxy did it (the tool-call
    ids it made up left empty)."""
    turn = parse_turn(template.decode(generated_ids), bare_json=template.tool_calls_bare_json, max_depth=max_depth)
    calls = tuple(ToolCall("", c.name, c.arguments) for c in turn.tool_calls)
    return Message("assistant", turn.text, turn.reasoning, calls)


def answer_key(template: TemplateRenderer, generated_ids: list[int]) -> tuple[Any, ...]:
    """The key of the answer the proxy returned for ``generated_ids`` (the tool-call ids are not part of it)."""
    return answer(template, generated_ids).key()


@dataclass
class RestorePlan:
    live: list[ProxyRegistration] = field(default_factory=list)  # registrations to serve again
    finished: list[ProxyRegistration] = field(default_factory=list)  # finished attempts still remembered
    expired: list[str] = field(default_factory=list)  # this proxy's rollout ids to forget (tombstones)


def plan_restore(latest: Mapping[str, ProxyRegistration | None], proxy: str, now_ms: int) -> RestorePlan:
    """Sort the latest record per rollout id (None: a tombstone) of ``proxy`` (its public URL); others' are left."""
    plan = RestorePlan()
    for rid, reg in sorted(latest.items()):
        if reg is None or reg.proxy != proxy:
            continue
        if reg.expires_at_ms < now_ms:
            plan.expired.append(rid)
        elif reg.finished:
            plan.finished.append(reg)
        else:
            plan.live.append(reg)
    return plan


@dataclass
class Replayed:
    """One registration's state after its call events were replayed."""

    renderer: RolloutRenderer
    next_seq: int = 0
    calls_served: int = 0
    prompt_tokens: int = 0  # summed over the replayed calls: what the prompt-token quota had counted
    main_fingerprint: str | None = None
    tampered: int = 0  # replayed calls whose request held an assistant turn the proxy never generated
    infra_failure: str | None = None  # set: the state could not be rebuilt faithfully; the rollout is not served


def own_events(reg: ProxyRegistration, events: Iterable[CallEvent]) -> list[CallEvent]:
    """The call events of ``reg``'s attempt: its rollout id and attempt id, received after it was registered (an
    earlier registration of the id with the same attempt id was forgotten before), each ``call_id`` once."""
    seen: dict[str, CallEvent] = {}
    for e in events:
        if e.rollout_id == reg.rollout_id and e.attempt_id == reg.attempt_id and e.timestamp_ms >= reg.registered_at_ms:
            seen.setdefault(e.call_id, e)
    return sorted(seen.values(), key=lambda e: e.seq)


def replay_calls(template: TemplateRenderer, reg: ProxyRegistration, events: Iterable[CallEvent]) -> Replayed:
    """Rebuild ``reg``'s renderer (the answers it knows as its own included), next seq, calls served, prompt tokens
    (the quota's count), tampered calls and main fingerprint from its call events (any order)."""
    renderer = RolloutRenderer(template)
    out = Replayed(renderer)
    calls = own_events(reg, events)
    prompts: dict[str, tuple[list[int], list[int]]] = {}  # call id -> (prompt ids, generated ids)
    for index, e in enumerate(calls):
        problem = _check(e, index, prompts)
        if problem is not None:
            return Replayed(RolloutRenderer(template), infra_failure=f"restoring call seq {index}: {problem}")
        new, gen = [int(t) for t in e.new_tokens], [int(t) for t in e.generated_tokens]
        if e.parent_call_id is None:
            prompt = new
        else:
            parent_prompt, parent_gen = prompts[e.parent_call_id]
            prompt = (parent_prompt + parent_gen)[: e.shared_prefix_len] + new
        prompts[e.call_id] = (prompt, gen)
        assert e.conversation_messages is not None and e.conversation_digest is not None  # checked above
        own = answer(template, gen)
        renderer.restore(
            e.call_id,
            e.seq,
            prompt,
            gen,
            own.key(),
            e.conversation_messages,
            bytes.fromhex(e.conversation_digest),
            own.reasoning,
        )
        if out.main_fingerprint is None and e.call_kind == CallKind.MAIN:  # the first main call defines it
            out.main_fingerprint = e.system_fingerprint
    out.next_seq = out.calls_served = len(calls)
    out.prompt_tokens = sum(e.prompt_len for e in calls)
    out.tampered = sum(e.tampered for e in calls)
    return out


def _check(e: CallEvent, index: int, prompts: Mapping[str, tuple[list[int], list[int]]]) -> str | None:
    if e.seq != index:
        return f"its event is missing (the next one found has seq {e.seq})" if e.seq > index else "seq doubled"
    if e.parent_call_id is not None:
        if e.parent_call_id not in prompts:
            return f"parent call {e.parent_call_id} is not an earlier call of this attempt"
        parent_prompt, parent_gen = prompts[e.parent_call_id]
        if e.shared_prefix_len > len(parent_prompt) + len(parent_gen):
            return f"shared_prefix_len {e.shared_prefix_len} exceeds its parent's tokens"
    elif e.shared_prefix_len:
        return f"shared_prefix_len {e.shared_prefix_len} without a parent"
    if e.prompt_len != e.shared_prefix_len + len(e.new_tokens):
        return f"prompt_len {e.prompt_len} != shared_prefix_len {e.shared_prefix_len} + {len(e.new_tokens)} new tokens"
    if e.conversation_messages is None or not e.conversation_digest:
        return "the event carries no conversation digest (written by an older proxy)"
    try:
        bytes.fromhex(e.conversation_digest)
    except ValueError:
        return f"conversation_digest {e.conversation_digest[:40]!r} is not hex"
    return None
