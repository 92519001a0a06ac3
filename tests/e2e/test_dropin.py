"""A Flower project that is not ours swaps FedAvg for ``pollen.strategies.FedAMS`` and runs.

The ServerApp and ClientApp below are written the way Flower's templates write them
(numpy linear regression instead of torch, so the test also runs against the newest
Flower without torch). The only pollen line is the strategy import; the run goes
through Flower's real simulation runtime (Ray).
"""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.simulation import run_simulation

from pollen.strategies import FedAMS

pytestmark = [pytest.mark.flower_compat, pytest.mark.slow]

TRUE_W = np.array([2.0, -3.0, 0.5], dtype=np.float32)
RESULTS: dict = {}


def _local_data(partition_id: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(partition_id)
    x = rng.normal(size=(64, 3)).astype(np.float32)
    return x, x @ TRUE_W


client_app = ClientApp()


@client_app.train()
def train(msg: Message, context: Context) -> Message:
    w = next(iter(msg.content["arrays"].values())).numpy().copy()
    x, y = _local_data(int(context.node_config["partition-id"]))
    for _ in range(10):
        w -= 0.05 * (2 / len(x)) * x.T @ (x @ w - y)
    content = RecordDict(
        {"arrays": ArrayRecord([w.astype(np.float32)]), "metrics": MetricRecord({"num-examples": len(x)})}
    )
    return Message(content=content, reply_to=msg)


@client_app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    w = next(iter(msg.content["arrays"].values())).numpy()
    x, y = _local_data(int(context.node_config["partition-id"]))
    mse = float(np.mean((x @ w - y) ** 2))
    return Message(content=RecordDict({"metrics": MetricRecord({"mse": mse, "num-examples": len(x)})}), reply_to=msg)


server_app = ServerApp()


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    strategy = FedAMS(fraction_train=1.0, fraction_evaluate=1.0, eta=0.3, eps=1e-3)
    initial = ArrayRecord([np.zeros(3, dtype=np.float32)])
    result = strategy.start(grid=grid, initial_arrays=initial, num_rounds=20)
    RESULTS["arrays"] = result.arrays
    RESULTS["evaluate"] = result.evaluate_metrics_clientapp


def test_fedams_drops_into_a_plain_flower_project() -> None:
    RESULTS.clear()
    run_simulation(
        server_app=server_app,
        client_app=client_app,
        num_supernodes=3,
        backend_config={"client_resources": {"num_cpus": 1}, "init_args": {"num_cpus": 2}},
    )
    assert "arrays" in RESULTS, "the ServerApp did not finish"
    final = next(iter(RESULTS["arrays"].values())).numpy()
    mse = RESULTS["evaluate"]
    assert mse[20]["mse"] < 0.05 * mse[1]["mse"], mse
    assert np.linalg.norm(final - TRUE_W) < 0.25 * np.linalg.norm(TRUE_W), final
