"""Minimal Faust app for the foundation test: an agent reads RewardEvents (Avro, via the project codec) and answers
each with a Metric event on another topic. Run: ``python -m tests.integration.apps.faust_echo worker``.

Environment: ECHO_BOOTSTRAP (host:port), ECHO_IN, ECHO_OUT (full topic names), ECHO_APP_ID.
"""

from __future__ import annotations

import os

import faust

from schemas.events import Metric, RewardEvent, now_ms
from streams.codec import CODEC_NAME

app = faust.App(
    os.environ["ECHO_APP_ID"],
    broker=f"kafka://{os.environ['ECHO_BOOTSTRAP']}",
    store="memory://",
    web_enabled=False,
    topic_disable_leader=True,  # the broker forbids auto-creation; this app needs no leader topic
    consumer_auto_offset_reset="earliest",
)
source = app.topic(os.environ["ECHO_IN"], key_serializer="raw", value_serializer=CODEC_NAME)
sink = app.topic(os.environ["ECHO_OUT"], key_serializer="raw", value_serializer=CODEC_NAME)


@app.agent(source)
async def echo(stream: faust.StreamT) -> None:
    async for key, event in stream.items():
        assert isinstance(event, RewardEvent), type(event)
        reply = Metric(
            policy_version=event.policy_version,
            timestamp_ms=now_ms(),
            source="faust-echo",
            name="reward_seen",
            values={"reward": event.reward if event.reward is not None else -1.0},
            rollout_id=event.rollout_id,
            labels={"grader": event.grader, "status": event.status.value},
        )
        await sink.send(key=key, value=reply)


if __name__ == "__main__":
    app.main()
