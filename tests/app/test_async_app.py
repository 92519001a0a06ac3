"""``driver=async`` through pollen's app, in-process on real Fashion-MNIST partitions (issue 38).

The ServerApp builds the buffered asynchronous driver from the run-config; each server step is a results
row carrying the virtual clock and the staleness of the replies it applied. A run is bit-identical whatever
order the replies arrive in (the grid's pulls hand each waiting reply back with probability 1/2), and the
asynchronous FedCAMS (sign + error feedback) runs its codec unchanged. Bad driver settings stop the run
before round 1 with one line.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from pollen.app.config import AppConfig, ConfigError, defaults_from_pyproject
from pollen.testing.inprocess import PYPROJECT, run_inprocess

SMALL = {
    "model": "mlp",
    "num-server-rounds": 4,
    "local-steps": 2,
    "batch-size": 16,
    "eval-every": 2,
    "eval-batch-size": 500,
    "test-examples": 500,
    "fraction-train": 1.0,
    "fraction-evaluate": 0.0,
    "driver": "async",
    "concurrency": 3,
    "buffer-size": 2,
    "client-speed": "stragglers:0.3:3:5",
}
NODES = 4


def _run(tmp_path: Path, tag: str, arrival_seed: int | None, **extra: object) -> tuple[list[dict], str]:
    settings = {**SMALL, **extra, "results-dir": str(tmp_path), "run-name": tag}
    rows = run_inprocess(settings, NODES, arrival_seed=arrival_seed)[1:]  # row 0: the initial model
    digest = hashlib.sha256((tmp_path / tag / "final_model.npz").read_bytes()).hexdigest()
    return rows, digest


@pytest.mark.parametrize(
    "method",
    [
        {"strategy": "fedams", "async-rule": "fadas"},
        {"strategy": "fedopt", "server-optimizer": "sgd", "server-lr": 1.0, "async-rule": "fedbuff"},
        {"strategy": "fedcams", "compressor": "sign", "async-rule": "fadas"},
    ],
    ids=["fadas", "fedbuff", "fedcams-async"],
)
def test_an_async_run_writes_a_row_per_step_and_ignores_arrival_order(tmp_path: Path, method: dict) -> None:
    rows, first = _run(tmp_path, "a", None, **method)
    assert [row["round"] for row in rows] == [1, 2, 3, 4]
    assert all(row["replies"] == 2 for row in rows), [row["replies"] for row in rows]
    clock = [row["method.async_virtual_time"] for row in rows]
    assert all(b >= a for a, b in zip(clock, clock[1:])) and clock[-1] > 0
    assert all(row["method.async_staleness_max"] >= 0 for row in rows)
    assert rows[-1]["accuracy"] > 0.1
    _, again = _run(tmp_path, "b", 5, **method)
    assert again == first


def test_the_async_fedasync_rule_takes_a_buffer_of_one_by_default(tmp_path: Path) -> None:
    rows, _ = _run(
        tmp_path,
        "fedasync",
        None,
        strategy="fedopt",
        **{"server-optimizer": "sgd", "server-lr": 1.0},
        **{"async-rule": "fedasync", "buffer-size": 0},
    )
    assert [row["replies"] for row in rows] == [1, 1, 1, 1]


def test_a_method_that_needs_lock_step_rounds_stops_before_round_1(tmp_path: Path) -> None:
    from pollen.server_app import RunRefused

    with pytest.raises(RunRefused, match="gossip"):
        _run(tmp_path, "hafed", None, strategy="hafed", **{"cluster-size": 2})


def test_a_buffer_larger_than_the_concurrency_is_refused_by_the_config() -> None:
    run_config = {**defaults_from_pyproject(str(PYPROJECT)), "driver": "async", "concurrency": 2, "buffer-size": 3}
    with pytest.raises(ConfigError, match="buffer-size <= concurrency"):
        AppConfig.from_run_config(run_config, given=set(run_config))


def test_a_bad_client_speed_is_refused_with_the_models_allowed() -> None:
    run_config = {**defaults_from_pyproject(str(PYPROJECT)), "client-speed": "stragglers:half"}
    with pytest.raises(ConfigError, match="stragglers:fraction:k_lo:k_hi"):
        AppConfig.from_run_config(run_config, given={"client-speed"})


@pytest.mark.parametrize("stop_after", [1, 3])
def test_a_resumed_async_run_equals_the_uninterrupted_one(tmp_path: Path, stop_after: int) -> None:
    """FedCAMS (error feedback in client state files) on the async driver: stopped after a step with jobs still
    in flight (their clients already trained them), resumed, it ends bit-identical to the uninterrupted run. The
    jobs in flight go out again with the model and round they had, and each client starts them again from its
    state of before (``state-dir``)."""
    import numpy as np

    settings = {
        **SMALL,
        "strategy": "fedcams",
        "compressor": "sign",
        "num-server-rounds": 5,
        "results-dir": str(tmp_path),
    }
    full = run_inprocess({**settings, "run-name": "full", "state-dir": str(tmp_path / "clients-full")}, NODES)
    cut_settings = {**settings, "state-dir": str(tmp_path / "clients")}
    run_inprocess({**cut_settings, "run-name": "cut", "stop-after-round": stop_after}, NODES, arrival_seed=3)
    cut = tmp_path / "cut"
    assert (cut / "checkpoint.npz").is_file() and not (cut / "final_model.npz").exists()
    resumed = run_inprocess({**cut_settings, "run-name": "cut", "resume": str(cut)}, NODES, arrival_seed=9)
    assert [row["round"] for row in resumed] == [row["round"] for row in full]
    assert [row["accuracy"] for row in resumed] == [row["accuracy"] for row in full]
    clock = [row.get("method.async_virtual_time") for row in resumed]
    assert clock == [row.get("method.async_virtual_time") for row in full]
    want, got = np.load(tmp_path / "full" / "final_model.npz"), np.load(cut / "final_model.npz")
    for name in want.files:
        assert want[name].tobytes() == got[name].tobytes(), name


@pytest.mark.parametrize(("first", "then"), [("async", "sync"), ("sync", "async")])
def test_a_checkpoint_resumes_only_on_the_driver_that_wrote_it(tmp_path: Path, first: str, then: str) -> None:
    from pollen.server_app import RunRefused

    settings = {**SMALL, "num-server-rounds": 3, "results-dir": str(tmp_path), "strategy": "fedams"}
    run_inprocess({**settings, "driver": first, "run-name": "cut", "stop-after-round": 1}, NODES)
    with pytest.raises(RunRefused, match="driver"):
        run_inprocess({**settings, "run-name": "cut", "driver": then, "resume": str(tmp_path / "cut")}, NODES)


def test_an_altered_driver_state_is_refused_before_the_run_goes_on(tmp_path: Path) -> None:
    """A job in flight whose start lies after the saved clock: one line naming the field, nothing resumed."""
    from pollen.core.checkpoint import load_checkpoint, save_checkpoint
    from pollen.server_app import RunRefused

    settings = {**SMALL, "num-server-rounds": 3, "results-dir": str(tmp_path), "resume-trust-file": True}
    run_inprocess({**settings, "run-name": "cut", "stop-after-round": 1}, NODES)
    path = tmp_path / "cut" / "checkpoint.npz"
    tree = load_checkpoint(path)
    tree["driver"]["jobs"][0][2] = tree["driver"]["clock"] + 5.0
    save_checkpoint(path, tree)
    with pytest.raises(RunRefused, match=r"driver/jobs/0/2"):
        run_inprocess({**settings, "run-name": "cut", "resume": str(tmp_path / "cut")}, NODES)


def test_a_driver_state_with_two_jobs_of_one_client_is_refused(tmp_path: Path) -> None:
    from pollen.core.checkpoint import load_checkpoint, save_checkpoint
    from pollen.server_app import RunRefused

    settings = {**SMALL, "num-server-rounds": 3, "results-dir": str(tmp_path), "resume-trust-file": True}
    run_inprocess({**settings, "run-name": "cut", "stop-after-round": 1}, NODES)
    path = tmp_path / "cut" / "checkpoint.npz"
    tree = load_checkpoint(path)
    first = list(tree["driver"]["jobs"][0])
    tree["driver"]["jobs"].append([first[0], first[1], first[2], first[3], tree["driver"]["seq"]])
    save_checkpoint(path, tree)
    index = len(tree["driver"]["jobs"]) - 1
    with pytest.raises(RunRefused, match=rf"driver/jobs/{index}/0.*one job at a time"):
        run_inprocess({**settings, "run-name": "cut", "resume": str(tmp_path / "cut")}, NODES)


def test_a_resumed_sync_run_with_a_speed_model_keeps_its_virtual_clock(tmp_path: Path) -> None:
    settings = {
        **SMALL,
        "driver": "sync",
        "strategy": "fedams",
        "num-server-rounds": 4,
        "results-dir": str(tmp_path),
        "client-speed": "stragglers:0.5:3:5",
    }
    full = run_inprocess({**settings, "run-name": "full"}, NODES)
    run_inprocess({**settings, "run-name": "cut", "stop-after-round": 2}, NODES)
    resumed = run_inprocess({**settings, "run-name": "cut", "resume": str(tmp_path / "cut")}, NODES)
    want = [row.get("method.async_virtual_time") for row in full]
    assert [row.get("method.async_virtual_time") for row in resumed] == want
    assert want[-1] > want[1] > 0
