"""What a ``pollen-sweep`` spends outside training, cold (Ray started per run) and warm (one Ray head per sweep).

The same small sweep twice, from an empty output folder each time, on this machine's CPUs: the ``fedcams-cpu``
preset's FedAMS and FedCAMS sign, seeds 1 and 2, ``--rounds`` rounds each (4 runs).

- cold: every ``flwr run`` as a plain user's command runs it (one local SuperLink for the sweep, as Flower
  keeps it, but a Ray start and shutdown inside every run);
- warm: ``pollen-sweep --warm``, one Ray head on 127.0.0.1 and one SuperLink joined to it for all runs.

Reported: the sweep's wall time, the sum of its runs' training time (the ServerApp's seconds from round 1's
start to the last round's end, from each run's own rows), and what is left: start-up, imports, partitioning,
teardown. Both sweeps use the disk cache of partitions, warmed by a first run that is not counted.

    python benchmarks/bench_sweep_startup.py [--rounds 5]
    python benchmarks/bench_sweep_startup.py --timeline [--rounds 5]     # where one run's time goes

``--timeline`` runs one run of the sweep (FedAMS, seed 1) as ``pollen-sweep`` runs it, stamps every line of
its ``flwr run --stream`` output with the time it arrived, and prints the intervals between the milestones a
run logs (app submitted, ServerApp up, data and strategy ready, round 0's evaluation, each round, done, exit).
"""

from __future__ import annotations

import argparse
import functools
import json
import tempfile
import time
from pathlib import Path

from pollen.app import sweep
from pollen.app.local_superlink import LocalSuperLink
from pollen.app.preset import load_preset

REPO = Path(__file__).resolve().parents[1]
METHODS = ["fedams", "fedcams-sign"]
SEEDS = [1, 2]


def training_seconds(runs: list[sweep.PlannedRun]) -> float:
    total = 0.0
    for run in runs:
        rows = json.loads((run.run_dir / "metrics.json").read_text())["rows"]
        total += sum(row["round_seconds"] for row in rows if row["round"] >= 1)
    return total


def one_sweep(folder: Path, app: str, rounds: int, warm: bool) -> tuple[float, float]:
    preset = load_preset("fedcams-cpu")
    runs = sweep.plan(preset, METHODS, SEEDS, {"num-server-rounds": rounds, "eval-every": rounds}, None, folder)
    started = time.perf_counter()
    if warm:
        with sweep.warm_flower(folder / "flwr-home", say=lambda line: None) as env:
            failures = sweep.execute(
                runs, app=app, supernodes=preset.supernodes, runner=functools.partial(sweep.run_with_flwr, env=env)
            )
    else:
        with LocalSuperLink(folder / "flwr-home") as link:
            failures = sweep.execute(
                runs, app=app, supernodes=preset.supernodes, runner=functools.partial(sweep.run_with_flwr, env=link.env)
            )
    wall = time.perf_counter() - started
    assert not failures, failures
    return wall, training_seconds(runs)


#: What a run logs at each milestone (the first line containing it), in order.
MILESTONES = (
    ("flwr run submitted the app", "Successfully started run"),
    ("ServerApp process started", "Start `flwr-serverapp`"),
    ("ServerApp imported, data found", "[pollen] data:"),
    ("strategy built", "strategy:"),
    ("round 0 evaluated", "[pollen] round 0/"),
    ("round 1 done", "[pollen] round 1/"),
    ("last round done", "[pollen] round {rounds}/"),
    ("results written", "[pollen] done"),
)


def timeline(folder: Path, app: str, rounds: int) -> list[tuple[str, float]]:
    """``(milestone, seconds since the command started)`` of one ``flwr run`` in the order reached, then the exit."""
    import subprocess

    preset = load_preset("fedcams-cpu")
    run = sweep.plan(preset, ["fedams"], [1], {"num-server-rounds": rounds, "eval-every": rounds}, None, folder)[0]
    with LocalSuperLink(folder / "flwr-home") as link:
        started = time.perf_counter()
        proc = subprocess.Popen(
            sweep.flwr_command(run, app, preset.supernodes),
            env=dict(link.env),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        needles = {name: needle.format(rounds=rounds) for name, needle in MILESTONES}
        at: dict[str, float] = {}
        for line in proc.stdout:
            for name, needle in needles.items():
                if name not in at and needle in line:
                    at[name] = time.perf_counter() - started
        proc.wait()
        exited = time.perf_counter() - started
    seen = sorted(at.items(), key=lambda item: item[1])  # a milestone a run does not log is left out
    return [*seen, (f"flwr run exited ({proc.returncode})", exited)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--timeline", action="store_true", help="where one run's time goes, milestone by milestone")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pollen-sweep-bench-") as tmp:
        app = str(sweep.snapshot_app(REPO, Path(tmp) / "app"))
        if args.timeline:
            timeline(Path(tmp) / "warm-up", app, 1)  # partitions into the disk cache, imports into page cache
            last = 0.0
            print("| milestone | s since start | s since the previous |\n|---|---|---|")
            for name, at in timeline(Path(tmp) / "timeline", app, args.rounds):
                print(f"| {name} | {at:.1f} | {at - last:.1f} |")
                last = at
            return
        one_sweep(Path(tmp) / "warm-up", app, 1, warm=False)  # partitions into the disk cache, imports into page cache
        print(f"{len(METHODS) * len(SEEDS)} runs of the fedcams-cpu preset, {args.rounds} rounds each")
        print("| sweep | wall s | training s (sum over runs) | outside training s | per run |")
        print("|---|---|---|---|---|")
        for name, warm in (("cold (Ray per run)", False), ("warm (one Ray head)", True)):
            wall, train = one_sweep(Path(tmp) / name.split()[0], app, args.rounds, warm)
            outside = wall - train
            print(f"| {name} | {wall:.1f} | {train:.1f} | {outside:.1f} | {outside / 4:.1f} |", flush=True)


if __name__ == "__main__":
    main()
