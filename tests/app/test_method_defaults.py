"""Run-config by family: the assembled schema against pyproject.toml, and each method's recommended values.

Precedence (``pollen.app.config``): a key the user gave > the preset > the method's recommended values >
the pyproject defaults. No torch needed.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from pollen.app import methods as families
from pollen.app.config import SCHEMA, AppConfig, clients_need_given_keys, defaults_from_pyproject, effective_run_config
from pollen.app.methods import FAMILIES, METHODS
from pollen.app.preset import NODE_LOCAL_KEYS
from pollen.app.spec import assemble, choice, pos_int

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def defaults() -> dict:
    return defaults_from_pyproject(str(ROOT / "pyproject.toml"))


# --------------------------------------------------------------------------- the schema and pyproject.toml
def test_pyproject_defaults_match_the_assembled_schema(defaults: dict) -> None:
    """Same keys; each pyproject default is the schema's default, of its type, and passes its check."""
    assert set(defaults) == set(SCHEMA), (sorted(set(defaults) - set(SCHEMA)), sorted(set(SCHEMA) - set(defaults)))
    for key, spec in SCHEMA.items():
        value = defaults[key]
        assert value == spec.default and type(value) is type(spec.default), (key, value, spec.default)
        assert isinstance(value, spec.type) or (spec.type is float and isinstance(value, int)), (key, value)
        assert spec.check(value), f"pyproject default {key} = {value!r} fails its check ({spec.words})"


def test_every_family_declares_keys_of_its_own() -> None:
    names = [name for family in FAMILIES for name in family.KEYS]
    assert len(names) == len(set(names))
    assert {"eps-mode", "compressor", "server-optimizer", "sync-every", "cluster-size", "tau-up"} <= set(names)
    with pytest.raises(ValueError, match="'batch-size' is declared twice"):
        assemble({"batch-size": pos_int(32)}, {"batch-size": pos_int(50)})


def test_enumerations_come_from_their_owners() -> None:
    from pollen.compression import CODECS, GRANULARITIES
    from pollen.compression.quant import PRECISIONS
    from pollen.gossip import TOPOLOGIES
    from pollen.lazy.rules import DOWNLINK_MODES
    from pollen.optim import SERVER_OPTIMIZERS
    from pollen.strategies.engine.screening import RULES
    from pollen.strategies.fedlamb import SYNC_PHASES
    from pollen.task.catalog import DATASETS, MODELS, NORMS, PARTITIONERS

    owned = {
        "dataset": DATASETS,
        "model": MODELS,
        "norm": NORMS,
        "partitioner": PARTITIONERS,
        "compressor": CODECS,
        "compressor-down": CODECS,
        "compression-granularity": GRANULARITIES,
        "table-precision": PRECISIONS,
        "topology": TOPOLOGIES,
        "downlink-mode": DOWNLINK_MODES,
        "server-optimizer": SERVER_OPTIMIZERS,
        "sync-phase": SYNC_PHASES,
        "outlier-rule": RULES,
    }
    for key, names in owned.items():
        assert SCHEMA[key].words == "one of " + ", ".join(names), key
        assert all(SCHEMA[key].check(name) for name in names) and not SCHEMA[key].check("nope"), key


def test_a_choice_can_read_its_owner_late() -> None:
    seen = []
    key = choice(lambda: seen.append(1) or ("a", "b"), "a")
    assert not seen  # nothing read when the schema is built
    assert key.check("b") and not key.check("c") and key.words == "one of a, b"


# --------------------------------------------------------------------------- recommended values
def test_every_method_has_a_family_and_valid_recommended_values() -> None:
    for name, method in METHODS.items():
        assert method.family in {f.__name__.rpartition(".")[2] for f in FAMILIES}, name
        unknown = sorted(set(method.defaults) - set(SCHEMA))
        assert not unknown, f"{name} recommends unknown keys {unknown}"
        assert not set(method.defaults) & NODE_LOCAL_KEYS, name
        assert "strategy" not in method.defaults and "preset" not in method.defaults, name
        for key, value in method.defaults.items():
            spec = SCHEMA[key]
            assert isinstance(value, spec.type) or (spec.type is float and isinstance(value, int)), (name, key, value)
            assert spec.check(value), f"{name}: {key} = {value!r} fails its check ({spec.words})"


#: One method per family: keys its paper sets to a value other than the pyproject default.
PAPER_VALUES = {
    "fedamsgrad": {"eps": 0.1},  # papers/fedcams.md 5.1: FedAMSGrad (Option 2) with eps 0.1
    "fedadavr": {"beta-2": 0.999, "eps": 1e-8, "server-lr": 0.01, "batch-size": 20, "local-epochs": 3, "momentum": 0.9},
    "mifa": {"server-lr": 1.0, "beta-2": 0.999},
    "fed-lamb": {"beta-2": 0.999, "eps": 1e-8, "batch-size": 128},
    "hafed": {"server-lr": 0.01, "eps": 1e-8, "batch-size": 50, "local-lr": 0.1},
    "fedamsgrad-uniform": {"fraction-train": 0.25, "eps": 1e-8},
    "fedbaca": {"local-epochs": 3, "compressor": "topk", "topk-ratio": 0.125},
    "fednlaa": {"local-epochs": 3},
    "fedyogi": {"server-lr": 0.01},
    "fedopt": {"server-lr": 0.01, "compressor": "none"},  # dense unless a codec is named
}


def test_every_family_with_values_of_its_own_is_tested(defaults: dict) -> None:
    own = {m.family for m in METHODS.values() if any(defaults[k] != v for k, v in m.defaults.items())}
    assert (
        own
        == {METHODS[name].family for name in PAPER_VALUES}
        == {"fedams", "fedadavr", "fedlamb", "hafed", "lazy", "baselines", "fedopt"}
    )


@pytest.mark.parametrize("name", list(PAPER_VALUES))
def test_a_method_alone_runs_with_its_papers_values(defaults: dict, name: str) -> None:
    cfg = AppConfig.from_run_config({**defaults, "strategy": name})
    for key, value in PAPER_VALUES[name].items():
        assert defaults[key] != value, f"{key}: pick a value that differs from the pyproject default"
        assert cfg[key] == value, (name, key)


@pytest.mark.parametrize("name", list(PAPER_VALUES))
def test_a_value_the_user_gives_wins_over_the_methods(defaults: dict, name: str) -> None:
    for key, value in PAPER_VALUES[name].items():
        mine = {"compressor": "fp16", "fraction-train": 0.4, "momentum": 0.5, "beta-2": 0.95}.get(
            key, SCHEMA[key].default * 2
        )
        assert mine not in (value, defaults[key]), key
        # a value that differs from the pyproject default counts as given
        assert AppConfig.from_run_config({**defaults, "strategy": name, key: mine})[key] == mine
        # the default value itself, given explicitly (Flower's override config says so), wins too
        given = AppConfig.from_run_config({**defaults, "strategy": name}, given={"strategy", key})
        assert given[key] == defaults[key], (name, key)


def test_the_fedams_family_is_the_pyproject_default(defaults: dict) -> None:
    """FedAMS is the default method: its recommended values are the pyproject defaults (a default run is unchanged)."""
    for name in ("fedams", "fedcams"):
        for key, value in METHODS[name].defaults.items():
            assert defaults[key] == value, (name, key)
    assert AppConfig.from_run_config(defaults).as_dict() == {k: defaults[k] for k in SCHEMA}


def test_a_preset_wins_over_the_methods_values(defaults: dict, tmp_path: Path) -> None:
    preset = tmp_path / "mine.toml"
    preset.write_text(
        '[preset]\ntitle = "t"\nscaled = "s"\nsize = "cpu"\nsupernodes = 4\nneeds = "fashion-mnist"\n\n'
        '[config]\nstrategy = "hafed"\nserver-lr = 0.05\nbatch-size = 32\n'
    )
    cfg = AppConfig.from_run_config({**defaults, "preset": str(preset)})
    assert cfg["strategy"] == "hafed"
    assert cfg["server-lr"] == 0.05  # the preset's
    assert cfg["batch-size"] == 32  # the preset's, though it equals the pyproject default
    assert cfg["eps"] == 1e-8 and cfg["local-lr"] == 0.1  # HA-Fed's, the preset sets neither
    given = AppConfig.from_run_config({**defaults, "preset": str(preset), "eps": 0.001}, given={"preset", "eps"})
    assert given["eps"] == 0.001  # the user's, at its pyproject default


def test_baselines_recommend_flowers_own_constructor_defaults() -> None:
    from flwr.serverapp.strategy import FedAdagrad, FedAdam, FedYogi

    names = {"server-lr": "eta", "beta-1": "beta_1", "beta-2": "beta_2", "eps": "tau"}
    for method, cls in (("fedadam", FedAdam), ("fedyogi", FedYogi), ("fedadagrad", FedAdagrad)):
        flower = {name: p.default for name, p in inspect.signature(cls.__init__).parameters.items()}
        recommended = families.baselines.DEFAULTS[method]
        assert recommended and {names[k]: v for k, v in recommended.items()} == {
            names[k]: flower[names[k]] for k in recommended
        }, method


def test_replace_keeps_what_was_given(defaults: dict) -> None:
    cfg = AppConfig.from_run_config({**defaults, "strategy": "hafed"}, given={"strategy", "batch-size"})
    assert cfg["batch-size"] == defaults["batch-size"] and cfg["eps"] == 1e-8
    changed = cfg.replace(seed=7)
    assert changed["seed"] == 7 and changed["batch-size"] == defaults["batch-size"] and changed["eps"] == 1e-8


def test_the_server_tells_clients_the_given_keys_only_when_it_matters(defaults: dict) -> None:
    hafed = {**defaults, "strategy": "hafed"}
    assert not clients_need_given_keys(defaults, {"seed"})  # FedAMS: its values are the defaults
    assert not clients_need_given_keys(hafed, {"strategy", "seed"})  # nothing given at a value HA-Fed changes
    assert not clients_need_given_keys(hafed, set())
    assert clients_need_given_keys(hafed, {"strategy", "batch-size"})  # batch 32 given: a client would take 50
    assert effective_run_config(hafed, {"strategy", "batch-size"})["batch-size"] == 32
    assert effective_run_config(hafed)["batch-size"] == 50


def test_a_client_resolves_like_the_server_without_the_strategies(defaults: dict) -> None:
    cfg = AppConfig.from_run_config({**defaults, "strategy": "hafed"}, check_strategy=False)
    assert cfg["batch-size"] == 50
    # A value only the server checks keeps its type check on the client.
    from pollen.app.config import ConfigError

    with pytest.raises(ConfigError, match="'outlier-rule' = 3 is not a string"):
        AppConfig.from_run_config({**defaults, "outlier-rule": 3}, check_strategy=False)
    AppConfig.from_run_config({**defaults, "outlier-rule": "nope"}, check_strategy=False)  # left to the server
    with pytest.raises(ConfigError, match="'outlier-rule' = 'nope' is out of range; allowed: one of reject, clip, off"):
        AppConfig.from_run_config({**defaults, "outlier-rule": "nope"})
