"""The learner's batches consumer: room for a long training step (``LearnerSettings.max_step_s``).

librdkafka takes a consumer that does not poll for ``max.poll.interval.ms`` (300 s by default) out of its group; the
learner does not poll while it trains, so a longer step lost its group and the step's offset commit was refused
(ILLEGAL_GENERATION): the learner died after training the batch, in the mixed-harness e2e test on a loaded machine.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from confluent_kafka import Consumer
from pydantic import ValidationError

from clawbase.kafka.clients import consumer_config
from clawbase.settings import KafkaSettings
from learner.settings import LearnerSettings


def test_a_step_may_take_hours_before_the_group_drops_the_learner(tmp_path: Path) -> None:
    settings = LearnerSettings(model_dir=tmp_path, weight_store=tmp_path)
    overrides = settings.consumer_config("p.")
    assert overrides["max.poll.interval.ms"] >= 3600 * 1000  # librdkafka's default is 300,000
    assert overrides["group.instance.id"] == "p.clawstream-learner-policy"
    assert (
        LearnerSettings(model_dir=tmp_path, weight_store=tmp_path, max_step_s=90).consumer_config()[
            "max.poll.interval.ms"
        ]
        == 90_000
    )
    # librdkafka accepts the whole configuration as the learner builds it (nothing connects)
    kafka = KafkaSettings(bootstrap_servers="127.0.0.1:9")
    Consumer(consumer_config(kafka, settings.resolved_group_id(), **overrides)).close()


def test_max_step_s_is_bounded_by_what_librdkafka_accepts(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="max_step_s"):
        LearnerSettings(model_dir=tmp_path, weight_store=tmp_path, max_step_s=200_000)
