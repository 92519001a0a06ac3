"""Issue 2 measurements: FedAMS vs FedAvg quality, and Flower simulation overhead.

Quality: real Fashion-MNIST (Debian's full set when installed, else the embedded
subset), 20 clients, Dirichlet(0.5), the papers' small CNN, 10 clients per round,
~30 rounds, each run through the real app with ``flwr run`` (simulation, Ray).

Overhead: seconds per round of that ``flwr run`` simulation divided by seconds of
the same local training (same data, steps, model, clients per round) in a plain
PyTorch loop in one process.

    python benchmarks/bench_quality_overhead.py [--rounds 30]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.flwr_cli import LocalFlower  # noqa: E402

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
    "batch-size": 32,
    "local-lr": 0.01,
    "seed": 1,
}
METHODS = {
    "fedavg": {"strategy": "fedavg"},
    "fedams": {"strategy": "fedams", "server-lr": 0.1, "eps": 0.001},
}


def plain_pytorch_seconds_per_round(rounds: int) -> float:
    """The same local training in one process: 10 of 20 clients a round, one epoch each."""
    import numpy as np
    import torch

    from pollen.config import AppConfig, defaults_from_pyproject
    from pollen.experiment import build_model, data_config
    from pollen.task.data import load_partition
    from pollen.task.device import resolve_device
    from pollen.task.train import train

    torch.set_num_threads(1)
    cfg = AppConfig.from_run_config({**defaults_from_pyproject("pyproject.toml"), **COMMON})
    data_cfg = data_config(cfg, num_partitions=CLIENTS)
    model = build_model(cfg)
    device = resolve_device("cpu")
    rng = np.random.default_rng(0)
    start = time.perf_counter()
    for r in range(rounds):
        for pid in rng.choice(CLIENTS, 10, replace=False):
            loader, _ = load_partition(data_cfg, int(pid), 32)
            train(model, loader, lr=0.01, local_epochs=1, device=device, seed=r)
    return (time.perf_counter() - start) / rounds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp(prefix="pollen-quality-"))
    flower = LocalFlower(out / "flwr-home")
    finals = {}
    try:
        for name, settings in METHODS.items():
            proc = flower.run(
                {**COMMON, **settings, "num-server-rounds": args.rounds, "results-dir": str(out), "run-name": name},
                num_supernodes=CLIENTS,
                timeout=3600,
            )
            if proc.returncode != 0:
                raise SystemExit(proc.stdout[-3000:] + proc.stderr[-3000:])
            rows = json.loads((out / name / "metrics.json").read_text())["rows"]
            steady = [r["round_seconds"] for r in rows[2:]]
            finals[name] = (rows[-1]["accuracy"], sum(steady) / len(steady), rows[-1]["cum_uplink_bytes"])
    finally:
        flower.stop()
    plain = plain_pytorch_seconds_per_round(min(args.rounds, 5))
    print(f"Fashion-MNIST (source: see results config), {CLIENTS} clients, Dirichlet(0.5), CNN, 10 clients/round, {args.rounds} rounds, seed 1")
    for name, (acc, sec, up) in finals.items():
        print(f"  {name:8s} final accuracy {acc:.4f}   steady-state {sec:.2f} s/round   uplink total {up/1e6:.1f} MB")
    sim = finals["fedams"][1]
    print(f"plain PyTorch loop, same training: {plain:.2f} s/round")
    print(f"overhead ratio (flwr run simulation / plain loop): {sim / plain:.2f}")
    print(f"results folders: {out}")


if __name__ == "__main__":
    main()
