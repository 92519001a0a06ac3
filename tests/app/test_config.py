"""Run-config validation (DESIGN.md: one clear line naming key, value and what is allowed)
and building every strategy from it (no torch needed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pollen.app.config import (
    DATASETS,
    MODELS,
    PARTITIONERS,
    SCHEMA,
    AppConfig,
    ConfigError,
    defaults_from_pyproject,
    strategy_names,
)
from pollen.app.experiment import build_strategy

pytestmark = pytest.mark.flower_compat

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def defaults() -> dict:
    return defaults_from_pyproject(str(ROOT / "pyproject.toml"))


def test_defaults_from_pyproject_pass(defaults):
    assert set(defaults) == set(SCHEMA)
    cfg = AppConfig.from_run_config(defaults)
    assert cfg["strategy"] in strategy_names()
    assert isinstance(cfg["server-lr"], float) and isinstance(cfg["seed"], int)
    assert isinstance(cfg["error-feedback"], bool)
    assert cfg.as_dict() == {k: cfg[k] for k in SCHEMA}
    # Integers given for float keys become floats (TOML "1" for a learning rate).
    assert AppConfig.from_run_config({**defaults, "server-lr": 1})["server-lr"] == 1.0
    assert isinstance(AppConfig.from_run_config({**defaults, "server-lr": 1})["server-lr"], float)
    assert cfg.replace(**{"server-lr": 0.5})["server-lr"] == 0.5


def _error(defaults: dict, **changes: object) -> str:
    with pytest.raises(ConfigError) as info:
        AppConfig.from_run_config({**defaults, **changes})
    message = str(info.value)
    assert "\n" not in message, "one line"
    return message


@pytest.mark.parametrize(
    ("key", "value", "allowed"),
    [
        ("strategy", "fedprox", strategy_names()),
        ("dataset", "imagenet", DATASETS),
        ("model", "vit", MODELS),
        ("partitioner", "label-skew", PARTITIONERS),
    ],
)
def test_unknown_names_are_rejected(defaults, key, value, allowed):
    message = _error(defaults, **{key: value})
    assert f"'{key}'" in message and repr(value) in message
    for name in allowed:
        assert name in message


@pytest.mark.parametrize(
    ("key", "value", "allowed"),
    [
        ("local-lr", 0.0, "> 0"),
        ("local-lr", -0.01, "> 0"),
        ("server-lr", 0.0, "> 0"),
        ("server-lr", -1.0, "> 0"),
        ("fraction-train", 0.0, "(0, 1]"),
        ("fraction-train", 1.5, "(0, 1]"),
        ("fraction-evaluate", 1.01, "[0, 1]"),
        ("beta-1", 1.0, "[0, 1)"),
        ("num-server-rounds", 0, ">= 1"),
        ("topk-ratio", 0.0, "(0, 1]"),
    ],
)
def test_out_of_range_values_are_rejected(defaults, key, value, allowed):
    message = _error(defaults, **{key: value})
    assert f"'{key}'" in message and repr(value) in message and allowed in message


@pytest.mark.parametrize(
    ("key", "value", "allowed"),
    [
        ("server-lr", "0.1", "a number > 0"),
        ("local-lr", "fast", "a number > 0"),
        ("fraction-train", True, "(0, 1]"),
        ("num-server-rounds", 2.5, "an integer >= 1"),
        ("num-server-rounds", "10", "an integer >= 1"),
        ("error-feedback", "true", "true or false"),
        ("strategy", 3, "fedams"),
    ],
)
def test_wrong_types_are_rejected(defaults, key, value, allowed):
    message = _error(defaults, **{key: value})
    assert f"'{key}'" in message and repr(value) in message and allowed in message


def test_unknown_key_is_rejected(defaults):
    message = _error(defaults, **{"sever-lr": 0.5})
    assert "'sever-lr'" in message and "unknown" in message
    assert "server-lr" in message  # the allowed keys are listed


def test_missing_key_is_rejected(defaults):
    incomplete = dict(defaults)
    del incomplete["server-lr"]
    with pytest.raises(ConfigError, match="'server-lr'"):
        AppConfig.from_run_config(incomplete)


# --------------------------------------------------------------------------- build_strategy
@pytest.mark.parametrize("name", strategy_names())
def test_build_strategy_builds_every_name(defaults, name):
    from flwr.serverapp.strategy import Strategy

    from pollen.strategies import (
        FedAMS,
        FedCAMS,
        MeteredFedAdagrad,
        MeteredFedAdam,
        MeteredFedAvg,
        MeteredFedYogi,
    )

    changes = {"strategy": name, "server-lr": 0.25, "fraction-train": 0.4, "eps": 0.002, "seed": 13, "local-steps": 4}
    cfg = AppConfig.from_run_config({**defaults, **changes})
    strategy = build_strategy(cfg)
    expected = {
        "fedavg": MeteredFedAvg,
        "fedadam": MeteredFedAdam,
        "fedyogi": MeteredFedYogi,
        "fedadagrad": MeteredFedAdagrad,
        "fedams": FedAMS,
        "fedamsgrad": FedAMS,
        "fedcams": FedCAMS,
    }.get(name)
    assert isinstance(strategy, Strategy)
    if expected is not None:  # names added later are at least real Flower strategies
        assert type(strategy) is expected
    assert strategy.fraction_train == 0.4
    strategy.summary()  # logs without raising
    if name in ("fedadam", "fedyogi", "fedadagrad"):
        assert strategy.eta == 0.25 and strategy.tau == 0.002
    if name in ("fedams", "fedamsgrad", "fedcams"):
        hyper = strategy.optimizer.hyperparameters()
        assert hyper["eta"] == 0.25 and hyper["eps"] == 0.002
        assert strategy.seed == 13
        option = 2 if name == "fedamsgrad" or cfg["eps-mode"] == "add" else 1
        assert strategy.option == option
        assert hyper["eps_mode"] == ("max" if option == 1 else "add")
    if name == "fedcams":
        assert strategy.compressor == cfg["compressor"]
        assert strategy.error_feedback == cfg["error-feedback"]


def test_hafed_counts_local_iterations(defaults):
    cfg = AppConfig.from_run_config({**defaults, "strategy": "hafed", "local-steps": 0})
    assert build_strategy(cfg).local_steps == 48  # the paper's tau when local-steps keeps its default
    cfg = AppConfig.from_run_config({**defaults, "strategy": "hafed", "local-steps": 12, "gossip-every": 4})
    assert len(build_strategy(cfg).segments) == 3


def test_eps_mode_add_makes_fedams_option_2(defaults):
    cfg = AppConfig.from_run_config({**defaults, "strategy": "fedams", "eps-mode": "add"})
    assert build_strategy(cfg).option == 2
    cfg = AppConfig.from_run_config({**defaults, "strategy": "fedams", "eps-mode": "max"})
    assert build_strategy(cfg).option == 1
    cfg = AppConfig.from_run_config({**defaults, "strategy": "fedams", "eps-mode": "paper"})
    assert build_strategy(cfg).option == 1
    cfg = AppConfig.from_run_config({**defaults, "strategy": "fedams", "eps-mode": "inside"})
    with pytest.raises(ValueError, match="'inside' is HA-Fed's and the lazy family's form.*allow paper, max or add"):
        build_strategy(cfg)


def test_library_and_strategies_import_without_torch():
    """The Flower-facing library (strategies, mods, config, experiment.build_strategy) must not
    pull torch in: it also runs in environments that only have Flower and numpy."""
    code = (
        "import sys\n"
        "from pollen.app.config import AppConfig, strategy_names, defaults_from_pyproject\n"
        "from pollen.app.experiment import build_strategy\n"
        "import pollen.strategies, pollen.clientside, pollen.wire.records, pollen.compression, pollen.optim\n"
        f"d = defaults_from_pyproject({str(ROOT / 'pyproject.toml')!r})\n"
        "for name in strategy_names():\n"
        "    try:\n"
        "        build_strategy(AppConfig.from_run_config({**d, 'strategy': name, 'local-steps': 4}))\n"
        "    except TypeError:\n"
        "        pass  # a wrong argument is test_build_strategy_builds_every_name's business\n"
        "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "assert not loaded, loaded[:5]\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
