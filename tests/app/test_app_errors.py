"""The ServerApp stops before round 1, with one clear line, on every kind of bad input.

The ServerApp's ``main`` runs in-process on a fake grid whose clients must never be
called: every case fails before the first train message.
"""

from __future__ import annotations

import logging

import pytest
from flwr.app import Context, RecordDict

import pollen.server_app as server_app
from pollen.app.config import ConfigError, defaults_from_pyproject
from pollen.app.results import read_run_state
from pollen.testing.fakes import FakeGrid, capture_flwr_logs
from pollen.testing.flwr_cli import REPO


def never_called(msg):  # noqa: ANN001, ANN201
    raise AssertionError("no message may reach a client when the config is bad")


def run_main(tmp_path, nodes: int = 3, **overrides):  # noqa: ANN001, ANN003, ANN201
    run_config = {
        **defaults_from_pyproject(str(REPO / "pyproject.toml")),
        "results-dir": str(tmp_path),
        "run-name": "bad",
    }
    run_config.update(overrides)
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=run_config)
    grid = FakeGrid(list(range(1, nodes + 1)), never_called)
    with capture_flwr_logs(logging.ERROR) as records, pytest.raises(ConfigError) as err:
        server_app.main(grid, context)
    folder = tmp_path / "bad"
    assert [p.name for p in folder.iterdir()] == ["run.json"], "only the run state may be written before round 1"
    state = read_run_state(folder)
    assert (state["status"], state["reason"], state["last_round"]) == ("stopped", str(err.value), 0)
    lines = [r.getMessage() for r in records if "stopped before round 1" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0] and f"(run.json in {folder})" in lines[0]
    return str(err.value)


@pytest.mark.parametrize(
    "key, value, allowed",
    [
        ("strategy", "fedfoo", "fedams"),
        ("dataset", "imagenet", "fashion-mnist"),
        ("model", "vgg", "resnet18"),
        ("partitioner", "zipf", "dirichlet"),
        ("local-lr", 0.0, "> 0"),
        ("server-lr", -1.0, "> 0"),
        ("fraction-train", 0.0, "(0, 1]"),
        ("fraction-train", 1.5, "(0, 1]"),
    ],
)
def test_bad_run_config_values(tmp_path, key, value, allowed):
    message = run_main(tmp_path, **{key: value})
    assert key in message and str(value) in message and allowed in message


def test_more_clients_requested_than_partitions(tmp_path):
    message = run_main(tmp_path, nodes=3, **{"min-train-nodes": 5, "node-wait-seconds": 0.5})
    assert "min-train-nodes" in message and "5" in message and "3" in message


def test_data_dir_without_the_dataset(tmp_path):
    empty = tmp_path / "empty-data"
    empty.mkdir()
    message = run_main(tmp_path, **{"data-dir": str(empty)})
    assert "data-dir" in message and str(empty) in message


def test_dataset_with_no_reachable_source(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    message = run_main(tmp_path, dataset="cifar10", model="cnn")
    assert "cifar10" in message and "data-dir" in message


def test_more_test_examples_than_the_test_split(tmp_path):
    message = run_main(tmp_path, **{"test-examples": 10**6})
    assert "test-examples=1000000" in message and "allowed: 0 (the whole split) or 1 to" in message


@pytest.mark.parametrize("aggregator", ["median", "trimmed-mean", "majority-vote"])
def test_a_robust_aggregator_with_error_fed_uploads(tmp_path, aggregator):
    """Issue 43: a robust aggregate has no per-client share to tell an error-fed client; FedCAMS's own uplink
    (scaled sign, error feedback on) with a robust aggregator stops before round 1 with what is allowed."""
    message = run_main(tmp_path, strategy="fedcams", aggregator=aggregator)
    assert f"aggregator={aggregator!r} cannot take error-fed 'sign' uploads" in message
    assert message.endswith(
        "allowed: error_feedback=False (run-config 'error-feedback' = false) with it, or aggregator='mean'"
    )
