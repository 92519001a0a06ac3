"""Privacy against utility: FedAvg, FedAMS and FedCAMS with central DP at a few epsilons, and without DP.

Every run is pollen's app in-process (:func:`pollen.testing.inprocess.run_inprocess`: the real ServerApp and
ClientApp, one client after another) on real Fashion-MNIST (Debian's ``dataset-fashion-mnist``; the package's
subset where it is missing), ``--clients`` clients (Dirichlet 0.5), ``--per-round`` of them sampled a round
uniformly without replacement, an MLP (no BatchNorm buffers, which central DP refuses), ``--rounds`` rounds of
``--local-steps`` local SGD steps. With DP (``dp=central``) each client's update is clipped to ``--clip`` (the
median update norm of these runs without DP is about 0.28; measured on seed 1 with the same settings), the sum
gets Gaussian noise and is divided by the sample size before the server optimiser; the noise multiplier ``z``
of each target epsilon is the smallest that keeps epsilon (RDP, sampling without replacement, the run's
``--rounds`` releases, delta ``--delta``) at or below it, found here by bisection with pollen's accountant.

Methods, each with the app's defaults otherwise (the settings a user gets; nothing tuned for DP):

- ``fedavg``: ``strategy=fedopt server-optimizer=sgd server-lr=1.0`` (DP-FedAvg);
- ``fedams``: FedAMS (AMSGrad on the server, ``server-lr`` 0.1, ``eps`` 1e-3);
- ``fedcams``: FedCAMS (scaled sign + error feedback; each client clips ``Delta + e`` before compressing).

    python benchmarks/bench_privacy.py                      # the docs' table (about 15 minutes on one core)
    python benchmarks/bench_privacy.py --seeds 1 --epsilons 8   # a quick look
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from pollen.privacy import PrivacyAccountant, PrivacySetting
from pollen.testing.inprocess import run_inprocess

REPORT = Path(__file__).resolve().parent / "reports" / "privacy.json"

METHODS: dict[str, dict[str, Any]] = {
    "fedavg": {"strategy": "fedopt", "server-optimizer": "sgd", "server-lr": 1.0},
    "fedams": {"strategy": "fedams"},
    "fedcams": {"strategy": "fedcams", "compressor": "sign"},
}


def epsilon_of(z: float, args: argparse.Namespace) -> float:
    setting = PrivacySetting(z, args.delta, "without-replacement", population=args.clients, sample_size=args.per_round)
    accountant = PrivacyAccountant(setting)
    accountant.record(args.rounds)
    return accountant.epsilon()


def noise_for(target: float, args: argparse.Namespace) -> float:
    """The smallest noise multiplier (to 3 significant digits) whose epsilon after the run is <= ``target``."""
    low, high = 0.05, 64.0
    if epsilon_of(high, args) > target:
        raise SystemExit(f"epsilon {target} is out of reach with z <= {high}")
    while high - low > 1e-3 * high:
        mid = (low + high) / 2
        low, high = (mid, high) if epsilon_of(mid, args) > target else (low, mid)
    return float(f"{high:.3g}") if epsilon_of(float(f"{high:.3g}"), args) <= target else high


def one_run(method: str, z: float | None, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        settings: dict[str, Any] = {
            **METHODS[method],
            "seed": seed,
            "model": "mlp",
            "num-server-rounds": args.rounds,
            "local-steps": args.local_steps,
            "batch-size": 32,
            "fraction-train": args.per_round / args.clients,
            "min-train-nodes": args.per_round,
            "fraction-evaluate": 0.0,
            "eval-every": args.rounds,
            "test-examples": args.test_examples,
            "results-dir": tmp,
            "run-name": "run",
        }
        if z is not None:
            settings.update({"dp": "central", "dp-clip": args.clip, "dp-noise-multiplier": z, "dp-delta": args.delta})
            settings["dp-noise-seed"] = seed  # reproducible here; a deployment draws from the OS
        started = time.perf_counter()
        rows = run_inprocess(settings, args.clients)
        seconds = time.perf_counter() - started
    last = rows[-1]
    epsilon = last.get("method.dp_epsilon")
    return {
        "method": method,
        "z": z,
        "seed": seed,
        "accuracy": float(last["accuracy"]),
        "epsilon": float(epsilon) if epsilon not in (None, "") else None,
        "clipped_last_round": last.get("method.dp_clipped"),
        "seconds": round(seconds, 1),
    }


def table(runs: list[dict[str, Any]], targets: dict[str, float | None]) -> str:
    lines = [
        "| method | " + " | ".join(targets) + " |",
        "|---|" + "---|" * len(targets),
    ]
    for method in METHODS:
        cells = []
        for z in targets.values():
            accs = [r["accuracy"] for r in runs if r["method"] == method and r["z"] == z]
            if not accs:
                cells.append("")
                continue
            mean = statistics.fmean(accs)
            cells.append(f"{mean:.3f} ({min(accs):.3f}-{max(accs):.3f})")
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 3.0, 8.0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--per-round", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--local-steps", type=int, default=10)
    parser.add_argument("--clip", type=float, default=0.3)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--test-examples", type=int, default=2000)
    parser.add_argument("--json", type=Path, default=REPORT)
    parser.add_argument("--from-json", type=Path, help="print the table of an earlier report")
    args = parser.parse_args()
    if args.from_json:
        report = json.loads(args.from_json.read_text())
        print(table(report["runs"], report["targets"]))
        return
    targets: dict[str, float | None] = {"no DP": None}
    for epsilon in args.epsilons:
        z = noise_for(epsilon, args)
        targets[f"eps {epsilon:g} (z={z:g})"] = z
        print(f"epsilon {epsilon:g}: z = {z:g} (epsilon {epsilon_of(z, args):.3f} after {args.rounds} releases)")
    runs = []
    for method in args.methods:
        for z in targets.values():
            for seed in args.seeds:
                run = one_run(method, z, seed, args)
                runs.append(run)
                print(json.dumps(run), flush=True)
    settings = {k: v for k, v in vars(args).items() if k not in ("json", "from_json")}
    report = {"settings": settings, "targets": targets, "runs": runs}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1, default=str))
    print(table(runs, targets))


if __name__ == "__main__":
    main()
