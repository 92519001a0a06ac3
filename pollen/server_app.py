"""pollen's ServerApp: read the run-config, build the strategy, run, write results.

Everything a user can set is validated before round 1; a bad value stops the run
with one line naming the key, the value and what is allowed. Each round the app
evaluates the global model on the server's test set, logs one progress line and
appends a row to ``results/<run-name>/metrics.csv`` and ``metrics.json``.
"""

from __future__ import annotations

import copy
import random
import time
from datetime import datetime
from logging import ERROR, INFO
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.common import log
from flwr.serverapp import Grid, ServerApp

from pollen.app.config import RESUME_MAY_DIFFER, AppConfig, ConfigError, clients_need_given_keys
from pollen.app.experiment import build_model, build_strategy, client_train_config, data_config
from pollen.app.registry import Table
from pollen.app.results import METHOD_PREFIX, RunRecorder, human_bytes
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


class RoundReporter:
    """Centralised evaluation plus the per-round row and progress line (Flower's ``evaluate_fn``)."""

    def __init__(self, cfg: AppConfig, strategy: Any, recorder: RunRecorder, model: Any, test_loader: Any) -> None:
        from pollen.task.device import resolve_device

        self.cfg = cfg
        self.strategy = strategy
        self.recorder = recorder
        self.model = model
        self.test_loader = test_loader
        self.device = resolve_device(cfg["device"])
        self.started = time.perf_counter()
        self.last = self.started
        self.elapsed_before = 0.0  # seconds of the run before a resume

    def app_state(self) -> dict[str, Any]:
        """What a checkpoint keeps of the reporter: the rows so far and the elapsed time."""
        return {"rows": self.recorder.rows, "elapsed": self.elapsed_before + time.perf_counter() - self.started}

    def restore(self, app_state: dict[str, Any]) -> None:
        """Continue from a checkpoint's rows and elapsed time."""
        self.recorder.restore(app_state.get("rows", []))
        self.elapsed_before = float(app_state.get("elapsed", 0.0))

    def __call__(self, server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        from pollen.task.train import evaluate

        total = self.cfg["num-server-rounds"]
        due = server_round % self.cfg["eval-every"] == 0 or server_round == total
        if not due:
            now = time.perf_counter()
            self.recorder.record(self._row(server_round, None, None, now))
            self.last = now
            return None
        self.model.load_state_dict(arrays.to_torch_state_dict())
        loss, accuracy, _ = evaluate(self.model, self.test_loader, self.device)
        now = time.perf_counter()
        row = self._row(server_round, accuracy, loss, now)
        self.recorder.record(row)
        self.last = now
        log(
            INFO,
            "[pollen] round %d/%d  accuracy %.4f  loss %.4f  uplink %s (total %s, x%.1f vs fp32)  "
            "downlink total %s  %.1fs",
            server_round,
            total,
            accuracy,
            loss,
            human_bytes(row.get("uplink_bytes", 0) or 0),
            human_bytes(row["cum_uplink_bytes"]),
            row.get("compression_ratio", 1.0) or 1.0,
            human_bytes(row["cum_downlink_bytes"]),
            row["round_seconds"],
        )
        by_kind = _records_in_words(row.get("uplink_by_record"), row.get("downlink_by_record"))
        if by_kind:
            log(
                INFO,
                "[pollen]   round %d by record: %s; %d gradient evaluations",
                server_round,
                by_kind,
                row.get("grad_evals", 0),
            )
        counters = _method_in_words(
            {name.removeprefix(METHOD_PREFIX): value for name, value in row.items() if name.startswith(METHOD_PREFIX)}
        )
        if counters:
            log(INFO, "[pollen]   round %d method: %s", server_round, counters)
        return MetricRecord({"accuracy": accuracy, "loss": loss})

    def _row(self, server_round: int, accuracy: float | None, loss: float | None, now: float) -> dict[str, Any]:
        accounting = self.strategy.accounting
        row: dict[str, Any] = {
            "round": server_round,
            "accuracy": accuracy,
            "loss": loss,
            "cum_uplink_bytes": accounting.cumulative("uplink_bytes", server_round),
            "cum_downlink_bytes": accounting.cumulative("downlink_bytes", server_round)
            + accounting.cumulative("eval_downlink_bytes", server_round),
            "round_seconds": now - self.last,
            "elapsed_seconds": self.elapsed_before + now - self.started,
        }
        stats = accounting.rounds.get(server_round)
        if stats is not None:
            row.update(
                sampled=stats.sampled,
                replies=stats.replies,
                failures=stats.failures,
                uplink_bytes=stats.uplink_bytes,
                uplink_update_bytes=stats.uplink_update_bytes,
                uplink_fp32_bytes=stats.uplink_fp32_bytes,
                uplink_by_record=dict(stats.uplink_records),
                downlink_by_record=dict(stats.downlink_records),
                messages_sent=stats.messages_sent,
                exchange_messages=stats.exchange_messages,
                grad_evals=stats.grad_evals,
                compression_ratio=stats.compression_ratio,
                downlink_bytes=stats.downlink_bytes + stats.eval_downlink_bytes,
                server_state_bytes=getattr(stats, "server_state_bytes", 0),
                train_loss=stats.train_metrics.get("train-loss", ""),
                fed_accuracy=stats.evaluate_metrics.get("accuracy", ""),
                fed_loss=stats.evaluate_metrics.get("loss", ""),
            )
            row.update({METHOD_PREFIX + name: copy.deepcopy(value) for name, value in stats.method.items()})
        return row


def _records_in_words(uplink: dict[str, int] | None, downlink: dict[str, int] | None) -> str:
    """``up model 1.2 MB, v 1.2 MB | down ...`` when a round carried more than the model and metrics."""
    plain = {protocol.ARRAYS_RECORD, protocol.CONFIG_RECORD, protocol.METRICS_RECORD, protocol.CLIENT_INFO_RECORD}
    if not uplink or set(uplink) | set(downlink or {}) <= plain:
        return ""

    def words(records: dict[str, int]) -> str:
        shown = {
            name.removeprefix(protocol.extra_record("")): size
            for name, size in records.items()
            if name not in (protocol.CONFIG_RECORD, protocol.METRICS_RECORD, protocol.CLIENT_INFO_RECORD)
        }
        return ", ".join(f"{name} {human_bytes(size)}" for name, size in shown.items())

    return f"up {words(uplink)} | down {words(downlink or {})}"


def given_keys(grid: Grid) -> set[str]:
    """The run-config keys the user set for this run (Flower's run record keeps them); empty if unknown."""
    try:
        return {str(key) for key in (grid.run.override_config or {})}
    except Exception:  # noqa: BLE001 - a grid without a run record (tests, other runtimes): fall back
        return set()


def _method_in_words(counters: dict[str, Any]) -> str:
    """A round's method counters in words, whatever the method:
    ``relayed_bytes 1.20 MB | lazy_events up-send 3, up-skip 1``.

    A number named ``*_bytes`` reads as a size; a mapping lists its non-zero numbers, and its lists as
    ``count in [min, max]``; zeros and empty values are left out.
    """

    def one(name: str, value: Any) -> str:
        if isinstance(value, list):
            numbers = [v for v in value if isinstance(v, (int, float))]
            return f"{name} {len(numbers)} in [{min(numbers):.3g}, {max(numbers):.3g}]" if numbers else ""
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value:
            return ""
        if name.endswith("_bytes"):
            return f"{name} {human_bytes(value)}"
        return f"{name} {value}" if isinstance(value, int) else f"{name} {value:.4g}"

    parts = []
    for name, value in counters.items():
        if isinstance(value, dict):
            inner = ", ".join(words for key, item in value.items() if (words := one(str(key), item)))
            if inner:
                parts.append(f"{name} {inner}")
        elif words := one(name, value):
            parts.append(words)
    return " | ".join(parts)


def prepare(cfg: AppConfig, grid: Grid) -> tuple[Any, Any, int]:
    """Everything that can fail before round 1: nodes, data source, model."""
    from pollen.task.data import describe_source, load_test_set, validate_data_config

    nodes = _wait_for_nodes(grid, cfg["min-train-nodes"], cfg["node-wait-seconds"])
    if nodes < cfg["min-train-nodes"]:
        raise ConfigError(
            f"run-config 'min-train-nodes' = {cfg['min-train-nodes']} but only {nodes} SuperNodes "
            f"(partitions) are connected; allowed: at most {nodes}"
        )
    data_cfg = data_config(cfg, num_partitions=max(nodes, 1))
    validate_data_config(data_cfg)
    log(INFO, "[pollen] data: %s", describe_source(data_cfg))
    test_loader = load_test_set(data_cfg, cfg["eval-batch-size"])
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
    )


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run one experiment as the run-config says (or resume one)."""
    serve(grid, context)


def serve(grid: Grid, context: Context, methods: Table | None = None) -> None:
    """The ServerApp's work with a method table (default: the product's; the test harness adds its demos)."""
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
        model, test_loader, nodes = prepare(cfg, grid)
    except ValueError as err:  # ConfigError, CheckpointError, DataSourceError and the task layer's checks
        log(ERROR, "[pollen] stopped before round 1: %s", err)
        raise ConfigError(str(err)) from None

    # Flower's own baselines sample with the global `random`; seed it too. (pollen's
    # strategies use their own seeded generator over stable client ids.)
    random.seed(cfg["seed"])
    recorder = RunRecorder(out_dir, cfg.as_dict(), fresh=not checkpoint.resume)
    log(INFO, "[pollen] %s on %s, %d SuperNodes; results in %s", cfg["strategy"], cfg["dataset"], nodes, out_dir)
    initial = ArrayRecord(model.state_dict())
    reporter = RoundReporter(cfg, strategy, recorder, model, test_loader)
    checkpoint.app_state = reporter.app_state
    if checkpoint.resume:
        reporter.restore(checkpoint.read_app_state(type(strategy).__name__))
    train_config = client_train_config(cfg)
    train_config[protocol.CFG_RUN_KEY] = out_dir.name
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
    except SetupError as err:
        log(ERROR, "[pollen] stopped before round 1: %s", err)
        raise ConfigError(str(err)) from None
    except RunInterrupted as stop:
        log(
            INFO,
            "[pollen] stopped after round %d as asked; continue with --run-config \"resume='%s'\"",
            stop.server_round,
            out_dir,
        )
        return
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
