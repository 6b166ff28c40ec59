"""One served model call → its :class:`~schemas.events.CallEvent`, the record the proxy publishes to
``clawstream.calls`` (keyed by rollout id, acks=all) before it releases the answer.

It carries what the learner needs (prompt as the parent call's prompt + new tokens, generated ids, rollout
log-probs, the rollout's sampling settings) and what the analytics read (call kind, timings, the engine's cached
prompt tokens and GPU readings: null when the engine did not report them), and whether its request held an assistant
turn the proxy never generated for the rollout (``tampered``, ``RolloutRenderer.provenance``).
"""

from __future__ import annotations

from producers.proxy.conversation import system_fingerprint
from producers.proxy.dialects import ParsedRequest
from producers.proxy.engine_client import EngineReply
from producers.proxy.render import RenderResult
from producers.proxy.rollout_state import Rollout
from producers.proxy.tool_parse import ParsedTurn
from schemas.events import CallEvent, CallKind


def call_event(
    rollout: Rollout,
    parsed: ParsedRequest,
    rendered: RenderResult,
    reply: EngineReply,
    turn: ParsedTurn,
    *,
    call_id: str,
    seq: int,
    kind: CallKind,
    timestamp_ms: int,
    times_ms: dict[str, float],
    conversation: tuple[int, bytes] | None = None,
) -> CallEvent:
    """``times_ms``: the call's ``received_ms``, ``render_ms``, ``engine_ms`` and ``total_ms`` durations;
    ``conversation``: (messages, digest chain) of the conversation a follow-up extends (``RenderResult.answered``)."""
    return CallEvent(
        rollout_id=rollout.rollout_id,
        policy_version=reply.policy_version,
        timestamp_ms=timestamp_ms,
        call_id=call_id,
        seq=seq,
        dialect=parsed.dialect,
        requested_model=parsed.model,
        call_kind=kind,
        new_tokens=rendered.new_tokens,
        prompt_len=len(rendered.prompt_ids),
        generated_tokens=reply.token_ids,
        logprobs=reply.logprobs,
        # A turn that ends in tool calls is recorded as such whatever stop token closed it.
        finish_reason="tool_calls" if turn.tool_calls and reply.finish == "stop" else reply.finish,
        system_fingerprint=system_fingerprint(parsed.conversation.system),
        parent_call_id=rendered.parent_call_id,
        shared_prefix_len=rendered.shared_prefix_len,
        flags=rendered.flags + turn.flags,
        received_ms=times_ms["received_ms"],
        render_ms=times_ms["render_ms"],
        engine_ms=times_ms["engine_ms"],
        total_ms=times_ms["total_ms"],
        cached_prompt_tokens=reply.cached_tokens,
        gpu_utilization=reply.gpu_utilization,
        gpu_memory_used_bytes=reply.gpu_memory_used_bytes,
        attempt_id=rollout.attempt_id,
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        top_k=rollout.top_k,
        conversation_messages=None if conversation is None else conversation[0],
        conversation_digest=None if conversation is None else conversation[1].hex(),
        tampered=bool(rendered.forged),
    )
