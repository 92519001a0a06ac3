"""State serialisation, the factory, hyper-parameter validation and input checks of pollen.optim."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from pollen.optim import (
    BY_NAME,
    SERVER_OPTIMIZERS,
    OptState,
    Transform,
    make_server_optimizer,
    segments_from_sizes,
)

F32 = np.float32
D = 23
SEGS = segments_from_sizes([5, 10, 8])

# one non-default configuration per optimiser, so that every slot is exercised
CONFIGS = {
    "sgd": dict(eta=0.5, momentum=0.9),
    "adam": dict(eta=0.1, bias_correction=True),
    "yogi": dict(eta=0.01, bias_correction=True),
    "adagrad": dict(eta=0.1, beta_1=0.5),
    "adabelief": dict(eta=0.01, inner_eps=True),
    "lamb": dict(eta=0.01, segments=SEGS),
    "amsgrad": dict(eta=1.0, eps=1e-3, eps_mode="max", bias_correction=True),
    "adpfed_adam": dict(eta=0.05, v0=1e-6),
}


def _inputs(rounds, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(D).astype(F32) * 0.1 for _ in range(rounds)]


def test_registry_lists_every_optimiser():
    assert set(SERVER_OPTIMIZERS) == {"sgd", "adam", "yogi", "adagrad", "adabelief", "lamb", "amsgrad", "adpfed_adam"}
    assert SERVER_OPTIMIZERS == tuple(BY_NAME)
    assert set(CONFIGS) == set(SERVER_OPTIMIZERS)
    for name in SERVER_OPTIMIZERS:
        opt = make_server_optimizer(name, **CONFIGS[name])
        assert isinstance(opt, Transform) and opt.name == name
        hp = opt.hyperparameters()
        assert all(isinstance(v, (bool, int, float, str)) for v in hp.values())
        assert name in repr(opt).lower() or type(opt).__name__ in repr(opt)


@pytest.mark.parametrize("name", SERVER_OPTIMIZERS)
@pytest.mark.parametrize("via", ["dict", "pickle"])
def test_state_round_trip_then_continue_gives_identical_steps(name, via):
    opt = make_server_optimizer(name, **CONFIGS[name])
    params = np.random.default_rng(9).standard_normal(D).astype(F32)
    deltas = _inputs(7)
    state = opt.init(D)
    for d in deltas[:3]:
        _, state = opt.update(state, d, params=params)
    saved = state.to_dict()
    if via == "pickle":
        saved = pickle.loads(pickle.dumps(saved))
    restored = OptState.from_dict(saved)
    assert restored.step == state.step == 3
    assert restored.slots.keys() == state.slots.keys()
    for k in state.slots:
        assert restored.slots[k].dtype == F32 and np.array_equal(restored.slots[k], state.slots[k])
    fresh = make_server_optimizer(name, **CONFIGS[name])  # a new process would build a new optimiser
    for d in deltas[3:]:
        a, state = opt.update(state, d, params=params)
        b, restored = fresh.update(restored, d, params=params)
        assert np.array_equal(a, b)
    for k in state.slots:
        assert np.array_equal(restored.slots[k], state.slots[k])


def test_to_dict_is_a_snapshot_and_from_dict_copies():
    opt = make_server_optimizer("adam")
    state = opt.init(4)
    snap = state.to_dict()
    _, state = opt.update(state, np.ones(4, F32))
    assert not snap["slots"]["m"].any() and snap["step"] == 0
    restored = OptState.from_dict(snap)
    assert not np.shares_memory(restored.slots["m"], snap["slots"]["m"])
    with pytest.raises(ValueError, match="read-only"):
        restored.slots["m"][:] = 1.0  # a restored state is as read-only as any other
    snap["slots"]["m"][:] = 1.0  # the dict stays the caller's: writing it leaves the state alone
    assert not restored.slots["m"].any()


@pytest.mark.parametrize(
    "bad",
    [
        {"slots": {}},
        {"step": -1, "slots": {}},
        {"step": 1.5, "slots": {}},
        {"step": 0, "slots": {"m": np.zeros((2, 2), F32)}},
        {"step": 0, "slots": {"m": np.zeros(3, np.float64)}},
        {"step": 0, "slots": {"m": np.zeros(3, F32), "v": np.zeros(4, F32)}},
        [1, 2],
    ],
)
def test_from_dict_rejects_malformed(bad):
    with pytest.raises(ValueError):
        OptState.from_dict(bad)


def test_update_rejects_wrong_shape_and_foreign_state():
    opt = make_server_optimizer("amsgrad")
    state = opt.init(4)
    with pytest.raises(ValueError, match=r"delta has shape \(5,\)"):
        opt.update(state, np.ones(5, F32))
    with pytest.raises(ValueError, match="delta"):
        opt.update(state, np.ones((2, 2), F32))
    assert state.step == 0
    with pytest.raises(ValueError, match="v_hat"):
        opt.update(make_server_optimizer("adam").init(4), np.ones(4, F32))


def test_update_casts_float64_input_and_returns_float32():
    opt = make_server_optimizer("adam")
    step, state = opt.update(opt.init(3), np.array([1.0, -1.0, 0.0]))
    assert step.dtype == F32 and state.slots["m"].dtype == F32


def test_update_returns_new_step_array_each_round():
    opt = make_server_optimizer("sgd", eta=0.5)
    state = opt.init(3)
    a, state = opt.update(state, np.ones(3, F32))
    b, state = opt.update(state, np.full(3, 2.0, F32))
    assert a[0] == 0.5 and b[0] == 1.0


def test_init_rejects_bad_dim():
    for dim in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="dim"):
            make_server_optimizer("adam").init(dim)


# ----------------------------------------------------------------------------- factory errors


def test_unknown_name_lists_allowed():
    with pytest.raises(ValueError) as e:
        make_server_optimizer("fedprox", eta=1.0)
    msg = str(e.value)
    assert "'fedprox'" in msg and all(n in msg for n in SERVER_OPTIMIZERS)


def test_unknown_hyper_parameter_names_key_and_allowed():
    with pytest.raises(ValueError) as e:
        make_server_optimizer("adam", tau=1e-3)
    msg = str(e.value)
    assert "tau=0.001" in msg and "beta_1" in msg and "eps" in msg


@pytest.mark.parametrize(
    "name, key, value",
    [
        ("sgd", "eta", 0.0),
        ("sgd", "eta", -1.0),
        ("sgd", "momentum", 1.0),
        ("sgd", "momentum", -0.1),
        ("adam", "eta", float("nan")),
        ("adam", "beta_1", 1.0),
        ("adam", "beta_2", -0.5),
        ("adam", "eps", -1e-8),
        ("adam", "eta", "0.1"),
        ("adam", "bias_correction", "true"),
        ("yogi", "beta_2", 2.0),
        ("yogi", "eps", float("inf")),
        ("adagrad", "initial_accumulator", -1.0),
        ("adagrad", "beta_1", 1.5),
        ("adabelief", "inner_eps", 0),
        ("adabelief", "beta_1", True),
        ("lamb", "layerwise", None),
        ("lamb", "eta", 0),
        ("amsgrad", "eps_mode", "outside"),
        ("amsgrad", "eps", 0.0),
        ("amsgrad", "max_stabilisation", 1),
    ],
)
def test_bad_value_names_key_value_and_allowed(name, key, value):
    kw = dict(CONFIGS[name]) if name == "lamb" else {}
    kw[key] = value
    with pytest.raises(ValueError) as e:
        make_server_optimizer(name, **kw)
    msg = str(e.value)
    assert f"{key}=" in msg and "allowed" in msg and name in msg
    assert repr(value) in msg or str(value) in msg


@pytest.mark.parametrize("name", SERVER_OPTIMIZERS)
def test_blocked_evaluation_does_not_change_a_single_bit(name):
    """update() runs the element-wise math block by block; block size 7 (blocks straddle
    LAMB's segments) must give exactly the numbers of one block over the whole vector."""
    params = np.random.default_rng(9).standard_normal(D).astype(F32)
    whole = make_server_optimizer(name, **CONFIGS[name])
    blocked = make_server_optimizer(name, **CONFIGS[name])
    blocked.block_size = 7
    s1, s2 = whole.init(D), blocked.init(D)
    for d in _inputs(5):
        a, s1 = whole.update(s1, d, params=params)
        b, s2 = blocked.update(s2, d, params=params)
        assert np.array_equal(a, b)
    for k in s1.slots:
        assert np.array_equal(s1.slots[k], s2.slots[k])


def test_every_coordinate_of_a_multi_block_vector_is_updated():
    """d spans several default-size blocks plus a one-element tail."""
    opt = make_server_optimizer("adam", eta=0.1, eps=1e-3)
    d = 2 * opt.block_size + 1
    rng = np.random.default_rng(4)
    g1, g2 = (rng.standard_normal(d).astype(F32) for _ in range(2))
    _, state = opt.update(opt.init(d), g1)
    step, state = opt.update(state, g2)
    m = 0.9 * 0.1 * g1.astype(np.float64) + 0.1 * g2
    v = 0.99 * 0.01 * g1.astype(np.float64) ** 2 + 0.01 * g2.astype(np.float64) ** 2
    np.testing.assert_allclose(step, 0.1 * m / (np.sqrt(v) + 1e-3), rtol=1e-4, atol=1e-7)
