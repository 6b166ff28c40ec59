"""Dialect parsing of realistic harness requests, error bodies, tool-call parsing and call-kind rules."""

from __future__ import annotations

import json

import pytest

from producers.proxy.conversation import CallKindRules, Conversation, Message, classify_call
from producers.proxy.dialects import (
    PARSERS,
    DialectError,
    anthropic_error,
    openai_error,
    parse_anthropic,
    parse_openai_chat,
    parse_openai_responses,
)
from producers.proxy.emit import EMITTERS
from producers.proxy.tool_parse import MALFORMED_TOOL_JSON, parse_turn
from schemas.events import CallKind, Dialect
from tests.support import proxy_helpers as H
from tests.support.scripted_engine import tool_call_text


def test_claude_code_request_places_both_system_prompts_and_ignores_unknown_fields() -> None:
    first = H.claude_first_user()
    answer = {
        "content": [
            {"type": "thinking", "thinking": "plan", "signature": "x"},
            {
                "type": "tool_use",
                "id": "toolu_1",
                "name": "Write",
                "input": {"file_path": "/w/hello.txt", "content": "hi"},
            },
        ]
    }
    body = H.claude_request([first, *H.claude_followup(answer, "File created")], stream=True)
    body["messages"][-1]["content"].append({"type": "text", "text": "<system-reminder>x</system-reminder>"})
    parsed = parse_anthropic(body)
    msgs = parsed.conversation.messages
    assert parsed.dialect == Dialect.ANTHROPIC_MESSAGES and parsed.stream and parsed.max_tokens == 32000
    assert [m.role for m in msgs] == ["system", "system", "user", "assistant", "tool", "user"]
    assert msgs[0].content == H.CLAUDE_SYSTEM[0]["text"] + "\n\n" + H.CLAUDE_SYSTEM[1]["text"]
    assert msgs[1].content == H.CLAUDE_MID_SYSTEM
    assert msgs[2].content == "<system-reminder>Be concise.</system-reminder>\n" + H.TASK
    assert msgs[3].reasoning == "plan" and msgs[3].tool_calls[0].name == "Write"
    assert msgs[3].tool_calls[0].arguments == {"file_path": "/w/hello.txt", "content": "hi"}
    assert msgs[4].content == "File created" and msgs[4].tool_call_id == "toolu_1"
    assert [t["function"]["name"] for t in parsed.conversation.tools] == ["Write", "Bash"]
    # cache_control moving between calls does not change the conversation
    body2 = json.loads(json.dumps(body))
    del body2["messages"][1]["content"][1]["cache_control"]
    body2["system"][0]["cache_control"] = {"type": "ephemeral"}
    assert parse_anthropic(body2).conversation == parsed.conversation


def test_codex_responses_request() -> None:
    response = {
        "output": [
            {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "think"}]},
            {"type": "message", "id": "msg_1", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
            {
                "type": "function_call",
                "id": "fc_1",
                "call_id": "call_1",
                "name": "exec_command",
                "arguments": '{"cmd": "echo hi > hello.txt"}',
            },
        ]
    }
    body = H.codex_request(H.codex_followup(response, "exit 0"), stream=True)
    body["tools"].append({"type": "custom", "name": "apply_patch", "description": "patch", "format": {}})
    parsed = parse_openai_responses(body)
    msgs = parsed.conversation.messages
    assert [m.role for m in msgs] == ["system", "user", "assistant", "tool"]
    assert msgs[0].content == H.CODEX_DEVELOPER and msgs[1].content == H.TASK
    assert msgs[2].content == "ok" and msgs[2].reasoning == "think"
    assert msgs[2].tool_calls[0].key() == ("exec_command", '{"cmd":"echo hi > hello.txt"}')
    assert msgs[3].content == "exit 0" and msgs[3].tool_call_id == "call_1"
    assert [t["function"]["name"] for t in parsed.conversation.tools] == ["exec_command", "apply_patch"]
    assert parse_openai_responses({"model": "m", "input": "hi"}).conversation.messages == (Message("user", "hi"),)


def test_openai_chat_request_with_parts_developer_and_tool_calls() -> None:
    completion = {
        "choices": [
            {
                "message": {
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_9",
                            "type": "function",
                            "function": {"name": "write_file", "arguments": '{"a": 1}'},
                        }
                    ],
                }
            }
        ]
    }
    body = H.qwen_request(H.qwen_followup(completion, "ok"), stream=True)
    body["messages"].insert(1, {"role": "developer", "content": "dev"})
    parsed = parse_openai_chat(body)
    assert parsed.include_usage and parsed.max_tokens == 2048
    msgs = parsed.conversation.messages
    assert [m.role for m in msgs] == ["system", "system", "user", "assistant", "tool"]
    assert msgs[2].content == H.TASK and msgs[3].content == "" and msgs[3].tool_calls[0].name == "write_file"


@pytest.mark.parametrize(
    ("parser", "body"),
    [
        (parse_anthropic, {"model": "m"}),
        (parse_anthropic, {"model": "m", "messages": [{"role": "robot", "content": "x"}]}),
        (parse_anthropic, {"model": "m", "messages": [{"role": "user", "content": 3}]}),
        (parse_anthropic, {"model": "m", "max_tokens": -1, "messages": [{"role": "user", "content": "x"}]}),
        # non-string text / thinking (issue #29: these were an HTTP 500 in plain text)
        (parse_anthropic, {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}),
        (
            parse_anthropic,
            {"model": "m", "messages": [{"role": "assistant", "content": [{"type": "text", "text": []}]}]},
        ),
        (
            parse_anthropic,
            {"model": "m", "messages": [{"role": "assistant", "content": [{"type": "thinking", "thinking": {}}]}]},
        ),
        (parse_openai_chat, []),
        (parse_openai_chat, {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}),
        (parse_openai_chat, {"model": "m", "messages": [{"role": "assistant", "tool_calls": [{"x": 1}]}]}),
        (parse_openai_responses, {"model": "m", "input": []}),
        (parse_openai_responses, {"model": "m", "input": [{"type": "function_call", "arguments": "{}"}]}),
    ],
)
def test_schema_errors_raise_dialect_error(parser, body) -> None:
    with pytest.raises(DialectError):
        parser(body)


def test_error_bodies_follow_each_dialect() -> None:
    assert anthropic_error(401, "no") == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "no"},
    }
    assert anthropic_error(413, "big")["error"]["type"] == "request_too_large"
    err = openai_error(502, "down")["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "server_error"


def test_every_dialect_has_a_parser_and_an_emitter_row() -> None:
    """The request side (PARSERS) and the response side (EMITTERS) are tables over the same dialects."""
    assert set(PARSERS) == set(EMITTERS) == set(Dialect)
    paths = [path for emitter in EMITTERS.values() for path in emitter.paths]
    assert len(paths) == len(set(paths))
    assert EMITTERS[Dialect.ANTHROPIC_MESSAGES].response_id("0123456789abcdef0123456789abcdef") == (
        "msg_0123456789abcdef01234567"
    )
    assert EMITTERS[Dialect.ANTHROPIC_MESSAGES].error_body(401, "no") == anthropic_error(401, "no")
    assert EMITTERS[Dialect.OPENAI_RESPONSES].error_body(401, "no") == openai_error(401, "no")


def test_tool_call_parsing_several_calls_think_and_malformed_json() -> None:
    text = (
        "<think>\nI should write.\n</think>\n\nWriting now.\n"
        + tool_call_text("Write", {"a": 1})
        + "\n"
        + (tool_call_text("Bash", {"command": "ls"}))
    )
    turn = parse_turn(text)
    assert turn.reasoning == "I should write." and turn.text == "Writing now."
    assert [(c.name, c.arguments) for c in turn.tool_calls] == [("Write", {"a": 1}), ("Bash", {"command": "ls"})]
    assert turn.flags == []
    bad = 'ok\n<tool_call>\n{"name": "Write", "arguments": {"a": 1}\n</tool_call>\n' + tool_call_text("Bash", {})
    turn = parse_turn(bad)
    assert turn.flags == [MALFORMED_TOOL_JSON] and [c.name for c in turn.tool_calls] == ["Bash"]
    assert '<tool_call>\n{"name": "Write"' in turn.text  # returned as text, verbatim
    turn = parse_turn('<tool_call>\n{"name": "X", "arguments": "{\\"k\\": 2}"}\n</tool_call>')
    assert turn.tool_calls[0].arguments == {"k": 2}
    assert parse_turn('<tool_call>\n{"name": "X", "argu').flags == [MALFORMED_TOOL_JSON]
    turn = parse_turn("abc</think>plain")  # the template put <think> into the prompt
    assert (turn.reasoning, turn.text) == ("abc", "plain")


def _conv(system: str, tools: bool, last: str = "hi") -> Conversation:
    tool = ({"type": "function", "function": {"name": "t"}},) if tools else ()
    return Conversation((Message("system", system), Message("user", last)), tool)


def test_call_kind_rules() -> None:
    rules = CallKindRules()
    main_sys = "You are the agent. " * 200
    kind, fp = classify_call(_conv("Generate a short title.", False), "policy", None, rules)
    assert kind == CallKind.SIDE and fp is None  # a title call before the main agent does not define it
    kind, fp = classify_call(_conv(main_sys, True), "policy", fp, rules)
    assert kind == CallKind.MAIN and fp is not None
    assert classify_call(_conv(main_sys, True), "policy", fp, rules)[0] == CallKind.MAIN
    assert classify_call(_conv("You are a search subagent.", True), "policy", fp, rules)[0] == CallKind.SUBAGENT
    assert classify_call(_conv("Generate a short title.", False), "policy", fp, rules)[0] == CallKind.SIDE
    assert classify_call(_conv(main_sys, True), "policy-side", fp, rules)[0] == CallKind.SIDE
    assert classify_call(_conv(main_sys, True), "claude-haiku-4-5", fp, rules)[0] == CallKind.SIDE
    compact = "Your task is to create a detailed summary of the conversation so far."
    assert classify_call(_conv(main_sys, True, compact), "policy", fp, rules)[0] == CallKind.COMPACTION
    custom = CallKindRules(side_model_pattern=r"^small$", compaction_pattern=r"SUMMARY PLEASE")
    assert classify_call(_conv(main_sys, True), "policy-side", fp, custom)[0] == CallKind.MAIN
    assert classify_call(_conv(main_sys, True, "SUMMARY PLEASE"), "policy", fp, custom)[0] == CallKind.COMPACTION
