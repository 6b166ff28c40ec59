"""``clawstream harness check``'s verdict from recorded calls: tokens here are characters (``decode`` joins them), so a
prompt is written as text and the differing text the verdict names can be read back."""

from __future__ import annotations

from collections.abc import Sequence

from producers.harnesses.check_report import CheckCall, CheckSettings, name_difference, verdict

SYSTEM = "You are an agent. " * 20  # 360 characters


def enc(text: str) -> list[int]:
    return [ord(ch) for ch in text]


def dec(ids: Sequence[int]) -> str:
    return "".join(map(chr, ids))


def rollout(first: str, *, answers: int = 2, kind: str = "MAIN", dialect: str = "OPENAI_CHAT") -> list[CheckCall]:
    """A rollout whose main calls each extend the previous one (prompt + answer + a tool result)."""
    calls: list[CheckCall] = []
    full: list[int] = []  # the previous call's prompt + answer
    for i in range(answers):
        new = enc(first) if i == 0 else enc(f"<result {i}>")
        out = enc(f"<call {i}>")
        parent = None if i == 0 else f"c{i - 1}"
        calls.append(CheckCall(f"c{i}", i, parent, len(full), new, out, kind, dialect))
        full = full + new + out
    return calls


def test_a_per_rollout_id_at_half_the_first_prompt_fails_and_names_the_text() -> None:
    rollouts = {
        "a1": rollout(SYSTEM + "session 3f2a9c1e-77aa-4b1c-9e2d-0123456789ab. " + SYSTEM),
        "a2": rollout(SYSTEM + "session 9b8e7d6c-1122-4b1c-9e2d-abcdefabcdef. " + SYSTEM),
    }
    v = verdict("scripted", "OPENAI_CHAT", rollouts, {"a1": "t", "a2": "t"}, dec)
    assert v.failed and v.first_prompt_share is not None and 0.45 < v.first_prompt_share < 0.55
    text = "\n".join(v.lines())
    assert "FAIL" in text and "'3f2a9c1e" in text and "'9b8e7d6c" in text and "an id" in text, text
    assert "before 90 %" in text and "fix:" in text


def test_the_same_harness_without_the_id_passes() -> None:
    rollouts = {"a1": rollout(SYSTEM + "task: sum"), "a2": rollout(SYSTEM + "task: sum"), "b1": rollout("x")}
    v = verdict("scripted", "OPENAI_CHAT", rollouts, {"a1": "t", "a2": "t", "b1": "u"}, dec)
    assert not v.failed, v.lines()
    assert v.first_prompt_share == 1.0 and v.main_extends == (3, 3) and v.calls_per_rollout == [2, 2, 2]
    assert 0 < v.trainable_share < 1 and v.kinds == {"MAIN": 6}


def test_a_clock_late_in_the_first_prompt_passes_at_the_threshold_openclaw_sits_above() -> None:
    head = SYSTEM * 3  # 1,080 characters, then a clock: ~98 % of the first prompt
    a = rollout(head + "Current time: 2026-12-06 23:41:07 UTC, session abc")
    b = rollout(head + "Current time: 2026-12-06 23:44:52 UTC, session abd")
    v = verdict("openclaw-like", "OPENAI_CHAT", {"a": a, "b": b}, {"a": "t", "b": "t"}, dec)
    assert not v.failed and v.first_prompt_share is not None and 0.97 < v.first_prompt_share < 0.99
    strict = verdict(
        "x", "OPENAI_CHAT", {"a": a, "b": b}, {"a": "t", "b": "t"}, dec, CheckSettings(min_first_prompt_share=0.995)
    )
    assert strict.failed and "a clock" in strict.divergence


def test_a_check_that_judged_nothing_fails() -> None:
    alone = verdict("one", "OPENAI_CHAT", {"a": rollout("x")}, {"a": "t"}, dec, outcomes={"a": "exit 0"})
    assert alone.failed and any("first prompts not compared" in p.what for p in alone.problems)
    pair = {"a": rollout("x"), "b": rollout("x")}
    timed_out = verdict(
        "slow", "OPENAI_CHAT", pair, {"a": "t", "b": "t"}, dec, outcomes={"a": "timed out", "b": "timed out"}
    )
    assert timed_out.failed and "2 of 2 rollouts did not end with exit 0" in timed_out.problems[0].what
    one_slow = verdict(
        "slow", "OPENAI_CHAT", pair, {"a": "t", "b": "t"}, dec, outcomes={"a": "exit 0", "b": "timed out"}
    )
    assert not one_slow.failed and one_slow.problems[0].severity == "warning"


def test_no_calls_a_wrong_dialect_and_no_main_call_are_errors_with_a_fix() -> None:
    none = verdict("quiet", "OPENAI_CHAT", {"a": [], "b": []}, {}, dec)
    assert none.failed and "no model call reached the proxy" in none.problems[0].what
    assert "${base_url}" in none.problems[0].fix
    wrong = verdict("w", "ANTHROPIC_MESSAGES", {"a": rollout("x"), "b": rollout("x")}, {"a": "t", "b": "t"}, dec)
    assert wrong.failed and 'dialect = "openai-chat"' in wrong.problems[0].fix
    side = verdict("s", "OPENAI_CHAT", {"a": rollout("x", kind="SIDE")}, {}, dec)
    assert side.failed and any("MAIN" in p.what for p in side.problems)


def test_a_history_that_is_rewritten_is_a_warning_not_a_failure() -> None:
    calls = rollout(SYSTEM + "go", answers=1)
    calls.append(CheckCall("c9", 9, "c0", 10, enc("rewritten history"), enc("<done>"), "MAIN", "OPENAI_CHAT"))
    twin = rollout(SYSTEM + "go", answers=1)
    v = verdict("branchy", "OPENAI_CHAT", {"a": calls, "b": twin}, {"a": "t", "b": "t"}, dec)
    assert not v.failed and v.main_extends == (0, 1)
    assert [p.severity for p in v.problems if "extend" in p.what] == ["warning"]


def test_what_differs_is_named() -> None:
    assert name_difference("cwd /tmp/abc/workspace", "cwd /tmp/xyz/workspace") == "a path"
    assert name_difference("at 12:01:09", "at 12:04:10") == "a clock (date/time)"
    assert name_difference("id 9f8e7d6c5b4a3f2e", "id 0a1b2c3d4e5f6a7b") == "an id"
