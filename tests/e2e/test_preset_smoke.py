"""Each preset, shrunk to 2 rounds of 2 local steps, runs with pollen's real ServerApp and ClientApps (issue 14).

The runs go through ``pollen/testing/inprocess.py`` (the in-process grid the quality benchmarks use: every message
to the real ClientApp of its node, no Ray), with the preset's own clients, data, model and first method; only
the rounds, the local steps, the clients per round and the evaluation are cut. A preset whose dataset is not on this
machine (the full-size CIFAR-10 ones here) is skipped with that reason.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pollen.app.preset import load_preset, preset_names

pytestmark = pytest.mark.slow


def data_missing(dataset: str) -> str | None:
    from pollen.task.data import DataConfig, describe_source
    from pollen.task.sources import DataSourceError

    try:
        describe_source(DataConfig(dataset=dataset))
    except DataSourceError as err:
        return str(err)
    return None


@pytest.mark.parametrize("name", preset_names())
def test_a_two_round_smoke_version_of_each_preset_runs(name: str, tmp_path: Path) -> None:
    from pollen.testing.inprocess import run_inprocess

    preset = load_preset(name)
    missing = data_missing(preset.needs)
    if missing:
        pytest.skip(f"preset {name} needs {preset.needs}, not on this machine: {missing[:120]}")
    if preset.config.get("model") in ("resnet18", "convmixer"):
        pytest.skip(f"preset {name} trains {preset.config['model']}: a GPU machine's smoke test")
    method = next(iter(preset.methods))
    rows = run_inprocess(
        {
            "preset": name,
            **preset.methods[method],
            "num-server-rounds": 2,
            "local-steps": 2,
            "eval-every": 2,
            "eval-batch-size": 2000,
            "test-examples": 1000,
            "fraction-train": 0.05,
            "min-train-nodes": 2,
            "results-dir": str(tmp_path),
            "run-name": name,
        },
        preset.supernodes,
    )
    assert [row["round"] for row in rows] == [0, 1, 2]
    assert rows[-1]["replies"] >= 1 and rows[-1]["failures"] == 0, rows[-1]
    assert isinstance(rows[-1]["accuracy"], float)
