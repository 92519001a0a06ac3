"""The constructor defaults a Flower project gets when it swaps its strategy, and the paper's one argument away.

Measured in three of Flower's examples (``benchmarks/bench_dropin.py``, ``docs/results/dropin.md``): AdaBelief
and FedAdaVR's Adam with the paper's ``beta_2=0.999`` and bias correction were 11 points behind FedAvg after 5
rounds of quickstart-pytorch, FedCAMS's one scale for the whole model 15.5 behind after 20 of advanced-pytorch.
So a strategy built directly reads the moments as FedAMS does (``beta_2=0.99``, no bias correction) and
FedCAMS scales its signs per tensor; pollen's app passes the papers' settings, which stay as they were.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pollen.app.config import AppConfig, defaults_from_pyproject
from pollen.app.experiment import build_strategy
from pollen.strategies import FedAdaVR, FedAMS, FedCAMS, FedLazy, FedOpt, HAFed

pytestmark = pytest.mark.flower_compat

PYPROJECT = str(Path(__file__).resolve().parents[2] / "pyproject.toml")


def test_adabelief_drops_in_with_fedams_reading_of_the_moments_and_an_argument_wins() -> None:
    assert FedOpt(optimizer="adabelief").settings == {"eta": 0.01, "beta_2": 0.99, "bias_correction": False}
    paper = FedOpt(optimizer="adabelief", beta_2=0.999, bias_correction=True).settings
    assert paper == {"eta": 0.01, "beta_2": 0.999, "bias_correction": True}
    assert FedOpt(optimizer="adam").settings == {"eta": 0.01}, "other optimisers keep their own defaults"


def test_fedadavr_drops_in_without_bias_correction_and_its_optimiser_gets_it() -> None:
    strategy = FedAdaVR()
    assert (strategy.beta_2, strategy.bias_correction) == (0.99, False)
    assert strategy._optimizer_kwargs(None) == {
        "eta": 0.02,
        "eps": 3e-4,
        "beta_1": 0.9,
        "beta_2": 0.99,
        "bias_correction": False,
    }
    assert FedAdaVR(bias_correction=True)._optimizer_kwargs(None)["bias_correction"] is True


def test_fedadavr_adam_drops_in_with_eta_0_02_and_eps_3e_4_and_other_optimisers_keep_theirs() -> None:
    """Adam's drop-in (0.01 with eps 1e-8 was 11 points behind FedAvg after 5 rounds of advanced-pytorch over ten
    seeds); the other optimisers keep their variant's eta and eps 1e-8; an argument wins."""
    assert (FedAdaVR().eta, FedAdaVR().eps) == (0.02, 3e-4)
    assert (FedAdaVR(variant="fedadavr-quant").eta, FedAdaVR(variant="fedadavr-quant").eps) == (0.02, 3e-4)
    assert (FedAdaVR(variant="mifa").eta, FedAdaVR(variant="mifa").eps) == (1.0, 1e-8)
    assert (FedAdaVR(server_optimizer="yogi").eta, FedAdaVR(server_optimizer="yogi").eps) == (0.01, 1e-8)
    assert (FedAdaVR(eta=0.01, eps=1e-8).eta, FedAdaVR(eta=0.01, eps=1e-8).eps) == (0.01, 1e-8)
    # below eps a stored update takes a step in proportion to it: eta * (1 - beta_1) y / (sqrt(1 - beta_2) |y| + eps)
    y = np.array([1.0, -1e-5], dtype=np.float32)
    optimizer = FedAdaVR().build_optimizer(None)
    step, _ = optimizer.update(optimizer.init(y.size), y, params=np.zeros_like(y))
    expected = 0.02 * 0.1 * y / (0.1 * np.abs(y) + 3e-4)
    np.testing.assert_allclose(step, expected, rtol=1e-4)


def first_step(strategy: object, delta: np.ndarray) -> np.ndarray:
    """The server step the strategy's optimiser takes on its first round's mean update ``delta``."""
    optimizer = strategy.server_step.optimizer
    step, _ = optimizer.update(optimizer.init(delta.size), delta, params=np.zeros_like(delta))
    return step


def test_fedams_drops_in_with_eta_0_02() -> None:
    """AMSGrad's first step without bias correction is ``eta * sign(delta)`` where ``|delta|`` is above the floor:
    0.02 for FedAMS and FedLazy (0.01 was 10 points behind FedAvg after 5 rounds of advanced-pytorch over ten seeds;
    option 1); an argument wins."""
    delta = np.array([0.5, -2.0, 3e-3], dtype=np.float32)
    np.testing.assert_allclose(first_step(FedAMS(), delta), [0.02, -0.02, 0.02], rtol=1e-5)
    np.testing.assert_allclose(first_step(FedLazy(), delta), [0.02, -0.02, 0.02], rtol=1e-5)
    np.testing.assert_allclose(first_step(FedAMS(eta=0.005), delta), [0.005, -0.005, 0.005], rtol=1e-5)


def test_fedcams_drops_in_with_beta_1_0_5_bias_corrected_at_eta_0_015() -> None:
    """FedCAMS's drop-in moments: ``beta_1=0.5`` (0.9 stalled its sign uploads 10 points behind FedAvg after 20
    rounds of advanced-pytorch) with bias correction, so every round's step on a steady update is ``eta``, not the
    ``eta (1 - beta_1^t) / sqrt(1 - beta_2^t)`` of the uncorrected form (five times ``eta`` in round 1 at
    ``beta_1=0.5``, which put quickstart-pytorch at chance); ``eta=0.015``. Each argument wins."""
    delta = np.array([0.5, -2.0, 3e-3], dtype=np.float32)
    optimizer = FedCAMS().server_step.optimizer
    state = optimizer.init(delta.size)
    for _ in range(4):  # the same update every round: each bias-corrected step is eta * sign(delta)
        step, state = optimizer.update(state, delta, params=np.zeros_like(delta))
        np.testing.assert_allclose(step, 0.015 * np.sign(delta), rtol=1e-5)
    uncorrected = FedCAMS(bias_correction=False)
    np.testing.assert_allclose(first_step(uncorrected, delta), 0.015 * 5 * np.sign(delta), rtol=1e-5)
    before = FedCAMS(eta=0.01, beta_1=0.9, bias_correction=False)  # the defaults until 2026-11-30
    np.testing.assert_allclose(first_step(before, delta), 0.01 * np.sign(delta), rtol=1e-5)
    np.testing.assert_allclose(first_step(FedCAMS(eta=0.004), delta), 0.004 * np.sign(delta), rtol=1e-5)


def test_option_2_and_hafed_drop_in_with_eta_0_02_and_a_floor_of_3e_4_on_the_root() -> None:
    """Option 2 (eps outside the sqrt) with eps 1e-8 gave every coordinate a whole eta: 0.02 fell 13 points behind
    FedAvg in quickstart-pytorch and 0.01 8 behind in advanced-pytorch over ten seeds. With ``eps=3e-4`` (HA-Fed:
    1e-6 under the sqrt) a coordinate far below the floor takes a step in proportion to its update, a large one
    about eta; FedLazy follows FedAMS's option; an argument wins."""
    delta = np.array([0.5, -2.0, 1e-6], dtype=np.float32)
    root = np.sqrt(0.01) * np.abs(delta)  # sqrt(v_hat) after one round, beta_2 = 0.99, no bias correction
    option_2 = 0.02 * 0.1 * delta / (root + 3e-4)
    np.testing.assert_allclose(first_step(FedAMS(option=2), delta), option_2, rtol=1e-4)
    np.testing.assert_allclose(first_step(FedLazy(option=2), delta), option_2, rtol=1e-4)
    under_the_root = 0.02 * 0.1 * delta / np.sqrt(root**2 + 1e-6)
    np.testing.assert_allclose(
        first_step(HAFed(topology="identity", clustered=False), delta), under_the_root, rtol=1e-4
    )
    tiny = first_step(FedAMS(option=2), delta)[2]
    assert 6e-6 < tiny < 7e-6, "a tiny update takes eta (1 - beta_1) / eps = 6.7 times itself, not a whole eta"
    np.testing.assert_allclose(first_step(FedAMS(option=2, eps=1e-8), delta)[:2], [0.02, -0.02], rtol=1e-4)
    np.testing.assert_allclose(first_step(FedAMS(option=3), delta)[:2], [0.01, -0.01], rtol=1e-4)


def test_fedcams_scales_signs_per_tensor_and_keeps_top_k_global_unless_told() -> None:
    assert FedCAMS().granularity == "tensor"
    assert FedCAMS(compressor="topk").granularity == "model"
    assert FedCAMS(granularity="model").granularity == "model"


def test_the_app_still_builds_the_papers_settings() -> None:
    """``strategy=fedadavr`` passes Appendix B's bias correction and beta_2 0.999; ``fedcams`` one scale a model."""
    defaults = defaults_from_pyproject(PYPROJECT)
    fedadavr = build_strategy(AppConfig.from_run_config({**defaults, "strategy": "fedadavr"}, given={"strategy"}))
    assert (fedadavr.beta_2, fedadavr.bias_correction) == (0.999, True)
    fedcams = build_strategy(AppConfig.from_run_config({**defaults, "strategy": "fedcams"}, given={"strategy"}))
    assert fedcams.granularity == "model"
