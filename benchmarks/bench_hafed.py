"""Issue 11: HA-Fed's "dilemma of local steps" and what relayed gossip costs, on real Fashion-MNIST.

The spec's C9 setting scaled to a 2-core CPU (``papers/hafed.md`` §5.1, §9): 32 clients in 4 clusters
of 8 (client i in cluster i // 8), label-sorted shards (6 per client), the CNN, batch 50,
eta_l = 0.1, server AMSGrad eta = 0.01, eps = 1e-8 inside the sqrt, beta 0.9 / 0.99, p = 1/4:

- FedAMSGrad: 8 of 32 clients uniformly (``fedamsgrad-uniform``);
- HA-Fed: a ring in each cluster (rho = 0.805), m = 2 uploaders per cluster, all 32 train and gossip
  after every local step.

Tables: final test accuracy and loss for tau in {2, 4, 8} and the paper's {12, 24, 48}, the rho ablation at
tau = 4 (W = 11^T/n: 0, K_{4,4}: 0.6, ring: 0.805, I: 1 = stratified FedAMSGrad), and the cost: seconds
per round, gossip messages, bytes through the SuperLink against a peer network's, and the relay's
share of the time (HA-Fed's round minus the same 32 clients' training without gossip,
``hafed-nogossip``: W = I with every client uploading). Runs are pollen's real ServerApp and
ClientApp in one process (``pollen/testing/inprocess.py``); each is resumable.

    python benchmarks/bench_hafed.py [--rounds 6] [--seeds 1 2 3] [--out DIR]

A 6-round HA-Fed run at tau = 8 takes about 3 minutes here, at tau = 48 about 7; the whole script about 80 minutes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from pollen.testing.inprocess import run_inprocess

CLIENTS, CLUSTER = 32, 8
SETUP = {
    "dataset": "fashion-mnist",
    "model": "cnn",
    "partitioner": "shards",
    "shards-per-partition": 6,
    "val-fraction": 0.0,
    "cluster-size": CLUSTER,
    "batch-size": 50,
    "local-lr": 0.1,
    "momentum": 0.0,
    "weight-decay": 0.0,
    "server-lr": 0.01,
    "beta-1": 0.9,
    "beta-2": 0.99,
    "eps": 1e-8,
    "eps-mode": "inside",
    "min-train-nodes": CLIENTS // 4,
    "fraction-evaluate": 0.0,
    "min-evaluate-nodes": 0,
    "eval-batch-size": 2000,
    "eval-every": 2,
}
FEDAMSGRAD = {"strategy": "fedamsgrad-uniform", "fraction-train": 0.25}
HAFED = {"strategy": "hafed", "topology": "ring", "uploaders-per-cluster": 2}
TAUS = (2, 4, 8)
PAPER_TAUS = (12, 24, 48)  # the paper's; run last (the longest)
RHO = {  # name: (run-config, rho)
    "W = 11^T/n": ({"strategy": "hafed", "topology": "full", "uploaders-per-cluster": 2}, 0.0),
    "K_{4,4}": ({"strategy": "hafed", "topology": "bipartite", "uploaders-per-cluster": 2}, 0.6),
    "ring": (HAFED, 0.805),
    "W = I (stratified FedAMSGrad)": ({"strategy": "fedamsgrad-stratified", "uploaders-per-cluster": 2}, 1.0),
}
#: Flower's own strategies on the same data (local SGD with the app's shuffled loader), 8 of 32 per round.
FLOWER_BASELINES = {
    "FedAvg (Flower's)": {"strategy": "fedavg", "fraction-train": 0.25},
    "FedAdam (Flower's, eps 1e-8)": {"strategy": "fedadam", "fraction-train": 0.25},
    "FedYogi (Flower's, eps 1e-8)": {"strategy": "fedyogi", "fraction-train": 0.25},
}
NO_GOSSIP = {"strategy": "fedamsgrad-stratified", "uploaders-per-cluster": CLUSTER}  # all 32 train, no relay


def run_once(out: Path, rounds: int, name: str, config: dict, tau: int, seed: int, every: int = 1) -> list[dict]:
    run = (
        f"{name}-tau{tau}-g{every}-s{seed}".replace(" ", "_")
        .replace("/", "_")
        .replace("{", "")
        .replace("}", "")
        .replace("^", "")
        .replace("=", "")
    )
    done = out / run / "metrics.json"
    if done.is_file():
        rows = json.loads(done.read_text())["rows"]
        if rows and rows[-1]["round"] == rounds:
            return rows
    started = time.perf_counter()
    rows = run_inprocess(
        {
            **SETUP,
            **config,
            "local-steps": tau,
            "gossip-every": every,
            "seed": seed,
            "num-server-rounds": rounds,
            "results-dir": str(out),
            "run-name": run,
        },
        CLIENTS,
    )
    print(f"  {run}: final {rows[-1]['accuracy']:.4f} in {time.perf_counter() - started:.0f} s", flush=True)
    return rows


def mean_sd(values: list[float], digits: int = 4) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.{digits}f} ± {sd:.{digits}f}"


def counter(row: dict, name: str) -> float:
    """A method counter of a results row: column ``method.<name>``
    (``<name>`` in results written before those columns)."""
    return row.get(f"method.{name}", row.get(name, 0)) or 0


def seconds_per_round(rows: list[dict]) -> float:
    """Median training-round time, the evaluation rounds' test pass left out where it can be."""
    return (
        statistics.median(r["round_seconds"] for r in rows[1:] if r["accuracy"] is None)
        if len(rows) > 2
        else rows[-1]["round_seconds"]
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--out", default="/tmp/pollen-hafed")
    args = parser.parse_args()
    out, seeds, rounds = Path(args.out), args.seeds, args.rounds
    out.mkdir(parents=True, exist_ok=True)
    print(
        f"Fashion-MNIST, {CLIENTS} clients in {CLIENTS // CLUSTER} clusters of {CLUSTER}, shards (6 per client), CNN, "
        f"batch 50, eta_l 0.1, AMSGrad eta 0.01 eps 1e-8 inside, p = 1/4, {rounds} rounds, seeds {seeds}",
        flush=True,
    )

    print("\n| tau | method | final accuracy | final test loss | train loss (last round) | grad evals / round |")
    print("|---|---|---|---|---|---|")
    for tau in TAUS:
        for name, config in (("FedAMSGrad (8 of 32)", FEDAMSGRAD), ("HA-Fed (ring, m = 2)", HAFED)):
            runs = [run_once(out, rounds, name.split()[0], config, tau, s) for s in seeds]
            print(
                f"| {tau} | {name} | {mean_sd([r[-1]['accuracy'] for r in runs])} | "
                f"{mean_sd([r[-1]['loss'] for r in runs])} | "
                f"{mean_sd([float(r[-1]['train_loss']) for r in runs])} | {runs[0][-1]['grad_evals']} |",
                flush=True,
            )

    print("\n| W (tau = 4) | rho | final accuracy | final test loss |")
    print("|---|---|---|---|")
    for name, (config, rho) in RHO.items():
        runs = [run_once(out, rounds, "HA-Fed" if name == "ring" else name, config, 4, s) for s in seeds]
        print(
            f"| {name} | {rho:g} | {mean_sd([r[-1]['accuracy'] for r in runs])} | "
            f"{mean_sd([r[-1]['loss'] for r in runs])} |",
            flush=True,
        )

    print("\n| baseline (tau = 4, 8 of 32) | final accuracy | final test loss |")
    print("|---|---|---|")
    for name, config in FLOWER_BASELINES.items():
        runs = [run_once(out, rounds, name.split()[0], config, 4, s) for s in seeds]
        print(
            f"| {name} | {mean_sd([r[-1]['accuracy'] for r in runs])} | {mean_sd([r[-1]['loss'] for r in runs])} |",
            flush=True,
        )

    print(
        "\n| tau / G | method | s / round | gossip messages / round | through the SuperLink MB / round | "
        "of it relayed gossip MB | peer network MB | relay overhead s / round | per gossip message ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for tau, every in ((2, 1), (4, 1), (8, 1), (8, 4)):
        base = run_once(out, rounds, "no-gossip", NO_GOSSIP, tau, seeds[0])
        ams = run_once(out, rounds, "FedAMSGrad", FEDAMSGRAD, tau, seeds[0])
        ha = run_once(out, rounds, "HA-Fed", HAFED, tau, seeds[0], every)
        for name, rows in (("FedAMSGrad (8 of 32)", ams), ("32 clients, no gossip", base), ("HA-Fed (ring)", ha)):
            last = rows[-1]
            through = (last["uplink_bytes"] + last["downlink_bytes"]) / 1e6
            overhead = seconds_per_round(rows) - seconds_per_round(base) if name.startswith("HA") else 0.0
            per_msg = (
                1e3 * overhead / last["exchange_messages"]
                if name.startswith("HA") and last["exchange_messages"]
                else 0.0
            )
            print(
                f"| {tau} / {every} | {name} | {seconds_per_round(rows):.1f} | {last['exchange_messages']} | "
                f"{through:.1f} | "
                f"{counter(last, 'relayed_bytes') / 1e6:.1f} | {counter(last, 'peer_bytes') / 1e6:.1f} | "
                f"{overhead:.1f} | {per_msg:.1f} |",
                flush=True,
            )
    if len(seeds) > 1:
        g4 = [run_once(out, rounds, "HA-Fed", HAFED, 8, s, 4) for s in seeds]
        g1 = [run_once(out, rounds, "HA-Fed", HAFED, 8, s, 1) for s in seeds]
        print(
            f"\ngossip every 4 of tau = 8: final accuracy {mean_sd([r[-1]['accuracy'] for r in g4])} "
            f"(every step: {mean_sd([r[-1]['accuracy'] for r in g1])})"
        )
    print(
        "\n| the paper's tau | method | seeds | final accuracy | final test loss | train loss (last round) | "
        "s / round |"
    )
    print("|---|---|---|---|---|---|---|")
    for tau in PAPER_TAUS:
        for name, config in (("FedAMSGrad (8 of 32)", FEDAMSGRAD), ("HA-Fed (ring, m = 2)", HAFED)):
            runs = [
                run_once(out, rounds, name.split()[0], config, tau, s) for s in seeds
            ]  # tau = 48: ~7 min a run here
            print(
                f"| {tau} | {name} | {len(runs)} | {mean_sd([r[-1]['accuracy'] for r in runs])} | "
                f"{mean_sd([r[-1]['loss'] for r in runs])} | "
                f"{mean_sd([float(r[-1]['train_loss']) for r in runs])} | "
                f"{statistics.median(seconds_per_round(r) for r in runs):.1f} |",
                flush=True,
            )
    print(f"\nruns in {out}")


if __name__ == "__main__":
    main()
