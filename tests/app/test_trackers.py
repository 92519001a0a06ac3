"""Experiment trackers: what a run logs to TensorBoard and MLflow, read back with their own readers.

TensorBoard's event files are read with TensorBoard's ``EventAccumulator``; MLflow's runs with
``MlflowClient``, from a SQLite store and from a real ``mlflow server`` that the tests start on 127.0.0.1
and stop by its process group id. Every number is compared with the row the run wrote to ``metrics.json``.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord
from torch.utils.data import DataLoader, TensorDataset

from pollen.app import sweep
from pollen.app.config import AppConfig, ConfigError, defaults_from_pyproject
from pollen.app.preset import load_preset
from pollen.app.reporter import RoundReporter
from pollen.app.results import RunRecorder
from pollen.app.trackers import RunTrackers, open_trackers, round_metrics
from pollen.app.trackers.base import FINISHED, STOPPED
from pollen.app.trackers.mlflow import MLflowTracker
from pollen.app.trackers.tensorboard import TensorBoardTracker
from pollen.core.processes import free_port
from pollen.strategies.engine.accounting import Accounting
from pollen.testing.flwr_cli import REPO
from pollen.testing.inprocess import run_inprocess
from pollen.testing.mlflow_server import MlflowServer

DEFAULTS = defaults_from_pyproject(str(REPO / "pyproject.toml"))

#: The columns a tracker must show, each compared number for number with metrics.json.
PLAIN = (
    "accuracy",
    "loss",
    "uplink_bytes",
    "downlink_bytes",
    "cum_uplink_bytes",
    "cum_downlink_bytes",
    "round_seconds",
)
BY_RECORD = ("uplink_by_record", "downlink_by_record")

PRESET = """
[preset]
title = "Tracker test preset"
scaled = "nothing"
size = "cpu"
supernodes = 4
needs = "fashion-mnist"

[config]
num-server-rounds = 3
model = "mlp"

[methods]
fedams = { strategy = "fedams" }
"fedcams-sign" = { strategy = "fedcams", compressor = "sign" }
"""


# --- helpers ------------------------------------------------------------------------------------------------


def rows_of(run_dir: Path) -> list[dict]:
    return json.loads((run_dir / "metrics.json").read_text())["rows"]


def expected(rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """(step, value) per metric name, straight from the rows' columns (not through the trackers' code)."""
    want: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        for column in PLAIN:
            if isinstance(row.get(column), (int, float)):
                want.setdefault(column, []).append((row["round"], float(row[column])))
        for column in BY_RECORD:
            for record, size in (row.get(column) or {}).items():
                want.setdefault(f"{column}/{record}", []).append((row["round"], float(size)))
    return want


def tensorboard_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def tensorboard_hparams(log_dir: Path) -> tuple[dict, int | None]:
    """The hyper-parameters a run's event files hold, and its session-end status (None: not ended)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    events = EventAccumulator(str(log_dir))
    events.Reload()
    content = events.PluginTagToContent("hparams")
    start = HParamsPluginData.FromString(content["_hparams_/session_start_info"]).session_start_info
    values = {key: getattr(value, value.WhichOneof("kind")) for key, value in start.hparams.items()}
    end = content.get("_hparams_/session_end_info")
    return values, HParamsPluginData.FromString(end).session_end_info.status if end else None


def assert_tensorboard_equals_rows(log_dir: Path, rows: list[dict]) -> None:
    """Every shown column, every round: TensorBoard's float32 scalar equals the row's value as float32."""
    scalars = tensorboard_scalars(log_dir)
    for name, points in expected(rows).items():
        assert scalars.get(name) == [(step, float(np.float32(value))) for step, value in points], name


def mlflow_history(client, run_id: str, name: str) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, name), key=lambda m: m.step)]


def assert_mlflow_equals_rows(client, run_id: str, rows: list[dict]) -> None:
    """Every shown column, every round: MLflow's metric (a double) equals the row's value exactly."""
    for name, points in expected(rows).items():
        assert mlflow_history(client, run_id, name) == points, name


def params_of(config: dict) -> dict[str, str]:
    """A run-config as MLflow params read back (strings; booleans as on the command line)."""
    return {
        key: ("true" if value else "false") if isinstance(value, bool) else str(value) for key, value in config.items()
    }


def hparams_of(config: dict) -> dict[str, str | float]:
    """A run-config as TensorBoard's hyper-parameters read back (numbers as floats, the rest as MLflow's text)."""
    text = params_of(config)
    return {
        key: float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else text[key]
        for key, v in config.items()
    }


def tracker_rows(rounds: int, seed: int = 0) -> list[dict]:
    """Results rows shaped as a run writes them, with per-record bytes and a round without evaluation."""
    rng = np.random.default_rng(seed)
    rows, cum_up = [], 0
    for r in range(rounds + 1):
        up = 0 if r == 0 else int(rng.integers(1000, 5000))
        cum_up += up
        rows.append(
            {
                "round": r,
                "accuracy": None if r == 1 else float(rng.uniform(0.1, 0.9)),
                "loss": None if r == 1 else float(rng.uniform(0.3, 2.3)),
                "uplink_bytes": up,
                "downlink_bytes": 8 * up,
                "uplink_by_record": {} if r == 0 else {"pollen.update": up - 100, "metrics": 100},
                "downlink_by_record": {} if r == 0 else {"arrays": 8 * up},
                "cum_uplink_bytes": cum_up,
                "cum_downlink_bytes": 8 * cum_up,
                "round_seconds": float(rng.uniform(0.1, 2.0)),
                "elapsed_seconds": 0.5 * r,
            }
        )
    return rows


def must_not_run(command: list[str], log: Path) -> int:
    raise AssertionError(f"a finished run was run again: {command}")


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "flwr" and r.levelno == logging.WARNING]


# --- rows, names and settings ---------------------------------------------------------------------------------


def test_a_results_row_becomes_named_numbers_with_dict_columns_flattened():
    row = {
        "round": 3,
        "accuracy": 0.5,
        "loss": None,
        "train_loss": "",
        "replies": 4,
        "uplink_by_record": {"pollen.update": 1200, "hafed-gossip/arrays": 30},
        "method.lazy_events": {"up-send": 3, "up-skip": 0, "note": "text"},
        "method.norms": [1.0, 2.0],
        "method.flag": True,
        "odd name!": 1.5,
    }
    assert round_metrics(row) == {
        "accuracy": 0.5,
        "replies": 4.0,
        "uplink_by_record/pollen.update": 1200.0,
        "uplink_by_record/hafed-gossip/arrays": 30.0,
        "method.lazy_events/up-send": 3.0,
        "method.lazy_events/up-skip": 0.0,
        "odd name_": 1.5,
    }


@pytest.mark.parametrize(
    ("key", "value", "words"),
    [
        ("tracker", "wandb", "comma-separated list of tensorboard, mlflow"),
        ("tracker", "mlflow,mlflow", "each once"),
        ("mlflow-tracking-uri", "ftp://host/x", "http(s)://host:port"),
        ("mlflow-tracking-uri", "http://", "http(s)://host:port"),
        ("mlflow-tracking-uri", "sqlite://", "sqlite:///path.db"),
        ("mlflow-experiment", "  ", "a non-empty MLflow experiment name"),
    ],
)
def test_bad_tracker_settings_stop_the_run_naming_the_key_and_what_is_allowed(key, value, words):
    with pytest.raises(ConfigError) as err:
        AppConfig.from_run_config({**DEFAULTS, key: value})
    assert f"run-config '{key}' = {value!r}" in str(err.value) and words in str(err.value)


def test_good_tracker_settings_pass():
    for settings in (
        {"tracker": "tensorboard, mlflow", "mlflow-tracking-uri": "http://127.0.0.1:5000"},
        {"tracker": "mlflow", "mlflow-tracking-uri": "sqlite:////tmp/x/mlflow.db"},
        {"tracker": "mlflow", "mlflow-tracking-uri": "postgresql+psycopg2://u@db/mlflow"},
        {"tracker": "mlflow", "mlflow-tracking-uri": "mlruns"},
    ):
        AppConfig.from_run_config({**DEFAULTS, **settings})


def test_a_chosen_tracker_that_is_not_installed_names_the_extra_to_install(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    cfg = AppConfig.from_run_config({**DEFAULTS, "tracker": "tensorboard,mlflow"})
    with pytest.raises(
        ConfigError, match=r'mlflow is not installed; install it with: pip install "flwr-pollen\[mlflow\]"'
    ):
        open_trackers(cfg, tmp_path / "run")


def test_trackers_write_beside_the_results_unless_told_where(tmp_path):
    cfg = AppConfig.from_run_config({**DEFAULTS, "tracker": "tensorboard,mlflow"})
    board, flow = (guarded.tracker for guarded in open_trackers(cfg, tmp_path / "results" / "run-a").trackers)
    assert board.log_dir == tmp_path / "results" / "tensorboard" / "run-a"
    assert flow.tracking_uri == f"sqlite:///{tmp_path / 'results' / 'mlflow.db'}"
    assert (flow.experiment, flow.run_name) == ("pollen", "run-a")
    cfg = cfg.replace(**{"tracker-dir": str(tmp_path / "boards"), "mlflow-experiment": "mine"})
    board, flow = (guarded.tracker for guarded in open_trackers(cfg, tmp_path / "results" / "run-a").trackers)
    assert board.log_dir == tmp_path / "boards" / "run-a" and flow.experiment == "mine"
    assert not open_trackers(cfg.replace(tracker=""), tmp_path / "results" / "run-a")


# --- TensorBoard ------------------------------------------------------------------------------------------------


def test_a_resumed_run_continues_its_tensorboard_directory_from_the_checkpoint_round(tmp_path):
    first, second = tracker_rows(3, seed=1), tracker_rows(3, seed=2)
    board = RunTrackers([TensorBoardTracker(tmp_path / "tb" / "run")])
    board.start({"seed": 1})
    for row in first:  # rounds 2 and 3 were logged, then the run crashed; its checkpoint is round 1's
        board.log_round(row)
    board.finish(STOPPED)
    again = TensorBoardTracker(tmp_path / "tb" / "run")
    resumed = RunTrackers([again])
    resumed.start({"seed": 1}, earlier_rows=first[:2])
    for row in second[2:]:
        resumed.log_round(row)
    resumed.finish(FINISHED)
    assert_tensorboard_equals_rows(tmp_path / "tb" / "run", first[:2] + second[2:])
    assert tensorboard_hparams(tmp_path / "tb" / "run")[1] == 1  # STATUS_SUCCESS


def test_a_sweep_keeps_one_tensorboard_directory_with_a_folder_per_run(tmp_path):
    """Runs finished before the tracker was asked for are not run again: their rows are logged instead."""
    preset_path = tmp_path / "tiny.toml"
    preset_path.write_text(PRESET)
    preset, out = load_preset(str(preset_path)), tmp_path / "sweep"
    untracked = sweep.plan(preset, ["fedams", "fedcams-sign"], [1], {}, None, out)
    for index, run in enumerate(untracked):
        recorder = RunRecorder(run.run_dir, run.config)
        for row in tracker_rows(3, seed=index):
            recorder.record(row)
    runs = sweep.plan(preset, ["fedams", "fedcams-sign"], [1], {"tracker": "tensorboard"}, None, out)
    assert {run.config["tracker-dir"] for run in runs} == {str(out / "tensorboard")}
    assert all(sweep.is_finished(run) for run in runs)  # the tracker keys do not make a run run again

    assert sweep.execute(runs, app=".", supernodes=4, runner=must_not_run, say=lambda line: None) == []
    assert sorted(path.name for path in (out / "tensorboard").iterdir()) == sorted(run.run_dir.name for run in runs)
    for run in runs:
        assert_tensorboard_equals_rows(out / "tensorboard" / run.run_dir.name, rows_of(run.run_dir))
    assert sweep.where_tracked(runs[0]) == [f"TensorBoard: tensorboard --logdir {out / 'tensorboard'}"]


# --- a real run of the ServerApp, in process --------------------------------------------------------------------


def test_a_run_logs_every_round_to_tensorboard_and_to_a_local_mlflow_store(tmp_path):
    """The ServerApp's own path: the default locations beside the results, numbers equal to metrics.json."""
    from mlflow.tracking import MlflowClient

    settings = {
        "strategy": "fedcams",
        "compressor": "sign",
        "model": "mlp",
        "num-server-rounds": 3,
        "eval-every": 2,  # round 1 has no accuracy: the trackers must not invent one
        "local-steps": 2,
        "batch-size": 16,
        "eval-batch-size": 500,
        "fraction-train": 1.0,
        "fraction-evaluate": 0.0,
        "results-dir": str(tmp_path / "results"),
        "run-name": "tracked",
        "tracker": "tensorboard,mlflow",
    }
    rows = run_inprocess(settings, 3)
    assert [row["round"] for row in rows] == [0, 1, 2, 3] and rows[1]["accuracy"] is None
    assert rows[2]["uplink_by_record"] and rows[2]["downlink_by_record"]
    config = json.loads((tmp_path / "results" / "tracked" / "config.json").read_text())

    board = tmp_path / "results" / "tensorboard" / "tracked"
    assert_tensorboard_equals_rows(board, rows)
    assert [step for step, _ in tensorboard_scalars(board)["accuracy"]] == [0, 2, 3]
    assert tensorboard_hparams(board) == (hparams_of(config), 1)  # 1: STATUS_SUCCESS

    client = MlflowClient(f"sqlite:///{tmp_path / 'results' / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("pollen")
    (run,) = client.search_runs([experiment.experiment_id])
    assert (run.info.run_name, run.info.status) == ("tracked", "FINISHED")
    assert run.data.params == params_of(config)
    assert_mlflow_equals_rows(client, run.info.run_id, rows)


# --- an MLflow tracking server ------------------------------------------------------------------------------


def test_an_unreachable_tracking_server_costs_one_warning_and_the_rounds_go_on(tmp_path, caplog):
    closed = f"http://127.0.0.1:{free_port()}"
    cfg = AppConfig.from_run_config(
        {**DEFAULTS, "tracker": "mlflow", "mlflow-tracking-uri": closed, "num-server-rounds": 4, "device": "cpu"}
    )
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 3))
    loader = DataLoader(TensorDataset(torch.randn(8, 4), torch.randint(0, 3, (8,))), batch_size=4)
    strategy = type("Strategy", (), {"accounting": Accounting()})()
    recorder = RunRecorder(tmp_path / "run", cfg.as_dict())
    trackers = open_trackers(cfg, tmp_path / "run")
    reporter = RoundReporter(cfg, strategy, recorder, model, loader, trackers)
    started = time.perf_counter()
    with caplog.at_level(logging.WARNING, logger="flwr"):
        trackers.start(cfg.as_dict())
        for server_round in range(5):
            reporter(server_round, ArrayRecord(model.state_dict()))
        trackers.finish(FINISHED)
    assert time.perf_counter() - started < 60
    assert [row["round"] for row in rows_of(tmp_path / "run")] == [0, 1, 2, 3, 4]
    (warning,) = warnings_of(caplog)
    assert "tracker mlflow" in warning and closed in warning and "the run goes on" in warning


@pytest.fixture(scope="module")
def _server(tmp_path_factory):
    with MlflowServer(tmp_path_factory.mktemp("mlflow-server")) as server:
        yield server


@pytest.fixture
def mlflow_server(_server):
    """One server for this module's tests (a test that stops it leaves the next one a fresh start)."""
    if _server.process is None:
        _server.start()
    return _server


@pytest.mark.slow
@pytest.mark.xdist_group("mlflow-server")
def test_the_runs_of_a_sweep_land_in_one_mlflow_experiment_on_a_tracking_server(tmp_path, mlflow_server):
    from mlflow.tracking import MlflowClient

    preset_path = tmp_path / "tiny.toml"
    preset_path.write_text(PRESET)
    preset, out = load_preset(str(preset_path)), tmp_path / "sweep"
    settings = {"tracker": "mlflow", "mlflow-tracking-uri": mlflow_server.uri}
    runs = sweep.plan(preset, ["fedams", "fedcams-sign"], [1], settings, None, out)
    assert {run.config["mlflow-experiment"] for run in runs} == {"sweep-sweep"}
    for index, run in enumerate(runs):
        recorder = RunRecorder(run.run_dir, run.config)
        for row in tracker_rows(3, seed=10 + index):
            recorder.record(row)
    for _ in range(2):  # the second pass finds each run already in MLflow and logs nothing twice
        assert sweep.execute(runs, app=".", supernodes=4, runner=must_not_run, say=lambda line: None) == []

    client = MlflowClient(mlflow_server.uri)
    experiment = client.get_experiment_by_name("sweep-sweep")
    logged = {run.info.run_name: run for run in client.search_runs([experiment.experiment_id])}
    assert sorted(logged) == sorted(run.run_dir.name for run in runs)
    for run in runs:
        mine = logged[run.run_dir.name]
        assert mine.info.status == "FINISHED"
        assert mine.data.params["strategy"] == run.config["strategy"]
        assert_mlflow_equals_rows(client, mine.info.run_id, rows_of(run.run_dir))


@pytest.mark.slow
@pytest.mark.xdist_group("mlflow-server")
def test_a_resumed_run_continues_its_mlflow_run_and_a_server_that_goes_away_costs_one_warning(
    tmp_path, mlflow_server, caplog
):
    from mlflow.tracking import MlflowClient

    rows = tracker_rows(4, seed=7)
    config = {"strategy": "fedams", "seed": 3, "bias-correction": False}
    first = RunTrackers([MLflowTracker(mlflow_server.uri, "resume", "run-r", tmp_path)])
    first.start(config)
    for row in rows[:2]:
        first.log_round(row)
    first.finish(STOPPED)
    client = MlflowClient(mlflow_server.uri)
    (stopped,) = client.search_runs([client.get_experiment_by_name("resume").experiment_id])
    assert stopped.info.status == "KILLED"

    resumed = RunTrackers([MLflowTracker(mlflow_server.uri, "resume", "run-r", tmp_path)])
    resumed.start({**config, "num-server-rounds": 20}, earlier_rows=rows[:2])
    resumed.log_round(rows[2])
    (run,) = client.search_runs([client.get_experiment_by_name("resume").experiment_id])
    assert run.info.run_id == stopped.info.run_id and run.info.status == "RUNNING"
    assert run.data.params == params_of(config)
    assert_mlflow_equals_rows(client, run.info.run_id, rows[:3])

    mlflow_server.stop()
    started = time.perf_counter()
    with caplog.at_level(logging.WARNING, logger="flwr"):
        for row in rows[3:]:
            resumed.log_round(row)
        resumed.finish(FINISHED)
    assert time.perf_counter() - started < 60
    (warning,) = warnings_of(caplog)
    assert "failed to log round 3" in warning and "the run goes on" in warning
