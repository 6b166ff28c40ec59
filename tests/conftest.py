"""Shared test configuration: offline Hugging Face, quiet tokenizers, and the broker fixtures.

Broker fixtures (used by tests/integration and tests/e2e): one real Apache Kafka broker per test session, started
through the same code as ``clawstream kafka up`` (``LocalKafka.up``) in a session-private home so it never touches a
developer's own broker (the jar cache is the shared one, provisioned once), and a fresh topic prefix and consumer
group per test. Set ``CLAWSTREAM_TEST_BOOTSTRAP=host:port`` to run against an existing cluster instead.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from clawbase.kafka.clients import create_topics
from clawbase.settings import KafkaSettings
from clawstream.local_kafka import LocalKafka
from producers.sandbox import bwrap
from schemas.topics import CATALOG

# Local sandboxes are isolated with bubblewrap by default. Where it cannot run (and not in CI, which installs it), the
# other tests still run, unisolated; tests/integration/test_local_isolation.py skips (in CI: fails) with the reason.
_CI = os.environ.get("CI", "").strip().lower() in {"1", "true", "yes", "on"}
if not _CI and "CLAWSTREAM_SANDBOX_ISOLATION" not in os.environ and bwrap.probe() is not None:
    os.environ["CLAWSTREAM_SANDBOX_ISOLATION"] = "none"

# The shared helpers assert too (admin calls, leak checks): give them pytest's detailed failure messages.
pytest.register_assert_rewrite("tests.support")
from tests.support import provisioning  # noqa: E402 - after the rewrite is registered


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    provisioning.reorder(items)  # background-provisioned tests last (.ci/run; tests/support/provisioning.py)


_not_provisioned: dict[str, str] = {}


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):  # noqa: ANN201
    # Outside pytest-timeout's timer (its own protocol wrapper runs inside this one): the wait is not the test's time.
    why = provisioning.wait_for(item)
    if why is not None:
        _not_provisioned[item.nodeid] = why
    yield


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.nodeid in _not_provisioned:
        pytest.fail(_not_provisioned[item.nodeid], pytrace=False)


@pytest.fixture(scope="session")
def kafka_bootstrap(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    external = os.environ.get("CLAWSTREAM_TEST_BOOTSTRAP")
    if external:
        yield external
        return
    broker = LocalKafka(home=tmp_path_factory.mktemp("kafka-home"))
    state = broker.up(timeout=120, quiet=True)
    try:
        yield state.bootstrap
    finally:
        broker.down()


@pytest.fixture
def topic_prefix() -> str:
    return f"t-{uuid.uuid4().hex[:10]}."


@pytest.fixture
def kafka_settings(kafka_bootstrap: str, topic_prefix: str) -> KafkaSettings:
    """Settings with a fresh topic prefix; every catalog topic exists (created for this test)."""
    settings = KafkaSettings(bootstrap_servers=kafka_bootstrap, topic_prefix=topic_prefix)
    create_topics(settings, CATALOG)
    return settings


@pytest.fixture
def group_id() -> str:
    return f"g-{uuid.uuid4().hex[:10]}"
