"""``strategy=hafed`` (and its stratified baseline) run with no other key on the README's 10 SuperNodes.

Before round 1 HA-Fed groups the connected nodes by the cluster id each reports to pollen's identify
query, and refuses a layout whose clusters are not equal. These tests resolve the run-config as the
ServerApp does, answer the identify query with pollen's real ClientApp (simulation contexts: partition
id, no node-config cluster id) and run the strategy's set-up check: no Flower processes, no training.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from flwr.app import Context, Message, RecordDict

from pollen.app.config import AppConfig, defaults_from_pyproject
from pollen.app.methods.hafed import DEFAULT_CLUSTER_SIZE
from pollen.app.registry import build_strategy
from pollen.strategies.engine.rounds import SetupError
from pollen.testing.fakes import FakeGrid

ROOT = Path(__file__).resolve().parents[2]
DEFAULTS = defaults_from_pyproject(str(ROOT / "pyproject.toml"))
README_SUPERNODES = 10  # the README's main job: --federation-config "num-supernodes=10"


class ClientAppGrid(FakeGrid):
    """A FakeGrid whose identify queries are answered by pollen's ClientApp with each node's context."""

    def __init__(self, contexts: dict[int, Context]) -> None:
        super().__init__(list(contexts), lambda msg: None)
        self.contexts = contexts

    def _identify(self, msg: Message) -> Message:
        from pollen.client_app import app

        return app(msg, self.contexts[msg.metadata.dst_node_id])


def _simulation(run_config: dict, nodes: int) -> ClientAppGrid:
    """Nodes as Flower's simulation makes them: partition-id and num-partitions, the run's config."""
    return ClientAppGrid(
        {
            node: Context(
                run_id=1,
                node_id=node,
                node_config={"partition-id": node - 1, "num-partitions": nodes},
                state=RecordDict(),
                run_config=run_config,
            )
            for node in range(1, nodes + 1)
        }
    )


@pytest.mark.parametrize("strategy", ["hafed", "fedamsgrad-stratified"])
def test_the_strategy_alone_forms_clusters_on_the_readmes_supernodes(strategy: str) -> None:
    run_config = {**DEFAULTS, "strategy": strategy}  # what `--run-config "strategy='hafed'"` hands both sides
    cfg = AppConfig.from_run_config(run_config, given={"strategy"})
    assert cfg["cluster-size"] == DEFAULT_CLUSTER_SIZE and README_SUPERNODES % DEFAULT_CLUSTER_SIZE == 0
    hafed = build_strategy(cfg)
    hafed.check_setup(_simulation(run_config, README_SUPERNODES))
    clusters = [[hafed.sampler.key(node) for node in cluster.nodes] for cluster in hafed.sampler.plan.clusters]
    assert clusters == [[f"partition-{i}" for i in range(5)], [f"partition-{i}" for i in range(5, 10)]]


def test_a_cluster_size_the_user_gives_wins() -> None:
    run_config = {**DEFAULTS, "strategy": "hafed", "cluster-size": 4}
    hafed = build_strategy(AppConfig.from_run_config(run_config, given={"strategy", "cluster-size"}))
    hafed.check_setup(_simulation(run_config, 8))
    assert [len(cluster.nodes) for cluster in hafed.sampler.plan.clusters] == [4, 4]


def test_clients_the_default_does_not_tile_get_one_line_naming_the_sizes() -> None:
    run_config = {**DEFAULTS, "strategy": "hafed"}
    hafed = build_strategy(AppConfig.from_run_config(run_config, given={"strategy"}))
    with pytest.raises(SetupError, match=r"HA-Fed cannot use clusters of sizes \{'0': 5, '1': 5, '2': 2\}"):
        hafed.check_setup(_simulation(run_config, 12))
