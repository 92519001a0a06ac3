"""The transform contract of pollen.optim: returned (never mutated) state, spare states, chains, aliases.

The first test pins the numbers: every alias, in every setting, equals bit for bit a frozen copy of the
single-class optimisers pollen had before the transforms (their per-element numpy formulas, written out
below in the same order of operations), over several rounds of random data, at several block sizes,
with and without a reused spare state. The project's presets therefore give the same results as before.

Sign convention: delta = x_local - x_global, x_new = x + step.
"""

from __future__ import annotations

import ast
import itertools
import math
from pathlib import Path

import numpy as np
import pytest

from pollen.optim import (
    BY_NAME,
    SERVER_OPTIMIZERS,
    OptState,
    adam,
    amsgrad,
    chain,
    lamb,
    make_server_optimizer,
    scale,
    scale_by_adam,
    scale_by_amsgrad,
    scale_by_belief,
    scale_by_trust_ratio,
    scale_by_yogi,
    segments_from_sizes,
    sgd,
    spare_like,
    trace,
)

F32 = np.float32
D = 301
SEGS = segments_from_sizes([5, 120, 0, 31, 145])


# ----------------------------------------------------------------------------- the frozen reference
# The update of each optimiser before the transforms, whole-vector, in the order of operations of the old
# code (float32 arrays times Python floats, as numpy rounds them). `s` is the state dict (name -> array),
# replaced by the new values; returns the step.


def _old_adaptive_step(m, second, *, eta, eps, t, b1, b2, bc, positive=False):
    out = np.sqrt(second)
    if bc:
        out /= math.sqrt(1.0 - b2**t)
    if eps != 0.0:
        out += eps
    if eps == 0.0 and not positive and not out.all():
        np.divide(m, out, out=out, where=out != 0)
    else:
        np.divide(m, out, out=out)
    factor = eta / (1.0 - b1**t) if bc else eta
    if factor != 1.0:
        out *= factor
    return out


def _old_moments(s, d, b1, b2):
    s["m"] = s["m"] * b1 + d * (1.0 - b1)
    s["v"] = s["v"] * b2 + (d * d) * (1.0 - b2)


def _old_sgd(s, d, p, t, eta=1.0, momentum=0.0):
    if momentum > 0.0:
        s["momentum_buffer"] = s["momentum_buffer"] * momentum + d
        return s["momentum_buffer"] * eta
    return d * eta


def _old_adam(s, d, p, t, eta=0.1, beta_1=0.9, beta_2=0.99, eps=1e-3, bias_correction=False):
    _old_moments(s, d, beta_1, beta_2)
    return _old_adaptive_step(s["m"], s["v"], eta=eta, eps=eps, t=t, b1=beta_1, b2=beta_2, bc=bias_correction)


def _old_yogi(s, d, p, t, eta=0.01, beta_1=0.9, beta_2=0.99, eps=1e-3, bias_correction=False):
    s["m"] = s["m"] * beta_1 + d * (1.0 - beta_1)
    g2 = d * d
    s["v"] = s["v"] - np.sign(s["v"] - g2) * g2 * (1.0 - beta_2)
    return _old_adaptive_step(s["m"], s["v"], eta=eta, eps=eps, t=t, b1=beta_1, b2=beta_2, bc=bias_correction)


def _old_adagrad(s, d, p, t, eta=0.1, eps=1e-3, beta_1=0.0, initial_accumulator=0.0):
    if beta_1 > 0.0:
        s["m"] = s["m"] * beta_1 + d * (1.0 - beta_1)
    m = s["m"] if beta_1 > 0.0 else d
    s["z"] = s["z"] + d * d
    return _old_adaptive_step(m, s["z"], eta=eta, eps=eps, t=t, b1=0.0, b2=0.0, bc=False)


def _old_adabelief(s, d, p, t, eta=0.01, beta_1=0.9, beta_2=0.999, eps=1e-8, bias_correction=True, inner_eps=False):
    s["m"] = s["m"] * beta_1 + d * (1.0 - beta_1)
    diff = d - s["m"]
    s["z"] = s["z"] * beta_2 + (diff * diff) * (1.0 - beta_2)
    if inner_eps:
        s["z"] = s["z"] + eps
    return _old_adaptive_step(s["m"], s["z"], eta=eta, eps=eps, t=t, b1=beta_1, b2=beta_2, bc=bias_correction)


def _old_lamb(
    s, d, p, t, eta=0.01, beta_1=0.9, beta_2=0.999, eps=1e-8, bias_correction=True, segments=None, layerwise=True
):
    _old_moments(s, d, beta_1, beta_2)
    r_hat = _old_adaptive_step(s["m"], s["v"], eta=1.0, eps=eps, t=t, b1=beta_1, b2=beta_2, bc=bias_correction)
    for start, stop in segments if layerwise else ((0, d.shape[0]),):
        w, r = p[start:stop], r_hat[start:stop]
        weight_norm = math.sqrt(float(np.dot(w, w)))
        update_norm = math.sqrt(float(np.dot(r, r)))
        ratio = weight_norm / update_norm if weight_norm > 0.0 and update_norm > 0.0 else 1.0
        r *= eta * ratio  # one multiply by the product
    return r_hat


def _old_amsgrad(
    s,
    d,
    p,
    t,
    eta=1.0,
    beta_1=0.9,
    beta_2=0.99,
    eps=1e-3,
    eps_mode="max",
    bias_correction=False,
    max_stabilisation=True,
):
    _old_moments(s, d, beta_1, beta_2)
    option1 = eps_mode == "max"
    if max_stabilisation:
        s["v_hat"] = np.maximum(s["v_hat"], s["v"])
        if option1:
            s["v_hat"] = np.maximum(s["v_hat"], eps)
        v_hat = s["v_hat"]
    else:
        v_hat = np.maximum(s["v"], eps) if option1 else s["v"]
    kw = dict(eta=eta, t=t, b1=beta_1, b2=beta_2, bc=bias_correction)
    if eps_mode == "inside":
        return _old_adaptive_step(s["m"], v_hat + eps, eps=0.0, positive=eps > 0, **kw)
    return _old_adaptive_step(s["m"], v_hat, eps=0.0 if option1 else eps, positive=option1, **kw)


def _old_adpfed_adam(s, d, p, t, eta=0.01, beta_1=0.9, beta_2=0.999, v0=1e-8, floor=1e-16):
    _old_moments(s, d, beta_1, beta_2)
    out = np.sqrt(np.maximum(s["v"], floor))
    out = s["m"] / out
    out *= eta
    return out


OLD = {
    "sgd": (_old_sgd, lambda kw, d: {"momentum_buffer": np.zeros(d, F32)} if kw.get("momentum", 0.0) > 0 else {}),
    "adam": (_old_adam, lambda kw, d: {"m": np.zeros(d, F32), "v": np.zeros(d, F32)}),
    "yogi": (_old_yogi, lambda kw, d: {"m": np.zeros(d, F32), "v": np.zeros(d, F32)}),
    "adagrad": (
        _old_adagrad,
        lambda kw, d: {
            **({"m": np.zeros(d, F32)} if kw.get("beta_1", 0.0) > 0 else {}),
            "z": np.full(d, kw.get("initial_accumulator", 0.0), F32),
        },
    ),
    "adabelief": (_old_adabelief, lambda kw, d: {"m": np.zeros(d, F32), "z": np.zeros(d, F32)}),
    "lamb": (_old_lamb, lambda kw, d: {"m": np.zeros(d, F32), "v": np.zeros(d, F32)}),
    "amsgrad": (
        _old_amsgrad,
        lambda kw, d: {
            "m": np.zeros(d, F32),
            "v": np.zeros(d, F32),
            **(
                {"v_hat": np.full(d, kw.get("eps", 1e-3) if kw.get("eps_mode", "max") == "max" else 0.0, F32)}
                if kw.get("max_stabilisation", True)
                else {}
            ),
        },
    ),
    "adpfed_adam": (_old_adpfed_adam, lambda kw, d: {"m": np.zeros(d, F32), "v": np.full(d, kw.get("v0", 1e-8), F32)}),
}


def _settings():
    out = []
    for mom, eta in itertools.product((0.0, 0.9), (1.0, 0.5)):
        out.append(("sgd", dict(eta=eta, momentum=mom)))
    for name, bc, eps, eta in itertools.product(("adam", "yogi"), (False, True), (0.0, 1e-3), (1.0, 0.1)):
        out.append((name, dict(eta=eta, eps=eps, bias_correction=bc, beta_2=0.999 if bc else 0.99)))
    for b1, eps in itertools.product((0.0, 0.5), (0.0, 1e-3)):
        out.append(("adagrad", dict(eta=0.1, eps=eps, beta_1=b1, initial_accumulator=0.01 if b1 else 0.0)))
    for inner, bc in itertools.product((False, True), (False, True)):
        out.append(("adabelief", dict(eta=0.01, inner_eps=inner, bias_correction=bc)))
    for lw, bc, eta in itertools.product((False, True), (False, True), (1.0, 0.01)):
        out.append(("lamb", dict(eta=eta, segments=SEGS, layerwise=lw, bias_correction=bc)))
    for mode, bc, ms, eta in itertools.product(("max", "add", "inside"), (False, True), (False, True), (1.0, 0.3)):
        for eps in (1e-3,) if mode == "max" else (0.0, 1e-3):
            out.append(("amsgrad", dict(eta=eta, eps=eps, eps_mode=mode, bias_correction=bc, max_stabilisation=ms)))
    for floor, v0 in itertools.product((1e-16, 0.0), (1e-8, 1e-3)):
        out.append(("adpfed_adam", dict(eta=0.05, v0=v0, floor=floor)))
    return out


SETTINGS = _settings()


def _rounds(n=6, d=D, seed=0):
    rng = np.random.default_rng(seed)
    deltas = []
    for _ in range(n):
        x = rng.standard_normal(d) * 10.0 ** rng.uniform(-5, 1, size=d)  # many scales
        x[rng.random(d) < 0.15] = 0.0
        x[:7] = 0.0  # coordinates that never move (0/0 guards)
        deltas.append(x.astype(F32))
    params = rng.standard_normal(d).astype(F32)
    params[5:125] = 0.0  # a zero-initialised tensor (trust ratio 1)
    return deltas, params


def test_the_settings_cover_every_alias():
    assert {name for name, _ in SETTINGS} == set(SERVER_OPTIMIZERS) == set(OLD)


@pytest.mark.parametrize("block_size", [1 << 16, 64, 7])
@pytest.mark.parametrize(("name", "kw"), SETTINGS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(SETTINGS)])
def test_aliases_are_bit_identical_to_the_frozen_old_optimisers(name, kw, block_size):
    deltas, params = _rounds()
    old_update, old_init = OLD[name]
    ref = old_init(kw, D)
    opt = make_server_optimizer(name, **kw)
    opt.block_size = block_size
    state, spare = opt.init(D), None
    fresh_state = state
    for t, d in enumerate(deltas, start=1):
        want = old_update(ref, d, params, t, **kw)
        got, new = opt.update(state, d, params, into=spare)  # reusing the spare state...
        again, fresh_state = opt.update(fresh_state, d, params)  # ...and allocating every round
        assert want.dtype == got.dtype == F32
        assert want.tobytes() == got.tobytes() == again.tobytes(), (name, kw, t)
        assert new.slots.keys() == ref.keys() == fresh_state.slots.keys()
        for k in ref:
            assert ref[k].dtype == F32 and ref[k].tobytes() == new.slots[k].tobytes() == fresh_state.slots[k].tobytes()
        spare, state = state, new


# ----------------------------------------------------------------------------- the state is never modified


def _fingerprint(state: OptState) -> tuple:
    return state.step, {k: (v.tobytes(), v.dtype, v.shape) for k, v in state.slots.items()}


@pytest.mark.parametrize("name", SERVER_OPTIMIZERS)
def test_update_never_modifies_the_state_it_is_given(name):
    kw = dict(segments=SEGS) if name == "lamb" else {}
    opt = make_server_optimizer(name, **kw)
    deltas, params = _rounds(4)
    state = opt.init(D)
    for d in deltas:
        before = _fingerprint(state)
        delta_before, params_before = d.tobytes(), params.tobytes()
        step, new = opt.update(state, d, params)
        assert _fingerprint(state) == before  # the old state is intact...
        assert d.tobytes() == delta_before and params.tobytes() == params_before  # ...and so are the inputs
        assert new is not state and new.step == state.step + 1
        for k in state.slots:
            assert not np.shares_memory(new.slots[k], state.slots[k])
            assert not state.slots[k].flags.writeable and not new.slots[k].flags.writeable
        state = new


def test_the_state_cannot_be_changed_by_accident():
    state = amsgrad().init(4)
    with pytest.raises(ValueError, match="read-only"):
        state.slots["m"][0] = 1.0
    with pytest.raises(TypeError):
        state.slots["m"] = np.ones(4, F32)  # the mapping is read-only
    with pytest.raises(AttributeError):
        state.step = 3  # frozen


# ----------------------------------------------------------------------------- spare states (into=)


@pytest.mark.parametrize("name", SERVER_OPTIMIZERS)
def test_into_reuses_the_spare_arrays_and_gives_the_same_bits_as_a_fresh_update(name):
    kw = dict(segments=SEGS) if name == "lamb" else {}
    opt = make_server_optimizer(name, **kw)
    deltas, params = _rounds(5, seed=3)
    state, spare = opt.init(D), spare_like(opt.init(D))
    fresh = state
    out = np.empty(D, F32)
    for d in deltas:
        arrays = {k: v for k, v in spare.slots.items()}
        step, new = opt.update(state, d, params, into=spare, out=out)
        want, fresh = opt.update(fresh, d, params)
        assert step is out and step.tobytes() == want.tobytes()
        for k in new.slots:
            assert new.slots[k] is arrays[k]  # written in place: no allocation
            assert new.slots[k].tobytes() == fresh.slots[k].tobytes()
        spare, state = state, new  # commit: the old state is the next spare


def test_rollback_is_keeping_the_old_state():
    opt = amsgrad(eta=0.5, eps=1e-3, bias_correction=True)
    deltas, _ = _rounds(4, seed=5)
    state = opt.init(D)
    _, state = opt.update(state, deltas[0])
    kept = _fingerprint(state)
    # a round that fails after the step: its state is discarded (and becomes the next spare)
    _, discarded = opt.update(state, deltas[1] * F32(1e6))
    spare = discarded
    assert _fingerprint(state) == kept
    # the old state goes on as if the failed round never happened
    a, state = opt.update(state, deltas[2], into=spare)
    control = opt.init(D)
    _, control = opt.update(control, deltas[0])
    b, control = opt.update(control, deltas[2])
    assert a.tobytes() == b.tobytes()
    for k in state.slots:
        assert state.slots[k].tobytes() == control.slots[k].tobytes()


def test_into_and_out_that_would_overwrite_an_input_are_refused():
    opt = adam()
    state = opt.init(4)
    d = np.ones(4, F32)
    with pytest.raises(ValueError, match="into is the state itself"):
        opt.update(state, d, into=state)
    aliased = OptState(0, {"m": state.slots["m"], "v": np.zeros(4, F32)})
    with pytest.raises(ValueError, match="shares memory with state slot 'm'"):
        opt.update(state, d, into=aliased)
    spare = spare_like(state)
    with pytest.raises(ValueError, match="shares memory with delta"):
        opt.update(state, spare.slots["v"], into=spare)
    with pytest.raises(ValueError, match=r"out shares memory with delta"):
        opt.update(state, d, out=d)
    with pytest.raises(ValueError, match="missing"):
        opt.update(state, d, into=OptState(0, {"m": np.zeros(4, F32)}))
    with pytest.raises(ValueError, match=r"length 5"):
        opt.update(state, d, into=spare_like(opt.init(5)))
    assert _fingerprint(state) == _fingerprint(opt.init(4))  # nothing changed by the refused calls


def test_a_foreign_state_is_refused_by_name():
    with pytest.raises(ValueError, match=r"unexpected \['v_hat'\]"):
        adam().update(amsgrad().init(3), np.ones(3, F32))


# ----------------------------------------------------------------------------- chains


def test_chain_of_pieces_equals_the_alias_bit_for_bit():
    deltas, _ = _rounds(5, seed=7)
    pieces = chain(scale_by_adam(beta_1=0.9, beta_2=0.999, eps=1e-8, bias_correction=True), scale(0.01))
    named = adam(eta=0.01, beta_1=0.9, beta_2=0.999, eps=1e-8, bias_correction=True)
    s1, s2 = pieces.init(D), named.init(D)
    for d in deltas:
        a, s1 = pieces.update(s1, d)
        b, s2 = named.update(s2, d)
        assert a.tobytes() == b.tobytes()
    assert pieces.name == "chain(scale_by_adam, scale)" and named.name == "adam"
    assert pieces.hyperparameters() == named.hyperparameters()


def test_scales_fuse_into_one_factor_and_chains_flatten():
    deltas, _ = _rounds(3, seed=8)
    two = chain(scale_by_amsgrad(eps_mode="add"), scale(0.5), scale(0.25))
    one = chain(chain(scale_by_amsgrad(eps_mode="add")), scale(0.125))  # 0.5 * 0.25 == 0.125 exactly
    s1, s2 = two.init(D), one.init(D)
    for d in deltas:
        a, s1 = two.update(s1, d)
        b, s2 = one.update(s2, d)
        assert a.tobytes() == b.tobytes()
    only_scales = chain(scale(0.5), scale(3.0))
    step, _ = only_scales.update(only_scales.init(D), deltas[0])
    assert step.tobytes() == (deltas[0] * 1.5).tobytes()


def test_a_piece_after_another_reads_that_ones_output():
    """scale(2) then Adam's direction is Adam's direction of 2 * delta (the chain hands Adam a copy of
    its input, since Adam writes ``out`` before it has read its input for the last time)."""
    deltas, _ = _rounds(4, seed=9)
    first = chain(scale(2.0), scale_by_adam(eps=1e-3))
    alone = scale_by_adam(eps=1e-3)
    for block_size in (1 << 16, 5):
        first.block_size = alone.block_size = block_size
        s1, s2 = first.init(D), alone.init(D)
        for d in deltas:
            a, s1 = first.update(s1, d)
            b, s2 = alone.update(s2, np.multiply(d, 2.0))
            assert a.tobytes() == b.tobytes()


def test_chain_state_is_the_pieces_slots_side_by_side():
    tx = chain(trace(0.9), scale_by_belief(), scale(0.1))
    state = tx.init(6)
    assert set(state.slots) == {"momentum_buffer", "m", "z"}
    _, new = tx.update(state, np.ones(6, F32))
    assert new.step == 1 and set(new.slots) == set(state.slots)
    assert new.slots["momentum_buffer"][0] == 1.0  # the trace saw delta; AdaBelief saw the trace
    with pytest.raises(ValueError, match="slot 'm' is kept by both scale_by_adam and scale_by_yogi"):
        chain(scale_by_adam(), scale_by_yogi())
    with pytest.raises(ValueError, match="not a Transform"):
        chain(scale_by_adam(), 0.1)
    empty = chain()
    step, _ = empty.update(empty.init(3), np.array([1.0, -2.0, 3.0], F32))
    assert step.tolist() == [1.0, -2.0, 3.0]


# ----------------------------------------------------------------------------- aliases


def test_by_name_covers_every_name_and_builds_what_the_alias_builds():
    assert tuple(BY_NAME) == SERVER_OPTIMIZERS
    deltas, params = _rounds(3, seed=11)
    for name, build in BY_NAME.items():
        kw = dict(segments=SEGS) if name == "lamb" else {}
        a, b = build(**kw), make_server_optimizer(name, **kw)
        assert a.name == b.name == name and repr(a) == repr(b)
        s1, s2 = a.init(D), b.init(D)
        for d in deltas:
            x, s1 = a.update(s1, d, params)
            y, s2 = b.update(s2, d, params)
            assert x.tobytes() == y.tobytes()


def test_alias_errors_name_the_alias_and_the_piece():
    with pytest.raises(ValueError) as e:
        amsgrad(eps_mode="max", eps=0.0)
    assert str(e.value).startswith("amsgrad: scale_by_amsgrad: eps=0.0 is out of range; allowed: 0 < eps")
    with pytest.raises(ValueError, match=r"^sgd: scale: eta=-1\.0 is out of range; allowed: 0 < eta"):
        sgd(eta=-1.0)


def test_lamb_is_adam_then_a_separable_trust_ratio_then_eta():
    """LAMB = chain(scale_by_adam, scale_by_trust_ratio, scale(eta)); per tensor, its step is Adam's
    direction (rate 1) times ``eta * ||x_l|| / ||r_l||``, one multiply by that product."""
    deltas, params = _rounds(5, seed=13)
    eta = 0.01
    adam_kw = dict(beta_1=0.9, beta_2=0.999, eps=1e-8, bias_correction=True)
    named = lamb(eta=eta, segments=SEGS, **adam_kw)
    pieces = chain(scale_by_adam(**adam_kw), scale_by_trust_ratio(segments=SEGS), scale(eta))
    direction = scale_by_adam(**adam_kw)  # the same first piece alone: r_hat
    s1, s2, s3 = named.init(D), pieces.init(D), direction.init(D)
    for d in deltas:
        a, s1 = named.update(s1, d, params)
        b, s2 = pieces.update(s2, d, params)
        r_hat, s3 = direction.update(s3, d)
        want = np.empty(D, F32)
        for start, stop in SEGS:
            w, r = params[start:stop], r_hat[start:stop]
            wn, rn = math.sqrt(float(np.dot(w, w))), math.sqrt(float(np.dot(r, r)))
            ratio = wn / rn if wn > 0 and rn > 0 else 1.0
            np.multiply(r, eta * ratio, out=want[start:stop])
        assert a.tobytes() == b.tobytes() == want.tobytes()
    assert set(s1.slots) == {"m", "v"}  # the trust ratio keeps nothing
    with pytest.raises(ValueError, match="params"):
        scale_by_trust_ratio(layerwise=False).update(scale_by_trust_ratio(layerwise=False).init(3), np.ones(3, F32))


# ----------------------------------------------------------------------------- Flower-free


def test_the_math_layer_imports_no_flower():
    root = Path(__file__).resolve().parents[1] / "pollen" / "optim"
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            assert not any(n == "flwr" or n.startswith("flwr.") for n in names), path.name
