"""Capture health on the real broker: rollouts recorded as the proxy records them, `clawstream health` over a range.

The calls are rendered by the proxy's own per-rollout renderer (``producers.proxy.render.RolloutRenderer``, the
tiny model's real chat template and tokenizer) and put into ``CallEvent`` exactly as ``producers.proxy.call_event``
does; the trajectory is built by the streams' own pure core (``streams.trajectory.build_trajectory``). The command
runs as its own process (``python -m consumers.analytics.dashboard.health_report``) against the session's Kafka broker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import TopicPartition

from clawbase.kafka.clients import make_admin, make_consumer, make_producer
from clawbase.settings import KafkaSettings
from producers.proxy.conversation import Conversation, Message
from producers.proxy.render import FULL_RENDER, RenderResult, RolloutRenderer, TemplateRenderer
from schemas.events import (
    CallEvent,
    CallKind,
    Dialect,
    Event,
    RewardEvent,
    RewardStatus,
    RolloutEvent,
    RolloutRequest,
    RolloutState,
)
from schemas.topics import CALLS, REWARDS, ROLLOUT_EVENTS, ROLLOUT_REQUESTS, TRAJECTORIES
from streams.rollout import RolloutAccumulator
from streams.settings import StreamsSettings
from streams.trajectory import build_trajectory
from tests.support import proxy_helpers as H

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
T0 = 1_790_000_000_000
TOPIC = {RolloutRequest: ROLLOUT_REQUESTS, RolloutEvent: ROLLOUT_EVENTS, CallEvent: CALLS, RewardEvent: REWARDS}


class ProxyRecorder:
    """One rollout's calls, rendered and encoded the way ``producers.proxy.call_event`` records them."""

    def __init__(self, template: TemplateRenderer, rollout_id: str, attempt_id: str) -> None:
        self.template, self.rollout_id, self.attempt_id = template, rollout_id, attempt_id
        self.renderer = RolloutRenderer(template)
        self.calls: list[CallEvent] = []
        self.results: list[RenderResult] = []

    def call(self, messages: list[Message], answer: str, *, cached: int | None = None) -> CallEvent:
        rendered = self.renderer.render(Conversation(tuple(messages)))
        gen = self.template.encode(answer) + [self.template.im_end_id]
        seq = len(self.calls)
        event = CallEvent(
            rollout_id=self.rollout_id,
            policy_version=0,
            timestamp_ms=T0 + 1000 * seq,
            call_id=f"{self.rollout_id}-{seq}",
            seq=seq,
            dialect=Dialect.OPENAI_CHAT,
            requested_model="policy",
            call_kind=CallKind.MAIN,
            new_tokens=rendered.new_tokens,
            prompt_len=len(rendered.prompt_ids),
            generated_tokens=gen,
            logprobs=[-0.5] * len(gen),
            finish_reason="stop",
            parent_call_id=rendered.parent_call_id,
            shared_prefix_len=rendered.shared_prefix_len,
            flags=list(rendered.flags),
            cached_prompt_tokens=cached,
            attempt_id=self.attempt_id,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
        )
        self.renderer.record(event.call_id, seq, rendered, gen, Message("assistant", answer))
        self.calls.append(CallEvent.from_bytes(event.to_bytes()))  # as a consumer will see it
        self.results.append(rendered)
        return event


def lifecycle(rollout_id: str, harness: str, attempt_id: str, calls: int, attempt: int = 0) -> list[Event]:
    group = f"t1|{harness}|0"
    return [
        RolloutRequest(
            rollout_id=rollout_id,
            policy_version=0,
            timestamp_ms=T0 - 10,
            suite="builtin:cpu",
            task_id="t1",
            harness=harness,
            group_id=group,
            step=0,
            timeout_s=60.0,
            attempt=attempt,
        ),
        RolloutEvent(
            rollout_id=rollout_id,
            policy_version=0,
            timestamp_ms=T0 - 5 + attempt,
            attempt_id=attempt_id,
            state=RolloutState.STARTED,
            group_id=group,
            harness=harness,
            attempt=attempt,
        ),
        RolloutEvent(
            rollout_id=rollout_id,
            policy_version=0,
            timestamp_ms=T0 + 60_000,
            attempt_id=attempt_id,
            state=RolloutState.HARNESS_EXITED,
            group_id=group,
            harness=harness,
            exit_code=0,
            calls_served=calls,
            attempt=attempt,
        ),
    ]


def settle(rollout_id: str, harness: str, attempt_id: str, calls: list[CallEvent]) -> Any:
    """The trajectory the streams' assembler emits for these calls (its pure core)."""
    acc = RolloutAccumulator(
        rollout_id,
        T0,
        T0,
        attempt_id=attempt_id,
        started={"group_id": f"t1|{harness}|0", "harness": harness, "policy_version": 0},
        terminal={
            "state": RolloutState.HARNESS_EXITED.value,
            "calls_served": len(calls),
            "group_id": f"t1|{harness}|0",
            "harness": harness,
            "policy_version": 0,
        },
        reward={
            "attempt_id": attempt_id,
            "status": RewardStatus.OK.value,
            "reward": 1.0,
            "reason": None,
            "grader": "native",
        },
    )
    return build_trajectory(acc, calls, T0 + 70_000, StreamsSettings())


def produce(settings: KafkaSettings, events: list[Any]) -> None:
    producer = make_producer(settings)
    for event in events:
        topic = TOPIC.get(type(event), TRAJECTORIES)
        producer.produce(settings.topic(topic), key=event.rollout_id.encode(), value=event.to_bytes())
    assert producer.flush(30) == 0


def health(settings: KafkaSettings, *args: str, as_json: bool = True) -> Any:
    cmd = [
        sys.executable,
        "-m",
        "consumers.analytics.dashboard.health_report",
        "--bootstrap",
        settings.bootstrap_servers or "",
        "--topic-prefix",
        settings.topic_prefix,
        *args,
    ]
    if as_json:
        cmd.append("--json")
    proc = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"}
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout) if as_json else proc.stdout


@pytest.fixture(scope="module")
def template() -> TemplateRenderer:
    return TemplateRenderer(H.tiny_tokenizer())


def test_health_reports_exactly_the_known_fork_re_render_orphan_and_masked_tokens(
    kafka_settings: KafkaSettings, template: TemplateRenderer
) -> None:
    system = Message("system", "You are a careful coding agent. " * 3)
    task = Message("user", "create hello.txt containing hi")
    ctx = Message("user", "[internal context] session 42, working directory /w")
    a0, a1, a2, a3 = "I will list the files first.", "The file is missing.", "Writing it now.", "Done: hi."
    tool0 = Message("user", "ls: (empty)")
    tool0_edited = Message(
        "user",
        "ls: (empty) [output truncated by the harness: it re-ran the command and "
        "replaced the result with a longer explanation of what it saw]",
    )
    tool2 = Message("user", "wrote hello.txt")

    # "oc": c1 extends c0; c2 drops c1's answer and edits the tool result (a fork, no re-render: its conversation
    # still extends c0's); c3 moves the context message to the end (a full re-render, and a fork); c3 ends it.
    oc = ProxyRecorder(template, "oc", "oc-a0")
    oc.call([system, task, ctx], a0)
    oc.call([system, task, ctx, Message("assistant", a0), tool0], a1)
    c2 = oc.call([system, task, ctx, Message("assistant", a0), tool0_edited], a2)
    c3 = oc.call([system, task, Message("assistant", a0), tool0_edited, Message("assistant", a2), tool2, ctx], a3)
    # what the proxy itself says: c2 is no re-render (its declared parent c0 is extended exactly), c3 is one
    assert c2.parent_call_id == "oc-0" and FULL_RENDER not in c2.flags
    assert FULL_RENDER in c3.flags
    gen = [len(c.generated_tokens) for c in oc.calls]

    # "al": append-only with cached prompt tokens, plus one call of a superseded attempt (a re-run)
    stale = ProxyRecorder(template, "al", "al-a0")
    stale.call([system, task], a0)
    al = ProxyRecorder(template, "al", "al-a1")
    al.call([system, task], a0, cached=0)
    al.call([system, task, Message("assistant", a0), tool0], a2, cached=al.calls[0].prompt_len)
    al.call(
        [system, task, Message("assistant", a0), tool0, Message("assistant", a2), tool2],
        a3,
        cached=al.calls[1].prompt_len + 4,
    )
    for c in stale.calls:
        c.call_id = "al-old-" + c.call_id

    events: list[Any] = [
        *lifecycle("oc", "openclaw", "oc-a0", 4),
        *oc.calls,
        settle("oc", "openclaw", "oc-a0", oc.calls),
        *lifecycle("al", "agentloop", "al-a0", 1),
        *stale.calls,
        *lifecycle("al", "agentloop", "al-a1", 3, attempt=1),
        *al.calls,
        settle("al", "agentloop", "al-a1", al.calls),
        # its grader failed on what the rollout left in its workspace: a graded 0, counted apart
        RewardEvent(
            rollout_id="al",
            policy_version=0,
            timestamp_ms=T0 + 65_000,
            attempt_id="al-a1",
            status=RewardStatus.OK,
            grader="native",
            reward=0.0,
            reason="grader_error_by_rollout: PermissionError",
            grader_error_by_rollout=True,
        ),
    ]
    produce(kafka_settings, events)
    consumer = make_consumer(kafka_settings, "probe")
    calls_topic = kafka_settings.topic(CALLS)
    parts = make_admin(kafka_settings).list_topics(calls_topic, timeout=10).topics[calls_topic].partitions
    ends = {p: consumer.get_watermark_offsets(TopicPartition(calls_topic, p), timeout=10)[1] for p in parts}
    consumer.close()

    # later noise, outside the range given below: another openclaw rollout that forks on every call
    noise = ProxyRecorder(template, "zz", "zz-a0")
    noise.call([system, task, ctx], a0)
    noise.call([system, ctx, task, Message("assistant", a0), tool0], a1)
    noise.call([system, task, Message("assistant", a0), Message("assistant", a1), ctx], a2)
    noise.calls[2].tampered = True  # as the proxy marks a request holding an assistant turn it never generated
    produce(kafka_settings, [*lifecycle("zz", "openclaw", "zz-a0", 3), *noise.calls])

    report = health(kafka_settings, *[f"--to={p}:{end}" for p, end in ends.items()])
    rows = {(r["harness"], r["template"]): r for r in report["rows"]}
    assert set(rows) == {("openclaw", "openai_chat"), ("agentloop", "openai_chat"), ("(all)", "(all)")}
    assert report["rollouts"] == 2 and report["calls_in_range"] == 8 and report["errors"] == []

    o = rows["openclaw", "openai_chat"]
    assert (o["rollouts"], o["main_calls"], o["follow_ups"]) == (1, 4, 3)
    assert (o["extends"], o["forks"], o["full_renders"], o["answer_forks"], o["roots"]) == (1, 2, 1, 0, 0)
    assert o["extends_share"] == pytest.approx(1 / 3)
    assert o["retry_orphans"] == 1  # c1's answer: the harness went on without it
    assert o["stale_attempt_calls"] == 0 and o["unresolved_calls"] == 0
    assert all((r["tampered_rollouts"], r["tampered_calls"]) == (0, 0) for r in rows.values())
    assert {k: r["grader_error_rollouts"] for k, r in rows.items()} == {k: int(k[0] != "openclaw") for k in rows}
    # The streams' tree keeps c3's path and c0 (carried: its answer sits where c3's prompt departs); c1 is a dead
    # end, and c2's answer lies far from c3's branch point, so the one-off re-layout costs c2's tokens as well.
    assert o["generated_tokens"] == sum(gen)
    assert o["masked_tokens"] == gen[1] + gen[2]
    assert o["masked_token_fraction"] == pytest.approx((gen[1] + gen[2]) / sum(gen))
    assert o["prefix_cache_hit_rate"] is None  # no call reported a cached count

    a = rows["agentloop", "openai_chat"]
    assert (a["rollouts"], a["main_calls"], a["follow_ups"], a["extends"], a["forks"], a["full_renders"]) == (
        1,
        3,
        2,
        2,
        0,
        0,
    )
    assert a["extends_share"] == 1.0 and a["retry_orphans"] == 0 and a["masked_tokens"] == 0
    assert a["stale_attempt_calls"] == 1
    prompts = [c.prompt_len for c in al.calls]
    cached = 0 + prompts[0] + prompts[1] + 4
    assert a["prefix_cache_hit_rate"] == pytest.approx(cached / sum(prompts))

    # the whole topic: the noise rollout counts too (and forks on both follow-ups)
    everything = {(r["harness"], r["template"]): r for r in health(kafka_settings)["rows"]}
    assert everything["openclaw", "openai_chat"]["rollouts"] == 2
    assert everything["openclaw", "openai_chat"]["forks"] == 2 + 2
    tampered = {k: (r["tampered_rollouts"], r["tampered_calls"]) for k, r in everything.items()}
    assert tampered == {k: (1, 1) if k[0] != "agentloop" else (0, 0) for k in everything}

    # the table a person reads
    text = health(kafka_settings, *[f"--to={p}:{end}" for p, end in ends.items()], as_json=False)
    print(text)  # the table docs/dashboard.md shows
    line = next(ln for ln in text.splitlines() if ln.startswith("openclaw"))
    assert "33.3% (1/3)" in line and "1.00 (1)" in line and "2.00 (2)" in line
    assert text.splitlines()[0].endswith("tampered  grader error") and line.split()[-3:] == ["0", "(0)", "0"]
    assert next(ln for ln in text.splitlines() if ln.startswith("agentloop")).split()[-3:] == ["0", "(0)", "1"]


def test_health_errors_are_one_clear_line(kafka_settings: KafkaSettings) -> None:
    base = [
        sys.executable,
        "-m",
        "consumers.analytics.dashboard.health_report",
        "--bootstrap",
        kafka_settings.bootstrap_servers or "",
    ]
    cases = {
        "no topic": (["--topic-prefix", "nope-" + kafka_settings.topic_prefix], "no topic nope-"),
        "bad time": (["--topic-prefix", kafka_settings.topic_prefix, "--since", "yesterday-ish"], "cannot read"),
        "bad offset": (["--topic-prefix", kafka_settings.topic_prefix, "--from", "x:1"], "--from 'x:1'"),
        "no partition": (["--topic-prefix", kafka_settings.topic_prefix, "--from", "99:0"], "no partition 99"),
    }
    for name, (args, expected) in cases.items():
        proc = subprocess.run([*base, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 1, (name, proc.stdout, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], (name, proc.stderr)
    # an empty range is not an error
    proc = subprocess.run(
        [*base, "--topic-prefix", kafka_settings.topic_prefix], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and proc.stdout.startswith("no calls in the range (0 read)"), proc.stderr
