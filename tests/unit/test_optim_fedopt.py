"""SGD/FedAvgM, Adam, Yogi, Adagrad, AdaBelief and LAMB against plain-Python references,
closed forms and the first-step values of the FedAdaVR spec (§3.6, §6.A item 4).

Sign convention: delta = x_local - x_global (downhill); x_new = x + step. FedAdaVR writes
G = -delta and subtracts, so its "Delta w ~= -eta sgn(G)" is step ~= +eta sgn(delta) here.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from pollen.optim import OptState, adabelief, adagrad, adam, lamb, segments_from_sizes, sgd, yogi

F32 = np.float32
ADAVR = dict(beta_1=0.9, beta_2=0.999, eps=1e-8)  # FedAdaVR Table 1


def _run(opt, deltas, params=None):
    state = opt.init(len(deltas[0]))
    steps = []
    for d in deltas:
        step, state = opt.update(state, np.asarray(d, dtype=F32), params=params)
        steps.append(step.copy())
    return state, steps


def _deltas(rounds=8, d=40, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(d) * 10.0 ** rng.uniform(-3, 0, size=d)).astype(F32) for _ in range(rounds)]


def _big_first_delta(d=200, seed=7):
    """|Delta| in [1e-3, 1] >> eps = 1e-8, both signs."""
    rng = np.random.default_rng(seed)
    return (rng.choice([-1.0, 1.0], d) * 10.0 ** rng.uniform(-3, 0, d)).astype(F32)


# ----------------------------------------------------------------------------- SGD / FedAvg(M)


def test_fedavg_eta1_step_is_mean_update_and_lands_on_mean_model():
    rng = np.random.default_rng(0)
    x = rng.standard_normal(1000).astype(F32)
    clients = [x + rng.standard_normal(1000).astype(F32) * 0.1 for _ in range(10)]
    delta = np.mean([c - x for c in clients], axis=0).astype(F32)
    opt = sgd(eta=1.0)
    step, state = opt.update(opt.init(1000), delta)
    assert np.array_equal(step, delta)
    np.testing.assert_allclose(x + step, np.mean(clients, axis=0), atol=1e-6)
    assert state.slots == {} and state.step == 1


def test_sgd_steps_telescope():
    deltas = _deltas()
    _, steps = _run(sgd(eta=0.5), deltas)
    want = 0.5 * np.sum(deltas, axis=0, dtype=np.float64)  # x_T - x_0 = eta * sum_t Delta_t
    np.testing.assert_allclose(np.sum(steps, axis=0), want, rtol=1e-5, atol=1e-7)


def test_fedavgm_heavy_ball_closed_form():
    eta, mu = 0.7, 0.9
    deltas = _deltas()
    _, steps = _run(sgd(eta=eta, momentum=mu), deltas)
    for t, got in enumerate(steps):
        want = eta * sum(mu ** (t - s) * deltas[s].astype(np.float64) for s in range(t + 1))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


# ----------------------------------------------------------------------------- Adam


def _plain_adam(deltas, eta, beta_1, beta_2, eps, bc):
    d = len(deltas[0])
    m, v, out = [0.0] * d, [0.0] * d, []
    for t, delta in enumerate(deltas, start=1):
        row = []
        for i in range(d):
            g = float(delta[i])
            m[i] = beta_1 * m[i] + (1 - beta_1) * g
            v[i] = beta_2 * v[i] + (1 - beta_2) * g * g
            if bc:  # FedAdaVR eqs. 16-18
                row.append(eta * (m[i] / (1 - beta_1**t)) / (math.sqrt(v[i] / (1 - beta_2**t)) + eps))
            else:  # FedCAMS eq. 3.4
                row.append(eta * m[i] / (math.sqrt(v[i]) + eps))
        out.append(row)
    return out


@pytest.mark.parametrize("bc", [False, True])
def test_adam_matches_reference(bc):
    deltas = _deltas()
    _, steps = _run(adam(eta=0.1, beta_1=0.9, beta_2=0.99, eps=1e-3, bias_correction=bc), deltas)
    for got, want in zip(steps, _plain_adam(deltas, 0.1, 0.9, 0.99, 1e-3, bc)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def test_adam_moments_closed_form():
    b1, b2 = 0.9, 0.99
    deltas = _deltas(rounds=10)
    state, _ = _run(adam(beta_1=b1, beta_2=b2), deltas)
    T = len(deltas)
    m = sum((1 - b1) * b1 ** (T - 1 - s) * deltas[s].astype(np.float64) for s in range(T))
    v = sum((1 - b2) * b2 ** (T - 1 - s) * deltas[s].astype(np.float64) ** 2 for s in range(T))
    np.testing.assert_allclose(state.slots["m"], m, rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(state.slots["v"], v, rtol=1e-5, atol=1e-12)


def test_bias_corrected_adam_constant_delta_constant_step():
    # m_hat = c and v_hat = c**2 in every round, so step_t = eta c / (|c| + eps) for all t
    c = np.array([0.5, -0.25, 2.0, -1e-3], dtype=F32)
    eta, eps = 0.1, 1e-3
    _, steps = _run(adam(eta=eta, eps=eps, bias_correction=True), [c] * 20)
    want = eta * c.astype(np.float64) / (np.abs(c) + eps)
    for got in steps:
        np.testing.assert_allclose(got, want, rtol=2e-5)


def test_adam_first_step_is_sign_step_fedadavr():
    d = _big_first_delta()
    eta = 0.01
    _, (step,) = _run(adam(eta=eta, bias_correction=True, **ADAVR), [d])
    np.testing.assert_allclose(step, eta * np.sign(d), rtol=2e-5)
    # and the first step really is eta * G / (|G| + eps)
    np.testing.assert_allclose(step, eta * d / (np.abs(d).astype(np.float64) + 1e-8), rtol=1e-6)


def test_step_points_along_delta():
    """The server adds the step; a downhill delta gives a step in the same direction."""
    d = _big_first_delta()
    for opt in (sgd(), adam(), yogi(), adagrad(), adabelief(), lamb(layerwise=False)):
        step, _ = opt.update(opt.init(d.size), d, params=np.ones_like(d))
        assert np.array_equal(np.sign(step), np.sign(d)), opt.name


# ----------------------------------------------------------------------------- Yogi


def _plain_yogi(deltas, eta, beta_1, beta_2, eps, bc):
    d = len(deltas[0])
    m, v, out = [0.0] * d, [0.0] * d, []
    for t, delta in enumerate(deltas, start=1):
        row = []
        for i in range(d):
            g = float(delta[i])
            m[i] = beta_1 * m[i] + (1 - beta_1) * g
            diff = v[i] - g * g
            sgn = (diff > 0) - (diff < 0)
            v[i] = v[i] - (1 - beta_2) * g * g * sgn
            if bc:  # FedAdaVR eqs. 26-28
                row.append(eta * (m[i] / (1 - beta_1**t)) / (math.sqrt(v[i] / (1 - beta_2**t)) + eps))
            else:
                row.append(eta * m[i] / (math.sqrt(v[i]) + eps))
        out.append(row)
    return out


@pytest.mark.parametrize("bc", [False, True])
def test_yogi_matches_reference(bc):
    deltas = _deltas(rounds=10)
    _, steps = _run(yogi(eta=0.01, beta_1=0.9, beta_2=0.99, eps=1e-3, bias_correction=bc), deltas)
    for got, want in zip(steps, _plain_yogi(deltas, 0.01, 0.9, 0.99, 1e-3, bc)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-8)


def test_yogi_first_step_is_sign_step_and_never_nan():
    d = _big_first_delta()
    opt = yogi(eta=0.01, bias_correction=True, **ADAVR)
    step, state = opt.update(opt.init(d.size), d)
    np.testing.assert_allclose(state.slots["v"], 0.001 * d.astype(np.float64) ** 2, rtol=1e-6)  # v_1 = (1-b2) G^2
    np.testing.assert_allclose(step, 0.01 * np.sign(d), rtol=2e-5)
    rng = np.random.default_rng(0)
    for _t in range(300):
        g = (rng.standard_normal(d.size) * 10.0 ** rng.uniform(-6, 1, d.size)).astype(F32)
        g[rng.random(d.size) < 0.3] = 0.0
        step, state = opt.update(state, g)
        assert np.all(state.slots["v"] >= 0.0) and np.all(np.isfinite(step))
    assert state.step == 301


def test_yogi_differs_from_adam_after_first_round():
    deltas = [np.array([1.0, 1.0], F32), np.array([0.1, 3.0], F32)]
    _, y = _run(yogi(eta=1.0, eps=0.0), deltas)
    _, a = _run(adam(eta=1.0, eps=0.0), deltas)
    assert np.array_equal(y[0], a[0]) and not np.allclose(y[1], a[1])


# ----------------------------------------------------------------------------- Adagrad


def test_adagrad_fedadavr_form_and_accumulator_telescopes():
    deltas = _deltas()
    eta, eps = 0.1, 1e-3
    state, steps = _run(adagrad(eta=eta, eps=eps), deltas)
    z = np.zeros(len(deltas[0]))
    for d, got in zip(deltas, steps):
        z += d.astype(np.float64) ** 2  # z_t = z_{t-1} + G^2
        np.testing.assert_allclose(got, eta * d / (np.sqrt(z) + eps), rtol=1e-5)
    np.testing.assert_allclose(state.slots["z"], np.sum(np.square(deltas, dtype=np.float64), axis=0), rtol=1e-5)
    assert set(state.slots) == {"z"}


def test_adagrad_reddi_momentum_and_initial_accumulator():
    deltas = _deltas(rounds=5)
    eta, eps, b1, z0 = 0.1, 1e-3, 0.9, 0.01
    _, steps = _run(adagrad(eta=eta, eps=eps, beta_1=b1, initial_accumulator=z0), deltas)
    m, z = 0.0, z0
    for d, got in zip(deltas, steps):
        m = b1 * m + (1 - b1) * d.astype(np.float64)
        z = z + d.astype(np.float64) ** 2
        np.testing.assert_allclose(got, eta * m / (np.sqrt(z) + eps), rtol=1e-5, atol=1e-9)


def test_adagrad_first_step_is_sign_step():
    d = _big_first_delta()
    _, (step,) = _run(adagrad(eta=0.01, eps=1e-8), [d])
    np.testing.assert_allclose(step, 0.01 * np.sign(d), rtol=2e-5)


# ----------------------------------------------------------------------------- AdaBelief


def _plain_adabelief(deltas, eta, beta_1, beta_2, eps, inner):
    d = len(deltas[0])
    m, z, out = [0.0] * d, [0.0] * d, []
    for t, delta in enumerate(deltas, start=1):
        row = []
        for i in range(d):
            g = float(delta[i])
            m[i] = beta_1 * m[i] + (1 - beta_1) * g
            z[i] = beta_2 * z[i] + (1 - beta_2) * (g - m[i]) ** 2 + (eps if inner else 0.0)
            row.append(eta * (m[i] / (1 - beta_1**t)) / (math.sqrt(z[i] / (1 - beta_2**t)) + eps))
        out.append(row)
    return out


@pytest.mark.parametrize("inner", [False, True])
def test_adabelief_matches_reference(inner):
    deltas = _deltas(rounds=10)
    _, steps = _run(adabelief(eta=0.01, inner_eps=inner, **ADAVR), deltas)
    for got, want in zip(steps, _plain_adabelief(deltas, 0.01, 0.9, 0.999, 1e-8, inner)):
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=1e-9)  # (G - m) cancels in float32


def test_adabelief_first_step_is_sign_over_beta1():
    d = _big_first_delta()
    opt = adabelief(eta=0.01, **ADAVR)
    step, state = opt.update(opt.init(d.size), d)
    # z_1 = (1 - b2) b1^2 G^2 (uses the new m_1 = (1 - b1) G)
    np.testing.assert_allclose(state.slots["z"], 0.001 * 0.81 * d.astype(np.float64) ** 2, rtol=1e-5)
    np.testing.assert_allclose(step, 0.01 * np.sign(d) / 0.9, rtol=2e-5)


# ----------------------------------------------------------------------------- LAMB


def _plain_lamb(deltas, params, segments, eta, beta_1, beta_2, eps):
    d = len(deltas[0])
    m, v, out = [0.0] * d, [0.0] * d, []
    for t, delta in enumerate(deltas, start=1):
        r_hat = []
        for i in range(d):
            g = float(delta[i])
            m[i] = beta_1 * m[i] + (1 - beta_1) * g
            v[i] = beta_2 * v[i] + (1 - beta_2) * g * g
            r_hat.append((m[i] / (1 - beta_1**t)) / (math.sqrt(v[i] / (1 - beta_2**t)) + eps))
        row = [0.0] * d
        for a, b in segments:
            wn = math.sqrt(sum(float(w) ** 2 for w in params[a:b]))
            un = math.sqrt(sum(r * r for r in r_hat[a:b]))
            ratio = wn / un if wn > 0 and un > 0 else 1.0
            for i in range(a, b):
                row[i] = eta * ratio * r_hat[i]
        out.append(row)
    return out


SIZES = [6, 3, 10, 1, 4]


def _lamb_params():
    rng = np.random.default_rng(5)
    p = rng.standard_normal(sum(SIZES)).astype(F32)
    p[6:9] = 0.0  # a zero-initialised bias
    return p


@pytest.mark.parametrize("layerwise", [True, False])
def test_lamb_matches_reference(layerwise):
    segs = segments_from_sizes(SIZES)
    params = _lamb_params()
    deltas = _deltas(rounds=6, d=sum(SIZES))
    opt = lamb(eta=0.01, segments=segs, layerwise=layerwise, **ADAVR)
    _, steps = _run(opt, deltas, params=params)
    ref_segs = segs if layerwise else [(0, sum(SIZES))]
    for got, want in zip(steps, _plain_lamb(deltas, params, ref_segs, 0.01, 0.9, 0.999, 1e-8)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-10)


def test_lamb_first_step_moves_each_layer_by_eta_weight_norm():
    segs = segments_from_sizes(SIZES)
    params = _lamb_params()
    d = _big_first_delta(sum(SIZES))
    eta = 0.01
    opt = lamb(eta=eta, segments=segs, **ADAVR)
    step, _ = opt.update(opt.init(d.size), d, params=params)
    for a, b in segs:
        w = np.linalg.norm(params[a:b].astype(np.float64))
        if w > 0:
            np.testing.assert_allclose(np.linalg.norm(step[a:b].astype(np.float64)), eta * w, rtol=1e-6)
        else:  # zero-norm weights: trust ratio 1, step = eta * r_hat ~= eta * sign(G)
            np.testing.assert_allclose(step[a:b], eta * np.sign(d[a:b]), rtol=2e-5)


def test_lamb_whole_model_norm():
    params = _lamb_params()
    d = _big_first_delta(sum(SIZES))
    opt = lamb(eta=0.01, layerwise=False, **ADAVR)
    step, _ = opt.update(opt.init(d.size), d, params=params)
    want = 0.01 * np.linalg.norm(params.astype(np.float64))
    np.testing.assert_allclose(np.linalg.norm(step.astype(np.float64)), want, rtol=1e-6)


def test_lamb_zero_update_segment_keeps_ratio_one_and_no_nan():
    segs = segments_from_sizes([2, 2])
    params = np.array([1.0, 2.0, 3.0, 4.0], F32)
    opt = lamb(eta=0.01, segments=segs)
    step, _ = opt.update(opt.init(4), np.array([0.0, 0.0, 1.0, -1.0], F32), params=params)
    assert np.all(np.isfinite(step)) and np.all(step[:2] == 0.0)


def test_lamb_needs_params_and_matching_segments():
    opt = lamb(segments=segments_from_sizes([2, 2]))
    state = opt.init(4)
    with pytest.raises(ValueError, match="params"):
        opt.update(state, np.ones(4, F32))
    assert state.step == 0 and not state.slots["m"].any()  # nothing changed by a rejected call
    with pytest.raises(ValueError, match="segments"):
        opt.init(5)
    with pytest.raises(ValueError, match="params"):
        opt.update(state, np.ones(4, F32), params=np.ones(3, F32))


@pytest.mark.parametrize(
    "segments",
    [[(1, 3)], [(0, 2), (3, 4)], [(0, 2), (2, 1)], [(0, 2.0)], [], [(0,)], "ab"],
)
def test_lamb_rejects_bad_segments(segments):
    with pytest.raises(ValueError, match="segments"):
        lamb(segments=segments)


def test_lamb_layerwise_without_segments_is_an_error():
    with pytest.raises(ValueError, match="segments"):
        lamb()
    assert lamb(layerwise=False).hyperparameters()["layerwise"] is False


# ----------------------------------------------------------------------------- bias-correction counter


@pytest.mark.parametrize("cls", [adam, yogi, adabelief])
def test_bias_correction_exponent_increments_once_per_round(cls):
    """Constant-sign delta: round t uses 1 - beta**t, t = state.step (from 1); skipping a count would show."""
    opt = cls(eta=1.0, bias_correction=True, **ADAVR)
    state = opt.init(3)
    for t in range(1, 6):
        _, state = opt.update(state, np.array([1.0, -2.0, 0.5], F32))
        assert state.step == t
    # restart at a shifted counter: the step must change
    shifted = OptState(10, opt.init(3).slots)
    a, _ = opt.update(shifted, np.array([1.0, -2.0, 0.5], F32))
    b, _ = opt.update(opt.init(3), np.array([1.0, -2.0, 0.5], F32))
    assert not np.allclose(a, b)
