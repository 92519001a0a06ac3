"""The shipped experiment presets (``pollen/app/presets/*.toml``): each loads, each of its run-configs
passes the app's validation and builds its strategy, CPU presets stay CPU-sized, and every paper
has a CPU and a full preset. No torch needed."""

from __future__ import annotations

from pathlib import Path

import pytest

from pollen.app.config import DATASETS, AppConfig, defaults_from_pyproject
from pollen.app.experiment import build_strategy
from pollen.app.preset import SIZES, load_preset, preset_names

pytestmark = pytest.mark.flower_compat

ROOT = Path(__file__).resolve().parents[2]
PAPERS = ("fedcams", "hafed", "fedlamb", "fedbaca", "fedadavr")
CPU_DATASETS = ("fashion-mnist", "mnist")
CPU_MAX_ROUNDS = 30

NAMES = preset_names()


@pytest.fixture(scope="module")
def defaults() -> dict:
    return defaults_from_pyproject(str(ROOT / "pyproject.toml"))


def test_every_paper_has_a_cpu_and_a_full_preset() -> None:
    for paper in PAPERS:
        for size in SIZES:
            assert f"{paper}-{size}" in NAMES, f"preset {paper}-{size} is missing"


def test_every_preset_belongs_to_a_paper_and_a_size() -> None:
    for name in NAMES:
        paper, _, size = name.rpartition("-")
        assert paper in PAPERS and size in SIZES, f"preset {name!r} is not <paper>-<size>"


@pytest.mark.parametrize("name", NAMES)
def test_preset_head(name: str) -> None:
    preset = load_preset(name)
    assert preset.name == name
    assert preset.size == name.rpartition("-")[2]
    assert preset.title.strip() and preset.scaled.strip()
    assert preset.supernodes >= 1
    assert preset.needs in DATASETS
    assert preset.config.get("dataset") == preset.needs
    assert "preset" not in preset.config
    assert preset.methods, f"preset {name!r} lists no methods"


@pytest.mark.parametrize("name", NAMES)
def test_preset_file_says_what_it_follows(name: str) -> None:
    text = (ROOT / "pollen" / "app" / "presets" / f"{name}.toml").read_text()
    assert text.startswith("#"), f"preset {name!r} has no leading comment"


@pytest.mark.parametrize("name", NAMES)
def test_preset_config_and_every_method_validate_and_build(name: str, defaults: dict) -> None:
    preset = load_preset(name)
    configs = {"[config]": dict(preset.config)}
    configs.update({label: preset.method_config(label) for label in preset.methods})
    for label, values in configs.items():
        cfg = AppConfig.from_run_config({**defaults, **values})
        assert cfg["dataset"] == preset.needs, f"{name} {label}: dataset {cfg['dataset']!r} != needs"
        assert cfg["min-train-nodes"] <= preset.supernodes, f"{name} {label}: min-train-nodes > supernodes"
        assert cfg["min-evaluate-nodes"] <= preset.supernodes, f"{name} {label}: min-evaluate-nodes > supernodes"
        assert int(cfg["fraction-train"] * preset.supernodes) >= 1, f"{name} {label}: no client sampled per round"
        if cfg["cluster-size"]:
            assert preset.supernodes % cfg["cluster-size"] == 0, f"{name} {label}: clusters do not tile the clients"
        if label != "[config]":
            assert build_strategy(cfg) is not None


@pytest.mark.parametrize("name", [n for n in NAMES if n.endswith("-cpu")])
def test_cpu_presets_are_cpu_sized(name: str, defaults: dict) -> None:
    preset = load_preset(name)
    for values in [preset.config, *(preset.method_config(label) for label in preset.methods)]:
        cfg = AppConfig.from_run_config({**defaults, **values})
        assert cfg["dataset"] in CPU_DATASETS
        assert cfg["model"] in ("mlp", "cnn", "lenet5")
        assert cfg["num-server-rounds"] <= CPU_MAX_ROUNDS
