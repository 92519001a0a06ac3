"""Test and demo code out of the product: the fault keys and the relay demo live only in the test harness's apps."""

from __future__ import annotations

import logging

import pytest
import tomllib
from flwr.app import Context, RecordDict

from pollen import client_app
from pollen.app.config import AppConfig, ConfigError, defaults_from_pyproject, strategy_names
from pollen.app.experiment import build_strategy
from pollen.app.results import read_run_state
from pollen.clientside.compression_mod import compression_mod
from pollen.clientside.lazy_mod import lazy_mod
from pollen.clientside.secagg_mod import secagg_mod
from pollen.testing import apps
from pollen.testing.fakes import FakeGrid, capture_flwr_logs
from pollen.testing.flwr_cli import REPO
from pollen.testing.relay_demo import FIRST_HALF_STEP, RELAY_PHASE, RelayAverage

PYPROJECT = REPO / "pyproject.toml"


@pytest.fixture(scope="module")
def defaults() -> dict:
    return defaults_from_pyproject(str(PYPROJECT))


def test_the_products_run_config_has_no_fault_keys(defaults: dict) -> None:
    assert not [key for key in defaults if key.startswith("fault-")]
    with pytest.raises(ConfigError, match="run-config key 'fault-fraction' is unknown"):
        AppConfig.from_run_config({**defaults, "fault-fraction": 0.3})


def test_the_products_client_app_runs_no_fault_mod() -> None:
    assert client_app.TRAIN_MODS == (secagg_mod, lazy_mod, compression_mod)
    assert client_app.PHASE_MODS == (secagg_mod, compression_mod)
    assert FIRST_HALF_STEP not in client_app.LOCAL_STEPS and RELAY_PHASE not in client_app.PHASES


def test_the_relay_demo_is_a_method_of_the_harness_only(defaults: dict) -> None:
    assert "relay-demo" not in strategy_names() and "relay-demo" in strategy_names(apps.METHODS)
    assert set(strategy_names()) < set(apps.METHODS)
    with pytest.raises(ConfigError, match="'strategy' = 'relay-demo' is out of range"):
        AppConfig.from_run_config({**defaults, "strategy": "relay-demo"})
    cfg = AppConfig.from_run_config({**defaults, "strategy": "relay-demo", "server-lr": 0.5}, methods=apps.METHODS)
    strategy = build_strategy(cfg)
    assert type(strategy) is RelayAverage and strategy.optimizer.hyperparameters()["eta"] == 0.5
    assert cfg.replace(seed=3)["strategy"] == "relay-demo"  # the table travels with the config
    assert apps.STEPS[FIRST_HALF_STEP] and apps.STEPS["sgd"] is client_app.LOCAL_STEPS["sgd"]
    assert RELAY_PHASE in apps.PHASES


def test_handlers_see_a_run_config_without_the_testing_keys() -> None:
    state = RecordDict()
    context = Context(
        run_id=1,
        node_id=2,
        node_config={"partition-id": 1},
        state=state,
        run_config={"seed": 4, "fault-fraction": 0.5, "fault-kind": "mixed", "fault-delay": 0.0},
    )
    product = apps.product_context(context)
    assert product.run_config == {"seed": 4} and product.state is state and product.node_config == context.node_config
    assert context.run_config["fault-fraction"] == 0.5  # the message's own context is left as it was


def test_the_testing_pyproject_runs_the_harness_apps_with_the_fault_keys() -> None:
    product = PYPROJECT.read_text()
    testing = tomllib.loads(apps.testing_pyproject(product))
    flwr = testing["tool"]["flwr"]["app"]
    assert flwr["components"] == {
        "serverapp": "pollen.testing.apps:serverapp",
        "clientapp": "pollen.testing.apps:clientapp",
    }
    original = tomllib.loads(product)["tool"]["flwr"]["app"]["config"]
    assert flwr["config"] == {
        **original,
        "fault-fraction": 0.0,
        "fault-kind": "error",
        "fault-delay": 0.0,
        "fault-phase": "",
        "fault-partitions": "",
        "trace-dir": "",
    }
    with pytest.raises(ValueError, match="no single 'clientapp = ...' line"):
        apps.testing_pyproject(product.replace('clientapp = "pollen.client_app:app"', ""))


def test_the_testing_server_app_refuses_a_bad_fault_key_before_round_1(defaults: dict, tmp_path) -> None:
    def never_called(msg):  # noqa: ANN001, ANN202
        raise AssertionError("no message may reach a client when the config is bad")

    run_config = {
        **defaults,
        "results-dir": str(tmp_path),
        "run-name": "bad",
        "fault-fraction": 0.2,
        "fault-kind": "boom",
        "fault-delay": 0.0,
    }
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=run_config)
    with capture_flwr_logs(logging.ERROR) as records, pytest.raises(ConfigError) as err:
        apps.main(FakeGrid([1, 2, 3], never_called), context)
    assert "'fault-kind' = 'boom'" in str(err.value) and "one of error, garbage, timeout, mixed" in str(err.value)
    assert len([r for r in records if "stopped before round 1" in r.getMessage()]) == 1
    assert [p.name for p in (tmp_path / "bad").iterdir()] == ["run.json"]  # the run state, nothing else
    assert read_run_state(tmp_path / "bad")["status"] == "stopped"
