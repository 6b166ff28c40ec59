"""A restarted proxy's rebuild (pure): a registration and its call events → the renderer state, next seq and calls
served the live proxy had, so the next call is rendered, delta-encoded and numbered the same; events that do not
add up → an infrastructure failure, never a wrong rendering. Also the plan over the registrations topic and the
secret check (its sha256 only)."""

from __future__ import annotations

import dataclasses

import pytest

from producers.proxy.admin import Admin
from producers.proxy.call_event import call_event
from producers.proxy.conversation import CallKindRules, Conversation, Message, ToolCall, function_tool
from producers.proxy.dialects import ParsedRequest, parse_anthropic
from producers.proxy.engine_client import EngineReply
from producers.proxy.metrics import ProxyMetrics
from producers.proxy.quota import Quotas, Usage
from producers.proxy.render import FULL_RENDER, RenderResult, RolloutRenderer, TemplateRenderer
from producers.proxy.restore import (
    Replayed,
    plan_restore,
    replay_calls,
    secret_matches,
    secret_sha256,
)
from producers.proxy.rollout_state import Rollout
from producers.proxy.tool_parse import parse_turn
from schemas.events import CallEvent, Dialect, ProxyRegistration, now_ms
from tests.support import proxy_helpers as H
from tests.support.scripted_engine import tool_call_text

T0 = 1_800_000_000_000
SECRET = "s3cret-of-r-1"
TOOLS = (function_tool("write", "write a file", {"type": "object", "properties": {"path": {"type": "string"}}}),)


@pytest.fixture(scope="module")
def tok():
    return H.tiny_tokenizer()


@pytest.fixture(scope="module")
def template(tok) -> TemplateRenderer:
    return TemplateRenderer(tok)


def _ids(tok, text: str, *, cut: bool = False, odd: bool = False) -> list[int]:
    """Generated ids for ``text``: as the tokenizer splits it, or letter by letter (``odd``: a tokenization a
    re-encode would change), ending with ``<|im_end|>`` unless ``cut`` (a length stop)."""
    ids = [t for ch in text for t in tok.encode(ch, add_special_tokens=False)] if odd else tok.encode(text)
    return list(ids) if cut else [*ids, tok.convert_tokens_to_ids("<|im_end|>")]


class LiveProxy:
    """The proxy's steps for one rollout's calls (render → engine → parse → call event → record), without HTTP or
    Kafka; each call event goes through its bytes, as a restarted proxy reads it back."""

    def __init__(self, template: TemplateRenderer, attempt_id: str | None = "a-1") -> None:
        self.template = template
        self.rollout = Rollout(
            rollout_id="r-1",
            secret=SECRET,
            secret_sha256=secret_sha256(SECRET),
            registered_at_ms=T0,
            expires_at_ms=T0 + 3_600_000,
            temperature=0.75,
            top_p=0.875,
            top_k=40,
            max_tokens=64,
            seed=7,
            renderer=RolloutRenderer(template),
            attempt_id=attempt_id,
            attempt=1,
            lease_s=30.0,
        )
        self.events: list[CallEvent] = []

    def call(self, conv: Conversation, gen: list[int], model: str = "policy") -> Message:
        r = self.rollout
        rendered = r.renderer.render(conv)
        kind = r.classify(conv, model, CallKindRules())
        turn = parse_turn(self.template.decode(gen))
        calls = tuple(ToolCall(f"call_{r.next_seq}{i}", c.name, c.arguments) for i, c in enumerate(turn.tool_calls))
        answer = Message("assistant", turn.text, turn.reasoning, calls)
        seq = r.take_seq()
        event = call_event(
            r,
            ParsedRequest(Dialect.OPENAI_CHAT, model, conv, False, None),
            rendered,
            EngineReply(gen, [-0.5] * len(gen), "stop", 3),
            turn,
            call_id=f"c{seq}",
            seq=seq,
            kind=kind,
            timestamp_ms=T0 + 1 + seq,
            times_ms={"received_ms": 0.0, "render_ms": 0.0, "engine_ms": 0.0, "total_ms": 0.0},
            conversation=rendered.answered(answer.key()),
        )
        self.events.append(CallEvent.from_bytes(event.to_bytes()))
        r.record_call(f"c{seq}", seq, rendered, gen, answer, kind, conv)
        return answer

    def registration(self) -> ProxyRegistration:
        admin = Admin(
            self.template,
            ProxyMetrics(),
            token="t",
            public_url="http://127.0.0.1:8100",
            default_ttl_s=60,
            default_max_tokens=64,
            seal_wait_s=1,
        )
        admin.rollouts["r-1"] = self.rollout
        reg = admin.record_of("r-1")
        assert reg is not None
        return ProxyRegistration.from_bytes(reg.to_bytes())


def _same(a: RenderResult, b: RenderResult) -> None:
    assert (b.prompt_ids, b.parent_call_id, b.shared_prefix_len, b.flags, b.digest) == (
        a.prompt_ids,
        a.parent_call_id,
        a.shared_prefix_len,
        a.flags,
        a.digest,
    )


# --- the scenarios: a rollout's calls, then the conversations of the calls after the restart ----------------------


def _claude_episode(tok, live: LiveProxy) -> list[Conversation]:
    """Claude Code appends: a tool call sampled in an odd tokenization, one cut by the length limit, a text answer."""
    history = [H.claude_first_user()]
    answers = [
        _ids(tok, tool_call_text("Write", {"file_path": "/w/hello.txt", "content": "hi"}), odd=True),
        _ids(tok, "Let me check.\n" + tool_call_text("Bash", {"command": "cat hello.txt"}), cut=True),
        _ids(tok, tool_call_text("Bash", {"command": "ls"}) + tool_call_text("Bash", {"command": "pwd"})),
    ]
    for gen in answers:
        answer = live.call(parse_anthropic(H.claude_request(history, stream=True)).conversation, gen)
        blocks = ([{"type": "text", "text": answer.content}] if answer.content else []) + [
            {"type": "tool_use", "id": c.id, "name": c.name, "input": c.arguments} for c in answer.tool_calls
        ]
        history += H.claude_followup({"content": blocks}, "ok")
    nxt = parse_anthropic(H.claude_request(history, stream=True)).conversation
    later = parse_anthropic(
        H.claude_request([*history, {"role": "assistant", "content": "Done."}, {"role": "user", "content": "ty"}], True)
    ).conversation
    return [nxt, later]


def _side_calls_between(tok, live: LiveProxy) -> list[Conversation]:
    """A title side call between two main calls: the next main call extends the main one, not the latest."""
    system, task = Message("system", "You are an agent. " * 20), Message("user", "write hello.txt")
    c0 = Conversation((system, task), TOOLS)
    a0 = live.call(c0, _ids(tok, tool_call_text("write", {"path": "hello.txt"})))
    live.call(Conversation((Message("system", "Title this."), task)), _ids(tok, "Hello file"), model="haiku")
    c2 = Conversation((*c0.messages, a0, Message("tool", "wrote it")), TOOLS)
    a2 = live.call(c2, _ids(tok, "Done.", odd=True))
    live.call(Conversation((Message("system", "Title this."), task)), _ids(tok, "Hello file"), model="haiku")
    return [
        Conversation((*c2.messages, a2, Message("user", "and a second one?")), TOOLS),
        Conversation((*c0.messages, a0, Message("tool", "failed: retry")), TOOLS),  # a branch from call 0
    ]


def _openclaw_reorders(tok, live: LiveProxy) -> list[Conversation]:
    """OpenClaw moves a context message to the end on every call: full renders, delta-encoded by common prefix."""
    system, task = Message("system", "S" * 50), Message("user", H.TASK)
    ctx = Message("user", "[internal context] session 42")
    a0 = live.call(Conversation((system, task, ctx), TOOLS), _ids(tok, tool_call_text("write", {"path": "a"})))
    c1 = Conversation((system, task, a0, Message("tool", "wrote a"), ctx), TOOLS)
    a1 = live.call(c1, _ids(tok, tool_call_text("write", {"path": "b"}), odd=True))
    return [Conversation((system, task, a0, Message("tool", "wrote a"), a1, Message("tool", "wrote b"), ctx), TOOLS)]


def _repeated_answers(tok, live: LiveProxy) -> list[Conversation]:
    """The same answer text sampled as different ids twice: each turn keeps its own ids after the restart too."""
    ids = tok.convert_tokens_to_ids
    gen1 = [ids("Done"), ids("."), ids("<|im_end|>")]
    gen2 = [ids("D"), ids("o"), ids("n"), ids("e"), ids("."), ids("<|im_end|>")]
    system, task, ctx = Message("system", "S"), Message("user", "task"), Message("user", "[ctx]")
    done, more = Message("assistant", "Done."), Message("user", "one more")
    live.call(Conversation((system, task, ctx)), gen1)
    live.call(Conversation((system, task, done, more, ctx)), gen2)
    return [Conversation((system, task, done, more, done, more, ctx))]


SCENARIOS = {
    "claude-appends": _claude_episode,
    "side-calls-between": _side_calls_between,
    "openclaw-reorders": _openclaw_reorders,
    "repeated-answers": _repeated_answers,
}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_replayed_calls_render_the_next_calls_as_the_live_proxy(tok, template, scenario) -> None:
    live = LiveProxy(template)
    following = SCENARIOS[scenario](tok, live)
    reg = live.registration()
    assert (
        reg.secret_sha256 == secret_sha256(SECRET) and SECRET not in repr(reg) and SECRET.encode() not in reg.to_bytes()
    )
    back = replay_calls(template, reg, reversed(live.events))  # any order: replayed by seq
    assert back.infra_failure is None
    r = live.rollout
    assert (back.next_seq, back.calls_served, back.main_fingerprint) == (r.next_seq, r.calls_served, r.main_fingerprint)
    assert [(c.call_id, c.prompt_ids, c.generated_ids, c.answer_key) for c in back.renderer.records] == [
        (c.call_id, c.prompt_ids, c.generated_ids, c.answer_key) for c in r.renderer.records
    ]
    assert all(rec.conversation is None for rec in back.renderer.records)  # matched by digest only
    for k, conv in enumerate(following):  # the calls after the restart, each recorded on both sides
        want, got = r.renderer.render(conv), back.renderer.render(conv)
        _same(want, got)
        gen = _ids(tok, f"answer {k}")
        answer = Message("assistant", f"answer {k}")
        r.renderer.record(f"n{k}", r.next_seq + k, want, gen, answer)
        back.renderer.record(f"n{k}", back.next_seq + k, got, gen, answer)


def test_the_follow_up_is_an_append_not_a_full_render(tok, template) -> None:
    """Without the digests a restarted proxy could only lay the conversation out again (flag full_render)."""
    live = LiveProxy(template)
    nxt = _claude_episode(tok, live)[0]
    back = replay_calls(template, live.registration(), live.events)
    got = back.renderer.render(nxt)
    assert got.flags == [] and got.parent_call_id == "c2"
    assert got.shared_prefix_len == len(live.rollout.renderer.records[-1].prompt_ids) + len(
        live.rollout.renderer.records[-1].generated_ids
    )
    blind = replay_calls(
        template,
        live.registration(),
        [dataclasses.replace(e, conversation_messages=None, conversation_digest=None) for e in live.events],
    )
    assert blind.infra_failure is not None and "no conversation digest" in blind.infra_failure


def _broken(events: list[CallEvent], how: str) -> list[CallEvent]:
    e = list(events)
    if how == "missing":
        del e[1]
    elif how == "doubled":
        e.append(dataclasses.replace(e[1], call_id="other"))
    elif how == "unknown-parent":
        e[2] = dataclasses.replace(e[2], parent_call_id="c-from-elsewhere")
    elif how == "prompt-length":
        e[2] = dataclasses.replace(e[2], prompt_len=e[2].prompt_len + 1)
    elif how == "digest":
        e[2] = dataclasses.replace(e[2], conversation_digest="not hex")
    return e


@pytest.mark.parametrize(
    ("how", "reason"),
    [
        ("missing", "call seq 1: its event is missing"),
        ("doubled", "seq doubled"),
        ("unknown-parent", "not an earlier call"),
        ("prompt-length", "prompt_len"),
        ("digest", "not hex"),
    ],
)
def test_events_that_do_not_add_up_are_an_infra_failure(tok, template, how, reason) -> None:
    live = LiveProxy(template)
    _claude_episode(tok, live)
    back = replay_calls(template, live.registration(), _broken(live.events, how))
    assert back.infra_failure is not None and reason in back.infra_failure, back.infra_failure
    assert back.renderer.records == [] and back.calls_served == 0


def test_only_this_attempts_calls_after_its_registration_are_replayed(tok, template) -> None:
    live = LiveProxy(template)
    _claude_episode(tok, live)
    reg = live.registration()
    other = [dataclasses.replace(e, attempt_id="a-0", call_id="x" + e.call_id) for e in live.events]
    earlier = [dataclasses.replace(e, timestamp_ms=T0 - 5, call_id="y" + e.call_id) for e in live.events]
    foreign = [dataclasses.replace(e, rollout_id="r-2", call_id="z" + e.call_id) for e in live.events]
    back = replay_calls(template, reg, [*other, *earlier, *live.events, *foreign, *live.events])  # and each twice
    assert back.infra_failure is None and back.calls_served == 3
    assert [rec.call_id for rec in back.renderer.records] == ["c0", "c1", "c2"]


def test_the_plan_keeps_this_proxys_latest_records() -> None:
    def reg(rid: str, **kw) -> ProxyRegistration:
        return ProxyRegistration(rid, T0, kw.pop("proxy", "http://p:1"), kw.pop("expires", T0 + 10), **kw)

    latest = {
        "live": reg("live"),
        "sealed": reg("sealed", sealed=True),
        "done": reg("done", finished=True, attempt=2),
        "expired": reg("expired", expires=T0 - 1),
        "forgotten": None,
        "elsewhere": reg("elsewhere", proxy="http://q:1"),
    }
    plan = plan_restore(latest, "http://p:1", T0)
    assert [r.rollout_id for r in plan.live] == ["live", "sealed"]
    assert [r.rollout_id for r in plan.finished] == ["done"] and plan.expired == ["expired"]


def test_a_restored_rollout_checks_the_secrets_sha256_and_gets_a_fresh_lease(tok, template) -> None:
    assert secret_matches(SECRET, secret_sha256(SECRET))
    assert not secret_matches(SECRET + "x", secret_sha256(SECRET)) and not secret_matches("", secret_sha256(""))
    live = LiveProxy(template)
    _claude_episode(tok, live)
    admin = Admin(
        template, ProxyMetrics(), token="t", public_url="u", default_ttl_s=1, default_max_tokens=1, seal_wait_s=1
    )
    reg = dataclasses.replace(live.registration(), lease_s=600.0)
    rollout = admin.restore(reg, replay_calls(template, reg, live.events))
    assert rollout.secret is None and rollout.restored and rollout.refused is None
    assert rollout.accepts(SECRET) and not rollout.accepts("wrong") and not rollout.accepts("")
    assert rollout.live(now_ms()) and rollout.next_seq == 3 and rollout.seed == 7 and rollout.temperature == 0.75
    sealed = admin.restore(dataclasses.replace(reg, rollout_id="r-2", sealed=True, calls_served=5), None)
    assert sealed.sealed and sealed.calls_served == 5
    broken = admin.restore(reg, Replayed(RolloutRenderer(template), infra_failure="restoring call seq 1: gone"))
    assert broken.refused == broken.infra_failure == "restoring call seq 1: gone"
    assert admin.record_of("r-1") is not None and admin.record_of("nothing") is None


def test_a_full_render_after_the_restart_is_flagged_as_before(tok, template) -> None:
    live = LiveProxy(template)
    [nxt] = _openclaw_reorders(tok, live)
    back = replay_calls(template, live.registration(), live.events)
    assert FULL_RENDER in back.renderer.render(nxt).flags


def test_a_restored_rollouts_quota_usage_counts_the_replayed_calls_prompt_tokens(tok, template) -> None:
    """The prompt-token quota goes on from what the live proxy had admitted (each call's prompt_len), not from 0."""
    live = LiveProxy(template)
    _claude_episode(tok, live)
    reg = live.registration()
    back = replay_calls(template, reg, live.events)
    admitted = sum(len(rec.prompt_ids) for rec in live.rollout.renderer.records)
    assert admitted > 0 and back.prompt_tokens == sum(e.prompt_len for e in live.events) == admitted
    admin = Admin(
        template, ProxyMetrics(), token="t", public_url="u", default_ttl_s=1, default_max_tokens=1, seal_wait_s=1
    )
    rollout = admin.restore(reg, back)
    assert rollout.usage == Usage(calls=3, prompt_tokens=admitted)
    assert rollout.status()["usage"] == {"calls": 3, "prompt_tokens": admitted}
    # a quota the replayed calls already used up refuses the next call, as the live proxy would have
    assert rollout.usage.admit(Quotas(max_calls=0, max_prompt_tokens=admitted + 1), 2) is not None
