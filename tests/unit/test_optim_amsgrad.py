"""FedAMS / FedAMSGrad (FedCAMS Algorithm 1) against hand-computed numbers and the spec's invariants.

Sign convention: delta = x_local - x_global, x_new = x + step.
References here are plain-Python float arithmetic, never the code under test.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from pollen.optim import OptState, Transform, adam, amsgrad, make_server_optimizer

F32 = np.float32

# Three rounds on three coordinates with numbers that are exact in binary:
# beta_1 = beta_2 = 0.5, eps = 0.25, eta = 0.5.
#   coordinate a: Delta = 2, 0, 0     -> v falls, the running max keeps v_hat = 2
#   coordinate b: Delta = .5, -.5, 1  -> v below eps at first (Option 1 floor), then above
#   coordinate c: Delta = 0, 0, 0     -> never moves
DELTAS = [[2.0, 0.5, 0.0], [0.0, -0.5, 0.0], [0.0, 1.0, 0.0]]
HAND = dict(eta=0.5, beta_1=0.5, beta_2=0.5, eps=0.25)


def _run(opt, deltas, state=None):
    state = opt.init(len(deltas[0])) if state is None else state
    steps = []
    for d in deltas:
        step, state = opt.update(state, np.asarray(d, dtype=F32))
        steps.append(step.copy())
    return state, steps


def test_fedams_option1_hand_computed_three_rounds():
    # m:     a: 1, .5, .25          b: .25, -.125, .4375
    # v:     a: 2, 1, .5            b: .125, .1875, .59375
    # v_hat = max(v_hat, v, .25), v_hat_0 = .25:
    #        a: 2, 2, 2             b: .25, .25, .59375        c: .25, .25, .25
    # step = eta * m / sqrt(v_hat)
    expected = [
        [0.5 * 1.0 / math.sqrt(2.0), 0.5 * 0.25 / 0.5, 0.0],
        [0.5 * 0.5 / math.sqrt(2.0), 0.5 * -0.125 / 0.5, 0.0],
        [0.5 * 0.25 / math.sqrt(2.0), 0.5 * 0.4375 / math.sqrt(0.59375), 0.0],
    ]
    state, steps = _run(amsgrad(eps_mode="max", **HAND), DELTAS)
    for got, want in zip(steps, expected):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)
    np.testing.assert_array_equal(state.slots["m"], [0.25, 0.4375, 0.0])
    np.testing.assert_array_equal(state.slots["v"], [0.5, 0.59375, 0.0])
    np.testing.assert_array_equal(state.slots["v_hat"], [2.0, 0.59375, 0.25])
    assert state.step == 3


def test_fedamsgrad_option2_hand_computed_three_rounds():
    # same m and v; v_hat = max(v_hat, v), v_hat_0 = 0:
    #        a: 2, 2, 2             b: .125, .1875, .59375     c: 0, 0, 0
    # step = eta * m / (sqrt(v_hat) + eps)
    s2 = math.sqrt(2.0) + 0.25
    expected = [
        [0.5 * 1.0 / s2, 0.5 * 0.25 / (math.sqrt(0.125) + 0.25), 0.0],
        [0.5 * 0.5 / s2, 0.5 * -0.125 / (math.sqrt(0.1875) + 0.25), 0.0],
        [0.5 * 0.25 / s2, 0.5 * 0.4375 / (math.sqrt(0.59375) + 0.25), 0.0],
    ]
    state, steps = _run(amsgrad(eps_mode="add", **HAND), DELTAS)
    for got, want in zip(steps, expected):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)
    np.testing.assert_array_equal(state.slots["v_hat"], [2.0, 0.59375, 0.0])


def test_initial_v_hat_follows_spec_section_8():
    assert np.all(amsgrad(eps_mode="max", eps=1e-3).init(4).slots["v_hat"] == F32(1e-3))
    assert np.all(amsgrad(eps_mode="add", eps=1e-3).init(4).slots["v_hat"] == 0.0)
    assert set(amsgrad(max_stabilisation=False).init(4).slots) == {"m", "v"}


# ----------------------------------------------------------------------------- invariants (§7.1 item 4)


def _random_deltas(rounds=25, d=400, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(rounds):
        x = rng.standard_normal(d) * 10.0 ** rng.uniform(-4, 0, size=d)  # many scales, some below sqrt(eps)
        x[rng.random(d) < 0.1] = 0.0
        out.append(x.astype(F32))
    return out


@pytest.mark.parametrize("eps_mode", ["max", "add"])
@pytest.mark.parametrize("bias_correction", [False, True])
def test_v_hat_is_non_decreasing(eps_mode, bias_correction):
    opt = amsgrad(eta=1.0, eps=1e-3, eps_mode=eps_mode, bias_correction=bias_correction)
    state = opt.init(400)
    prev = state.slots["v_hat"].copy()
    for d in _random_deltas():
        step, state = opt.update(state, d)
        assert np.all(state.slots["v_hat"] >= prev)
        assert np.all(state.slots["v_hat"] >= state.slots["v"])
        assert np.all(np.isfinite(step))
        prev = state.slots["v_hat"].copy()


def test_option1_floor_and_step_bound():
    eta, eps = 0.7, 1e-3
    opt = amsgrad(eta=eta, eps=eps, eps_mode="max")
    state = opt.init(400)
    for d in _random_deltas():
        step, state = opt.update(state, d)
        assert state.slots["v_hat"].min() >= F32(eps)
        bound = eta * np.abs(state.slots["m"].astype(np.float64)) / math.sqrt(eps)
        assert np.all(np.abs(step) <= bound * (1 + 1e-6))


def _plain_amsgrad(deltas, eta, beta_1, beta_2):
    """Reddi et al. (2018) AMSGrad without epsilon, in plain Python floats."""
    d = len(deltas[0])
    m, v, vh = [0.0] * d, [0.0] * d, [0.0] * d
    steps = []
    for delta in deltas:
        row = []
        for i in range(d):
            g = float(delta[i])
            m[i] = beta_1 * m[i] + (1 - beta_1) * g
            v[i] = beta_2 * v[i] + (1 - beta_2) * g * g
            vh[i] = max(vh[i], v[i])
            row.append(eta * m[i] / math.sqrt(vh[i]))
        steps.append(row)
    return steps


def test_option2_with_eps_zero_is_plain_amsgrad():
    rng = np.random.default_rng(1)
    deltas = [rng.standard_normal(50).astype(F32) for _ in range(12)]
    _, steps = _run(amsgrad(eta=0.3, beta_1=0.9, beta_2=0.99, eps=0.0, eps_mode="add"), deltas)
    for got, want in zip(steps, _plain_amsgrad(deltas, 0.3, 0.9, 0.99)):
        # float32 state vs float64 reference: m can cancel to ~1e-4 of its history
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_option2_eps_zero_untouched_coordinate_steps_zero_not_nan():
    opt = amsgrad(eps=0.0, eps_mode="add")
    state, steps = _run(opt, [[1.0, 0.0], [2.0, 0.0]])
    assert np.all(np.isfinite(steps[-1])) and steps[-1][1] == 0.0


def test_option1_equals_eps_less_max_with_v_hat0_eps_bitwise():
    """max(v_hat, v, eps) == max(v_hat, v) started from v_hat_0 = eps (the code's max_init)."""
    eps = 1e-3
    deltas = _random_deltas()
    for bc in (False, True):
        _, steps1 = _run(amsgrad(eta=1.0, eps=eps, eps_mode="max", bias_correction=bc), deltas)
        code_style = amsgrad(eta=1.0, eps=0.0, eps_mode="add", bias_correction=bc)
        state = code_style.init(400)
        state = OptState(state.step, {**state.slots, "v_hat": np.full(400, eps, F32)})  # max_init = eps
        _, steps2 = _run(code_style, deltas, state)
        for a, b in zip(steps1, steps2):
            assert np.array_equal(a, b)


def test_option1_depends_on_eps_only_through_the_floor():
    """Any v_hat_0 in [0, eps] gives the same iterates (spec §8 A.1)."""
    deltas = _random_deltas(rounds=8)
    opt = amsgrad(eps=1e-3, eps_mode="max")
    _, ref = _run(opt, deltas)
    state = opt.init(400)
    state = OptState(state.step, {**state.slots, "v_hat": np.zeros(400, F32)})
    _, alt = _run(opt, deltas, state)
    for a, b in zip(ref, alt):
        assert np.array_equal(a, b)


# ----------------------------------------------------------------------------- FedAdam equivalence


@pytest.mark.parametrize("bias_correction", [False, True])
def test_option2_without_max_is_fedadam_bit_for_bit(bias_correction):
    kw = dict(eta=0.1, beta_1=0.9, beta_2=0.99, eps=1e-3, bias_correction=bias_correction)
    deltas = _random_deltas()
    _, a = _run(amsgrad(eps_mode="add", max_stabilisation=False, **kw), deltas)
    _, b = _run(adam(**kw), deltas)
    for x, y in zip(a, b):
        assert np.array_equal(x, y)


def test_option1_without_max_keeps_eps_floor():
    eta, eps = 1.0, 1e-2
    deltas = [[0.01, 1.0], [0.0, 0.0], [0.02, 0.5]]
    _, steps = _run(amsgrad(eta=eta, beta_1=0.5, beta_2=0.5, eps=eps, max_stabilisation=False), deltas)
    m, v = [0.0, 0.0], [0.0, 0.0]
    for delta, got in zip(deltas, steps):
        want = []
        for i in range(2):
            m[i] = 0.5 * m[i] + 0.5 * delta[i]
            v[i] = 0.5 * v[i] + 0.5 * delta[i] ** 2
            want.append(eta * m[i] / math.sqrt(max(v[i], eps)))
        np.testing.assert_allclose(got, want, rtol=1e-6)


# ----------------------------------------------------------------------------- bias correction (§3.9)


def _code_style(deltas, eta, beta_1, beta_2, eps, max_init):
    """The official code's loop (spec §3.9) in plain Python floats."""
    d = len(deltas[0])
    m, v, vh = [0.0] * d, [0.0] * d, [max_init] * d
    steps = []
    for t, delta in enumerate(deltas, start=1):
        row = []
        for i in range(d):
            g = float(delta[i])
            m[i] = beta_1 * m[i] + (1 - beta_1) * g
            v[i] = beta_2 * v[i] + (1 - beta_2) * g * g
            vh[i] = max(vh[i], v[i])
            denom = math.sqrt(vh[i]) / math.sqrt(1 - beta_2**t) + eps
            row.append(eta / (1 - beta_1**t) * m[i] / denom)
        steps.append(row)
    return steps


def test_bias_correction_matches_code_option1_and_option2():
    deltas = _random_deltas(rounds=10, d=60, seed=3)
    _, s1 = _run(amsgrad(eta=1.0, eps=1e-3, eps_mode="max", bias_correction=True), deltas)
    for got, want in zip(s1, _code_style(deltas, 1.0, 0.9, 0.99, eps=0.0, max_init=1e-3)):
        np.testing.assert_allclose(got, want, rtol=2e-5)
    _, s2 = _run(amsgrad(eta=0.1, eps=0.1, eps_mode="add", bias_correction=True), deltas)
    for got, want in zip(s2, _code_style(deltas, 0.1, 0.9, 0.99, eps=0.1, max_init=0.0)):
        np.testing.assert_allclose(got, want, rtol=2e-5)


def test_bias_correction_first_step_identical_for_paper_betas():
    """t = 1, beta_1 = 0.9, beta_2 = 0.99: 1 - beta_1 == sqrt(1 - beta_2), so Option 1 steps agree.

    Not bit-identical: in float64 1 - 0.9 = 0.09999999999999998 and sqrt(1 - 0.99) = 0.1000000000000000044.
    """
    d = _random_deltas(rounds=1)[0]
    _, (plain,) = _run(amsgrad(eps=1e-3, eps_mode="max", bias_correction=False), [d])
    _, (corrected,) = _run(amsgrad(eps=1e-3, eps_mode="max", bias_correction=True), [d])
    np.testing.assert_allclose(corrected, plain, rtol=1e-6)
    _, (_, p2) = _run(amsgrad(eps=1e-3, bias_correction=False), [d, d])
    _, (_, c2) = _run(amsgrad(eps=1e-3, bias_correction=True), [d, d])
    assert not np.allclose(p2[d != 0], c2[d != 0], rtol=1e-3)  # t = 2: the flag matters


def test_bias_correction_option2_first_step_differs_only_by_eps_scale():
    # t=1: (eta/(1-b1)) m / (sqrt(v)/sqrt(1-b2) + eps) = eta m / (sqrt(v) + 0.1 eps) for b1=.9, b2=.99
    eta, eps = 0.1, 0.1
    _, (got,) = _run(amsgrad(eta=eta, eps=eps, eps_mode="add", bias_correction=True), [[0.5, -0.02, 0.0]])
    want = [eta * 0.1 * g / (math.sqrt(0.01 * g * g) + 0.1 * eps) for g in (0.5, -0.02, 0.0)]
    np.testing.assert_allclose(got, want, rtol=1e-6)


# ----------------------------------------------------------------------------- factory


def test_factory_builds_amsgrad_with_options():
    opt = make_server_optimizer("amsgrad", eta=1, eps=1e-3, eps_mode="add", max_stabilisation=False)
    assert isinstance(opt, Transform) and opt.name == "amsgrad"
    assert opt.hyperparameters() == {
        "eta": 1.0,
        "beta_1": 0.9,
        "beta_2": 0.99,
        "eps": 1e-3,
        "eps_mode": "add",
        "bias_correction": False,
        "max_stabilisation": False,
    }


@pytest.mark.parametrize(
    "kw, key",
    [
        (dict(eps_mode="outside"), "eps_mode"),
        (dict(eps_mode="max", eps=0.0), "eps"),
        (dict(eps=-1e-3, eps_mode="add"), "eps"),
        (dict(max_stabilisation="yes"), "max_stabilisation"),
        (dict(bias_correction=1), "bias_correction"),
        (dict(beta_2=1.0), "beta_2"),
    ],
)
def test_bad_amsgrad_values_name_the_key(kw, key):
    with pytest.raises(ValueError, match=key):
        amsgrad(**kw)


def test_inside_mode_is_ha_feds_fedamsgrad_eps_under_the_sqrt():
    """HA-Fed eq. (3.2): v_hat = max(v_hat, v) from 0, x += eta * m / sqrt(v_hat + eps), no bias correction."""
    eta, b1, b2, eps = 0.01, 0.9, 0.99, 1e-8
    opt = amsgrad(eta=eta, beta_1=b1, beta_2=b2, eps=eps, eps_mode="inside")
    state = opt.init(4)
    assert not state.slots["v_hat"].any()
    m = v = v_hat = np.zeros(4)
    rng = np.random.default_rng(5)
    for _ in range(4):
        delta = (rng.standard_normal(4) * 1e-3).astype(np.float32)
        step, state = opt.update(state, delta)
        m = b1 * m + (1 - b1) * delta
        v = b2 * v + (1 - b2) * delta.astype(np.float64) ** 2
        v_hat = np.maximum(v_hat, v)
        np.testing.assert_allclose(step, eta * m / np.sqrt(v_hat + eps), rtol=1e-5)
    zero = amsgrad(eta=1.0, eps=0.0, eps_mode="inside")
    step, _ = zero.update(zero.init(2), np.zeros(2, np.float32))
    assert np.array_equal(step, np.zeros(2, np.float32))  # 0/0 is a zero step, not nan
