"""``flwr run`` of pollen on a two-node Ray cluster (two raylets on 127.0.0.1), against a one-node run.

The guide (``docs/ray-cluster.md``) spreads a simulation over machines the Flower way: a Ray head, Ray
workers joining it, ``RAY_ADDRESS`` where the SuperLink runs. Here both raylets run on this machine, bound to
loopback, one CPU each, so two clients train at once, one on each node. Stateful methods are the point:
FedCAMS with error feedback (a residual per client) and FedBNLACA (lazy, compressed both ways: a reference,
a mirror and residuals per client). Their client state lives in Flower's ``context.state``, which the
simulation engine keeps per node and hands to whichever Ray worker runs the node's next message, so a
client moved to the other Ray node keeps it, and the final model is bit-identical to a one-node run.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from pollen.app.ray_cluster import LocalRayCluster
from pollen.testing.flwr_cli import LocalFlower
from pollen.testing.placement import read_placements

pytestmark = [
    pytest.mark.slow,
    # one worker for the module, and its fixtures (a two-node cluster, both methods on it, the one-process
    # reference) session-scoped: a module-scoped one is torn down whenever the worker runs another module's
    # test in between, and was built once per test (CI paid 2 x 160 s of setup)
    pytest.mark.xdist_group("ray-cluster"),
]

CLIENTS, ROUNDS = 4, 4
SETTINGS = {
    "num-server-rounds": ROUNDS,
    "local-steps": 5,
    "batch-size": 32,
    "model": "cnn",
    "partitioner": "iid",
    "fraction-train": 1.0,
    "fraction-evaluate": 0.0,
    "min-evaluate-nodes": 0,
    "eval-batch-size": 1000,
    "eval-every": ROUNDS,
    "test-examples": 1000,
    "plots": False,
}
METHODS = {
    "fedcams": {"strategy": "fedcams", "compressor": "sign"},
    "fedbnlaca": {"strategy": "fedbnlaca"},
}


def _run_all(flower: LocalFlower, results: Path, traces: Path) -> None:
    for name, method in METHODS.items():
        trace = traces / name
        trace.mkdir(parents=True)
        config = {**SETTINGS, **method, "results-dir": str(results), "run-name": name, "trace-dir": str(trace)}
        proc = flower.run(config, num_supernodes=CLIENTS, variant="testing", client_cpus=1, timeout=500)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        metrics = json.loads((results / name / "metrics.json").read_text())
        assert [row["round"] for row in metrics["rows"]][-1] == ROUNDS


@pytest.fixture(scope="session")
def one_node(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Both methods in one process, clients one at a time (:func:`pollen.testing.inprocess.run_inprocess`).

    The reference for "bit-identical to a one-node run": the one-node local simulation (two Ray workers,
    clients finishing in either order) equals this runner bit for bit, which
    ``tests/e2e/test_flwr_run.py::test_parallel_workers_end_bit_identical_to_one_client_at_a_time`` checks
    through ``flwr run``; here it saves two more simulations of the same thing.
    """
    from pollen.testing.inprocess import run_inprocess

    results = tmp_path_factory.mktemp("one-results")
    for name, method in METHODS.items():
        rows = run_inprocess({**SETTINGS, **method, "results-dir": str(results), "run-name": name}, CLIENTS)
        assert rows[-1]["round"] == ROUNDS
    return results


@pytest.fixture(scope="session")
def two_nodes(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[str]]:
    """Both methods on a two-node Ray cluster the SuperLink's simulation joins through ``RAY_ADDRESS``."""
    results, traces = tmp_path_factory.mktemp("two-results"), tmp_path_factory.mktemp("two-traces")
    with LocalRayCluster(nodes=2, cpus_per_node=1) as cluster:
        nodes = cluster.alive_nodes()
        flower = LocalFlower(tmp_path_factory.mktemp("flwr-two"), extra_env=cluster.env)
        try:
            _run_all(flower, results, traces)
        finally:
            flower.stop()
    assert not (cluster.tmp / "ray_current_cluster").exists()  # the private folder, address file and all, is gone
    return results, traces, nodes


@pytest.mark.parametrize("method", list(METHODS))
def test_clients_ran_on_both_nodes_and_carried_their_state_across(
    two_nodes: tuple[Path, Path, list[str]], method: str
) -> None:
    _, traces, nodes = two_nodes
    placements = read_placements(traces / method)
    assert len(placements) == CLIENTS * ROUNDS
    used = {p["ray_node"] for p in placements}
    assert used == set(nodes) and len(used) == 2, used
    where = defaultdict(dict)
    for p in placements:
        where[p["client"]][p["round"]] = p["ray_node"]
    moved = [c for c, by_round in where.items() if len(set(by_round.values())) > 1]
    if not moved:
        # Ray places each message on whichever worker is free; a run where every client stayed on its node
        # (seen once in a fresh-clone CI run) did not exercise the move, and says so instead of failing CI.
        # The bit-identical test below still holds that run to the one-node result.
        pytest.skip(f"Ray kept every client on one node in all {ROUNDS} rounds this time: {dict(where)}")


@pytest.mark.parametrize("method", list(METHODS))
def test_the_two_node_run_is_bit_identical_to_the_one_node_run(
    one_node: Path, two_nodes: tuple[Path, Path, list[str]], method: str
) -> None:
    want = np.load(one_node / method / "final_model.npz")
    got = np.load(two_nodes[0] / method / "final_model.npz")
    assert sorted(want.files) == sorted(got.files)
    for name in want.files:
        assert want[name].tobytes() == got[name].tobytes(), name
