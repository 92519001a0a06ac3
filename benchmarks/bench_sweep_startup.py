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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pollen-sweep-bench-") as tmp:
        app = str(sweep.snapshot_app(REPO, Path(tmp) / "app"))
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
