"""Extras and buffers are screened against their own kind, squares of client values cannot overflow.

The hard limit (1e15) keeps a Fed-LAMB ``v`` of 1e10 or a BatchNorm ``running_var`` of 1e12: finite,
far below it, and still a million times what every other client sends. The outlier screen now judges
each screened record (an extra a method declares ``screen="norm"``, every floating-point buffer) by
its norm against the same record of the other replies, or its history: such a reply is rejected as a
whole and the server's state ends bit-identical to a run where that client stayed silent. Mime's
``v <- beta_2 v + (1 - beta_2) mean(G)^2`` is formed in float64 inside the step's transaction, and the
server step refuses an optimiser state that would hold NaN or Inf. No torch.
"""

from __future__ import annotations

import numpy as np
import pytest

from pollen.strategies import FedAMS, FedLAMB
from pollen.strategies.engine.parts import ClientSampler, EngineParts, UpdateScreen
from pollen.testing.fakes import (
    FakeGrid,
    config_of,
    full_model_reply,
    global_arrays_of,
    model_record,
    reply,
    split_trainable,
    tiny_model,
)
from pollen.wire import protocol
from pollen.wire.records import arrays_to_record

pytestmark = pytest.mark.flower_compat

D = 19
TRAINABLE = ("conv.weight", "conv.bias", "bn.weight")
NODES = [31, 32, 33, 34]
IDS = {n: f"c{i}" for i, n in enumerate(NODES)}
ATTACKER = NODES[1]


def with_running_var(model: dict) -> dict:
    """``tiny_model`` plus a BatchNorm ``running_var`` (ones), the buffer issue 24 poisons."""
    out = dict(model)
    out["bn.running_var"] = np.ones(4, dtype=np.float32)
    return out


def honest_stat(node: int, rnd: int, kind: str) -> np.ndarray:
    value = np.random.default_rng([node, rnd, 9]).standard_normal(D).astype(np.float32)
    return np.square(value) * 1e-3 + 1e-4 if kind == "v" else value * 1e-2


def client(kind: str | None, attack: dict):  # noqa: ANN201
    """``x + a_i``; buffers moved a little; on sync rounds the statistic ``kind``. ``attack[(round, node)]``
    is a function that changes ``(local model, statistic)`` or ``None`` for a silent client."""

    def run(msg):  # noqa: ANN001, ANN202
        node, config = msg.metadata.dst_node_id, config_of(msg)
        rnd = int(config[protocol.CFG_SERVER_ROUND])
        local = dict(global_arrays_of(msg))
        step = (np.random.default_rng([node, rnd]).standard_normal(D) * 0.01).astype(np.float32)
        for name, part in split_trainable(step, local, TRAINABLE).items():
            local[name] = local[name] + part
        if "bn.running_var" in local:
            local["bn.running_var"] = local["bn.running_var"] * np.float32(1.0 + 0.01 * (node - 30))
        stat = honest_stat(node, rnd, kind) if kind and config.get(protocol.CFG_SYNC, False) else None
        if (rnd, node) in attack:
            if attack[(rnd, node)] is None:
                return None
            local, stat = attack[(rnd, node)](local, stat)
        records = dict(full_model_reply(msg, local, **{"grad-evals": 10}).content.items())
        if stat is not None:
            records[protocol.extra_record(kind)] = arrays_to_record({protocol.EXTRA_ARRAY: stat})
        return reply(msg, records)

    return run


def run(make, rounds: int, kind: str | None = None, attack: dict | None = None, model: dict | None = None):  # noqa: ANN001, ANN201
    strategy = make()
    grid = FakeGrid(NODES, client(kind, attack or {}), client_ids=IDS)
    strategy.start(grid=grid, initial_arrays=model_record(model or tiny_model()), num_rounds=rounds)
    return strategy


def fed_lamb(variant: str = "fed-lamb", **screen):  # noqa: ANN201
    """A FedLAMB factory; ``screen``: the outlier screen's settings (``UpdateScreen``'s arguments)."""
    return lambda: FedLAMB(
        variant=variant,
        fraction_evaluate=0.0,
        parts=EngineParts(
            sampler=ClientSampler(seed=3, identify_clients=True), screen=UpdateScreen(**{"rule": "reject", **screen})
        ),
    )


def fed_ams(**screen):  # noqa: ANN201
    """A FedAMS factory; ``screen``: the outlier screen's settings (``UpdateScreen``'s arguments)."""
    return lambda: FedAMS(
        eta=0.1,
        fraction_evaluate=0.0,
        parts=EngineParts(
            sampler=ClientSampler(identify_clients=True, seed=3), screen=UpdateScreen(**{"rule": "reject", **screen})
        ),
    )


def assert_same_server_state(a, b, names: tuple[str, ...] = ()) -> None:  # noqa: ANN001
    np.testing.assert_array_equal(a.params, b.params)
    for name in names:
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    for slot, value in a.opt_state.slots.items():
        np.testing.assert_array_equal(value, b.opt_state.slots[slot], err_msg=slot)
    for name, value in a.buffers.items():
        np.testing.assert_array_equal(value, b.buffers[name], err_msg=name)
    assert a.screen.state_dict() == b.screen.state_dict()


def failure_reasons(strategy, rnd: int) -> list[str]:  # noqa: ANN001
    return strategy.accounting.rounds[rnd].failure_reasons


# ---------------------------------------------------------------------------- extras
@pytest.mark.parametrize("rnd", [1, 3], ids=["within-the-round", "against-the-history"])
def test_a_fed_lamb_v_a_million_times_the_others_is_rejected_and_v_hat_is_as_if_silent(rnd: int) -> None:
    def huge_v(local, stat):  # noqa: ANN001, ANN202
        return local, np.full(D, 1e10, dtype=np.float32)  # finite, 1e5 below the hard limit

    attacked = run(fed_lamb(), 4, "v", {(rnd, ATTACKER): huge_v})
    silent = run(fed_lamb(), 4, "v", {(rnd, ATTACKER): None})
    assert any("extra 'v' has norm" in r and "outlier screen" in r for r in failure_reasons(attacked, rnd))
    assert_same_server_state(attacked, silent, ("v_hat", "v"))
    assert attacked.v_hat_version == silent.v_hat_version
    assert float(attacked.v_hat.max()) < 1.0


def test_a_mime_gradient_of_1e14_is_rejected_and_v_and_v_hat_stay_as_if_silent() -> None:
    def huge_grad(local, stat):  # noqa: ANN001, ANN202
        stat = stat.copy()
        stat[4] = 1e14  # below the hard limit 1e15
        return local, stat

    for variant in ("mime", "mime-lamb"):
        attacked = run(fed_lamb(variant), 3, "grad", {(2, ATTACKER): huge_grad})
        silent = run(fed_lamb(variant), 3, "grad", {(2, ATTACKER): None})
        assert any("extra 'grad' has norm" in r for r in failure_reasons(attacked, 2))
        assert np.isfinite(attacked.v).all() and np.isfinite(attacked.v_hat).all()
        assert_same_server_state(attacked, silent, ("v_hat", "v"))


def test_mimes_square_is_formed_in_float64_and_a_round_that_would_overflow_float32_is_rolled_back() -> None:
    """With the screen off and a hard limit of 1e30, ``mean(G)^2`` of a 1e25 gradient is 1e49: float32's
    square is +Inf (v and v_hat Inf for ever); now the round fails with a reason and nothing changes."""

    def huge_grad(local, stat):  # noqa: ANN001, ANN202
        return local, np.full(D, 1e25, dtype=np.float32)

    make = fed_lamb("mime", rule="off", max_abs=1e30)
    attacked = run(make, 2, "grad", {(2, ATTACKER): huge_grad})
    before = run(make, 1, "grad")
    reasons = failure_reasons(attacked, 2)
    assert any("rolled back" in r and "outside float32's range" in r for r in reasons), reasons
    np.testing.assert_array_equal(attacked.params, before.params)
    np.testing.assert_array_equal(attacked.v, before.v)
    np.testing.assert_array_equal(attacked.v_hat, before.v_hat)
    assert attacked.v_hat_version == before.v_hat_version
    after = run(make, 3, "grad", {(2, ATTACKER): huge_grad})  # and the run goes on
    assert not failure_reasons(after, 3) and np.isfinite(after.v_hat).all()


def test_an_extra_declared_unscreened_gets_only_the_hard_limit() -> None:
    from pollen.core.layout import ModelLayout
    from pollen.strategies.engine.replies import Extra, ReplySpec, screened_kinds

    layout = ModelLayout.from_arrays(with_running_var(tiny_model()))
    spec = ReplySpec(extras=(Extra("v"), Extra("scale", size=1, screen="off")))
    assert screened_kinds(spec, layout) == ["extra:v", "buffer:bn.running_mean", "buffer:bn.running_var"]
    assert screened_kinds(ReplySpec(buffers="off"), layout) == []
    with pytest.raises(ValueError, match="screen='sometimes' is unknown; allowed: norm, off"):
        Extra("v", screen="sometimes")


# ---------------------------------------------------------------------------- buffers
@pytest.mark.parametrize("rnd", [1, 3], ids=["within-the-round", "streamed-against-the-history"])
def test_a_running_var_of_1e12_is_rejected_when_the_others_are_about_one(rnd: int) -> None:
    def huge_var(local, stat):  # noqa: ANN001, ANN202
        return {**local, "bn.running_var": np.full(4, 1e12, dtype=np.float32)}, stat

    model = with_running_var(tiny_model())
    attacked = run(fed_ams(), 4, attack={(rnd, ATTACKER): huge_var}, model=model)
    silent = run(fed_ams(), 4, attack={(rnd, ATTACKER): None}, model=model)
    assert any("buffer 'bn.running_var' has norm" in r for r in failure_reasons(attacked, rnd))
    assert_same_server_state(attacked, silent)
    assert float(attacked.buffers["bn.running_var"].max()) < 2.0


def test_the_history_per_kind_holds_accepted_norms_only_and_is_resumed_exactly() -> None:
    def huge_var(local, stat):  # noqa: ANN001, ANN202
        return {**local, "bn.running_var": np.full(4, 1e12, dtype=np.float32)}, stat

    strategy = run(fed_ams(), 3, attack={(3, ATTACKER): huge_var}, model=with_running_var(tiny_model()))
    kinds = strategy.screen.state_dict()["kinds"]
    assert set(kinds) == {"buffer:bn.running_mean", "buffer:bn.running_var"}  # the int64 counter is not screened
    assert [len(r) for r in kinds["buffer:bn.running_var"]] == [4, 4, 3]
    assert max(max(r) for r in kinds["buffer:bn.running_var"]) < 10.0
    fresh = FedAMS(
        eta=0.1,
        fraction_evaluate=0.0,
        parts=EngineParts(sampler=ClientSampler(identify_clients=True, seed=3), screen=UpdateScreen(rule="reject")),
    )
    fresh.load_state_dict(strategy.state_dict())
    assert fresh.screen.state_dict() == strategy.screen.state_dict()
    assert fresh.screen.kind_bound("buffer:bn.running_var") == strategy.screen.kind_bound("buffer:bn.running_var")


@pytest.mark.parametrize("bad", [[[-1.0]], [[float("nan")]], "x"])
def test_a_saved_history_per_kind_that_is_not_norms_is_refused(bad) -> None:  # noqa: ANN001
    screen = UpdateScreen()
    with pytest.raises(ValueError, match="screen.kinds"):
        screen.load_state_dict({"history": [], "kinds": {"extra:v": bad} if bad != "x" else bad})
    assert screen.kinds == {}


def test_with_the_clip_rule_an_outlying_buffer_is_scaled_to_its_bound() -> None:
    def huge_var(local, stat):  # noqa: ANN001, ANN202
        return {**local, "bn.running_var": np.full(4, 1e12, dtype=np.float32)}, stat

    strategy = run(fed_ams(rule="clip"), 3, attack={(3, ATTACKER): huge_var}, model=with_running_var(tiny_model()))
    assert not failure_reasons(strategy, 3)
    history = strategy.screen.state_dict()["kinds"]["buffer:bn.running_var"]
    others = sorted(history[-1])[:-1]  # the clipped attacker is the largest of its round
    factor = 10.0**2  # a variance is judged on its scale: the factor squared
    bound = max(factor * float(np.median([n for r in history[:2] for n in r])), factor * float(np.median(others)))
    assert max(history[-1]) <= bound * (1 + 1e-6)
    assert float(strategy.buffers["bn.running_var"].max()) < bound


# ---------------------------------------------------------------------------- the server step's state
def test_the_server_step_refuses_an_optimiser_state_that_would_hold_inf() -> None:
    """A mean coordinate of 1e20 (hard limit raised, screen off) squares to +Inf in float32: AMSGrad's
    step is then 0 and the parameters stay finite, but v_hat would be Inf for ever. The round is rolled back."""

    def huge_update(local, stat):  # noqa: ANN001, ANN202
        return {**local, "conv.bias": local["conv.bias"] + np.float32(1e20)}, stat

    make = fed_ams(rule="off", max_abs=1e30)
    attacked = run(make, 2, attack={(2, ATTACKER): huge_update})
    before = run(make, 1)
    assert any("rolled back" in r and "NaN or Inf in the optimiser's" in r for r in failure_reasons(attacked, 2))
    np.testing.assert_array_equal(attacked.params, before.params)
    for slot, value in attacked.opt_state.slots.items():
        np.testing.assert_array_equal(value, before.opt_state.slots[slot], err_msg=slot)


def test_a_variance_is_judged_on_its_scale_so_mimes_honest_running_var_passes() -> None:
    """Mime's run (docs/results/dropin.md): one honest client's ``running_var`` at 10.6x the median of the
    others' was refused with the factor of 10. A variance is the square of a scale: it is judged with the factor
    squared, a ``running_mean`` (and every other record) with the factor itself."""
    screen = UpdateScreen(rule="reject")
    var, mean = "buffer:bn.running_var", "buffer:bn.running_mean"
    assert (screen.factor_of(var), screen.factor_of(mean), screen.factor_of("extra:v")) == (100.0, 10.0, 10.0)
    norms = [{var: 37.0, mean: 2.0} for _ in range(9)] + [{var: 395.0, mean: 21.2}]
    bounds = screen.round_record_bounds(norms)
    assert bounds[-1] == {var: pytest.approx(3700.0), mean: pytest.approx(20.0)}
    assert screen.judge(395.0, bounds[-1][var])[0] == "accept"
    assert screen.judge(21.2, bounds[-1][mean])[0] == "reject"
    assert screen.judge(1e12, bounds[-1][var])[0] == "reject"  # a running_var of 1e12 among ~37 still is
