"""pollen's ServerApp: read the run-config, build the strategy, run, write results.

Everything a user can set is validated before round 1; a bad value stops the run
with one line naming the key, the value and what is allowed. Each round the app
evaluates the global model on the server's test set, logs one progress line,
appends a row to ``<results-dir>/<run-name>/metrics.csv`` and ``metrics.json`` and hands
that row to the experiment trackers the run-config names (``tracker``).

Relative paths resolve against the pollen home (``$POLLEN_HOME``, else ``~/.pollen``;
:mod:`pollen.app.paths`), and the run's first and last log lines print its folder.
``flwr run`` exits 0 however a run ends, so the folder's ``run.json`` says how it ended
(:class:`pollen.app.results.RunState`): finished, stopped (with the reason) or failed.
"""

from __future__ import annotations

import random
import secrets
import time
from collections.abc import Callable, Mapping
from datetime import datetime
from logging import ERROR, INFO
from pathlib import Path
from typing import Any, NoReturn

from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.common import log
from flwr.serverapp import Grid, ServerApp

from pollen.app.config import RESUME_MAY_DIFFER, AppConfig, ConfigError, clients_need_given_keys
from pollen.app.experiment import build_model, build_strategy, client_train_config, data_config
from pollen.app.paths import resolve, resolved_server_paths
from pollen.app.prompt_grid import prompt
from pollen.app.registry import Table
from pollen.app.reporter import RoundReporter
from pollen.app.results import RunRecorder, RunState
from pollen.app.trackers import open_trackers
from pollen.app.trackers.base import FAILED, FINISHED, STOPPED
from pollen.strategies import RunCheckpoint, RunInterrupted
from pollen.strategies.engine.rounds import SetupError
from pollen.wire import protocol

app = ServerApp()


class RunRefused(ConfigError):
    """pollen stopped the run before round 1; the reason is logged in one line and recorded in ``run.json``."""


def _wait_for_nodes(grid: Grid, needed: int, patience: float) -> int:
    """Number of connected nodes once ``needed`` are there, or after ``patience`` seconds."""
    deadline = time.monotonic() + patience
    while (count := len(list(grid.get_node_ids()))) < needed and time.monotonic() < deadline:
        time.sleep(0.5)
    return count


def run_name(cfg: AppConfig | Mapping[str, Any]) -> str:
    if cfg["run-name"]:
        return cfg["run-name"]
    return f"{cfg['strategy']}-{cfg['dataset']}-{datetime.now():%Y%m%d-%H%M%S}"


def run_dir(cfg: AppConfig) -> Path:
    """The run's results directory, absolute: the one ``resume`` names, else ``results-dir/<run-name>``.

    A relative path resolves against the pollen home (:mod:`pollen.app.paths`), not the working directory.
    """
    if cfg["resume"]:
        return resolve(cfg["resume"])
    return resolve(cfg["results-dir"]) / run_name(cfg)


def refused_run_dir(run_config: Mapping[str, Any]) -> Path | None:
    """Where a run refused before its config was valid records ``run.json``: the folder its run-config names.

    Read from the raw run-config (any value that is not a usable string takes its default). None for a
    ``resume`` folder that does not exist: a mistyped path is not created.
    """

    def value(key: str, default: str) -> str:
        given = run_config.get(key)
        return given if isinstance(given, str) and given else default

    if value("resume", ""):
        folder = resolve(value("resume", ""))
        return folder if folder.is_dir() else None
    names = {key: value(key, default) for key, default in (("run-name", ""), ("strategy", "run"), ("dataset", "data"))}
    return resolve(value("results-dir", "results")) / run_name(names)


def refuse(
    err: Exception,
    run_config: Mapping[str, Any],
    run_id: int | None,
    out_dir: Path | None = None,
    state: RunState | None = None,
) -> NoReturn:
    """Stop the run before round 1: one log line, ``run.json`` (status ``stopped``), then :class:`RunRefused`.

    ``state``: the run's state file once the run started; else ``out_dir``, the run's folder where it is
    known; else the folder the raw run-config names (:func:`refused_run_dir`). A folder that cannot be
    written leaves the log line without its path.
    """
    reason = str(err)
    if state is None:
        folder = out_dir if out_dir is not None else refused_run_dir(run_config)
        rounds = run_config.get("num-server-rounds")
        if folder is not None:
            state = RunState(folder, flower_run_id=run_id, num_rounds=rounds if isinstance(rounds, int) else None)
    where = ""
    if state is not None:
        try:
            state.end(STOPPED, reason=reason)
            where = f" (run.json in {state.path.parent})"
        except OSError:
            pass
    log(ERROR, "[pollen] stopped before round 1: %s%s", reason, where)
    raise RunRefused(reason) from None


def quiet_refusals(main_fn: Callable[[Grid, Context], None]) -> Callable[[Grid, Context], None]:
    """``main_fn`` as Flower's entry point: a :class:`RunRefused` ends the run without a traceback.

    Flower logs a traceback and an "unhandled exception" exit code for anything a ServerApp raises; a
    refusal has already said everything in one line and in ``run.json``, so the entry point returns.
    ``main_fn`` itself still raises, for callers in Python (the tests, :func:`pollen.testing.inprocess`).
    """

    def entry(grid: Grid, context: Context) -> None:
        try:
            main_fn(grid, context)
        except RunRefused:
            return

    entry.__doc__ = main_fn.__doc__
    return entry


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


def main(grid: Grid, context: Context) -> None:
    """Run one experiment as the run-config says (or resume one); :class:`RunRefused` before round 1."""
    serve(grid, context)


app.main()(quiet_refusals(main))


def serve(grid: Grid, context: Context, methods: Table | None = None) -> None:
    """The ServerApp's work with a method table (default: the product's; the test harness adds its demos)."""
    grid = prompt(grid)
    fresh_dir = None  # a fresh run's folder, once the first line has named it
    try:
        given = given_keys(grid)
        cfg = AppConfig.from_run_config(context.run_config, given=given, methods=methods)
        absolute = resolved_server_paths(cfg.values)
        if absolute:
            cfg = cfg.replace(**absolute)
        out_dir = run_dir(cfg)
        fresh_dir = None if cfg["resume"] else out_dir
        log(INFO, "[pollen] run %s: %s on %s; results in %s", out_dir.name, cfg["strategy"], cfg["dataset"], out_dir)
        strategy = build_strategy(cfg)
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
        refuse(err, context.run_config, context.run_id, fresh_dir)  # a resume's folder: only if it exists

    state = RunState(out_dir, flower_run_id=context.run_id, num_rounds=cfg["num-server-rounds"])
    state.start()
    status = FAILED  # what the trackers are told at the end, unless the rounds finish or stop as asked
    recorder = None
    try:
        # Flower's own baselines sample with the global `random`; seed it too. (pollen's
        # strategies use their own seeded generator over stable client ids.)
        random.seed(cfg["seed"])
        recorder = RunRecorder(out_dir, cfg.as_dict(), fresh=not checkpoint.resume, plots=cfg["plots"])
        log(INFO, "[pollen] %s on %s, %d SuperNodes", cfg["strategy"], cfg["dataset"], nodes)
        initial = ArrayRecord(model.state_dict())
        reporter = RoundReporter(cfg, strategy, recorder, model, test_loader, trackers)
        checkpoint.app_state = reporter.app_state
        if checkpoint.resume:
            reporter.restore(checkpoint.read_app_state(type(strategy).__name__))
        trackers.start(cfg.as_dict(), earlier_rows=list(recorder.rows))
        train_config = client_train_config(cfg)
        train_config[protocol.CFG_RUN_KEY] = out_dir.name
        train_config[protocol.CFG_SESSION] = secrets.token_hex(8)  # this process: the run, or this resume of it
        evaluate_config = {}
        if given and (cfg["preset"] or clients_need_given_keys(context.run_config, given, methods)):
            # the ClientApps resolve the preset and the method's recommended values as the server did
            train_config[protocol.CFG_GIVEN_KEYS] = evaluate_config[protocol.CFG_GIVEN_KEYS] = protocol.join_keys(
                sorted(given)
            )
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
    except SetupError as err:
        refuse(err, context.run_config, context.run_id, state=state)
    except RunInterrupted as stop:
        state.end(
            STOPPED,
            reason=f"stop-after-round={cfg['stop-after-round']}: stopped after round {stop.server_round} as asked",
            last_round=stop.server_round,
        )
        log(
            INFO,
            "[pollen] stopped after round %d as asked; continue with the same --run-config plus \"resume='%s'\" "
            "(without stop-after-round)",
            stop.server_round,
            out_dir,
        )
        return
    except Exception as err:
        done = _last_round(recorder)
        state.end(FAILED, reason=f"{type(err).__name__}: {err}", last_round=done)
        log(ERROR, "[pollen] failed after round %d: %s; results so far in %s", done, err, out_dir)
        raise
    state.end(FINISHED, last_round=cfg["num-server-rounds"])
    log(INFO, "[pollen] done: final accuracy %.4f; results in %s", last.get("accuracy", float("nan")), out_dir)


def _last_round(recorder: RunRecorder | None) -> int:
    """The last round with a results row (0: none yet)."""
    rows = recorder.rows if recorder is not None else []
    return int(rows[-1]["round"]) if rows and isinstance(rows[-1].get("round"), int) else 0
