"""Synchronous vs asynchronous aggregation under stragglers, on the same clients and the same virtual clock.

Every run is pollen's app in-process (:func:`pollen.testing.inprocess.run_inprocess`: the real ServerApp and
ClientApp, one client after another) on real Fashion-MNIST (Debian's ``dataset-fashion-mnist``), non-IID
(Dirichlet 0.5), an MLP, ``--clients`` clients. Each client's job durations come from one seeded speed model
(``client-speed=stragglers:<p>:5:10``: a fraction ``p`` of the clients 5-10x slower), and both drivers run on
it: a synchronous round lasts as long as its slowest sampled client; an asynchronous step happens when its
buffer fills. Every run is given the same number of client jobs (``--jobs``), so what differs is how long they
take on the virtual clock and what the server makes of them.

Reported per method and straggler fraction, mean and spread over seeds: the virtual time and the server
steps to reach ``--target`` test accuracy (on a fixed test subset, evaluated every step), the bytes each way
until then, and the final accuracy. Methods (the defaults of each unless named):

- ``fedams-sync``: FedAMS, ``--per-round`` clients a round;
- ``fadas``: FedAMS on the async driver, FADAS rule (buffer mean, delay-adaptive lr), concurrency
  ``--per-round``, buffer ``--buffer``;
- ``fedbuff``: FedOpt with a server SGD of lr 1, FedBuff's 1/sqrt(1+tau) weights, the same buffer;
- ``fedasync``: FedOpt with a server SGD of lr 1, FedAsync's mixing (alpha 0.9 x 1/sqrt(1+tau)), buffer 1;
- ``fedcams-sync`` / ``fedcams-async``: FedCAMS (scaled sign + error feedback), sync and FADAS-async.

    python benchmarks/bench_async_stragglers.py                       # the docs' numbers (about 15 minutes)
    python benchmarks/bench_async_stragglers.py --seeds 1 --fractions 0.2 --jobs 100   # a quick look
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from pollen.testing.inprocess import run_inprocess

REPORT = Path(__file__).resolve().parent / "reports" / "async_stragglers.json"


def methods(per_round: int, buffer: int) -> dict[str, dict[str, Any]]:
    sgd = {"strategy": "fedopt", "server-optimizer": "sgd", "server-lr": 1.0}
    async_ = {"driver": "async", "concurrency": per_round, "buffer-size": buffer}
    return {
        "fedams-sync": {"strategy": "fedams"},
        "fadas": {"strategy": "fedams", **async_, "async-rule": "fadas"},
        "fedbuff": {**sgd, **async_, "async-rule": "fedbuff"},
        "fedasync": {**sgd, **async_, "async-rule": "fedasync", "buffer-size": 1},
        "fedcams-sync": {"strategy": "fedcams", "compressor": "sign"},
        "fedcams-async": {"strategy": "fedcams", "compressor": "sign", **async_, "async-rule": "fadas"},
    }


def one_run(name: str, method: dict[str, Any], args: argparse.Namespace, fraction: float, seed: int) -> dict:
    per_step = method.get("buffer-size", args.per_round) if method.get("driver") == "async" else args.per_round
    steps = max(1, args.jobs // per_step)
    with tempfile.TemporaryDirectory() as tmp:
        settings = {
            **method,
            "seed": seed,
            "num-server-rounds": steps,
            "model": "mlp",
            "partitioner": "dirichlet",
            "dirichlet-alpha": 0.5,
            "local-steps": args.local_steps,
            "batch-size": 32,
            "fraction-train": args.per_round / args.clients,
            "min-train-nodes": args.per_round,
            "fraction-evaluate": 0.0,
            "min-evaluate-nodes": 0,
            "eval-every": 1,
            "eval-batch-size": 1000,
            "test-examples": args.test_examples,
            "client-speed": f"stragglers:{fraction}:5:10",
            "results-dir": tmp,
            "run-name": name,
        }
        started = time.perf_counter()
        rows = run_inprocess(settings, args.clients)[1:]
        seconds = time.perf_counter() - started
    hit = next((row for row in rows if isinstance(row.get("accuracy"), float) and row["accuracy"] >= args.target), None)
    return {
        "method": name,
        "stragglers": fraction,
        "seed": seed,
        "steps": len(rows),
        "final_accuracy": rows[-1]["accuracy"],
        "reached": hit is not None,
        "virtual_time_to_target": hit["method.async_virtual_time"] if hit else None,
        "steps_to_target": hit["round"] if hit else None,
        "uplink_bytes_to_target": hit["cum_uplink_bytes"] if hit else None,
        "downlink_bytes_to_target": hit["cum_downlink_bytes"] if hit else None,
        "virtual_time_total": rows[-1]["method.async_virtual_time"],
        "wall_seconds": seconds,
    }


def spread(values: list[float]) -> str:
    if not values:
        return "-"
    mean = statistics.fmean(values)
    return f"{mean:.4g} ± {statistics.pstdev(values):.2g}" if len(values) > 1 else f"{mean:.4g}"


def table(results: list[dict], target: float) -> str:
    lines = [
        f"| method | stragglers | reached {target:.2f} | virtual time to it | steps to it | uplink MB to it | "
        "final accuracy |",
        "|---|---|---|---|---|---|---|",
    ]
    keys = sorted(
        {(r["stragglers"], r["method"]) for r in results}, key=lambda k: (k[0], list(METHOD_ORDER).index(k[1]))
    )
    for fraction, name in keys:
        runs = [r for r in results if r["method"] == name and r["stragglers"] == fraction]
        hits = [r for r in runs if r["reached"]]
        lines.append(
            f"| {name} | {fraction:.0%} | {len(hits)}/{len(runs)} | "
            f"{spread([r['virtual_time_to_target'] for r in hits])} | {spread([r['steps_to_target'] for r in hits])} | "
            f"{spread([r['uplink_bytes_to_target'] / 1e6 for r in hits])} | "
            f"{spread([r['final_accuracy'] for r in runs])} |"
        )
    return "\n".join(lines)


METHOD_ORDER = ("fedams-sync", "fadas", "fedbuff", "fedasync", "fedcams-sync", "fedcams-async")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--per-round", type=int, default=10)
    parser.add_argument("--buffer", type=int, default=5)
    parser.add_argument("--jobs", type=int, default=300)
    parser.add_argument("--local-steps", type=int, default=5)
    parser.add_argument("--test-examples", type=int, default=1000)
    parser.add_argument("--target", type=float, default=0.65)
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.0, 0.2, 0.5])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--only", nargs="+", default=list(METHOD_ORDER))
    parser.add_argument("--out", type=Path, default=REPORT)
    args = parser.parse_args()
    results = []
    for fraction in args.fractions:
        for name, method in methods(args.per_round, args.buffer).items():
            if name not in args.only:
                continue
            for seed in args.seeds:
                result = one_run(name, method, args, fraction, seed)
                results.append(result)
                print(json.dumps(result), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"settings": vars(args) | {"out": str(args.out)}, "runs": results}, indent=1))
    print()
    print(table(results, args.target))


if __name__ == "__main__":
    main()
