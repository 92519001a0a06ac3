"""Issue 25: the round-1 denominator of Fed-AMS / Mime (authors' code vs the paper's literal eps) and
LocalLAMB's zero-norm guard and phi as run-config switches; each reading's equation checked by hand."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from pollen.app.config import AppConfig, defaults_from_pyproject, effective_run_config
from pollen.app.experiment import build_strategy
from pollen.clientside.lamb import LocalLAMB
from pollen.strategies import FedLAMB
from pollen.testing.fakes import FakeGrid, config_of, full_model_reply, global_arrays_of, model_record, tiny_model
from pollen.wire import protocol

PYPROJECT = str(Path(__file__).resolve().parents[2] / "pyproject.toml")
B1, B2, EPS, LR = 0.9, 0.999, 1e-8, 0.01


def one_step(local_vhat: bool, g: torch.Tensor) -> torch.Tensor:
    theta = torch.zeros_like(g, requires_grad=True)
    opt = LocalLAMB([theta], lr=LR, betas=(B1, B2), eps=EPS, trust_ratio=False, track_v=True, local_vhat=local_vhat)
    theta.grad = g.clone()
    opt.step()
    return theta.detach()


def test_the_literal_round_1_step_is_the_ten_thousand_fold_jump() -> None:
    g = torch.tensor([0.5, -2.0, 1e-3], dtype=torch.float64)
    m = (1 - B1) * g
    np.testing.assert_allclose(one_step(False, g).numpy(), (-LR * m / math.sqrt(EPS)).numpy(), rtol=1e-12)


def test_the_authors_round_1_step_divides_by_the_clients_own_running_v() -> None:
    g = torch.tensor([0.5, -2.0, 1e-3], dtype=torch.float64)
    m = (1 - B1) * g
    v = B2 * EPS + (1 - B2) * g**2  # line 11 from v = v_hat_0 = eps
    expected = -LR * m / torch.sqrt(torch.maximum(torch.full_like(v, EPS), v))
    got = one_step(True, g)
    np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-12)
    assert float(one_step(False, g).abs().max()) > 100 * float(got.abs().max())


def test_local_vhat_needs_a_tracked_v() -> None:
    with pytest.raises(ValueError, match="local_vhat"):
        LocalLAMB([torch.zeros(2, requires_grad=True)], track_v=False, local_vhat=True)


def _config(strategy: str, **given: object) -> AppConfig:
    run_config = {**defaults_from_pyproject(PYPROJECT), "strategy": strategy, **given}
    names = {"strategy", *given}
    return AppConfig.from_run_config(effective_run_config(run_config, names), given=names)


@pytest.mark.parametrize(("strategy", "expected"), [("fed-ams", "local-v"), ("mime", "local-v"), ("fed-lamb", "eps")])
def test_the_baselines_follow_the_authors_round_1_and_the_literal_reading_is_one_switch_away(
    strategy: str, expected: str
) -> None:
    assert build_strategy(_config(strategy)).round1_denominator == expected
    assert build_strategy(_config(strategy, **{"round1-denominator": "eps"})).round1_denominator == "eps"


@pytest.mark.parametrize("variant", ["fed-ams", "mime"])
def test_the_server_asks_for_the_local_denominator_until_the_first_v_hat_arrives(variant: str) -> None:
    asked: list[tuple[int, bool]] = []
    kind = "v" if variant == "fed-ams" else "grad"

    def client(msg):  # noqa: ANN001, ANN202
        config = config_of(msg)
        asked.append((int(config[protocol.CFG_SERVER_ROUND]), bool(config[protocol.CFG_LOCAL_VHAT])))
        reply = full_model_reply(msg, global_arrays_of(msg))
        if config[protocol.CFG_SYNC]:
            from pollen.wire.records import arrays_to_record

            reply.content[protocol.extra_record(kind)] = arrays_to_record(
                {protocol.EXTRA_ARRAY: np.full(19, 1e-2, dtype=np.float32)}
            )
        return reply

    strategy = FedLAMB(variant=variant, round1_denominator="local-v", fraction_evaluate=0.0, seed=1)
    grid = FakeGrid([1, 2], client, client_ids={1: "a", 2: "b"})
    strategy.start(grid=grid, initial_arrays=model_record(tiny_model()), num_rounds=3)
    assert sorted({(r, flag) for r, flag in asked}) == [(1, True), (2, False), (3, False)]
    literal = FedLAMB(variant=variant, round1_denominator="eps")
    literal.on_layout(type("L", (), {"dim": 19})())
    assert literal.train_config(1)[protocol.CFG_LOCAL_VHAT] is False


def test_an_unknown_round1_denominator_is_refused() -> None:
    with pytest.raises(ValueError, match="round1_denominator"):
        FedLAMB(variant="fed-ams", round1_denominator="v")


def test_zero_norm_guard_and_phi_reach_the_local_optimiser_from_run_config() -> None:
    from pollen.clientside.steps.fedlamb import lamb_settings

    class Work:
        def __init__(self, settings: dict) -> None:
            self.settings = settings

        def setting(self, key: str) -> object:
            return self.settings[key]

    keys = ("lamb-zero-norm-guard", "lamb-phi", "lamb-phi-min", "lamb-phi-max")
    cfg = _config("fed-lamb", **{"lamb-zero-norm-guard": False, "lamb-phi": "clip", "lamb-phi-max": 5.0})
    settings = lamb_settings(Work({key: cfg[key] for key in keys}))
    assert settings == {"zero_norm_guard": False, "phi": "clip", "phi_clip": (0.0, 5.0)}
    default = _config("fed-lamb")
    assert lamb_settings(Work({key: default[key] for key in keys})) == {"zero_norm_guard": True, "phi": "identity"}


def test_without_the_guard_a_zero_tensor_never_moves_and_with_it_it_takes_one_unnormalised_step() -> None:
    g = torch.tensor([0.3, -0.4], dtype=torch.float64)
    for guard, moved in ((False, False), (True, True)):
        theta = torch.zeros(2, dtype=torch.float64, requires_grad=True)
        opt = LocalLAMB([theta], lr=LR, betas=(B1, B2), eps=EPS, zero_norm_guard=guard)
        theta.grad = g.clone()
        opt.step()
        u = (1 - B1) * g / math.sqrt(EPS)
        expected = -LR * u if moved else torch.zeros(2, dtype=torch.float64)
        np.testing.assert_allclose(theta.detach().numpy(), expected.numpy(), rtol=1e-12)


def test_the_run_config_knows_every_phi_local_lamb_has() -> None:
    from pollen.app.methods import fedlamb as family
    from pollen.clientside import lamb

    assert family.PHIS == lamb.PHIS
