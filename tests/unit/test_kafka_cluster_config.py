"""The local cluster's configuration without starting a JVM: the replication rule, the server.properties each node
gets (one node exactly as before, three nodes replicated 3 / min ISR 2), state.json's old single-broker form, and the
replication setting's errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clawbase.errors import ConfigError, KafkaLocalError, TopicError
from clawbase.kafka.clients import _replication
from clawbase.kafka.local_state import ClusterState, NodeState
from clawbase.kafka.topic_spec import Replication, replication_for
from clawbase.settings import KafkaSettings, load_settings
from clawstream.local_kafka import LocalKafka


def _props(text: str) -> dict[str, str]:
    pairs = (line.split("=", 1) for line in text.splitlines() if line and not line.startswith("#"))
    return {k: v for k, v in pairs}


@pytest.mark.parametrize(("brokers", "factor", "min_isr"), [(1, 1, 1), (2, 2, 1), (3, 3, 2), (5, 3, 2)])
def test_replication_rule(brokers: int, factor: int, min_isr: int) -> None:
    assert replication_for(brokers) == Replication(factor, min_isr)


def test_replication_rule_with_a_pinned_factor() -> None:
    assert replication_for(3, 1) == Replication(1, 1)
    with pytest.raises(ConfigError, match="at least one broker"):
        replication_for(0)


def test_one_node_properties_are_the_single_broker_recipe(tmp_path: Path) -> None:
    local = LocalKafka(home=tmp_path)
    [node] = local.nodes(1)
    assert node.root == tmp_path and node.data_dir == tmp_path / "data" and node.log_file == tmp_path / "kafka.log"
    node.write_properties(NodeState(1, 9092, 9093), "1@127.0.0.1:9093", 1)
    props = _props(node.properties_file.read_text())
    assert props["node.id"] == "1" and props["controller.quorum.voters"] == "1@127.0.0.1:9093"
    assert props["listeners"] == "PLAINTEXT://127.0.0.1:9092,CONTROLLER://127.0.0.1:9093"
    replication = {k: v for k, v in props.items() if "replication.factor" in k or k.endswith("isr") or "insync" in k}
    assert set(replication.values()) == {"1"} and len(replication) == 7
    assert "{" not in node.properties_file.read_text()


def test_three_nodes_have_their_own_files_ports_and_replication_3(tmp_path: Path) -> None:
    local = LocalKafka(home=tmp_path)
    nodes = local.nodes(3)
    assert [n.root for n in nodes] == [tmp_path / f"node-{i}" for i in (1, 2, 3)]
    voters = "1@127.0.0.1:9101,2@127.0.0.1:9102,3@127.0.0.1:9103"
    for i, node in enumerate(nodes, start=1):
        node.write_properties(NodeState(i, 9000 + i, 9100 + i), voters, 3)
        props = _props(node.properties_file.read_text())
        assert props["node.id"] == str(i) and props["controller.quorum.voters"] == voters
        assert props["log.dirs"] == str(tmp_path / f"node-{i}" / "data")
        assert props["advertised.listeners"] == f"PLAINTEXT://127.0.0.1:{9000 + i}"
        for key in ("offsets.topic.replication.factor", "transaction.state.log.replication.factor"):
            assert props[key] == "3", key
        assert props["default.replication.factor"] == "3"
        assert props["transaction.state.log.min.isr"] == props["min.insync.replicas"] == "2"


def test_state_of_a_single_broker_written_before_clusters_is_read(tmp_path: Path) -> None:
    (tmp_path / "state.json").write_text(
        json.dumps({"port": 9092, "controller_port": 9093, "cluster_id": "abc", "pid": None, "started_at": None})
    )
    local = LocalKafka(home=tmp_path)
    assert local.brokers() == 1
    state = local.read_state()
    assert state == ClusterState("abc", [NodeState(1, 9092, 9093)])
    assert state.bootstrap == "127.0.0.1:9092" and local.status()["bootstrap"] == "127.0.0.1:9092"


def test_a_home_of_one_size_refuses_another(tmp_path: Path) -> None:
    local = LocalKafka(home=tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "meta.properties").write_text("formatted")
    (tmp_path / "state.json").write_text(
        json.dumps({"cluster_id": "abc", "nodes": [{"node_id": 1, "port": 1, "controller_port": 2}]})
    )
    with pytest.raises(KafkaLocalError, match="--home") as info:
        local.up(brokers=3)
    assert "1-broker cluster" in str(info.value)


def test_replication_setting_errors_name_the_variable() -> None:
    with pytest.raises(ConfigError, match="CLAWSTREAM_KAFKA_REPLICATION_FACTOR"):
        load_settings(KafkaSettings, replication_factor=0)
    pinned = KafkaSettings(bootstrap_servers="127.0.0.1:1", replication_factor=3)
    with pytest.raises(TopicError, match="CLAWSTREAM_KAFKA_REPLICATION_FACTOR") as info:
        _replication(pinned, 1)
    assert "1 broker(s)" in str(info.value)
    assert _replication(KafkaSettings(bootstrap_servers="127.0.0.1:1"), 3) == Replication(3, 2)
