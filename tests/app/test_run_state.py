"""How a run says it ended and where: ``run.json``, the pollen home for relative paths, the first and last lines.

``flwr run`` exits 0 however the run ended (Flower 1.39), so the run folder's ``run.json`` says it. The
ServerApp runs in-process on a fake grid; one short real run (an MLP, 3 clients) covers stopped, resumed and
finished, with relative paths and another working directory.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from flwr.app import Context, RecordDict

import pollen.server_app as server_app
from pollen.app import paths
from pollen.app.config import ConfigError, defaults_from_pyproject
from pollen.app.results import RunRecorder, read_run_state
from pollen.testing.fakes import FakeGrid, capture_flwr_logs
from pollen.testing.flwr_cli import REPO
from pollen.testing.inprocess import run_inprocess

DEFAULTS = defaults_from_pyproject(str(REPO / "pyproject.toml"))
SMALL = {
    "model": "mlp",
    "num-server-rounds": 2,
    "local-steps": 1,
    "batch-size": 16,
    "eval-batch-size": 500,
    "test-examples": 500,
    "fraction-train": 1.0,
    "fraction-evaluate": 0.0,
}


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A pollen home, and a working directory elsewhere (as the SuperLink's would be)."""
    monkeypatch.setenv(paths.HOME_ENV, str(tmp_path / "home"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    return tmp_path / "home"


def never_called(msg):  # noqa: ANN001, ANN201
    raise AssertionError("no message may reach a client when the config is bad")


def context_of(**overrides) -> Context:  # noqa: ANN003
    return Context(run_id=7, node_id=0, node_config={}, state=RecordDict(), run_config={**DEFAULTS, **overrides})


def pollen_lines(records: list[logging.LogRecord]) -> list[str]:
    return [r.getMessage() for r in records if r.getMessage().startswith("[pollen]")]


# --------------------------------------------------------------------------------------------- the rule


def test_relative_paths_resolve_against_the_pollen_home_not_the_working_directory(home: Path) -> None:
    assert paths.resolve("results") == home / "results"
    assert paths.resolve("results/a/../b") == home / "results" / "b"
    assert paths.resolve("/srv/runs") == Path("/srv/runs")
    assert paths.resolve("~/runs") == Path.home() / "runs"
    assert paths.resolved_server_paths({"results-dir": "r", "resume": "", "tracker-dir": "/abs", "seed": 1}) == {
        "results-dir": str(home / "r")
    }


def test_without_pollen_home_the_home_is_dot_pollen(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(paths.HOME_ENV, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert paths.resolve("results") == tmp_path / ".pollen" / "results"


@pytest.mark.parametrize("key", paths.NODE_PATH_KEYS)
def test_a_relative_path_every_client_reads_is_refused(home: Path, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        server_app.main(FakeGrid([1, 2, 3], never_called), context_of(**{key: "data", "run-name": "rel"}))
    assert f"'{key}' = 'data'" in str(err.value) and "an absolute path or one starting with ~" in str(err.value)


# ------------------------------------------------------------------------------------------- refusals


def test_flowers_entry_point_ends_a_refusal_with_one_line_and_no_exception(home: Path) -> None:
    """What ``flwr run`` shows: the run's folder, then one line (Flower prints a traceback only for what the
    ServerApp raises)."""
    context = context_of(**{"run-name": "r", "min-train-nodes": 5, "node-wait-seconds": 0.1})
    with capture_flwr_logs() as records:
        server_app.app._main(FakeGrid([1, 2, 3], never_called), context)
    folder = home / "results" / "r"
    reason = "run-config 'min-train-nodes' = 5 but only 3 SuperNodes (partitions) are connected; allowed: at most 3"
    assert pollen_lines(records) == [
        f"[pollen] run r: fedams on fashion-mnist; results in {folder}",
        f"[pollen] stopped before round 1: {reason} (run.json in {folder})",
    ]
    state = read_run_state(folder)
    assert (state["status"], state["reason"], state["last_round"]) == ("stopped", reason, 0)
    assert state["flower_run_id"] == 7 and state["results"] == str(folder)


def test_a_config_refused_before_its_folder_is_known_names_the_folder_in_its_one_line(home: Path) -> None:
    with capture_flwr_logs() as records:
        server_app.app._main(FakeGrid([1, 2, 3], never_called), context_of(**{"run-name": "r", "local-lr": 0.0}))
    assert pollen_lines(records) == [
        "[pollen] stopped before round 1: run-config 'local-lr' = 0.0 is out of range; allowed: a number > 0 "
        f"(run.json in {home / 'results' / 'r'})"
    ]


def test_a_misspelt_key_names_the_nearest_one_and_lands_where_the_config_says(home: Path) -> None:
    context = context_of(**{"run-name": "typo", "results-dir": "mine", "compresor": "topk"})
    with capture_flwr_logs() as records, pytest.raises(ConfigError, match="nearest allowed: 'compressor'"):
        server_app.main(FakeGrid([1, 2, 3], never_called), context)
    assert read_run_state(home / "mine" / "typo")["reason"].startswith("run-config key 'compresor' is unknown")
    assert len(pollen_lines(records)) == 1 and f"(run.json in {home / 'mine' / 'typo'})" in pollen_lines(records)[0]


def test_a_resume_of_a_folder_that_does_not_exist_creates_nothing(home: Path) -> None:
    with capture_flwr_logs() as records, pytest.raises(ConfigError):
        server_app.main(FakeGrid([1, 2, 3], never_called), context_of(resume="results/nope"))
    assert not (home / "results").exists()
    assert "run.json" not in pollen_lines(records)[-1] and str(home / "results" / "nope") in pollen_lines(records)[0]


# ---------------------------------------------------------------------------------- a run, start to end


def test_a_stopped_then_resumed_run_says_so_each_time_under_the_pollen_home(home: Path) -> None:
    """Relative ``results-dir`` and ``resume``, another working directory: everything under the home."""
    folder = home / "results" / "cut"
    with capture_flwr_logs() as records:
        run_inprocess({**SMALL, "run-name": "cut", "stop-after-round": 1}, 3)
    lines = pollen_lines(records)
    assert str(folder) in lines[0] and f"resume='{folder}'" in lines[-1]
    stopped = read_run_state(folder)
    assert (stopped["status"], stopped["last_round"], stopped["num_rounds"]) == ("stopped", 1, 2)
    assert stopped["reason"] == "stop-after-round=1: stopped after round 1 as asked" and stopped["ended_at"]
    assert not (Path.cwd() / "results").exists()

    with capture_flwr_logs() as records:
        rows = run_inprocess({**SMALL, "run-name": "cut", "resume": "results/cut"}, 3)
    lines = pollen_lines(records)
    assert str(folder) in lines[0] and lines[-1].startswith("[pollen] done") and lines[-1].endswith(str(folder))
    finished = read_run_state(folder)
    assert (finished["status"], finished["reason"], finished["last_round"]) == ("finished", "", 2)
    assert [row["round"] for row in rows] == [0, 1, 2]


def test_a_run_that_crashes_says_failed_and_the_error_still_reaches_flower(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken_finish(self, final_arrays, summary):  # noqa: ANN001, ANN202
        raise OSError("disk full")

    monkeypatch.setattr(RunRecorder, "finish", broken_finish)
    with capture_flwr_logs() as records, pytest.raises(OSError, match="disk full"):
        run_inprocess({**SMALL, "run-name": "crash"}, 3)
    state = read_run_state(home / "results" / "crash")
    assert (state["status"], state["reason"], state["last_round"]) == ("failed", "OSError: disk full", 2)
    assert pollen_lines(records)[-1].endswith(f"results so far in {home / 'results' / 'crash'}")
