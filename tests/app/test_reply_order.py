"""The server's result does not depend on the order replies arrive in (issue 24, order-independent aggregation).

Each run is pollen's app in-process (:func:`pollen.testing.inprocess.run_inprocess`) on real Fashion-MNIST
partitions; the second run's fake grid hands every round's replies back in a seeded random order, as
clients finishing in another order would. The final models must be the same bytes. The collector reads
replies in a fixed order (stable client id), so nothing downstream (the float32 running sum, a method's
per-client loop, buffer and metric averages) sees the arrival order; the negative control shows the
order does change the bits when that fixed order is taken away.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from pollen.app.methods import METHODS
from pollen.strategies.engine.collector import ReplyCollector
from pollen.testing.inprocess import run_inprocess

SMALL = {
    "model": "mlp",
    "num-server-rounds": 2,
    "local-steps": 2,
    "batch-size": 16,
    "eval-every": 2,
    "eval-batch-size": 500,
    "fraction-train": 1.0,
    "fraction-evaluate": 0.0,
}
NODES = 4


def _final_model(strategy: str, tmp_path: Path, tag: str, shuffle_seed: int | None) -> str:
    settings = {**SMALL, "strategy": strategy, "results-dir": str(tmp_path), "run-name": tag}
    if METHODS[strategy].family == "hafed":
        settings["cluster-size"] = 2
    rows = run_inprocess(settings, NODES, shuffle_seed=shuffle_seed)
    assert rows[1]["replies"] >= 2, rows[1]  # a round that aggregated
    return hashlib.sha256((tmp_path / tag / "final_model.npz").read_bytes()).hexdigest()


def _one_per_family() -> list[str]:
    chosen: dict[str, str] = {}
    for name, method in METHODS.items():
        chosen.setdefault(method.family, name)
    return list(chosen.values())


@pytest.mark.parametrize("strategy", _one_per_family())
def test_shuffled_replies_give_the_same_model_for_each_family(strategy: str, tmp_path: Path) -> None:
    assert _final_model(strategy, tmp_path, "arrival", None) == _final_model(strategy, tmp_path, "shuffled", 7)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", sorted(set(METHODS) - set(_one_per_family())))
def test_shuffled_replies_give_the_same_model_for_every_registered_method(strategy: str, tmp_path: Path) -> None:
    assert _final_model(strategy, tmp_path, "arrival", None) == _final_model(strategy, tmp_path, "shuffled", 7)


def test_without_the_fixed_order_arrival_order_changes_the_bits(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(ReplyCollector, "in_fixed_order", lambda self, replies: list(replies))
    models = {_final_model("fedams", tmp_path, f"seed-{seed}", seed) for seed in (None, 7, 8)}
    assert len(models) > 1, "the negative control saw no effect of arrival order: the test above proves nothing"
