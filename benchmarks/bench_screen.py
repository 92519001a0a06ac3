"""The outlier screen on honest runs: false rejections and accuracy, screen on vs off.

Real Fashion-MNIST (Debian's files when installed), 20 clients, Dirichlet(0.5), the papers' CNN, 10
clients per round, K = 20 local steps, FedAMS and FedCAMS (scaled sign), 20 rounds, seeds 1 and 2;
pollen's real ServerApp and ClientApp in one process (``pollen/testing/inprocess.py``). Prints the
final accuracy with ``outlier-rule=reject`` (the default) and ``off``, and how many honest replies
the screen rejected.

Run: ``python benchmarks/bench_screen.py [--rounds 20] [--seeds 1 2] [--mime]``.
"""

from __future__ import annotations

import argparse
import tempfile

from pollen.testing.inprocess import run_inprocess  # noqa: E402

COMMON = {
    "partitioner": "dirichlet",
    "dirichlet-alpha": 0.5,
    "model": "cnn",
    "fraction-train": 0.5,
    "min-train-nodes": 10,
    "fraction-evaluate": 0.0,
    "min-evaluate-nodes": 0,
    "local-steps": 20,
    "batch-size": 32,
    "local-lr": 0.05,
    "server-lr": 0.1,
    "eval-every": 5,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--seeds", type=int, nargs="*", default=[1, 2])
    parser.add_argument(
        "--mime",
        action="store_true",
        help="Mime instead (both server-v readings, the fedlamb preset's local-lr 3e-4, batch 128): the run "
        "whose honest steps grow ~30x from round 1 to 2",
    )
    args = parser.parse_args()
    runs = (("fedams", {}), ("fedcams", {"compressor": "sign"}))
    if args.mime:
        mime = {"local-lr": 0.0003, "batch-size": 128, "local-steps": 10}
        runs = (("mime", {**mime, "mime-server-v": "plain"}), ("mime", {**mime, "mime-server-v": "bias-corrected"}))
    print(f"{'strategy':<14} {'seed':>4} {'screen':>7} {'final acc':>9} {'rejected':>8} {'replies':>8}")
    with tempfile.TemporaryDirectory() as tmp:
        for strategy, extra in runs:
            for seed in args.seeds:
                for rule in ("reject", "off"):
                    rows = run_inprocess(
                        {
                            **COMMON,
                            **extra,
                            "strategy": strategy,
                            "seed": seed,
                            "outlier-rule": rule,
                            "num-server-rounds": args.rounds,
                            "results-dir": tmp,
                            "run-name": f"{strategy}-{seed}-{rule}-{len(extra)}",
                        },
                        num_nodes=20,
                    )
                    rejected = sum(int(r.get("failures") or 0) for r in rows[1:])
                    replies = sum(int(r.get("replies") or 0) for r in rows[1:])
                    print(
                        f"{strategy:<14} {seed:>4} {rule:>7} {rows[-1]['accuracy']:>9.4f} {rejected:>8} {replies:>8}",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
