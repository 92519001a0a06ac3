"""Population mode with torch: the client plays the partition its message names, and whole runs in-process.

A run with run-config ``population`` = N on fewer nodes must end bit-identical to N nodes, one client each,
for every method of the table that fits (the rest refuse with their reason); a run with too few nodes for a
round stops before round 1. The sampler, the messages and the refusals: ``test_population.py``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from flwr.app import ConfigRecord

from pollen.app.config import ConfigError, defaults_from_pyproject
from pollen.app.registry import strategy_names
from pollen.client_app import LocalTask
from pollen.clientside.compression_mod import client_state_for
from pollen.strategies.engine.sampling import ClientSampler
from pollen.testing.fakes import FakeGrid, capture_flwr_logs, messages_text
from pollen.testing.inprocess import run_inprocess
from pollen.wire import protocol
from tests.app.test_population import _context, _strategy

DEFAULTS = defaults_from_pyproject("pyproject.toml")


def test_a_run_with_too_few_nodes_for_a_round_stops_before_round_1(tmp_path: Path):
    with capture_flwr_logs() as records, pytest.raises(ConfigError, match="a round samples 5 clients"):
        run_inprocess(
            {
                "population": 50,
                "fraction-train": 0.1,
                "fraction-evaluate": 0.0,
                "state-dir": str(tmp_path / "s"),
                "results-dir": str(tmp_path),
                "run-name": "few",
                "node-wait-seconds": 0.2,
                "model": "mlp",
            },
            3,
        )
    assert "stopped before round 1" in messages_text(records)
    assert "allowed: at least 5 (simulation: options.num-supernodes)" in messages_text(records)


def test_the_client_plays_the_partition_the_message_names(tmp_path: Path):
    context = _context(population=30, **{"state-dir": str(tmp_path), "model": "mlp"})
    task = LocalTask(context, ConfigRecord({protocol.CFG_PARTITION: 17}))
    assert (task.partition_id, task.data_cfg.num_partitions, task.client_id) == (17, 30, "partition-17")
    own = LocalTask(context, ConfigRecord())
    assert (own.partition_id, own.data_cfg.num_partitions, own.client_id) == (0, 2, "partition-0")
    state = client_state_for(context, ConfigRecord({protocol.CFG_PARTITION: 17, protocol.CFG_SERVER_ROUND: 1}))
    state.set("x", np.arange(3, dtype=np.float32))
    state.commit()
    assert state.path.name == "partition-17.npz" and state.path.is_file()
    assert len(context.state) == 0  # the node plays other clients: nothing of partition 17 stays with it


@pytest.mark.parametrize(
    ("partition", "words"),
    [(30, "'pollen.partition' = 30 but run-config 'population' = 30"), (-2, "allowed: an integer >= 0")],
)
def test_a_partition_outside_the_population_is_a_clear_error(tmp_path: Path, partition, words):
    context = _context(population=30, **{"state-dir": str(tmp_path)})
    with pytest.raises(ValueError, match=words):
        LocalTask(context, ConfigRecord({protocol.CFG_PARTITION: partition}))


# ------------------------------------------------------------------ whole runs
SMALL = {
    "num-server-rounds": 3,
    "local-steps": 2,
    "batch-size": 16,
    "model": "mlp",
    "partitioner": "iid",
    "fraction-train": 0.5,
    "fraction-evaluate": 0.5,
    "min-evaluate-nodes": 1,
    "eval-every": 3,
    "test-examples": 300,
}


#: Run in the fast layer: the method with the most client state (a book and mirrors both ways, residuals on each
#: side); every other method of the table runs in the slow layer.
FAST = ("fedbnlaca",)
#: The methods that need one node per client, and why they say so.
REFUSING = {
    **{name: "it samples the connected nodes itself" for name in ("fedavg", "fedadam", "fedyogi", "fedadagrad")},
    **{name: "HA-Fed's clusters" for name in ("hafed", "fedamsgrad-stratified")},
}


def _table_params() -> list:
    return [
        pytest.param(name, marks=() if name in FAST or name in REFUSING else pytest.mark.slow)
        for name in strategy_names()
    ]


def _clients_that_move(seed: int, rounds: int) -> set[int]:
    """The partitions the runs below train on one node in one round and on another later (their state must
    follow them): the server's draws replayed, train then evaluate each round, on the runner's nodes 1..3."""
    sampler, grid, last, moved = ClientSampler(seed=seed, population=6), FakeGrid([1, 2, 3], lambda m: None), {}, set()
    for _ in range(rounds):
        for node in sampler.sample(grid, SMALL["fraction-train"], DEFAULTS["min-train-nodes"]):
            partition = sampler.partition(node)
            if last.get(partition, node) != node:
                moved.add(partition)
            last[partition] = node
        sampler.sample(grid, SMALL["fraction-evaluate"], SMALL["min-evaluate-nodes"])
    return moved


@pytest.mark.parametrize("strategy", _table_params())
def test_a_population_run_ends_bit_identical_to_one_node_per_client(tmp_path: Path, strategy):
    """Six clients, three sampled a round: on six nodes, and as a population of six on three nodes.

    Every method of the table: error-feedback residuals (FedCAMS), lazy references, mirrors and residuals
    (the lazy family), the stored-update table (FedAdaVR), LAMB's moments: a client that moves to another node
    keeps its state. The methods that need a node per client refuse a population with their reason.
    """
    settings = {**SMALL, "strategy": strategy, "results-dir": str(tmp_path), "cluster-size": 3}
    assert _clients_that_move(seed=DEFAULTS["seed"], rounds=SMALL["num-server-rounds"])  # state must follow them
    if strategy in REFUSING:
        with pytest.raises(ValueError, match=REFUSING[strategy]):
            _strategy(**{k: v for k, v in settings.items() if k != "results-dir"}, population=6)
        return
    nodes = run_inprocess({**settings, "run-name": "nodes", "state-dir": str(tmp_path / "s-nodes")}, 6)
    played = run_inprocess(
        {**settings, "run-name": "population", "population": 6, "state-dir": str(tmp_path / "s-pop")}, 3
    )
    want, got = np.load(tmp_path / "nodes" / "final_model.npz"), np.load(tmp_path / "population" / "final_model.npz")
    assert sorted(want.files) == sorted(got.files)
    for name in want.files:
        assert want[name].tobytes() == got[name].tobytes(), name
    assert [row["uplink_bytes"] for row in nodes] == [row["uplink_bytes"] for row in played]
    assert [row.get("accuracy") for row in nodes] == [row.get("accuracy") for row in played]


@pytest.mark.slow  # three in-process runs
def test_a_population_run_resumes_as_the_uninterrupted_one(tmp_path: Path):
    settings = {**SMALL, "strategy": "fedcams", "results-dir": str(tmp_path), "population": 8}
    run_inprocess({**settings, "run-name": "full", "state-dir": str(tmp_path / "s-full")}, 4)
    cut = {**settings, "run-name": "cut", "state-dir": str(tmp_path / "s-cut")}
    first = run_inprocess({**cut, "stop-after-round": 1}, 4)
    resumed = run_inprocess({**cut, "resume": str(tmp_path / "cut")}, 4)
    assert [row["round"] for row in first] == [0, 1] and [row["round"] for row in resumed] == [0, 1, 2, 3]
    assert resumed[1]["elapsed_seconds"] == first[1]["elapsed_seconds"]  # round 1 kept, not run again
    want, got = np.load(tmp_path / "full" / "final_model.npz"), np.load(tmp_path / "cut" / "final_model.npz")
    for name in want.files:
        assert want[name].tobytes() == got[name].tobytes(), name
