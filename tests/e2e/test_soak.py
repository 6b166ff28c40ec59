"""The soak's 60-second version (``bench/soak.py``; ``make soak`` runs the 10-minute one): 16 concurrent rollouts
through the real proxy, sandbox worker, streams, learner and scheduler against the instant engine, then the audit.

Asserts: the audit is clean (nothing lost, duplicated or trained twice), at least one step's rollouts settled and
one weight version trained, every service's resident memory grows ≤ 25 % from warm-up to the end. The stack first
runs unmeasured until the first weight version is out (every service has done its work once: the learner's first
step would otherwise read as +35 % on a slow machine), then 60 s measured; warm-up = 9–19 s, end = 50–60 s of those.
25 %, not the 10-minute run's 10 %: the windows are 10 s and a service's first batches (allocator arenas, RocksDB
and librdkafka buffers, the learner's second step) still move its RSS by several per cent. A slow leak is the
10-minute run's to find; this catches a fast one. ``CLAWSTREAM_SOAK_TEST_LEAK=MODULE:MB_PER_S[:AFTER_S]`` (e.g.
``producers.sandbox.worker:10:30``) makes that service leak on purpose (``bench.soak --leak``): the test then fails.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench.soak import render, run_soak
from clawbase.settings import KafkaSettings

pytestmark = [pytest.mark.e2e, pytest.mark.integration]

SECONDS, ROLLOUTS = 60.0, 16
GROWTH_LIMIT = 0.25


@pytest.mark.timeout(600)
def test_soak_60_seconds(kafka_settings: KafkaSettings, tmp_path: Path) -> None:
    leak = os.environ.get("CLAWSTREAM_SOAK_TEST_LEAK") or None
    result = run_soak(kafka_settings, tmp_path, seconds=SECONDS, rollouts=ROLLOUTS, leak=leak, warm_versions=1)
    text = render(result, "tests/e2e/test_soak.py", limit=GROWTH_LIMIT)
    print(text)
    tally = result.report.tally()
    assert result.report.clean, result.audit_text
    assert tally["lost"] == tally["duplicated"] == tally["trained twice"] == 0, result.audit_text
    assert result.done >= ROLLOUTS, f"only {result.done} rollouts settled in {SECONDS:.0f} s"
    assert result.versions >= 1 and result.report.batches_trained == result.versions, result.audit_text
    assert result.settled_total == result.requested, "issued rollouts not settled after the drain"
    grown = {s: round(result.growth(s), 3) for s in result.judged if not result.growth(s) <= GROWTH_LIMIT}
    assert not grown, f"RSS grew more than {GROWTH_LIMIT:.0%} after warm-up: {grown}\n{text}"
