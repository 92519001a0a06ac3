"""The sampler (stable ids, clusters, stratified sampling, saved state) and the strategy registry."""

from __future__ import annotations

import pytest
from flwr.app import ConfigRecord, Message, RecordDict

from pollen.app.config import SCHEMA, AppConfig, ConfigError, defaults_from_pyproject
from pollen.app.config import strategy_names as config_strategy_names
from pollen.app.registry import build_strategy, implementations, strategy_names
from pollen.strategies.engine.sampling import ClientSampler
from pollen.testing.fakes import FakeGrid
from pollen.wire import protocol

pytestmark = pytest.mark.flower_compat

NODES = list(range(101, 117))


class ClusterGrid(FakeGrid):
    """Answers the identify query with a client id and a cluster id (as pollen's ClientApp does)."""

    def _identify(self, msg: Message) -> Message:
        node = msg.metadata.dst_node_id
        record = ConfigRecord(
            {protocol.IDENTITY_CLIENT_ID: f"c{node - 101:02d}", protocol.IDENTITY_CLUSTER_ID: f"k{(node - 101) // 4}"}
        )
        return Message(RecordDict({protocol.IDENTITY_RECORD: record}), reply_to=msg)


def test_clusters_come_from_the_identify_reply_and_sampling_is_stratified():
    sampler = ClientSampler(seed=3, identify_clients=True)
    grid = ClusterGrid(NODES, lambda m: None)
    groups = sampler.clusters(grid)
    assert list(groups) == ["k0", "k1", "k2", "k3"]
    assert all(len(members) == 4 for members in groups.values())
    assert [sampler.key(n) for n in groups["k1"]] == ["c04", "c05", "c06", "c07"]
    picks = sampler.sample_per_cluster(groups, 2)
    assert all(len(p) == 2 and set(p) <= set(groups[k]) for k, p in picks.items())
    with pytest.raises(ValueError, match="cannot sample 5 nodes from cluster 'k0' of 4"):
        sampler.sample_per_cluster(groups, 5)


def test_a_node_without_a_cluster_id_is_a_clear_error():
    sampler = ClientSampler(seed=3, identify_clients=True)
    grid = FakeGrid(NODES, lambda m: None, client_ids={n: f"c{n}" for n in NODES})
    with pytest.raises(ValueError, match="reported no cluster id"):
        sampler.clusters(grid)


def test_sampler_state_round_trip_continues_the_same_draws():
    grid = ClusterGrid(NODES, lambda m: None)
    first = ClientSampler(seed=9, identify_clients=True)
    first.sample(grid, 0.25, 2)
    saved = first.state_dict()
    restored = ClientSampler(seed=9, identify_clients=True)  # the same run: its seed, the state's draws
    restored.load_state_dict(saved)
    assert [first.sample(grid, 0.25, 2) for _ in range(3)] == [restored.sample(grid, 0.25, 2) for _ in range(3)]
    assert restored.node_clusters == first.node_clusters and restored.known_clients == first.known_clients


def test_the_run_config_allows_exactly_the_registered_strategies():
    assert config_strategy_names() == strategy_names()
    assert set(implementations()) == set(strategy_names())
    assert {"fedams", "fedcams", "fedadavr", "fedavg", "fed-lamb"} <= set(strategy_names())
    assert (
        "relay-demo" not in strategy_names()
    )  # the demo is the test harness's (pollen.testing.apps), not the product's
    defaults = defaults_from_pyproject("pyproject.toml")
    with pytest.raises(ConfigError, match="'strategy' = 'fedfoo' is out of range; allowed: one of fedavg"):
        AppConfig.from_run_config({**defaults, "strategy": "fedfoo"})


@pytest.mark.parametrize("name", strategy_names())
def test_every_registered_name_builds_from_the_defaults(name):
    cfg = AppConfig.from_run_config({**defaults_from_pyproject("pyproject.toml"), "strategy": name})
    strategy = build_strategy(cfg)
    assert hasattr(strategy, "start") and hasattr(strategy, "state_dict") and hasattr(strategy, "load_state_dict")
    assert set(SCHEMA) == set(defaults_from_pyproject("pyproject.toml"))


def test_a_client_checks_its_run_config_without_importing_the_strategies():
    import subprocess
    import sys

    code = (
        "import sys; from pollen.app.config import AppConfig, defaults_from_pyproject; "
        "AppConfig.from_run_config(defaults_from_pyproject('pyproject.toml'), check_strategy=False); "
        "print('pollen.strategies' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
