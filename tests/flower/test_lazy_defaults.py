"""Issue 25, the lazy family: defaults that fire, an explicit codec, the paper's C / (alpha |S_t|) scaling,
Option B's epsilon under the square root, and a warning when a threshold cannot fire."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ConfigRecord

from pollen.app.config import AppConfig, defaults_from_pyproject, effective_run_config
from pollen.app.experiment import build_strategy
from pollen.app.methods.lazy import SHAPES, TAUS
from pollen.strategies import FedAMS, FedLazy
from pollen.testing.fakes import FakeGrid, config_of, full_model_reply, global_arrays_of, model_record, tiny_model
from pollen.wire import protocol

PYPROJECT = str(Path(__file__).resolve().parents[2] / "pyproject.toml")


def _build(strategy: str, **given: object) -> FedLazy:
    run_config = {**defaults_from_pyproject(PYPROJECT), "strategy": strategy, **given}
    names = {"strategy", *given}
    return build_strategy(AppConfig.from_run_config(effective_run_config(run_config, names), given=names))


@pytest.mark.parametrize("method", list(SHAPES))
def test_each_method_has_thresholds_that_fire_and_says_nothing_about_them(method: str) -> None:
    strategy = _build(method)
    assert strategy.up_tau == TAUS[method]["tau-up"] > 0
    if SHAPES[method][2]:
        assert strategy.downlink.tau == TAUS[method]["tau-down"] > 0
    assert strategy.threshold_warnings(*strategy.round_taus(1)) == []


def test_a_threshold_that_cannot_fire_is_named() -> None:
    def lines(strategy: str, **given: object) -> list[str]:
        built = _build(strategy, **given)
        return built.threshold_warnings(*built.round_taus(1))

    low = lines("fednlaca", **{"tau-up": 0.5})
    assert len(low) == 1 and "rarely fires" in low[0] and "0.5" in low[0]
    assert "never fires" in lines("fedaa", **{"tau-up": 0.0})[0]
    assert "tau-down = 0" in lines("fedbaca", **{"tau-down": 0.0})[0]


def test_the_papers_scaling_is_checked_once_the_sampled_clients_are_known() -> None:
    from pollen.testing.fakes import capture_flwr_logs, messages_text

    strategy = FedLazy(compressor="topk", up_tau=1.1, tau_scaling="paper", fraction_evaluate=0.0, eta=0.1)
    nodes = [1, 2, 3, 4]
    grid = FakeGrid(nodes, lambda msg: full_model_reply(msg, global_arrays_of(msg)))
    with capture_flwr_logs() as records:
        strategy.configure_train(1, model_record(tiny_model()), ConfigRecord(), grid)
        strategy.configure_train(2, model_record(tiny_model()), ConfigRecord(), grid)
    text = messages_text(records)
    assert text.count("rarely fires") == 1 and "4 sampled clients" in text, text


@pytest.mark.parametrize("method", ["fednlaca", "fedaca", "fedbnlaca", "fedbaca"])
def test_a_compressed_method_refuses_to_run_uncompressed(method: str) -> None:
    with pytest.raises(ValueError, match="compresses its uploads"):
        _build(method, compressor="none")
    assert _build(method).compressor == "topk"
    assert _build(method, compressor="sign").compressor == "sign"


def test_the_papers_scaling_divides_c_by_alpha_times_the_sampled_clients() -> None:
    seen: list[tuple[int, float]] = []

    def client(msg):  # noqa: ANN001, ANN202
        config = config_of(msg)
        seen.append((int(config[protocol.CFG_SERVER_ROUND]), float(config[protocol.CFG_LAZY_UP_TAU])))
        return full_model_reply(msg, global_arrays_of(msg))

    nodes = [1, 2, 3, 4]
    for fraction, sampled in ((1.0, 4), (0.5, 2)):
        seen.clear()
        strategy = FedLazy(
            up_rule="nla",
            up_tau=3.0,
            tau_scaling="paper",
            tau_alpha=0.5,
            fraction_train=fraction,
            fraction_evaluate=0.0,
            eta=0.1,
        )
        grid = FakeGrid(nodes, client, client_ids={n: f"c{n}" for n in nodes})
        messages = strategy.configure_train(1, model_record(tiny_model()), ConfigRecord(), grid)
        grid.send_and_receive(messages)
        assert {tau for _, tau in seen} == {3.0 / (0.5 * sampled)}
    assert FedLazy(up_tau=3.0, eta=0.1).round_taus(1) == (3.0, 0.0)


def test_option_b_puts_eps_under_the_square_root() -> None:
    eta, b1, b2, eps = 0.1, 0.9, 0.99, 1e-3
    delta = np.array([0.02, -0.5, 0.0], dtype=np.float32)
    strategy = FedAMS(eta=eta, beta_1=b1, beta_2=b2, eps=eps, option=3)
    strategy.server_step.start(strategy.optimizer, 3)
    params = np.zeros(3, dtype=np.float32)
    new = strategy.server_step.apply(params, delta.copy())
    m = (1 - b1) * delta.astype(np.float64)
    v = (1 - b2) * delta.astype(np.float64) ** 2
    np.testing.assert_allclose(new, eta * m / np.sqrt(v + eps), rtol=1e-5)
    assert _build("fedbaca", **{"eps-mode": "inside"}).option == 3
    with pytest.raises(ValueError, match="inside"):
        _build("fedcams", **{"eps-mode": "inside"})
    assert not math.isclose(float(new[1]), float(eta * m[1] / math.sqrt(v[1])), rel_tol=1e-3)
