"""TITO rendering: piecewise render == the chat template; append-only prefix property; full-render fallback."""

from __future__ import annotations

import pytest

from policy.token_prefix import common_prefix_len
from producers.proxy.conversation import Conversation, Message, ToolCall, function_tool
from producers.proxy.dialects import parse_anthropic, parse_openai_chat
from producers.proxy.render import FULL_RENDER, RolloutRenderer, TemplateRenderer
from producers.proxy.tool_parse import parse_turn
from tests.support import proxy_helpers as H
from tests.support.scripted_engine import tool_call_text

TOOLS = (function_tool("Write", "write a file", {"type": "object", "properties": {"file_path": {"type": "string"}}}),)


@pytest.fixture(scope="module")
def tok():
    return H.tiny_tokenizer()


@pytest.fixture(scope="module")
def renderer(tok) -> TemplateRenderer:
    return TemplateRenderer(tok)


def reference(tok, conv: Conversation) -> list[int]:
    return list(
        tok.apply_chat_template(
            [m.to_template() for m in conv.messages],
            tools=list(conv.tools) or None,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
    )


CONVERSATIONS = [
    Conversation((Message("user", "hi"),)),
    Conversation((Message("system", "sys"), Message("user", "hi"))),
    Conversation((Message("user", "hi"),), TOOLS),
    Conversation(
        (
            Message("system", "You are X."),
            Message("system", "mid system"),
            Message("user", "create hello.txt"),
            Message("assistant", "ok", "thinking first", (ToolCall("1", "Write", {"file_path": "a"}),)),
            Message("tool", "done1"),
            Message("tool", "done2"),
            Message("user", "thanks"),
            Message(
                "assistant",
                "",
                tool_calls=(ToolCall("2", "Write", '{"file_path": "b"}'), ToolCall("3", "Write", {"file_path": "c"})),
            ),
            Message("tool", "r"),
            Message("user", "[image]\nnext"),
        ),
        TOOLS,
    ),
]


@pytest.mark.parametrize("conv", CONVERSATIONS, ids=range(len(CONVERSATIONS)))
def test_piecewise_render_equals_the_chat_template(tok, renderer, conv) -> None:
    result = RolloutRenderer(renderer).render(conv)
    assert result.prompt_ids == reference(tok, conv)
    assert result.parent_call_id is None and result.shared_prefix_len == 0 and result.flags == []


def _generate(tok, text: str, *, cut: bool = False, odd_tokenization: bool = False) -> list[int]:
    ids = list(tok.encode(text, add_special_tokens=False))
    if odd_tokenization:  # a tokenization the tokenizer would never produce: re-encoding would change it
        ids = [t for ch in text for t in tok.encode(ch, add_special_tokens=False)]
        assert ids != list(tok.encode(text, add_special_tokens=False))
    return ids if cut else [*ids, tok.convert_tokens_to_ids("<|im_end|>")]


def test_tito_prefix_property_over_a_multi_turn_claude_code_episode(tok, renderer) -> None:
    """Every call's prompt = previous prompt + previous generated ids (+ suffix) + the new messages, exactly."""
    rr = RolloutRenderer(renderer)
    history = [H.claude_first_user()]
    answers = [
        (tool_call_text("Write", {"file_path": "/w/hello.txt", "content": "hi"}), dict(odd_tokenization=True)),
        ("Let me check.\n" + tool_call_text("Bash", {"command": "cat hello.txt"}), dict(cut=True)),
        (tool_call_text("Bash", {"command": "ls"}) + tool_call_text("Bash", {"command": "pwd"}), {}),
        ("Done: hello.txt contains hi.", {}),
    ]
    prev = None
    for seq, (text, how) in enumerate(answers):
        parsed = parse_anthropic(H.claude_request(history, stream=True))
        result = rr.render(parsed.conversation)
        if prev is None:
            assert result.prompt_ids == reference(tok, parsed.conversation)
        else:
            prompt, gen = prev
            suffix = renderer.turn_suffix(gen)
            assert result.parent_call_id == f"c{seq - 1}" and result.shared_prefix_len == len(prompt) + len(gen)
            assert result.prompt_ids[: len(prompt) + len(gen)] == prompt + gen
            assert result.new_tokens[: len(suffix)] == suffix
            # the new part is exactly the template's rendering of the new messages (tool results)
            assert tok.decode(result.new_tokens[len(suffix) :]).startswith("<|im_start|>user\n<tool_response>")
            assert result.flags == []
            # cost: only the new messages went through the template, not the context
            assert result.rendered_tokens < len(result.new_tokens) + 1
        gen = _generate(tok, text, **how)
        turn = parse_turn(renderer.decode(gen))
        calls = tuple(ToolCall(f"toolu_{seq}{i}", c.name, c.arguments) for i, c in enumerate(turn.tool_calls))
        rr.record(f"c{seq}", seq, result, gen, Message("assistant", turn.text, turn.reasoning, calls))
        blocks = ([{"type": "text", "text": turn.text}] if turn.text else []) + [
            {"type": "tool_use", "id": c.id, "name": c.name, "input": c.arguments} for c in calls
        ]
        history += H.claude_followup({"content": blocks}, "ok")
        prev = (result.prompt_ids, gen)


def test_openclaw_reordered_message_falls_back_to_full_render_with_longest_common_prefix(tok, renderer) -> None:
    rr = RolloutRenderer(renderer)
    ctx = {"role": "user", "content": "[internal context] session 42, 2026-11-02 10:00"}
    task = {"role": "user", "content": H.TASK}
    tools = [{"type": "function", "function": {"name": "write", "parameters": {"type": "object"}}}]
    body = {"model": "policy", "tools": tools, "messages": [{"role": "system", "content": "S" * 50}, task, ctx]}
    r1 = rr.render(parse_openai_chat(body).conversation)
    gen1 = _generate(tok, tool_call_text("write", {"path": "hello.txt", "content": "hi"}), odd_tokenization=True)
    turn = parse_turn(renderer.decode(gen1))
    call = ToolCall("call_1", turn.tool_calls[0].name, turn.tool_calls[0].arguments)
    rr.record("c0", 0, r1, gen1, Message("assistant", turn.text, "", (call,)))
    # OpenClaw: the internal-context message is removed and re-appended at the end.
    assistant = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "write", "arguments": call.arguments}}
        ],
    }
    tool = {"role": "tool", "tool_call_id": "call_1", "content": "wrote hello.txt"}
    body2 = {**body, "messages": [body["messages"][0], task, assistant, tool, ctx]}
    r2 = rr.render(parse_openai_chat(body2).conversation)
    assert FULL_RENDER in r2.flags
    assert r2.parent_call_id == "c0"
    assert r2.shared_prefix_len == common_prefix_len(r1.prompt_ids + gen1, r2.prompt_ids)
    assert 0 < r2.shared_prefix_len < len(r1.prompt_ids)
    # TITO still holds inside the re-laid-out prompt: the generated ids appear verbatim (not re-encoded)
    joined = r2.prompt_ids
    assert any(joined[i : i + len(gen1)] == gen1 for i in range(len(joined) - len(gen1)))
    # and the prompt is what the template renders, except for the generated turn's own tokenization
    assert renderer.decode(r2.prompt_ids) == renderer.decode(reference(tok, parse_openai_chat(body2).conversation))


def test_repeated_answer_text_keeps_each_answers_own_ids_on_a_full_render(tok, renderer) -> None:
    """Two answers with the same text but different sampled ids: after a re-order each turn keeps its own ids."""
    ids = tok.convert_tokens_to_ids
    im_end = ids("<|im_end|>")
    gen1 = [ids("Done"), ids("."), im_end]  # "Done." as the tokenizer splits it
    gen2 = [ids("D"), ids("o"), ids("n"), ids("e"), ids("."), im_end]  # the same text, sampled letter by letter
    assert gen1 != gen2 and renderer.decode(gen1) == renderer.decode(gen2) == "Done."
    system, task = Message("system", "S"), Message("user", "task")
    ctx = Message("user", "[internal context] session 42")  # OpenClaw moves it to the end on every call
    done, more = Message("assistant", "Done."), Message("user", "one more")
    rr = RolloutRenderer(renderer)
    r1 = rr.render(Conversation((system, task, ctx)))
    rr.record("c0", 0, r1, gen1, done)
    r2 = rr.render(Conversation((system, task, done, more, ctx)))
    assert FULL_RENDER in r2.flags
    rr.record("c1", 1, r2, gen2, done)
    r3 = rr.render(Conversation((system, task, done, more, done, more, ctx)))
    assert FULL_RENDER in r3.flags
    gp, seg = renderer.generation_prompt_ids, renderer.segment_ids
    expected = (
        renderer.header_ids(Conversation((system,)))
        + seg([task])
        + gp
        + gen1
        + renderer.turn_suffix(gen1)
        + seg([more])  # the first answer keeps the first call's ids
        + gp
        + gen2
        + renderer.turn_suffix(gen2)
        + seg([more])  # the second answer the second call's
        + seg([ctx])
        + gp
    )
    assert r3.prompt_ids == expected


def test_repeated_answer_text_with_counts_that_do_not_line_up_gets_the_latest_ids(tok, renderer) -> None:
    ids = tok.convert_tokens_to_ids
    gen1 = [ids("Done"), ids("."), ids("<|im_end|>")]
    gen2 = [ids("D"), ids("o"), ids("n"), ids("e"), ids("."), ids("<|im_end|>")]
    task, done = Message("user", "task"), Message("assistant", "Done.")
    rr = RolloutRenderer(renderer)
    r1 = rr.render(Conversation((task,)))
    rr.record("c0", 0, r1, gen1, done)
    rr.record("c1", 1, r1, gen2, done)  # a retry: the harness keeps only one of the two answers
    r = rr.render(Conversation((Message("user", "other"), done, Message("user", "next"))))
    gp = renderer.generation_prompt_ids
    assert r.prompt_ids == (
        renderer.segment_ids([Message("user", "other")])
        + gp
        + gen2
        + renderer.turn_suffix(gen2)
        + renderer.segment_ids([Message("user", "next")])
        + gp
    )


def test_unknown_assistant_turn_is_rendered_by_the_template(tok, renderer) -> None:
    rr = RolloutRenderer(renderer)
    conv = Conversation((Message("user", "a"), Message("assistant", "made up by the harness"), Message("user", "b")))
    result = rr.render(conv)
    assert result.prompt_ids == reference(tok, conv)
