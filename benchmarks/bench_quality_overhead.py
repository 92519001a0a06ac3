"""Issue 2 measurements: FedAMS vs FedAvg quality, and Flower simulation overhead.

Quality: real Fashion-MNIST (Debian's full set when installed, else the embedded
subset), 20 clients, Dirichlet(0.5), the papers' small CNN, 10 clients per round,
30 rounds; pollen's real ServerApp and ClientApp in one process
(``pollen/testing/inprocess.py``: only Ray and the SuperLink are left out).

Overhead: seconds per round of a ``flwr run`` simulation (Ray, local SuperLink)
divided by seconds of the same local training (same data, K steps, model, clients
per round) in a plain PyTorch loop in one process.

    python benchmarks/bench_quality_overhead.py [--rounds 30]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from pollen.testing.flwr_cli import LocalFlower  # noqa: E402
from pollen.testing.inprocess import PYPROJECT, run_inprocess  # noqa: E402

CLIENTS = 20
COMMON = {
    "partitioner": "dirichlet",
    "dirichlet-alpha": 0.5,
    "model": "cnn",
    "fraction-train": 0.5,
    "min-train-nodes": 10,
    "fraction-evaluate": 0.0,
    "min-evaluate-nodes": 0,
    "local-epochs": 1,
    "local-steps": 0,
    "eval-every": 5,
    "batch-size": 32,
    "local-lr": 0.01,
    "seed": 1,
}
METHODS = {
    "fedavg": {"strategy": "fedavg"},
    "fedams": {"strategy": "fedams", "server-lr": 0.1, "eps": 0.001},
}


OVERHEAD_STEPS = 20


def plain_pytorch_seconds_per_round(rounds: int) -> float:
    """The same local training in one process: 10 of 20 clients a round, K steps each."""
    import numpy as np

    from pollen.app.config import AppConfig, defaults_from_pyproject
    from pollen.app.experiment import build_model, data_config
    from pollen.task.data import load_partition
    from pollen.task.device import resolve_device
    from pollen.task.train import train

    cfg = AppConfig.from_run_config({**defaults_from_pyproject(str(PYPROJECT)), **COMMON})
    data_cfg = data_config(cfg, num_partitions=CLIENTS)
    model = build_model(cfg)
    device = resolve_device("cpu")
    rng = np.random.default_rng(0)
    for pid in range(CLIENTS):  # warm the partition cache, as a warm simulation worker has it
        load_partition(data_cfg, pid, 32)
    start = time.perf_counter()
    for r in range(rounds):
        for pid in rng.choice(CLIENTS, 10, replace=False):
            loader, _ = load_partition(data_cfg, int(pid), 32)
            local = build_model(cfg)
            local.load_state_dict(model.state_dict())
            train(local, loader, lr=0.01, local_steps=OVERHEAD_STEPS, device=device, seed=r)
    return (time.perf_counter() - start) / rounds


def simulation_seconds_per_round(out: Path, rounds: int) -> float:
    flower = LocalFlower(out / "flwr-home")
    try:
        proc = flower.run(
            {
                **COMMON,
                "strategy": "fedams",
                "local-steps": OVERHEAD_STEPS,
                "num-server-rounds": rounds,
                "eval-every": 1000,
                "results-dir": str(out),
                "run-name": "overhead",
            },
            num_supernodes=CLIENTS,
            timeout=1800,
        )
    finally:
        flower.stop()
    if proc.returncode != 0:
        raise SystemExit(proc.stdout[-3000:] + proc.stderr[-3000:])
    rows = json.loads((out / "overhead" / "metrics.json").read_text())["rows"]
    steady = [r["round_seconds"] for r in rows[2:-1]]  # skip Ray start-up and the final evaluation
    return sum(steady) / len(steady)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--overhead-rounds", type=int, default=8)
    parser.add_argument("--skip-quality", action="store_true")
    parser.add_argument("--skip-overhead", action="store_true")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp(prefix="pollen-quality-"))
    if not args.skip_quality:
        print(
            f"Quality: Fashion-MNIST, {CLIENTS} clients, Dirichlet(0.5), CNN, 10 clients/round, 1 local epoch "
            f"(batch 32, lr 0.01), {args.rounds} rounds, seed 1",
            flush=True,
        )
        for name in args.methods:
            settings = METHODS[name]
            rows = run_inprocess(
                {**COMMON, **settings, "num-server-rounds": args.rounds, "results-dir": str(out), "run-name": name},
                CLIENTS,
            )
            evaluated = [r for r in rows if isinstance(r["accuracy"], float)]
            curve = " ".join(f"{r['round']}:{r['accuracy']:.3f}" for r in evaluated)
            print(f"  {name:8s} final accuracy {rows[-1]['accuracy']:.4f}   (round:accuracy {curve})", flush=True)
    if args.skip_overhead:
        return
    sim = simulation_seconds_per_round(out, args.overhead_rounds)
    plain = plain_pytorch_seconds_per_round(3)
    print(f"Overhead: 20 SuperNodes, 10 per round, K={OVERHEAD_STEPS} steps of batch 32, CNN, no evaluation")
    print(f"  flwr run simulation (steady state): {sim:.2f} s/round")
    print(f"  plain PyTorch loop, same training:  {plain:.2f} s/round")
    print(f"  overhead ratio (simulation / plain loop): {sim / plain:.2f}")
    print(f"results folders: {out}")


if __name__ == "__main__":
    main()
