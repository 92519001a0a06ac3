"""Issue 12: quality per round and per byte of the Fed-LAMB family on real Fashion-MNIST.

Fed-LAMB, Mime-LAMB, Fed-AMS, Mime, Adp-Fed and Fed-SGD (spec ``papers/fedlamb.md`` §8.10-8.12),
IID and non-IID (class-pure shards, 2 per client: 1-2 classes each), the CNN, 50 clients, half per
round, batch 128, one local epoch. Each run is pollen's real ServerApp and ClientApp in one process
(``pollen/testing/inprocess.py``), so bytes are measured from the records as in a ``flwr run``.

Three stages, each resumable (a finished run is read back from ``--out``, not redone):

- ``grid``: every learning rate of the method's mini-grid (Table 2 of the paper, spec §8.10), IID, seed 1;
- ``seeds``: each method's best IID rate (by final accuracy in the grid), IID and non-IID, seeds 1-3;
- ``skip``: Fed-LAMB at that rate, non-IID, with Z in {1, 3, 5}, seed 1 (``--skip-seeds`` for more).

    python benchmarks/bench_fedlamb_quality.py --stage grid seeds skip [--rounds 8] [--out DIR] [--jobs 2]

Longer runs can take their rates from a finished shorter grid instead of running the grid again:
``--rounds 20 --out DIR20 --grid-out DIR8 --grid-rounds 8 --stage seeds``.

Scaled down from the paper for a 2-core CPU (a 20-round run takes 4-7 minutes here, Mime's twice
the gradient evaluations being the slow end): Fashion-MNIST only (MNIST is not on this machine), a
static partition (the paper re-deals the data every round, §9 E1), the test set read every 2 rounds,
2 rates per method chosen on IID only. The README's table: the grid at 8 rounds, the seeds and skip
stages at 20 (the paper: 20-50).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from pollen.testing.inprocess import run_inprocess, run_parallel

CLIENTS = 50
SETUP = {
    "dataset": "fashion-mnist",
    "model": "cnn",
    "fraction-train": 0.5,
    "min-train-nodes": 25,
    "fraction-evaluate": 0.0,
    "min-evaluate-nodes": 0,
    "local-epochs": 1,
    "local-steps": 0,
    "batch-size": 128,
    "val-fraction": 0.0,
    "beta-1": 0.9,
    "beta-2": 0.999,
    "eps": 1e-8,
    "weight-decay": 0.0,
    "momentum": 0.0,
    "eval-batch-size": 2000,
    "eval-every": 2,
}
#: Two rates per method from the spec's mini-grid (§8.10; the upper two, or Adp-Fed's larger local
#: rate with both server rates): what a 2-core CPU affords.
GRID = {
    "fed-lamb": [{"local-lr": lr} for lr in (0.01, 0.03)],
    "mime-lamb": [{"local-lr": lr} for lr in (0.01, 0.03)],
    "fed-ams": [{"local-lr": lr} for lr in (3e-4, 1e-3)],
    "mime": [{"local-lr": lr} for lr in (3e-4, 1e-3)],
    "adp-fed": [{"local-lr": 0.1, "server-lr": s} for s in (0.001, 0.01)],
    "fed-sgd": [{"local-lr": lr} for lr in (0.03, 0.1)],
}
PARTITIONS = {
    "IID": {"partitioner": "iid"},
    "non-IID (2 shards)": {"partitioner": "shards", "shards-per-partition": 2},
}
SEEDS = (1, 2, 3)
#: Run-config switches that choose a reading, named in the run names (not a rate).
READINGS = ("round1-denominator", "mime-server-v")
TARGETS = (0.80, 0.85, 0.90)


def run_name(method: str, part: str, rates: dict, seed: int, z: int = 1) -> str:
    rate = "_".join(f"{k}={v:g}" for k, v in sorted(rates.items()) if k not in READINGS)
    reading = f"-r1{rates['round1-denominator']}" if "round1-denominator" in rates else ""
    reading += f"-v{rates['mime-server-v']}" if "mime-server-v" in rates else ""
    return f"{method}-{part.split()[0]}-{rate}-z{z}-s{seed}{reading}"


REPORT_ONLY = False  # --report-only: tables from the finished runs, nothing new is run


def run_once(out: Path, rounds: int, method: str, part: str, rates: dict, seed: int, z: int = 1) -> list[dict] | None:
    """One run's rows, from ``out`` when it finished before (``None`` for a missing run with --report-only)."""
    name = run_name(method, part, rates, seed, z)
    done = out / name / "metrics.json"
    if done.is_file():
        rows = json.loads(done.read_text())["rows"]
        if rows and rows[-1]["round"] == rounds:
            return rows
    if REPORT_ONLY:
        return None
    started = time.perf_counter()
    overrides = {
        **SETUP,
        **PARTITIONS[part],
        **rates,
        "strategy": method,
        "seed": seed,
        "sync-every": z,
        "num-server-rounds": rounds,
        "results-dir": str(out),
        "run-name": name,
    }
    rows = run_inprocess(overrides, CLIENTS)
    print(f"  {name}: final {rows[-1]['accuracy']:.4f} in {time.perf_counter() - started:.0f} s", flush=True)
    return rows


def rounds_to(rows: list[dict], target: float) -> int | None:
    return next((r["round"] for r in rows if r["round"] > 0 and (r["accuracy"] or 0) >= target), None)  # read every 2


def best_rates(out: Path, rounds: int, jobs: int = 1) -> dict[tuple[str, str], dict]:
    """Each method's rate with the highest final IID accuracy at seed 1 (used for both partitions)."""
    if not REPORT_ONLY:
        run_parallel(run_once, [(out, rounds, m, "IID", rates, 1) for m, grid in GRID.items() for rates in grid], jobs)
    best = {}
    for method, grid in GRID.items():
        runs = [(run_once(out, rounds, method, "IID", rates, 1), i) for i, rates in enumerate(grid)]
        finals = [(rows[-1]["accuracy"], i) for rows, i in runs if rows is not None]
        if not finals:
            continue
        for part in PARTITIONS:
            best[(method, part)] = grid[max(finals)[1]]
    return best


def mean_sd(values: list[float]) -> str:
    return f"{statistics.mean(values):.4f} ± {statistics.stdev(values) if len(values) > 1 else 0.0:.4f}"


def fmt_rounds(values: list[int | None], rounds: int) -> str:
    hits = [v for v in values if v is not None]
    missed = len(values) - len(hits)
    text = f"{statistics.mean(hits):.1f}" if hits else f">{rounds}"
    return text + (f" ({missed} of {len(values)} never)" if missed and hits else "")


def print_grid(out: Path, rounds: int) -> None:
    print("\n| partition | method | rate(s) | final accuracy (seed 1) | best accuracy |")
    print("|---|---|---|---|---|")
    for part in ("IID",):
        for method, grid in GRID.items():
            for rates in grid:
                rows = run_once(out, rounds, method, part, rates, 1)
                if rows is None:
                    continue
                rate = ", ".join(f"{k} {v:g}" if not isinstance(v, str) else f"{k} {v}" for k, v in rates.items())
                print(
                    f"| {part} | {method} | {rate} | {rows[-1]['accuracy']:.4f} | "
                    f"{max(r['accuracy'] or 0 for r in rows):.4f} |"
                )


def print_seeds(out: Path, rounds: int, best: dict, jobs: int = 1) -> None:
    # seed-major: an interrupted sweep still has every method on the first seeds
    calls = [
        (out, rounds, method, part, best[(method, part)], seed)
        for seed in SEEDS
        for part in PARTITIONS
        for method in GRID
        if (method, part) in best
    ]
    if not REPORT_ONLY:
        run_parallel(run_once, calls, jobs)
    checkpoints = sorted(
        {r for r in (2, 4, 6, 8, 10, 15, 20, 30, 40) if r <= rounds and r % SETUP["eval-every"] == 0} | {rounds}
    )
    head = " | ".join(f"acc @ {r}" for r in checkpoints)
    print(
        f"\n| partition | method | rate(s) | {head} | rounds to 80% | rounds to 85% | rounds to 90% | "
        "up MB/round | down MB/round | grad evals/round | seeds |"
    )
    print("|---|---|---|" + "---|" * len(checkpoints) + "---|---|---|---|---|---|---|")
    for part in PARTITIONS:
        for method in GRID:
            if (method, part) not in best:
                continue
            rates = best[(method, part)]
            runs = [run for run in (run_once(out, rounds, method, part, rates, s) for s in SEEDS) if run is not None]
            if not runs:
                continue
            accs = " | ".join(mean_sd([run[c]["accuracy"] for run in runs]) for c in checkpoints)
            to = [fmt_rounds([rounds_to(run, t) for run in runs], rounds) for t in TARGETS]
            up = statistics.mean(sum(r.get("uplink_bytes") or 0 for r in run) for run in runs) / rounds / 1e6
            down = statistics.mean(sum(r.get("downlink_bytes") or 0 for r in run) for run in runs) / rounds / 1e6
            evals = statistics.mean(sum(r.get("grad_evals") or 0 for r in run) for run in runs) / rounds
            rate = ", ".join(f"{k} {v:g}" if not isinstance(v, str) else f"{k} {v}" for k, v in rates.items())
            print(
                f"| {part} | {method} | {rate} | {accs} | {to[0]} | {to[1]} | {to[2]} | "
                f"{up:.2f} | {down:.2f} | {evals:.0f} | {len(runs)} |",
                flush=True,
            )


def plot_seed_one(out: Path, rounds: int, best: dict, plots: Path) -> None:
    """Accuracy vs round and vs bytes (``pollen-compare``'s plots), seed 1, one folder per partition."""
    from pollen.app.results import plot_runs

    for part in PARTITIONS:
        runs = {}
        for method in GRID:
            rows = run_once(out, rounds, method, part, best[(method, part)], 1) if (method, part) in best else None
            if rows is not None:
                runs[method] = rows
        if runs:
            folder = plots / part.split()[0]
            folder.mkdir(parents=True, exist_ok=True)
            paths = plot_runs(runs, folder)
            print(f"plots ({part}, seed 1): {', '.join(str(p) for p in paths)}")


def print_skip(out: Path, rounds: int, best: dict, seeds: tuple[int, ...], jobs: int = 1) -> None:
    part = "non-IID (2 shards)"
    if not REPORT_ONLY:
        calls = [(out, rounds, "fed-lamb", part, best[("fed-lamb", part)], s, z) for s in seeds for z in (1, 3, 5)]
        run_parallel(run_once, calls, jobs)
    print(
        f"\n| method ({part}) | Z | final accuracy | statistic uploads (MB, total) | uplink MB total | "
        "v_hat downlink MB total |"
    )
    print("|---|---|---|---|---|---|")
    for method, stat in (("fed-lamb", "pollen.x.v"),):
        for z in (1, 3, 5):
            runs = [
                run
                for run in (run_once(out, rounds, method, part, best[(method, part)], s, z) for s in seeds)
                if run is not None
            ]
            if not runs:
                continue
            stat_mb = (
                statistics.mean(sum((r.get("uplink_by_record") or {}).get(stat, 0) for r in run) for run in runs) / 1e6
            )
            up = statistics.mean(sum(r.get("uplink_bytes") or 0 for r in run) for run in runs) / 1e6
            v_hat = (
                statistics.mean(
                    sum((r.get("downlink_by_record") or {}).get("pollen.x.v_hat", 0) for r in run) for run in runs
                )
                / 1e6
            )
            print(
                f"| {method} | {z} | {mean_sd([run[-1]['accuracy'] for run in runs])} | "
                f"{stat_mb:.1f} | {up:.1f} | {v_hat:.1f} |",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", nargs="+", choices=("grid", "seeds", "skip"), default=["grid", "seeds", "skip"])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--out", default="/tmp/pollen-fedlamb-quality")
    parser.add_argument("--skip-seeds", type=int, nargs="+", default=[1])
    parser.add_argument("--grid-out", default=None, help="the grid's runs (default: --out)")
    parser.add_argument("--grid-rounds", type=int, default=None, help="rounds of the grid's runs (default: --rounds)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once, one process and one torch thread each")
    parser.add_argument("--report-only", action="store_true", help="print the tables of the finished runs only")
    parser.add_argument(
        "--plots", default=None, help="folder for the seed-1 plots of the seeds stage (default: OUT/plots)"
    )
    parser.add_argument("--methods", nargs="+", choices=tuple(GRID), default=None, help="only these methods")
    parser.add_argument(
        "--round1",
        choices=("local-v", "eps"),
        default=None,
        help="run-config round1-denominator for every run (default: each method's own; named in the run names)",
    )
    parser.add_argument(
        "--mime-server-v",
        choices=("plain", "bias-corrected"),
        default=None,
        help="run-config mime-server-v for Mime's and Mime-LAMB's runs (default: each method's own; in the names)",
    )
    args = parser.parse_args()
    global REPORT_ONLY
    REPORT_ONLY = args.report_only
    for method in [m for m in GRID if args.methods and m not in args.methods]:
        del GRID[method]
    if args.round1 is not None:
        for grid in GRID.values():
            for rates in grid:
                rates["round1-denominator"] = args.round1
    if args.mime_server_v is not None:
        for method in ("mime", "mime-lamb"):
            for rates in GRID.get(method, ()):
                rates["mime-server-v"] = args.mime_server_v
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(
        f"Fashion-MNIST, {CLIENTS} clients, half per round, CNN, 1 local epoch of batch 128, {args.rounds} rounds; "
        f"beta 0.9/0.999, eps 1e-8, no weight decay; runs in {out}",
        flush=True,
    )
    grid_out = Path(args.grid_out) if args.grid_out else out
    grid_rounds = args.grid_rounds or args.rounds
    best = best_rates(grid_out, grid_rounds, args.jobs)
    if "grid" in args.stage:
        print_grid(grid_out, grid_rounds)
    if "seeds" in args.stage:
        print_seeds(out, args.rounds, best, args.jobs)
        plot_seed_one(out, args.rounds, best, Path(args.plots) if args.plots else out / "plots")
    if "skip" in args.stage:
        print_skip(out, args.rounds, best, tuple(args.skip_seeds), args.jobs)


if __name__ == "__main__":
    main()
