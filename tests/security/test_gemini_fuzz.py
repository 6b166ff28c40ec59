"""Malformed Gemini bodies get a Gemini-format 4xx, never a 500: schema-aware mutations of Gemini CLI's request
shape (a function call round trip in ``contents``, ``systemInstruction``, ``functionDeclarations``,
``generationConfig``) plus raw, truncated, invalid UTF-8, huge and deeply nested bodies.

Two layers, each a fixed seed (Hypothesis derandomized: a failure reproduces as is):

- ``INTAKE_EXAMPLES`` (2,000) through the proxy's intake itself (``producers.proxy.intake.parse_body``: the request
  limits, ``json.loads``, the Gemini parser, the conversation checks; the code every request of the proxy runs, a
  large one in a precheck process), answered with the Gemini emitter's error body: every refusal is a 4xx in
  Google's format. In-process, so 2,000 cost seconds.
- ``HTTP_EXAMPLES`` over real HTTP to a real proxy and scripted engine on the ``:generateContent`` and
  ``:streamGenerateContent`` routes: every answer is below 500 and, when refused, Google's error body; a refused
  request publishes no call event (the calls topic holds exactly one per 200). ``make test-long`` runs
  ``CLAWSTREAM_FUZZ_EXAMPLES`` (default 2000) fresh random ones over HTTP.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clawbase.settings import KafkaSettings
from producers.proxy.dialects import RequestLimits
from producers.proxy.emit import EMITTERS, ApiError
from producers.proxy.intake import parse_body
from schemas.events import Dialect
from tests.integration.test_proxy_fuzz import (
    BODY_LIMIT,
    CONTENT_TYPES,
    VALUE,
    ProxyThread,
    _deep,
    _mutate,
    _paths,
    post,
)
from tests.integration.test_proxy_gemini import MODEL, gemini_body
from tests.support.proxy_server import consume_calls

INTAKE_EXAMPLES = 2000
HTTP_EXAMPLES = 200
EXAMPLES = int(os.environ.get("CLAWSTREAM_FUZZ_EXAMPLES", "2000"))
_SUPPRESS = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example]


def good_body() -> dict[str, Any]:
    """Gemini CLI's second call of a rollout: the model's thought, text and function call, and its response."""
    model = {
        "role": "model",
        "parts": [
            {"text": "plan", "thought": True, "thoughtSignature": "c2ln"},
            {"text": "Writing."},
            {"functionCall": {"id": "fc_1", "name": "write_file", "args": {"file_path": "a.txt", "content": "hi"}}},
        ],
    }
    result = {"functionResponse": {"id": "fc_1", "name": "write_file", "response": {"output": "ok"}}}
    body = gemini_body([model, {"role": "user", "parts": [result, {"text": "go on"}]}])
    body["generationConfig"]["maxOutputTokens"] = 64
    return body


@st.composite
def requests(draw: st.DrawFn) -> tuple[bytes, str, str]:
    """(body bytes, content type, what was done)."""
    good = good_body()
    kind = draw(st.sampled_from(["mutate", "mutate", "mutate", "mutate", "raw", "truncate", "utf8", "huge", "deep"]))
    ctype = "application/json" if draw(st.integers(0, 9)) else draw(st.sampled_from(CONTENT_TYPES))
    if kind == "mutate":
        path = draw(st.sampled_from(list(_paths(good))))
        op = draw(st.sampled_from(["replace", "delete"]))
        return json.dumps(_mutate(good, path, op, draw(VALUE))).encode(), ctype, f"{op} {path}"
    if kind == "raw":
        return draw(st.binary(max_size=400)), ctype, "raw bytes"
    data = json.dumps(good).encode()
    if kind == "truncate":
        return data[: draw(st.integers(0, len(data) - 1))], ctype, "truncated"
    if kind == "utf8":
        at = draw(st.integers(0, len(data)))
        bad = draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x00", b'\\ud800"']))
        return data[:at] + bad + data[at:], ctype, "utf8"
    path = draw(st.sampled_from([p for p in _paths(good) if p]))
    if kind == "huge":
        size = draw(st.sampled_from([50_000, BODY_LIMIT + 1]))
        return json.dumps(_mutate(good, path, "replace", "y" * size)).encode(), ctype, f"huge {path}"
    marker = "@@deep@@"
    text = json.dumps(_mutate(good, path, "replace", marker))
    return text.replace(f'"{marker}"', _deep(draw(st.integers(50, 5000)))).encode(), ctype, f"deep {path}"


def google_error(status: int, body: bytes | dict[str, Any], what: str) -> None:
    err = json.loads(body) if isinstance(body, bytes) else body
    assert set(err) == {"error"} and set(err["error"]) == {"code", "message", "status"}, (status, what, err)
    assert err["error"]["code"] == status and isinstance(err["error"]["message"], str), (status, what, err)
    assert status != 400 or err["error"]["status"] == "INVALID_ARGUMENT", (status, what, err)


def test_intake_refuses_malformed_gemini_bodies_in_googles_format() -> None:
    limits = RequestLimits()
    counts = {"parsed": 0, "refused": 0}

    @settings(
        max_examples=INTAKE_EXAMPLES, derandomize=True, deadline=None, database=None, suppress_health_check=_SUPPRESS
    )
    @given(requests())
    def fuzz(example: tuple[bytes, str, str]) -> None:
        data, _ctype, what = example
        try:
            parse_body(data, Dialect.GEMINI, limits)
        except ApiError as exc:
            assert 400 <= exc.status < 500, (exc.status, what, exc.message)
            google_error(exc.status, EMITTERS[Dialect.GEMINI].error_body(exc.status, exc.message), what)
            counts["refused"] += 1
        else:
            counts["parsed"] += 1

    fuzz()
    print(f"\ngemini intake: {counts}")
    assert counts["refused"] > INTAKE_EXAMPLES // 4 and counts["parsed"] > 0  # both sides were exercised


@pytest.mark.integration
@pytest.mark.parametrize(
    "seeded", [pytest.param(True, id="seeded"), pytest.param(False, id="random", marks=pytest.mark.long)]
)
def test_fuzzed_gemini_requests_get_google_errors_and_publish_nothing(
    kafka_settings: KafkaSettings, seeded: bool
) -> None:
    rid = "fuzz-gemini"
    ok = 0
    statuses: dict[int, int] = {}
    with ProxyThread(kafka_settings, max_calls_per_rollout=0, max_prompt_tokens_per_rollout=0) as proxy:
        secret = proxy.register(rid)

        @settings(
            max_examples=HTTP_EXAMPLES if seeded else EXAMPLES,
            derandomize=seeded,
            deadline=None,
            database=None,
            suppress_health_check=_SUPPRESS,
        )
        @given(requests(), st.booleans())
        def fuzz(example: tuple[bytes, str, str], stream: bool) -> None:
            nonlocal ok
            data, ctype, what = example
            method = "streamGenerateContent?alt=sse" if stream else "generateContent"
            headers = {**({"Content-Type": ctype} if ctype else {}), "x-goog-api-key": secret}
            status, body = post(proxy.url, f"/r/{rid}/v1beta/models/{MODEL}:{method}", data, headers)
            statuses[status] = statuses.get(status, 0) + 1
            assert status < 500, (status, what, body[:400])
            if status == 200:
                ok += 1
            else:
                google_error(status, body, what)

        fuzz()
    print(f"\ngemini over HTTP: {sum(statuses.values())} requests, statuses {dict(sorted(statuses.items()))}")
    events = consume_calls(kafka_settings, {rid}, ok + 1, timeout=10 if ok else 3)
    assert len(events) == ok, f"{len(events)} call events for {ok} answered requests"
