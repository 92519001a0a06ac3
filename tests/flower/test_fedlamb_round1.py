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
from pollen.strategies.engine.parts import ClientSampler, EngineParts
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

    strategy = FedLAMB(
        variant=variant,
        round1_denominator="local-v",
        fraction_evaluate=0.0,
        parts=EngineParts(sampler=ClientSampler(seed=1, identify_clients=True)),
    )
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


def _mime_run(server_v: str, grads: list[float], rounds: int) -> FedLAMB:
    """Mime over ``rounds`` rounds on the fake grid; each client uploads the gradient ``grads[round - 1]``
    (the same in every coordinate) and its model unchanged."""

    def client(msg):  # noqa: ANN001, ANN202
        config = config_of(msg)
        reply = full_model_reply(msg, global_arrays_of(msg))
        if config[protocol.CFG_SYNC]:
            from pollen.wire.records import arrays_to_record

            g = grads[int(config[protocol.CFG_SERVER_ROUND]) - 1]
            reply.content[protocol.extra_record("grad")] = arrays_to_record(
                {protocol.EXTRA_ARRAY: np.full(19, g, dtype=np.float32)}
            )
        return reply

    strategy = FedLAMB(
        variant="mime",
        server_v=server_v,
        fraction_evaluate=0.0,
        parts=EngineParts(sampler=ClientSampler(seed=1, identify_clients=True)),
    )
    grid = FakeGrid([1, 2], client, client_ids={1: "a", 2: "b"})
    strategy.start(grid=grid, initial_arrays=model_record(tiny_model()), num_rounds=rounds)
    return strategy


def test_mimes_plain_server_v_is_the_papers_ema_without_correction() -> None:
    grads = [0.5, 0.1, 0.1]
    strategy = _mime_run("plain", grads, 3)
    v, seen = 0.0, [EPS]
    for g in grads:
        v = B2 * v + (1 - B2) * g * g  # lines 22-23: v_1 = (1 - beta_2) g^2, no correction
        seen.append(v)
    np.testing.assert_allclose(strategy.v, v, rtol=1e-5)
    np.testing.assert_allclose(strategy.v_hat, max(seen), rtol=1e-5)
    assert strategy.v_syncs == 3


def test_mimes_bias_corrected_server_v_divides_by_one_minus_beta2_to_the_k() -> None:
    grads = [0.5, 0.1, 0.1]
    strategy = _mime_run("bias-corrected", grads, 3)
    v, corrected = 0.0, []
    for k, g in enumerate(grads, start=1):
        v = B2 * v + (1 - B2) * g * g
        corrected.append(v / (1 - B2**k))
    np.testing.assert_allclose(strategy.v, v, rtol=1e-5)  # the EMA itself stays uncorrected
    np.testing.assert_allclose(strategy.v_hat, max(corrected), rtol=1e-5)
    np.testing.assert_allclose(corrected[0], 0.25, rtol=1e-12)  # round 1: exactly mean(G)^2
    assert strategy.v_syncs == 3
    # Mime's AMSGrad step divides by sqrt(v_hat): the plain reading's is 1/sqrt(1 - beta_2) ~ 31.6x larger.
    plain = _mime_run("plain", grads, 1)
    ratio = math.sqrt(float(_mime_run("bias-corrected", grads, 1).v_hat[0]) / float(plain.v_hat[0]))
    assert ratio == pytest.approx(1 / math.sqrt(1 - B2), rel=1e-4)


@pytest.mark.parametrize(("strategy", "expected"), [("mime", "bias-corrected"), ("mime-lamb", "plain")])
def test_mime_corrects_its_server_v_by_default_and_the_papers_reading_is_one_switch_away(
    strategy: str, expected: str
) -> None:
    assert build_strategy(_config(strategy)).server_v == expected
    assert build_strategy(_config(strategy, **{"mime-server-v": "plain"})).server_v == "plain"


def test_an_unknown_server_v_is_refused_and_a_saved_sync_count_past_the_round_is_too() -> None:
    with pytest.raises(ValueError, match="server_v='adam'.*plain, bias-corrected"):
        FedLAMB(variant="mime", server_v="adam")
    strategy = _mime_run("bias-corrected", [0.5, 0.1], 2)
    state = strategy.state_dict()
    fresh = FedLAMB(
        variant="mime",
        server_v="bias-corrected",
        fraction_evaluate=0.0,
        parts=EngineParts(sampler=ClientSampler(seed=1, identify_clients=True)),
    )
    fresh.load_state_dict(state, server_round=2)
    assert fresh.v_syncs == 2
    state["v_syncs"] = 9
    with pytest.raises(ValueError, match="v_syncs"):
        FedLAMB(
            variant="mime",
            server_v="bias-corrected",
            fraction_evaluate=0.0,
            parts=EngineParts(sampler=ClientSampler(seed=1, identify_clients=True)),
        ).load_state_dict(state, server_round=2)
