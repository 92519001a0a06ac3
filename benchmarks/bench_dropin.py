"""Every pollen strategy, with its constructor defaults, dropped into three of Flower's own examples.

The projects (``pollen/testing/foreign/``) are Flower's ``quickstart-pytorch`` (LeNet, CIFAR-like local
images, 4 clients), ``fl-tabular`` (an MLP on census-like rows, local Adam, 5 clients) and
``advanced-pytorch`` (a larger CNN on real Fashion-MNIST, Dirichlet(1.0), 10 clients, half a round),
rebuilt with local data and otherwise as the examples write them. Each strategy runs with only the
project's own sampling set, beside Flower's ``FedAvg()`` and ``FedAdam()`` in the same run, for
``--rounds`` rounds and each seed; the server's test accuracy after round 5 and after the last round
is reported as mean and spread over seeds, with the gap to FedAvg's mean, and how many replies the
outlier screen rejected (every client here is honest, so any is a false rejection) and clipped to its
bound (a drop-in's default rule: an honest client whose local training diverged still counts, scaled).

Run: ``python benchmarks/bench_dropin.py [--rounds 20] [--seeds 1 2 3] [--projects ...] [--only NAME ...]
[--json out.json]``. About 25 minutes on one core of the 2-core machine for the defaults.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time

from pollen.testing.foreign import harness
from pollen.testing.foreign.advanced_pytorch import PROJECT as ADVANCED
from pollen.testing.foreign.advanced_pytorch import available as fashion_mnist_available
from pollen.testing.foreign.fl_tabular import PROJECT as TABULAR
from pollen.testing.foreign.quickstart_pytorch import PROJECT as QUICKSTART

PROJECTS = {p.name: p for p in (QUICKSTART, TABULAR, ADVANCED)}
EARLY = 5  # the round a newcomer's first run often stops at
TOLERANCE = 0.05  # the promise: within 5 points of FedAvg


def fedams_with(eta: float) -> harness.DropIn:
    """FedAMS with its defaults but ``eta`` (the grid the default was chosen from)."""
    from pollen.strategies import FedAMS

    return harness.DropIn(f"FedAMS(eta={eta:g})", lambda f: FedAMS(eta=eta, fraction_train=f, fraction_evaluate=0.0))


def screen_rejections(strategy: object) -> int:
    """Replies the outlier screen rejected in a pollen run (Flower's strategies keep no such count)."""
    accounting = getattr(strategy, "accounting", None)
    if accounting is None:
        return 0
    return sum("outlier screen" in why for stats in accounting.rounds.values() for why in stats.failure_reasons)


def screen_clipped(strategy: object) -> int:
    """Replies the outlier screen clipped to their bound and applied (the default rule of a drop-in)."""
    screen = getattr(strategy, "screen", None)
    return int(getattr(screen, "clipped", 0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--seeds", type=int, nargs="*", default=[1, 2, 3])
    parser.add_argument("--projects", nargs="*", default=list(PROJECTS), choices=list(PROJECTS))
    parser.add_argument("--only", nargs="*", default=None, help="strategy names (as printed); FedAvg() always runs")
    parser.add_argument("--json", default=None, help="write every run's accuracy curve here")
    parser.add_argument(
        "--eta-grid",
        type=float,
        nargs="*",
        default=[],
        help="add FedAMS(eta=...) for each value (how the default was chosen)",
    )
    parser.add_argument("--from-json", nargs="*", default=None, help="report saved runs (of one or more --json)")
    parser.add_argument("--markdown", action="store_true", help="also print the results page's table")
    args = parser.parse_args()
    if args.from_json:
        saved = [json.load(open(path, encoding="utf-8")) for path in args.from_json]
        runs = [run for part in saved for run in part["runs"]]
        report(runs, saved[0]["rounds"], saved[0]["seeds"])
        if args.markdown:
            print(markdown_table(runs, saved[0]["rounds"]))
        return
    logging.getLogger("flwr").setLevel(logging.ERROR)
    drop_ins = [d for d in harness.drop_ins() if args.only is None or d.name in args.only or d.name == "FedAvg()"]
    drop_ins += [fedams_with(eta) for eta in args.eta_grid]
    runs = []
    for name in args.projects:
        project = PROJECTS[name]
        if project is ADVANCED and not fashion_mnist_available():
            print(f"{name}: skipped (Debian's dataset-fashion-mnist is not installed)")
            continue
        for drop_in in drop_ins:
            for seed in args.seeds:
                started = time.perf_counter()
                strategy = drop_in.make(project.fraction_train)
                curve = harness.run_project(project, strategy, seed=seed, num_rounds=args.rounds, mods=drop_in.mods)
                runs.append(
                    {
                        "project": name,
                        "strategy": drop_in.name,
                        "seed": seed,
                        "accuracy": curve,
                        "screen_rejections": screen_rejections(strategy),
                        "screen_clipped": screen_clipped(strategy),
                        "seconds": round(time.perf_counter() - started, 1),
                    }
                )
                print(f"  {name} {drop_in.name} seed {seed}: {curve[EARLY]:.3f} / {curve[-1]:.3f}", flush=True)
    report(runs, args.rounds, args.seeds)
    if args.markdown:
        print(markdown_table(runs, args.rounds))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"rounds": args.rounds, "seeds": args.seeds, "runs": runs}, f, indent=1)


def report(runs: list[dict], rounds: int, seeds: list[int]) -> None:
    """Per project, each strategy's accuracy after round ``EARLY`` and the last (mean, spread), the gap to FedAvg."""
    print(f"\nserver test accuracy, mean (min-max) over seeds {seeds}; gap = mean - FedAvg's mean")
    misses = []
    for project in dict.fromkeys(r["project"] for r in runs):
        mine = [r for r in runs if r["project"] == project]
        print(f"\n{project}")
        print(
            f"  {'strategy':<28} {'round ' + str(EARLY):>22} {'gap':>6} {'round ' + str(rounds):>22} {'gap':>6}"
            " rej clip"
        )
        bars = {}
        for strategy in dict.fromkeys(r["strategy"] for r in mine):
            cells = []
            for at in (EARLY, rounds):
                values = [r["accuracy"][at] for r in mine if r["strategy"] == strategy]
                mean = statistics.fmean(values)
                bars.setdefault(at, mean) if strategy == "FedAvg()" else None
                gap = mean - bars[at]
                cells.append(f"{mean:.3f} ({min(values):.3f}-{max(values):.3f}) {gap:+6.3f}")
                if gap < -TOLERANCE:
                    misses.append((project, strategy, at, round(gap, 3)))
            rejected = sum(r["screen_rejections"] for r in mine if r["strategy"] == strategy)
            clipped = sum(r.get("screen_clipped", 0) for r in mine if r["strategy"] == strategy)
            print(f"  {strategy:<28} {cells[0]:>29} {cells[1]:>29} {rejected:>3} {clipped:>4}")
    print(f"\nmore than {TOLERANCE:.2f} below FedAvg: {len(misses)}")
    for miss in misses:
        print(f"  {miss[0]} {miss[1]} after round {miss[2]}: {miss[3]:+.3f}")


def markdown_table(runs: list[dict], rounds: int) -> str:
    """The table of ``docs/results/dropin.md``: per project and strategy, mean (min-max) and the gap to FedAvg."""
    lines = [
        f"| project | strategy | round {EARLY} | gap at {EARLY} | round {rounds} | gap at {rounds} "
        "| screen rejections | clipped |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for project in dict.fromkeys(r["project"] for r in runs):
        mine = [r for r in runs if r["project"] == project]
        bars = {
            at: statistics.fmean(r["accuracy"][at] for r in mine if r["strategy"] == "FedAvg()")
            for at in (EARLY, rounds)
        }
        for strategy in dict.fromkeys(r["strategy"] for r in mine):
            cells = [project, f"`{strategy}`"]
            for at in (EARLY, rounds):
                values = [r["accuracy"][at] for r in mine if r["strategy"] == strategy]
                mean, gap = statistics.fmean(values), statistics.fmean(values) - bars[at]
                flag = "**" if gap < -TOLERANCE else ""
                cells += [f"{mean:.3f} ({min(values):.3f}-{max(values):.3f})", f"{flag}{gap:+.3f}{flag}"]
            cells.append(str(sum(r["screen_rejections"] for r in mine if r["strategy"] == strategy)))
            cells.append(str(sum(r.get("screen_clipped", 0) for r in mine if r["strategy"] == strategy)))
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
