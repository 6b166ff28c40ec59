"""Tool calls as bare JSON objects (Llama 3's convention: ``parse_turn(..., bare_json=True)``); tags by default."""

from __future__ import annotations

from producers.proxy.tool_parse import MALFORMED_TOOL_JSON, parse_turn

CALL = '{"name": "read", "parameters": {"path": "notes.txt"}}'


def test_bare_json_objects_one_per_line_are_tool_calls() -> None:
    turn = parse_turn(f"{CALL}\n" + '{"name": "write", "arguments": "{\\"path\\": \\"a\\"}"}', bare_json=True)
    calls = [(c.name, c.arguments) for c in turn.tool_calls]
    assert calls == [("read", {"path": "notes.txt"}), ("write", {"path": "a"})]
    assert turn.text == "" and turn.flags == []


def test_text_stays_text_and_a_broken_call_is_flagged() -> None:
    plain = parse_turn("Done: the summary is written.", bare_json=True)
    assert plain.text == "Done: the summary is written." and plain.tool_calls == [] and plain.flags == []
    mixed = parse_turn(f"I will read it.\n{CALL}", bare_json=True)  # prose around it: not a call (the template's form)
    assert mixed.tool_calls == [] and mixed.text == f"I will read it.\n{CALL}"
    broken = parse_turn('{"name": "read", "parameters": {"path": ', bare_json=True)  # cut off by max_tokens
    assert broken.tool_calls == [] and broken.flags == [MALFORMED_TOOL_JSON]


def test_without_bare_json_a_json_answer_is_text_and_tags_still_parse() -> None:
    assert parse_turn(CALL).tool_calls == [] and parse_turn(CALL).text == CALL  # Qwen: unchanged
    tagged = parse_turn('<tool_call>\n{"name": "read", "arguments": {"path": "x"}}\n</tool_call>', bare_json=True)
    assert [(c.name, c.arguments) for c in tagged.tool_calls] == [("read", {"path": "x"})]
