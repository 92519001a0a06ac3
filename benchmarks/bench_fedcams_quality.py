"""Issue 3: quality per byte of FedCAMS on real Fashion-MNIST (IID and Dirichlet(0.5)).

FedAMS, FedCAMS-sign, FedCAMS-top-k (1/64, 1/256) and FedCAMS-sign without error
feedback; same seeds and rounds; 3 seeds. Each run is pollen's real ServerApp and
ClientApp (with ``compression_mod``) in one process (``pollen/testing/inprocess.py``),
so bytes are measured from the records exactly as in a ``flwr run``.

    python benchmarks/bench_fedcams_quality.py [--rounds 20] [--seeds 1 2 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

from pollen.testing.inprocess import run_inprocess

CLIENTS = 100
SETUP = {
    "model": "cnn",
    "fraction-train": 0.1,
    "min-train-nodes": 10,
    "fraction-evaluate": 0.0,
    "min-evaluate-nodes": 0,
    "local-steps": 20,
    "batch-size": 20,
    "local-lr": 0.05,
    "server-lr": 0.1,
    "eps": 0.001,
    "eps-mode": "max",
    "eval-batch-size": 1000,
    "eval-every": 5,
}
METHODS = {
    "FedAMS": {"strategy": "fedams"},
    "FedCAMS sign": {"strategy": "fedcams", "compressor": "sign"},
    "FedCAMS top-k 1/64": {"strategy": "fedcams", "compressor": "topk", "topk-ratio": 1 / 64},
    "FedCAMS top-k 1/256": {"strategy": "fedcams", "compressor": "topk", "topk-ratio": 1 / 256},
    "FedCAMS sign, no EF": {"strategy": "fedcams", "compressor": "sign", "error-feedback": False},
}
PARTITIONS = {"IID": {"partitioner": "iid"}, "Dirichlet(0.5)": {"partitioner": "dirichlet", "dirichlet-alpha": 0.5}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    args = parser.parse_args()
    out = tempfile.mkdtemp(prefix="pollen-fedcams-")
    print(
        f"Fashion-MNIST, {CLIENTS} clients, 10 per round, CNN, K=20 steps of batch 20, eta_l=0.05, "
        f"FedAMS Option 1 eta=0.1 eps=1e-3, {args.rounds} rounds, seeds {args.seeds}"
    )
    print("| partition | method | final accuracy (mean ± sd) | uplink update bytes (total) | vs FedAMS |")
    print("|---|---|---|---|---|")
    for part_name, part in PARTITIONS.items():
        dense_bytes = None
        for name, method in METHODS.items():
            accs, up = [], []
            for seed in args.seeds:
                run = (
                    f"{part_name}-{name}-{seed}".replace(" ", "_")
                    .replace("/", "_")
                    .replace("(", "")
                    .replace(")", "")
                    .replace(",", "")
                )
                rows = run_inprocess(
                    {
                        **SETUP,
                        **part,
                        **method,
                        "seed": seed,
                        "num-server-rounds": args.rounds,
                        "results-dir": out,
                        "run-name": run,
                    },
                    CLIENTS,
                )
                accs.append(rows[-1]["accuracy"])
                up.append(sum(r.get("uplink_update_bytes") or 0 for r in rows))
            mean_up = statistics.mean(up)
            dense_bytes = dense_bytes or mean_up
            spread = statistics.stdev(accs) if len(accs) > 1 else 0.0
            print(
                f"| {part_name} | {name} | {statistics.mean(accs):.4f} ± {spread:.4f} | {mean_up:,.0f} | "
                f"1/{dense_bytes / mean_up:.1f} |",
                flush=True,
            )
    print(f"runs written under {out}")


if __name__ == "__main__":
    main()
