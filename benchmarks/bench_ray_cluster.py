"""One Ray node against a two-node Ray cluster: seconds per round and equality of the final models.

``flwr run`` of pollen's app (the testing variant, which notes where each message ran) on Flower's local
simulation (one Ray node, two workers of one CPU each) and on a two-node Ray cluster on 127.0.0.1 (two
raylets of one CPU each, :class:`pollen.app.ray_cluster.LocalRayCluster`; the SuperLink joins it through
``RAY_ADDRESS``). Stateful methods: FedCAMS sign with error feedback, FedBNLACA (top-k both ways, state on
both sides). The CNN on Fashion-MNIST, ``--clients`` clients all sampled every round, 20 local steps.

    python benchmarks/bench_ray_cluster.py [--rounds 6] [--clients 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import numpy as np

from pollen.app.ray_cluster import LocalRayCluster
from pollen.testing.flwr_cli import LocalFlower
from pollen.testing.placement import read_placements

METHODS = {"FedCAMS sign + EF": {"strategy": "fedcams", "compressor": "sign"}, "FedBNLACA": {"strategy": "fedbnlaca"}}


def run_all(flower: LocalFlower, folder: Path, rounds: int, clients: int) -> dict[str, tuple[list[float], Path, int]]:
    out = {}
    for label, method in METHODS.items():
        name = method["strategy"]
        trace = folder / "trace" / name
        trace.mkdir(parents=True)
        config = {
            "num-server-rounds": rounds,
            "local-steps": 20,
            "batch-size": 32,
            "model": "cnn",
            "partitioner": "iid",
            "fraction-train": 1.0,
            "fraction-evaluate": 0.0,
            "min-evaluate-nodes": 0,
            "eval-every": rounds,
            **method,
            "results-dir": str(folder / "results"),
            "run-name": name,
            "trace-dir": str(trace),
        }
        proc = flower.run(config, num_supernodes=clients, variant="testing", client_cpus=1, timeout=1800)
        assert proc.returncode == 0, proc.stderr[-2000:]
        rows = json.loads((folder / "results" / name / "metrics.json").read_text())["rows"]
        nodes = len({p["ray_node"] for p in read_placements(trace)})
        out[label] = ([row["round_seconds"] for row in rows if row["round"] >= 2], folder / "results" / name, nodes)
    return out


def same(first: Path, second: Path) -> bool:
    a, b = np.load(first / "final_model.npz"), np.load(second / "final_model.npz")
    return sorted(a.files) == sorted(b.files) and all(a[k].tobytes() == b[k].tobytes() for k in a.files)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--clients", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pollen-ray-bench-") as tmp:
        folder = Path(tmp)
        flower = LocalFlower(folder / "home-one")
        try:
            one = run_all(flower, folder / "one", args.rounds, args.clients)
        finally:
            flower.stop()
        with LocalRayCluster(nodes=2, cpus_per_node=1) as cluster:
            flower = LocalFlower(folder / "home-two", extra_env=cluster.env)
            try:
                two = run_all(flower, folder / "two", args.rounds, args.clients)
            finally:
                flower.stop()
        print(f"{args.clients} clients, all sampled, {args.rounds} rounds, CNN, 20 local steps; rounds 2+ (median)")
        print("| method | one node: s / round | two nodes: s / round | Ray nodes used (one / two) | final model |")
        print("|---|---|---|---|---|")
        for label in METHODS:
            (s1, p1, n1), (s2, p2, n2) = one[label], two[label]
            equal = "bit-identical" if same(p1, p2) else "DIFFERENT"
            print(
                f"| {label} | {statistics.median(s1):.2f} | {statistics.median(s2):.2f} | {n1} / {n2} | {equal} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
