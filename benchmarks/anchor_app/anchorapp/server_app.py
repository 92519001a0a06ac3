"""anchorapp's ServerApp: Flower's own FedAvg, every node trains every round, no evaluation."""

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from anchorapp.task import Net

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    torch.manual_seed(int(context.run_config["seed"]))
    strategy = FedAvg(fraction_train=float(context.run_config["fraction-train"]), fraction_evaluate=0.0)
    strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(Net().state_dict()),
        train_config=ConfigRecord({"lr": float(context.run_config["lr"])}),
        num_rounds=int(context.run_config["num-server-rounds"]),
    )
