"""pollen's ServerApp: read the run-config, build the strategy, run, write results.

Everything a user can set is validated before round 1; a bad value stops the run
with one line naming the key, the value and what is allowed. Each round the app
evaluates the global model on the server's test set, logs one progress line,
appends a row to ``results/<run-name>/metrics.csv`` and ``metrics.json`` and hands
that row to the experiment trackers the run-config names (``tracker``).
"""

from __future__ import annotations

import random
import time
from datetime import datetime
from logging import ERROR, INFO
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.common import log
from flwr.serverapp import Grid, ServerApp

from pollen.app.config import RESUME_MAY_DIFFER, AppConfig, ConfigError, clients_need_given_keys
from pollen.app.experiment import build_model, build_strategy, client_train_config, data_config
from pollen.app.prompt_grid import prompt
from pollen.app.registry import Table
from pollen.app.reporter import RoundReporter
from pollen.app.results import RunRecorder
from pollen.app.trackers import open_trackers
from pollen.app.trackers.base import FAILED, FINISHED, STOPPED
from pollen.strategies import RunCheckpoint, RunInterrupted
from pollen.strategies.rounds import SetupError
from pollen.wire import protocol

app = ServerApp()


def _wait_for_nodes(grid: Grid, needed: int, patience: float) -> int:
    """Number of connected nodes once ``needed`` are there, or after ``patience`` seconds."""
    deadline = time.monotonic() + patience
    while (count := len(list(grid.get_node_ids()))) < needed and time.monotonic() < deadline:
        time.sleep(0.5)
    return count


def run_name(cfg: AppConfig) -> str:
    if cfg["run-name"]:
        return cfg["run-name"]
    return f"{cfg['strategy']}-{cfg['dataset']}-{datetime.now():%Y%m%d-%H%M%S}"


def run_dir(cfg: AppConfig) -> Path:
    """The run's results directory: the one ``resume`` names, else ``results-dir/<run-name>``."""
    if cfg["resume"]:
        return Path(cfg["resume"]).expanduser().resolve()
    return Path(cfg["results-dir"]).expanduser().resolve() / run_name(cfg)


def given_keys(grid: Grid) -> set[str]:
    """The run-config keys the user set for this run (Flower's run record keeps them); empty if unknown."""
    try:
        return {str(key) for key in (grid.run.override_config or {})}
    except Exception:  # noqa: BLE001 - a grid without a run record (tests, other runtimes): fall back
        return set()


def nodes_to_play(strategy: Any) -> int:
    """Population mode: the most clients one round samples (training or evaluation), each needing a node."""
    sampler = strategy.sampler
    needed = sampler.sample_size(strategy.fraction_train, strategy.min_train_nodes)
    if strategy.fraction_evaluate > 0:
        needed = max(needed, sampler.sample_size(strategy.fraction_evaluate, strategy.min_evaluate_nodes))
    return needed


def prepare(cfg: AppConfig, grid: Grid, strategy: Any) -> tuple[Any, Any, int]:
    """Everything that can fail before round 1: nodes, data source, model."""
    from pollen.task.data import describe_source, load_test_set, validate_data_config

    if cfg["population"]:
        needed = nodes_to_play(strategy)
        nodes = _wait_for_nodes(grid, needed, cfg["node-wait-seconds"])
        if nodes < needed:
            raise ConfigError(
                f"run-config 'population' = {cfg['population']}: a round samples {needed} clients, each played by "
                f"a node of its own, but only {nodes} SuperNodes are connected; allowed: at least {needed} "
                "(simulation: options.num-supernodes), or smaller fraction-train / fraction-evaluate"
            )
    else:
        nodes = _wait_for_nodes(grid, cfg["min-train-nodes"], cfg["node-wait-seconds"])
        if nodes < cfg["min-train-nodes"]:
            raise ConfigError(
                f"run-config 'min-train-nodes' = {cfg['min-train-nodes']} but only {nodes} SuperNodes "
                f"(partitions) are connected; allowed: at most {nodes}"
            )
    data_cfg = data_config(cfg, num_partitions=cfg["population"] or max(nodes, 1))
    validate_data_config(data_cfg)
    log(INFO, "[pollen] data: %s", describe_source(data_cfg))
    test_loader = load_test_set(data_cfg, cfg["eval-batch-size"], cfg["test-examples"])
    model = build_model(cfg)
    return model, test_loader, nodes


def make_checkpoint(cfg: AppConfig, out_dir: Path) -> RunCheckpoint:
    """The run's checkpoint, tied to its run-config (keys in ``RESUME_MAY_DIFFER`` may change)."""
    return RunCheckpoint(
        out_dir,
        resume=bool(cfg["resume"]),
        fingerprint=cfg.as_dict(),
        ignore=(*RESUME_MAY_DIFFER, "run-name"),
        stop_after_round=cfg["stop-after-round"],
        trust_file=cfg["resume-trust-file"],
    )


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run one experiment as the run-config says (or resume one)."""
    serve(grid, context)


def serve(grid: Grid, context: Context, methods: Table | None = None) -> None:
    """The ServerApp's work with a method table (default: the product's; the test harness adds its demos)."""
    grid = prompt(grid)
    try:
        given = given_keys(grid)
        cfg = AppConfig.from_run_config(context.run_config, given=given, methods=methods)
        strategy = build_strategy(cfg)
        out_dir = run_dir(cfg)
        checkpoint = make_checkpoint(cfg, out_dir)
        if checkpoint.resume:
            done = checkpoint.validate(type(strategy).__name__)
            if done >= cfg["num-server-rounds"]:
                raise ConfigError(
                    f"run-config 'resume' = {cfg['resume']!r}: that run already finished round {done}; "
                    f"allowed: num-server-rounds > {done}"
                )
        trackers = open_trackers(cfg, out_dir)
        model, test_loader, nodes = prepare(cfg, grid, strategy)
    except ValueError as err:  # ConfigError, CheckpointError, DataSourceError and the task layer's checks
        log(ERROR, "[pollen] stopped before round 1: %s", err)
        raise ConfigError(str(err)) from None

    # Flower's own baselines sample with the global `random`; seed it too. (pollen's
    # strategies use their own seeded generator over stable client ids.)
    random.seed(cfg["seed"])
    recorder = RunRecorder(out_dir, cfg.as_dict(), fresh=not checkpoint.resume, plots=cfg["plots"])
    log(INFO, "[pollen] %s on %s, %d SuperNodes; results in %s", cfg["strategy"], cfg["dataset"], nodes, out_dir)
    initial = ArrayRecord(model.state_dict())
    reporter = RoundReporter(cfg, strategy, recorder, model, test_loader, trackers)
    checkpoint.app_state = reporter.app_state
    if checkpoint.resume:
        reporter.restore(checkpoint.read_app_state(type(strategy).__name__))
    trackers.start(cfg.as_dict(), earlier_rows=list(recorder.rows))
    train_config = client_train_config(cfg)
    train_config[protocol.CFG_RUN_KEY] = out_dir.name
    evaluate_config = {}
    if given and (cfg["preset"] or clients_need_given_keys(context.run_config, given, methods)):
        # the ClientApps resolve the preset and the method's recommended values as the server did
        train_config[protocol.CFG_GIVEN_KEYS] = evaluate_config[protocol.CFG_GIVEN_KEYS] = protocol.join_keys(
            sorted(given)
        )
    status = FAILED  # what the trackers are told at the end, unless the rounds finish or stop as asked
    try:
        result = strategy.start(
            grid=grid,
            initial_arrays=initial,
            num_rounds=cfg["num-server-rounds"],
            timeout=cfg["round-timeout"],
            train_config=ConfigRecord(train_config),
            evaluate_config=ConfigRecord(evaluate_config),
            evaluate_fn=reporter,
            checkpoint=checkpoint,
        )
        status = FINISHED
    except SetupError as err:
        log(ERROR, "[pollen] stopped before round 1: %s", err)
        raise ConfigError(str(err)) from None
    except RunInterrupted as stop:
        status = STOPPED
        log(
            INFO,
            "[pollen] stopped after round %d as asked; continue with --run-config \"resume='%s'\"",
            stop.server_round,
            out_dir,
        )
        return
    finally:
        trackers.finish(status)
    # Flower hands back an empty record when no round produced a model
    final = result.arrays if result.arrays is not None and len(result.arrays) > 0 else initial
    last = recorder.rows[-1] if recorder.rows else {}
    recorder.finish(
        {name: array.numpy() for name, array in final.items()},
        {
            "final_accuracy": last.get("accuracy"),
            "total_uplink_bytes": last.get("cum_uplink_bytes"),
            "total_downlink_bytes": last.get("cum_downlink_bytes"),
            "seconds": last.get("elapsed_seconds"),
            "checkpoint_bytes": checkpoint.last_bytes,
            "checkpoint_seconds": checkpoint.last_seconds,
        },
    )
    log(INFO, "[pollen] done: final accuracy %.4f; results in %s", last.get("accuracy", float("nan")), out_dir)
