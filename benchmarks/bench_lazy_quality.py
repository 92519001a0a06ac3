"""Issue 13: what lazy / accelerated aggregation and a compressed downlink give on real Fashion-MNIST.

The spec's CPU setting (``papers/fedbaca.md`` §9-10): 100 clients with 600 images each (IID), 50 sampled per
round, 3 local epochs of batch 32 at eta_l = 0.01, server FedAMS Option A (eta = 0.1, eps = 1e-3 as a floor,
beta 0.9 / 0.99, no bias correction), top-k over the whole model, applied error feedback, the downlink's
increment reading, bytes as they cross the wire (pollen's codecs: top-k sends k float32 values and k int32
indices, the model's metadata and the record framing). Runs are pollen's real ServerApp and ClientApp in one
process (``pollen/testing/inprocess.py``); each is resumable (a finished run is read back, not redone).

Methods (``CONFIGS``): FedAMS, FedCAMS (top-k 1/8, 1/128), FedNLAA / FedAA at the thresholds the spec's
calibration found to fire (tau = 0.25, 0.5), FedNLACA / FedACA at 1/8 with tau = 1.1 / 1.2, the compressed
downlink alone (FedBNLACA with both thresholds 0 = FedCAMS + error-fed downlink: up 1/128 with down 1/8, and
1/128 both ways), and FedBNLACA / FedBACA with up 1/128 tau 1.4, down 1/8 tau 0.65.

With ``--rel``, runs at threshold 0 (nothing fires) record the relative change ``||cand - ref|| / ||ref||``
of every upload and downlink increment against its reference, and a table shows their quantiles and the share
at or below each threshold: what a threshold would make fire. Two are runs of their own (FedNLAA and FedNLACA
1/8 at 0: the FedAMS and FedCAMS runs are not lazy and record nothing); the two downlink ones are the tau-0
FedBNLACA runs of the main table, run again if they finished before the relative changes were recorded.

Tables: final and best accuracy (mean +- sd over seeds), cumulative uplink / downlink / total MB, the share of
uploads skipped or merged and of downlinks skipped or merged, and with a compressed downlink how far the
clients' copies lag behind the server's model at the end (median ``||theta - x_i|| / ||theta||``, mean over
seeds). Plots (seed 1): accuracy vs round, uplink, downlink and total bytes, drawn by
``pollen.app.results.plot_runs`` (``pollen-compare``'s engine).

    python benchmarks/bench_lazy_quality.py [--model mlp|cnn] [--rounds 20] [--seeds 1 2 3] [--rel] [--out DIR]
                                            [--report-only] [--jobs 2]

An MLP run of 20 rounds takes about 45 s here, a CNN run about 14 minutes (3 local epochs of 19 steps for
50 clients a round: 57 CNN steps per client).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from functools import partial
from pathlib import Path

from pollen.testing.inprocess import run_inprocess, run_parallel

CLIENTS = 100
SETUP = {
    "dataset": "fashion-mnist",
    "partitioner": "iid",
    "val-fraction": 0.0,
    "fraction-train": 0.5,
    "min-train-nodes": 50,
    "fraction-evaluate": 0.0,
    "min-evaluate-nodes": 0,
    "local-epochs": 3,
    "batch-size": 32,
    "local-lr": 0.01,
    "momentum": 0.0,
    "server-lr": 0.1,
    "beta-1": 0.9,
    "beta-2": 0.99,
    "eps": 1e-3,
    "eps-mode": "max",
    "bias-correction": False,
    "error-feedback": True,
    "ef-mode": "applied",
    "downlink-mode": "increment",
    "compression-granularity": "model",
    "eval-batch-size": 2000,
    "eval-every": 1,
}
CONFIGS = {  # label: run-config
    "FedAMS": {"strategy": "fedams"},
    "FedCAMS top-k 1/8": {"strategy": "fedcams", "compressor": "topk", "topk-ratio": 1 / 8},
    "FedCAMS top-k 1/128": {"strategy": "fedcams", "compressor": "topk", "topk-ratio": 1 / 128},
    "FedNLAA tau 0.25": {"strategy": "fednlaa", "tau-up": 0.25},
    "FedNLAA tau 0.5": {"strategy": "fednlaa", "tau-up": 0.5},
    "FedAA tau 0.5": {"strategy": "fedaa", "tau-up": 0.5},
    "FedNLACA 1/8 tau 1.1": {"strategy": "fednlaca", "compressor": "topk", "topk-ratio": 1 / 8, "tau-up": 1.1},
    "FedACA 1/8 tau 1.2": {"strategy": "fedaca", "compressor": "topk", "topk-ratio": 1 / 8, "tau-up": 1.2},
    "up 1/128 + down 1/8 (FedBNLACA tau 0)": {
        "strategy": "fedbnlaca",
        "compressor": "topk",
        "topk-ratio": 1 / 128,
        "compressor-down": "topk",
        "topk-ratio-down": 1 / 8,
    },
    "up 1/128 + down 1/128 (FedBNLACA tau 0)": {
        "strategy": "fedbnlaca",
        "compressor": "topk",
        "topk-ratio": 1 / 128,
        "compressor-down": "topk",
        "topk-ratio-down": 1 / 128,
    },
    "FedBNLACA up 1/128 tau 1.4, down 1/8 tau 0.65": {
        "strategy": "fedbnlaca",
        "compressor": "topk",
        "topk-ratio": 1 / 128,
        "tau-up": 1.4,
        "compressor-down": "topk",
        "topk-ratio-down": 1 / 8,
        "tau-down": 0.65,
    },
    "FedBACA up 1/128 tau 1.4, down 1/8 tau 0.65": {
        "strategy": "fedbaca",
        "compressor": "topk",
        "topk-ratio": 1 / 128,
        "tau-up": 1.4,
        "compressor-down": "topk",
        "topk-ratio-down": 1 / 8,
        "tau-down": 0.65,
    },
    # The app's defaults (pollen/app/methods/lazy.py TAUS): no tau given, each method's own threshold.
    "FedNLAA (defaults)": {"strategy": "fednlaa"},
    "FedAA (defaults)": {"strategy": "fedaa"},
    "FedNLACA 1/8 (defaults)": {"strategy": "fednlaca", "compressor": "topk", "topk-ratio": 1 / 8},
    "FedACA 1/8 (defaults)": {"strategy": "fedaca", "compressor": "topk", "topk-ratio": 1 / 8},
    "FedBNLACA up 1/128, down 1/8 (defaults)": {
        "strategy": "fedbnlaca",
        "compressor": "topk",
        "topk-ratio": 1 / 128,
        "compressor-down": "topk",
        "topk-ratio-down": 1 / 8,
    },
    "FedBACA up 1/128, down 1/8 (defaults)": {
        "strategy": "fedbaca",
        "compressor": "topk",
        "topk-ratio": 1 / 128,
        "compressor-down": "topk",
        "topk-ratio-down": 1 / 8,
    },
}


#: Runs only the ``--rel`` table needs (threshold 0; FedAMS and FedCAMS record no relative changes).
REL_ONLY_CONFIGS = {
    "rel: uncompressed uploads": {"strategy": "fednlaa"},
    "rel: uploads top-k 1/8": {"strategy": "fednlaca", "compressor": "topk", "topk-ratio": 1 / 8},
}
#: The ``--rel`` table: label of a threshold-0 run -> [(direction, what its relative changes are)].
REL_TABLE = {
    "rel: uncompressed uploads": [("up", "uplink, uncompressed")],
    "rel: uploads top-k 1/8": [("up", "uplink, top-k 1/8 + EF")],
    "up 1/128 + down 1/8 (FedBNLACA tau 0)": [
        ("up", "uplink, top-k 1/128 + EF"),
        ("down", "downlink increments, top-k 1/8"),
    ],
    "up 1/128 + down 1/128 (FedBNLACA tau 0)": [("down", "downlink increments, top-k 1/128")],
}
RUN_CONFIGS = {**CONFIGS, **REL_ONLY_CONFIGS}
TAUS = (0.1, 0.25, 0.5, 0.65, 1.0, 1.1, 1.2, 1.3, 1.4, 1.5)


def rel_table(out: Path, model: str, rounds: int, seeds: list[int], report_only: bool, jobs: int) -> None:
    """Quantiles of the relative changes at threshold 0 and the share at or below each threshold."""
    import numpy as np

    if not report_only:
        calls = [
            (out, label, model, rounds, seed)
            for seed in seeds
            for label in REL_TABLE
            if finished_rows(out, run_name(label, model, seed), rounds, with_rel=True) is None
        ]
        run_parallel(partial(run_once, report_only=False, with_rel=True), calls, jobs)
    print(
        f"\n| {model}: what the rules compare (threshold 0, nothing fires) | values | rel 10% / 50% / 90% | "
        + " | ".join(f"<= {tau:g}" for tau in TAUS)
        + " |"
    )
    print("|---|---|---|" + "---|" * len(TAUS))
    for label, directions in REL_TABLE.items():
        runs = [
            rows for seed in seeds if (rows := finished_rows(out, run_name(label, model, seed), rounds, with_rel=True))
        ]
        for direction, what in directions:
            values = np.array(
                [v for rows in runs for row in rows for v in (counter(row, "lazy_rel") or {}).get(direction, [])]
            )
            if values.size == 0:
                continue
            q = np.quantile(values, [0.1, 0.5, 0.9])
            shares = " | ".join(f"{np.mean(values <= tau):.0%}" for tau in TAUS)
            print(f"| {what} | {values.size} | {q[0]:.2f} / {q[1]:.2f} / {q[2]:.2f} | {shares} |", flush=True)


def counter(row: dict, name: str) -> object:
    """A method counter of a results row: column ``method.<name>``
    (``<name>`` in results written before those columns)."""
    return row.get(f"method.{name}", row.get(name))


def run_name(label: str, model: str, seed: int) -> str:
    slug = "".join(ch if ch.isalnum() else "-" for ch in label.lower()).strip("-")
    while "--" in slug:
        slug = slug.replace("--", "-")
    return f"{model}-{slug}-s{seed}"


def finished_rows(out: Path, name: str, rounds: int, *, with_rel: bool = False) -> list[dict] | None:
    """The rows of a run that reached ``rounds``, or None (not started, cut short or of another length; with
    ``with_rel``, also a run from before the relative changes were recorded)."""
    done = out / name / "metrics.json"
    if done.is_file():
        rows = json.loads(done.read_text())["rows"]
        if rows and rows[-1]["round"] == rounds and (not with_rel or counter(rows[-1], "lazy_rel") is not None):
            return rows
    return None


def run_once(
    out: Path, label: str, model: str, rounds: int, seed: int, *, report_only: bool, with_rel: bool = False
) -> list[dict] | None:
    name = run_name(label, model, seed)
    rows = finished_rows(out, name, rounds, with_rel=with_rel)
    if rows is not None or report_only:
        return rows
    started = time.perf_counter()
    rows = run_inprocess(
        {
            **SETUP,
            **RUN_CONFIGS[label],
            "model": model,
            "seed": seed,
            "num-server-rounds": rounds,
            "results-dir": str(out),
            "run-name": name,
        },
        CLIENTS,
    )
    print(f"  {name}: final {rows[-1]['accuracy']:.4f} in {time.perf_counter() - started:.0f} s", flush=True)
    return rows


def mean_sd(values: list[float], digits: int = 4) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.{digits}f} ± {sd:.{digits}f}"


def event_share(runs: list[list[dict]], direction: str) -> str:
    """Share of the direction's messages that were skipped / merged (``method.lazy_events`` summed over rounds)."""
    counts: dict[str, int] = {}
    for rows in runs:
        for row in rows:
            for key, n in (counter(row, "lazy_events") or {}).items():
                counts[key] = counts.get(key, 0) + n
    kinds = ("send", "skip", "aa") if direction == "up" else ("full", "send", "skip", "aa", "dense")
    total = sum(counts.get(f"{direction}-{kind}", 0) for kind in kinds)
    if not total:
        return "-"
    skip, merged = counts.get(f"{direction}-skip", 0) / total, counts.get(f"{direction}-aa", 0) / total
    parts = [f"skip {skip:.1%}"] if skip else []
    parts += [f"aa {merged:.1%}"] if merged else []
    return ", ".join(parts) or "all sent"


def copy_lag(run_dir: Path) -> float | None:
    """At the end of a run with a compressed downlink: the median over clients of ``||theta - x_i|| / ||theta||``,
    how far the copy a client would next train from lags behind the server's model (read from the server's
    mirrors in the run's checkpoint); None for a dense downlink or a run without a checkpoint."""
    import numpy as np

    from pollen.core.checkpoint import load_checkpoint
    from pollen.strategies.lazy_book import ClientBook

    path = run_dir / "checkpoint.npz"
    if not path.is_file():
        return None
    strategy = load_checkpoint(path)["strategy"]
    book_state = strategy.get("book")
    if not book_state or "x" not in book_state["tables"]:
        return None
    theta = np.asarray(strategy["params"], dtype=np.float64)
    book = ClientBook(theta.size, kinds=tuple(book_state["tables"]))
    book.load_state_dict(book_state)
    lags = [np.linalg.norm(theta - book.get("x", key)) / np.linalg.norm(theta) for key in book_state["present"]["x"]]
    return float(np.median(lags)) if lags else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="mlp", choices=("mlp", "cnn"))
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument(
        "--configs", nargs="*", default=None, help="labels to run (default: every method of the main table)"
    )
    parser.add_argument("--out", default="/tmp/pollen-lazy-quality")
    parser.add_argument("--plots", default=None, help="folder for the seed-1 plots (default: OUT/plots-MODEL)")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument(
        "--rel", action="store_true", help="also the threshold-0 runs and the table of relative changes"
    )
    parser.add_argument("--jobs", type=int, default=1, help="runs at once, one process and one torch thread each")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    labels = args.configs or list(CONFIGS)
    unknown = [label for label in labels if label not in RUN_CONFIGS]
    if unknown:
        parser.error(f"--configs: unknown {unknown}; allowed: {', '.join(repr(label) for label in RUN_CONFIGS)}")
    print(
        f"Fashion-MNIST, {args.model}, {CLIENTS} clients (IID, 600 each), 50 per round, "
        "3 local epochs of batch 32, eta_l 0.01, "
        f"FedAMS Option A eta 0.1 eps 1e-3, {args.rounds} rounds, seeds {args.seeds}",
        flush=True,
    )
    if not args.report_only:  # seed-major: a partial run already has every method on the first seed
        calls = [
            (out, label, args.model, args.rounds, seed)
            for seed in args.seeds
            for label in labels
            if finished_rows(out, run_name(label, args.model, seed), args.rounds) is None
        ]  # no process just to read a file
        run_parallel(partial(run_once, report_only=False), calls, args.jobs)
    results: dict[str, list[list[dict]]] = {label: [] for label in labels}
    for seed in args.seeds:
        for label in labels:
            rows = run_once(out, label, args.model, args.rounds, seed, report_only=args.report_only)
            if rows is not None:
                results[label].append(rows)

    print(
        f"\n| method ({args.model}) | seeds | final accuracy | best accuracy | uplink MB | downlink MB | total MB "
        "| uploads | downlinks "
        "| client copy lag |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for label, runs in results.items():
        if not runs:
            continue
        up = statistics.mean(r[-1]["cum_uplink_bytes"] for r in runs) / 1e6
        down = statistics.mean(r[-1]["cum_downlink_bytes"] for r in runs) / 1e6
        best = [max(x["accuracy"] for x in r if isinstance(x.get("accuracy"), (int, float))) for r in runs]
        compressed_down = (
            "compressor-down" in RUN_CONFIGS[label]
        )  # a dense downlink keeps no mirrors: no checkpoint to read
        lags = [
            lag
            for seed in args.seeds
            if compressed_down and (lag := copy_lag(out / run_name(label, args.model, seed))) is not None
        ]
        lag_text = f"{statistics.mean(lags):.3f}" if lags else "-"
        print(
            f"| {label} | {len(runs)} | {mean_sd([r[-1]['accuracy'] for r in runs])} | {mean_sd(best)} | "
            f"{up:.1f} | {down:.1f} | "
            f"{up + down:.1f} | {event_share(runs, 'up')} | {event_share(runs, 'down')} | {lag_text} |",
            flush=True,
        )

    if args.rel:
        rel_table(out, args.model, args.rounds, args.seeds, args.report_only, args.jobs)

    first = {label: runs[0] for label, runs in results.items() if runs}
    if first:
        from pollen.app.results import plot_runs

        plots = Path(args.plots) if args.plots else out / f"plots-{args.model}"
        plots.mkdir(parents=True, exist_ok=True)
        paths = plot_runs(first, plots)
        print(f"\nplots (seed {args.seeds[0]}): {', '.join(str(p) for p in paths)}")
    print(f"runs in {out}")


if __name__ == "__main__":
    main()
