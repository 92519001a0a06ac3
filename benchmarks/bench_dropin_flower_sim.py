"""quickstart-pytorch through Flower's own simulation runtime: FedAvg() against pollen's strategies swapped in.

The in-process harness of ``bench_dropin.py`` seeds everything and runs clients one after another; this runs
the same foreign project (``pollen/testing/foreign/quickstart_pytorch.py``) the way ``flwr run`` does, through
``flwr.simulation.run_simulation`` (Ray, 4 SuperNodes, one CPU each), with the clients' shuffles unseeded as
a user's are. Each run prints the server's test accuracy after every round; ``--seed-init`` fixes the initial
model (as the harness's seed 1 does), otherwise it is drawn afresh.

Run: ``python benchmarks/bench_dropin_flower_sim.py [--runs 3] [--rounds 5] [--seed-init] [--only NAME ...]``
(names as ``bench_dropin.py`` prints them, e.g. ``"FedCAMS() + compression_mod"``; FedAvg() always runs,
FedAMS() when none is named). A strategy's mods go on the ClientApp as a project adds them.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.simulation import run_simulation

from pollen.testing.foreign.harness import DropIn, drop_ins
from pollen.testing.foreign.quickstart_pytorch import PROJECT


def one_run(drop_in: DropIn, rounds: int, seed_init: bool) -> list[float]:
    """The server's test accuracy after each round of one simulated run (index 0: the initial model)."""
    accuracy: dict[int, float] = {}
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        if seed_init:
            torch.manual_seed(1)
        net = PROJECT.net()
        test = PROJECT.test_set(1)

        def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
            model = PROJECT.net()
            model.load_state_dict(arrays.to_torch_state_dict())
            accuracy[server_round] = PROJECT.evaluate(model, test)[1]
            return MetricRecord({"accuracy": accuracy[server_round]})

        strategy = drop_in.make(1.0)
        strategy.start(
            grid=grid,
            initial_arrays=ArrayRecord(net.state_dict()),
            num_rounds=rounds,
            train_config=ConfigRecord(dict(PROJECT.train_config)),
            evaluate_fn=evaluate_fn,
        )

    run_simulation(
        server_app=server,
        client_app=PROJECT.make_app(list(drop_in.mods)),
        num_supernodes=PROJECT.num_clients,
        backend_config={"client_resources": {"num_cpus": 1}},
    )
    return [accuracy[r] for r in range(rounds + 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seed-init", action="store_true", help="the initial model of seed 1 in every run")
    known = {d.name: d for d in drop_ins()}
    parser.add_argument("--only", nargs="+", default=["FedAMS()"], choices=sorted(known), metavar="NAME")
    args = parser.parse_args()
    chosen = [known["FedAvg()"]] + [known[name] for name in args.only if name != "FedAvg()"]
    finals: dict[str, list[float]] = {d.name: [] for d in chosen}
    width = max(len(d.name) for d in chosen)
    for _ in range(args.runs):
        for drop_in in chosen:
            curve = one_run(drop_in, args.rounds, args.seed_init)
            finals[drop_in.name].append(curve[-1])
            print(f"{drop_in.name:<{width}} " + " ".join(f"{a:.3f}" for a in curve), flush=True)
    for name, values in finals.items():
        print(
            f"{name:<{width}} after round {args.rounds}: mean {statistics.fmean(values):.3f} over {len(values)} runs "
            f"({min(values):.3f}-{max(values):.3f})"
        )


if __name__ == "__main__":
    main()
