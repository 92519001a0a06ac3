"""``pollen-sweep``: run a preset's methods x seeds (x one swept setting) in simulation, then write a report.

    pollen-sweep fedcams-cpu                                   # every method of the preset, seeds 1 2 3
    pollen-sweep fedbaca-cpu --methods fedams fedbnlaca --seeds 1 2 --set num-server-rounds=10
    pollen-sweep fedcams-cpu --methods fedcams-topk --sweep topk-ratio=0.125,0.0078125 --target 0.8

Each run is a real ``flwr run <app> --stream --federation-config num-supernodes=<preset's> --run-config ...``
(its exact command is kept in the report). Runs land in ``<out>/runs/<run-name>``; a run whose
``metrics.json`` already reaches the last round is not run again, so an interrupted sweep resumes where it
stopped. One progress line per run, with an estimate of the time left. The report (``<out>/report.md``,
``report.json``, the accuracy plots vs round and vs cumulative uplink / downlink / total bytes, and
``commands.sh``) is written by :mod:`pollen.app.compare`, the same engine as ``pollen-compare``. Since the
report plots every run together, a run draws no plots of its own (run-config ``plots=false``, about 2 s of each
run's ServerApp) unless the preset or ``--set plots=true`` asks; ``plots`` never makes a finished run run again.

With a tracker (``--set tracker=tensorboard,mlflow``, or a preset that sets one) the sweep groups its runs:
TensorBoard event files in ``<out>/tensorboard/<run-name>`` (``tensorboard --logdir <out>/tensorboard``),
and one MLflow experiment ``sweep-<out folder>`` in ``sqlite:///<out>/mlflow.db``, unless ``--set`` names
``tracker-dir``, ``mlflow-tracking-uri`` or ``mlflow-experiment``. The tracker keys never make a finished
run run again: a finished run that a tracker has not seen yet is logged into it from its ``metrics.json``.

``--warm`` starts one Ray head on 127.0.0.1 (:class:`pollen.app.ray_cluster.LocalRayCluster`, the machine's
CPUs and GPUs) and one private local SuperLink that joins it (:class:`pollen.app.local_superlink.LocalSuperLink`,
``RAY_ADDRESS``), runs every ``flwr run`` against them, and stops both by process id at the end. Measured on a
2-core machine (``benchmarks/bench_sweep_startup.py``) it saves under a second per run: a run's ~26 s outside
training are not Ray's start, so it is not the default. Partitions come from pollen's disk cache after the
first run either way.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pollen.app.compare import write_report
from pollen.app.preset import Preset, PresetError, load_preset, tomllib
from pollen.app.trackers import TRACKER_KEYS, open_trackers, tracker_names
from pollen.app.trackers.base import FINISHED, TRACKERS, install_hint
from pollen.app.trackers.factory import missing_library
from pollen.app.trackers.mlflow import default_tracking_uri


@dataclass(frozen=True)
class PlannedRun:
    """One run of a sweep: its group label (method and swept value), seed, run-config and folder."""

    group: str
    seed: int
    config: dict[str, Any]
    run_dir: Path

    @property
    def rounds(self) -> int:
        return int(self.config["num-server-rounds"])


def toml_value(value: Any) -> str:
    """A run-config value as ``flwr run --run-config`` reads it (TOML)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value) if isinstance(value, float) else str(value)


def parse_assignment(text: str) -> tuple[str, Any]:
    """``key=value`` with a TOML value (``0.5``, ``true``, ``'topk'``); a bare word is a string."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise ValueError(f"{text!r} is not key=value")
    try:
        return key, tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return key, raw


def sweep_tracking(out: Path) -> dict[str, str]:
    """Where a sweep's runs are tracked, all together: one TensorBoard directory, one MLflow experiment."""
    return {
        "tracker-dir": str(out / "tensorboard"),
        "mlflow-tracking-uri": default_tracking_uri(out),
        "mlflow-experiment": f"sweep-{out.name}",
    }


def plan(
    preset: Preset,
    methods: Sequence[str],
    seeds: Sequence[int],
    settings: Mapping[str, Any],
    sweep: tuple[str, list[Any]] | None,
    out: Path,
) -> list[PlannedRun]:
    """Every run of the sweep, method-major within each seed (a partial sweep has every method on seed 1).

    A run with a tracker is tracked where the sweep's runs are (:func:`sweep_tracking`), unless the preset or
    ``settings`` say where. A run draws no plots of its own unless the preset or ``settings`` set ``plots``.
    """
    runs = []
    values = sweep[1] if sweep else [None]
    for seed in seeds:
        for method in methods:
            for value in values:
                group = method if sweep is None else f"{method} {sweep[0]}={value}"
                name = f"{method}-s{seed}" if sweep is None else f"{method}-{sweep[0]}-{value}-s{seed}"
                config = {
                    "plots": False,  # the report plots every run together
                    **preset.method_config(method),
                    **settings,
                    "seed": seed,
                    "run-name": name,
                    "results-dir": str(out / "runs"),
                }
                if sweep is not None:
                    config[sweep[0]] = value
                if config.get("tracker"):
                    for key, where in sweep_tracking(out).items():
                        config.setdefault(key, where)
                runs.append(PlannedRun(group, seed, config, out / "runs" / name))
    return runs


#: Run-config keys a finished run may differ in and still be this sweep's run.
NOT_COMPARED = (*TRACKER_KEYS, "plots")


def is_finished(run: PlannedRun) -> bool:
    """Whether the run's folder holds a finished run of exactly this config (else it is run again).

    The tracker keys and ``plots`` do not count: they change where a run is shown and which files it draws,
    not its numbers (:func:`track_finished`).
    """
    metrics, written = run.run_dir / "metrics.json", run.run_dir / "config.json"
    if not (metrics.is_file() and written.is_file()):
        return False
    try:
        rows = json.loads(metrics.read_text())["rows"]
        config = json.loads(written.read_text())
    except (ValueError, KeyError):
        return False
    if any(config.get(key) != value for key, value in run.config.items() if key not in NOT_COMPARED):
        return False  # the same name with other settings (a changed --set): not this run
    return bool(rows) and rows[-1].get("round") == run.rounds


def track_finished(run: PlannedRun) -> None:
    """Show a finished run in this sweep's trackers: its rows from ``metrics.json``, where not logged already.

    The trackers tell for themselves whether they hold the run (the MLflow run recorded in its folder, the
    event files in its TensorBoard directory) and then add nothing; a tracker that fails says so once.
    """
    if not run.config.get("tracker"):
        return
    written = json.loads((run.run_dir / "config.json").read_text())
    config = {**written, **{key: run.config.get(key, written.get(key, "")) for key in TRACKER_KEYS}}
    rows = json.loads((run.run_dir / "metrics.json").read_text())["rows"]
    trackers = open_trackers(config, run.run_dir)
    trackers.start(config, earlier_rows=rows)
    trackers.finish(FINISHED)


def check_trackers(runs: list[PlannedRun]) -> None:
    """``ValueError`` (one line) for a run whose ``tracker`` is not a list of trackers or is not installed."""
    for run in runs:
        try:
            names = tracker_names(str(run.config.get("tracker", "")))
        except ValueError as err:
            raise ValueError(f"tracker = {run.config['tracker']!r}: {err}; allowed: {', '.join(TRACKERS)}") from None
        missing = missing_library(names)
        if missing is not None:
            raise ValueError(f"tracker {missing} is not installed; install it with: {install_hint(missing)}")


def where_tracked(run: PlannedRun) -> list[str]:
    """How to open the trackers a run logs to, one line each (the sweep's runs share them)."""
    names = tracker_names(str(run.config.get("tracker", "")))
    lines = []
    if "tensorboard" in names:
        lines.append(f"TensorBoard: tensorboard --logdir {shlex.quote(str(run.config['tracker-dir']))}")
    if "mlflow" in names:
        uri = str(run.config["mlflow-tracking-uri"])
        opener = f"mlflow ui --backend-store-uri {shlex.quote(uri)}" if not uri.startswith("http") else uri
        lines.append(f"MLflow: {opener} (experiment {run.config['mlflow-experiment']!r})")
    return lines


def snapshot_app(app: Path, dest: Path) -> Path:
    """The files ``flwr run`` would pack from ``app`` (its bundle), extracted to ``dest``, made once per sweep.

    Every run of the sweep then uses the same code even if the checkout changes meanwhile, and Flower does not
    walk the whole checkout (a virtual environment inside it included) at every run.
    """
    import io
    import warnings
    import zipfile

    from flwr.cli.build import build_fab_from_disk

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        fab = build_fab_from_disk(Path(app))
    if dest.exists():
        shutil.rmtree(dest)
    with zipfile.ZipFile(io.BytesIO(fab)) as archive:
        for name in archive.namelist():
            if not name.startswith(".info/"):  # the bundle's manifest, written again when flwr builds it
                target = dest / name
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(archive.read(name))
    return dest


def flwr_executable() -> str:
    """The ``flwr`` of this Python environment (next to its interpreter), else the one on PATH."""
    beside = Path(sys.executable).with_name("flwr")
    return str(beside) if beside.is_file() else (shutil.which("flwr") or "flwr")


def flwr_command(run: PlannedRun, app: str, supernodes: int) -> list[str]:
    overrides = " ".join(f"{key}={toml_value(value)}" for key, value in run.config.items())
    return [
        flwr_executable(),
        "run",
        app,
        "--stream",
        "--federation-config",
        f"num-supernodes={supernodes}",
        "--run-config",
        overrides,
    ]


def run_with_flwr(command: list[str], log_path: Path, env: Mapping[str, str] | None = None) -> int:
    """Run one ``flwr run`` and keep its output next to the results; the exit code. ``env``: the environment
    of a warm SuperLink (:func:`warm_flower`); by default this process's, with Flower's per-run install off."""
    if env is None:
        bin_dir = str(Path(sys.executable).parent)  # flwr starts flower-superlink from PATH: this environment's
        env = {
            **os.environ,
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
        }
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as log:
        try:
            return subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=dict(env), check=False).returncode
        except OSError as err:  # no flwr executable: say so in the run's log and fail the run
            log.write(f"cannot start {command[0]!r}: {err}\n")
            return 127


@contextlib.contextmanager
def warm_flower(home: Path, say: Callable[[str], None] = print):
    """One Ray head and one private local SuperLink joined to it, for every run of a sweep; yields the
    environment ``flwr run`` needs to use them. Both are stopped by process id when the block ends."""
    from pollen.app.local_superlink import LocalSuperLink

    with LocalSuperLink.warm(home, say=say) as link:
        yield link.env


def execute(
    runs: list[PlannedRun],
    *,
    app: str,
    supernodes: int,
    runner: Callable[[list[str], Path], int] = run_with_flwr,
    say: Callable[[str], None] = print,
) -> list[str]:
    """Run what is not finished yet, one progress line per run; returns the failures (one line each)."""
    todo = [run for run in runs if not is_finished(run)]
    say(f"{len(runs)} runs, {len(runs) - len(todo)} already finished, {len(todo)} to run")
    for run in runs:
        if run not in todo:
            track_finished(run)
    failures, spent = [], []
    for index, run in enumerate(todo, start=1):
        command = flwr_command(run, app, supernodes)
        started = time.perf_counter()
        code = runner(command, run.run_dir.parent / f"{run.run_dir.name}.log")
        spent.append(time.perf_counter() - started)
        left = (len(todo) - index) * sum(spent) / len(spent)
        if code == 0 and is_finished(run):
            final = json.loads((run.run_dir / "metrics.json").read_text())["rows"][-1].get("accuracy")
            outcome = f"final accuracy {final:.4f}" if isinstance(final, (int, float)) else "finished"
        else:
            outcome = f"FAILED (exit {code}; see {run.run_dir.name}.log)"
            failures.append(f"{run.run_dir.name}: exit {code}")
        say(
            f"[{index}/{len(todo)}] {run.group} seed {run.seed}: {outcome} in {spent[-1]:.0f} s; "
            f"about {left / 60:.0f} min left"
        )
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("preset", help="a preset name (pollen/app/presets) or a path to a preset .toml file")
    parser.add_argument("--methods", nargs="+", help="labels of the preset's [methods] (default: all)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="run-config values for every run")
    parser.add_argument("--sweep", metavar="KEY=V1,V2,...", help="one setting to sweep")
    parser.add_argument("--target", type=float, default=None, help="accuracy for the rounds-to-target column")
    parser.add_argument("--supernodes", type=int, default=None, help="simulated SuperNodes (default: the preset's)")
    parser.add_argument("--app", default=".", help="the Flower app directory (default: .); runs use a snapshot of it")
    parser.add_argument("--out", type=Path, default=None, help="default: results/sweeps/<preset>")
    parser.add_argument("--report-only", action="store_true", help="write the report of the finished runs, run nothing")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    parser.add_argument(
        "--warm",
        action="store_true",
        help="one Ray head and one private SuperLink for all runs (stopped at the end) instead of a Ray per run",
    )
    args = parser.parse_args(argv)
    try:
        preset = load_preset(args.preset)
        methods = args.methods or list(preset.methods)
        unknown = [m for m in methods if m not in preset.methods]
        if unknown:
            raise PresetError(
                f"preset '{preset.name}' has no method {unknown[0]!r}; it has: {', '.join(preset.methods)}"
            )
        settings = dict(parse_assignment(text) for text in args.set)
        sweep = None
        if args.sweep:
            key, raw = args.sweep.split("=", 1) if "=" in args.sweep else (args.sweep, "")
            values = [parse_assignment(f"{key}={part}")[1] for part in raw.split(",") if part]
            if not values:
                raise ValueError(f"--sweep {args.sweep!r} names no values; e.g. --sweep topk-ratio=0.125,0.0078125")
            sweep = (key, values)
    except (PresetError, ValueError) as err:
        print(f"pollen-sweep: {err}", file=sys.stderr)
        return 2
    out = (args.out or Path("results") / "sweeps" / preset.name).resolve()
    supernodes = args.supernodes or preset.supernodes
    runs = plan(preset, methods, args.seeds, settings, sweep, out)
    try:
        check_trackers(runs)
    except ValueError as err:
        print(f"pollen-sweep: {err}", file=sys.stderr)
        return 2
    commands = [shlex.join(flwr_command(run, args.app, supernodes)) for run in runs]
    if args.dry_run:
        print("\n".join(commands))
        return 0
    print(f"{preset.title} ({preset.size} size, {supernodes} SuperNodes, needs {preset.needs})")
    failures = []
    if not args.report_only:
        app = str(snapshot_app(Path(args.app), out / "app"))
        started = time.perf_counter()
        if args.warm:
            with warm_flower(out / "flwr-home") as env:
                runner = functools.partial(run_with_flwr, env=env)
                failures = execute(runs, app=app, supernodes=supernodes, runner=runner)
        else:
            failures = execute(runs, app=app, supernodes=supernodes)
        print(f"sweep wall time {time.perf_counter() - started:.0f} s ({'warm' if args.warm else 'cold'})")
    groups: dict[str, list[Path]] = {}
    for run in runs:
        if is_finished(run):
            groups.setdefault(run.group, []).append(run.run_dir)
    if groups:
        title = f"{preset.title}: {len(runs)} runs ({', '.join(methods)} x seeds {' '.join(map(str, args.seeds))})"
        table = write_report(groups, out, title=title, commands=commands, target=args.target)
        print(table)
        print(f"\nreport: {out / 'report.md'}")
    for line in where_tracked(runs[0]) if runs else []:
        print(line)
    for line in failures:
        print(f"failed: {line}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
