"""``LocalLAMB``: the client-side optimiser of Fed-LAMB / Mime-LAMB / Fed-AMS (``papers/fedlamb.md``).

Checks 8.1, 8.2, 8.3, 8.7 and 8.8 of the spec, a comparison with a hand-written per-layer numpy loop
(the spec's §4.2 pseudocode, branch for branch), the state-dict round trip, bad arguments, and CUDA
against CPU where a CUDA device exists. References are numpy or plain torch arithmetic written here,
never the code under test.
"""

from __future__ import annotations

import copy
import io
import math

import numpy as np
import pytest
import torch
from torch import nn

from pollen.clientside.lamb import LocalLAMB
from pollen.clientside.steps.fedlamb import flat_local_v, global_v_hat, local_v, set_global_v_hat

BETA1, BETA2 = 0.9, 0.999


def _layers(dtype=torch.float32, seed=0):
    """Four parameter tensors with very different norms (about 0.05, 1, 20 and 3)."""
    g = torch.Generator().manual_seed(seed)
    shapes_scales = [((4, 3), 0.02), ((3,), 0.6), ((2, 2, 2), 7.0), ((5,), 1.5)]
    return [nn.Parameter(torch.randn(s, generator=g, dtype=dtype) * c) for s, c in shapes_scales]


def _grads(params, steps, seed=1):
    """A fixed gradient sequence for ``params`` (independent of the parameter values)."""
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(p.shape, generator=g, dtype=p.dtype) for p in params] for _ in range(steps)]


def _vhat(params, seed=2, low=1e-4, high=1e-2):
    g = torch.Generator().manual_seed(seed)
    return [low + (high - low) * torch.rand(p.shape, generator=g, dtype=p.dtype) for p in params]


def _installed(opt, v_hat):
    """``opt`` with the server's ``v_hat`` put in its state by the Fed-LAMB step's round I/O."""
    set_global_v_hat(opt, v_hat)
    return opt


def _apply(opt, params, grads):
    for p, g in zip(params, grads):
        p.grad = g.clone()
    opt.step()


def _tiny_model(dtype=torch.float64, zero_bias=True):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 3), nn.Tanh(), nn.Linear(3, 2)).to(dtype)
    if zero_bias:
        nn.init.zeros_(model[2].bias)  # a zero-norm layer: exercises the guard
    return model


def _data(dtype=torch.float64):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 8, 5, generator=g, dtype=torch.float64)
    return x.to(dtype), torch.randint(0, 2, (5, 8), generator=g)


def _loss(model, x, y, scale=1.0):
    return scale * nn.functional.cross_entropy(model(x), y)


def _train(model, opt, steps=5, scale=1.0, first=0):
    x, y = _data(next(model.parameters()).dtype)
    for t in range(first, first + steps):
        opt.zero_grad()
        _loss(model, x[t % 5], y[t % 5], scale).backward()
        opt.step()


# ------------------------------------------------------------------------------------------- 8.1


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
@pytest.mark.parametrize("phi_kw", [{}, {"phi": "clip", "phi_clip": (0.0, 2.0)}], ids=["identity", "min(a,2)"])
def test_each_layer_moves_by_lr_times_phi_of_its_norm(weight_decay, phi_kw):
    """Spec 8.1: ||theta_l^t - theta_l^{t-1}|| = lr * phi(||theta_l^{t-1}||), relative error < 1e-5 (fp32)."""
    params = _layers()
    lr = 0.01
    opt = _installed(LocalLAMB(params, lr=lr, weight_decay=weight_decay, **phi_kw), _vhat(params))
    phi = (lambda a: a) if not phi_kw else (lambda a: min(a, 2.0))
    clipped = False
    for grads in _grads(params, 5):
        before = [p.detach().clone() for p in params]
        _apply(opt, params, grads)
        for i, (p, b) in enumerate(zip(params, before)):
            norm = torch.linalg.vector_norm(b.double()).item()
            moved = torch.linalg.vector_norm((p.detach() - b).double()).item()
            expected = lr * phi(norm)
            clipped |= phi(norm) != norm
            assert abs(moved - expected) <= 1e-5 * expected, (i, moved, expected)
    assert clipped == bool(phi_kw)  # the clipped run does hit the clip (the 20-norm layer)


# ------------------------------------------------------------------------------------------- 8.2


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_step_direction_is_minus_psi_plus_lambda_theta(weight_decay):
    """Spec 8.2: each layer's move is parallel to -(m / sqrt(v_hat) + lambda * theta): cosine 1 +- 1e-6."""
    params = _layers()
    v_hat = _vhat(params)
    opt = _installed(LocalLAMB(params, lr=0.01, weight_decay=weight_decay), v_hat)
    for grads in _grads(params, 4):
        before = [p.detach().clone() for p in params]
        _apply(opt, params, grads)
        for p, b, vh in zip(params, before, v_hat):
            psi = opt.state[p]["m"] / vh.sqrt()
            direction = -(psi + weight_decay * b).double().reshape(-1)
            move = (p.detach() - b).double().reshape(-1)
            cosine = torch.dot(move, direction) / (move.norm() * direction.norm())
            assert abs(cosine.item() - 1.0) < 1e-6


def test_weight_decay_is_decoupled_from_the_moments():
    """Spec 8.2: m and v never see lambda * theta: same gradients, different lambda, identical m and v."""
    runs = []
    for weight_decay in (0.0, 0.1):
        params = _layers()
        opt = _installed(LocalLAMB(params, lr=0.01, weight_decay=weight_decay), _vhat(params))
        for grads in _grads(params, 5):
            _apply(opt, params, grads)
        runs.append((params, opt))
    (p0, o0), (p1, o1) = runs
    for a, b in zip(p0, p1):
        assert torch.equal(o0.state[a]["m"], o1.state[b]["m"])
        assert torch.equal(o0.state[a]["v"], o1.state[b]["v"])
        assert not torch.equal(a, b)  # while the parameters did differ


# ------------------------------------------------------------------------------------------- 8.3


def test_uploaded_v_is_the_closed_form_and_v_hat_stays_fixed():
    """Spec 8.3 / §4.2: v^T = beta_2^T v_hat + (1 - beta_2) sum_t beta_2^(T - t) g_t^2; v_hat never moves."""
    params = _layers(torch.float64)
    v_hat = _vhat(params)
    opt = _installed(LocalLAMB(params, lr=0.01, weight_decay=0.01), [v.clone() for v in v_hat])
    assert all(torch.equal(v, w) for v, w in zip(local_v(opt), v_hat))  # line 6: v <- v_hat
    T = 6
    grads = _grads(params, T)
    for step in grads:
        _apply(opt, params, step)
    for i, (p, vh) in enumerate(zip(params, v_hat)):
        closed = BETA2**T * vh + (1 - BETA2) * sum(BETA2 ** (T - t) * grads[t - 1][i] ** 2 for t in range(1, T + 1))
        torch.testing.assert_close(opt.state[p]["v"], closed, rtol=1e-12, atol=0.0)
        assert torch.equal(opt.state[p]["v_hat"], vh)  # bit for bit: step() never touches v_hat
    assert all(torch.equal(a, b) for a, b in zip(global_v_hat(opt), v_hat))
    flat = flat_local_v(opt, dtype=torch.float64)
    assert torch.equal(flat, torch.cat([opt.state[p]["v"].reshape(-1) for p in params]))
    # A new round: the server's v_hat_r = max(v_hat_{r-1}, mean v_i) comes back as one flat vector.
    new = torch.maximum(torch.cat([v.reshape(-1) for v in v_hat]), flat).numpy()
    set_global_v_hat(opt, new)
    assert torch.equal(flat_local_v(opt, dtype=torch.float64), torch.as_tensor(new))  # v reset to v_hat
    assert torch.equal(torch.cat([v.reshape(-1) for v in global_v_hat(opt)]), torch.as_tensor(new))


def test_local_v_does_not_enter_the_update():
    """§9 A4: with track_v=False (Mime-LAMB) the trajectory is the same, and there is nothing to upload."""
    runs = []
    for track_v in (True, False):
        params = _layers()
        opt = _installed(LocalLAMB(params, lr=0.01, track_v=track_v), _vhat(params))
        for grads in _grads(params, 5):
            _apply(opt, params, grads)
        runs.append((params, opt))
    assert all(torch.equal(a, b) for a, b in zip(runs[0][0], runs[1][0]))
    assert all("v" not in runs[1][1].state[p] for p in runs[1][0])
    with pytest.raises(RuntimeError, match="track_v=True"):
        local_v(runs[1][1])


def test_floor_mode_floors_v_hat_at_eps_and_add_mode_keeps_it():
    params = [nn.Parameter(torch.ones(3))]
    floor = _installed(LocalLAMB(params, eps=1e-6), [torch.tensor([0.0, 1e-7, 4.0])])
    assert global_v_hat(floor)[0].tolist() == pytest.approx([1e-6, 1e-6, 4.0], rel=1e-6)
    add = _installed(
        LocalLAMB([nn.Parameter(torch.ones(3))], eps=1e-6, eps_mode="add"), [torch.tensor([0.0, 1e-7, 4.0])]
    )
    assert global_v_hat(add)[0].tolist() == pytest.approx([0.0, 1e-7, 4.0], rel=1e-6)
    # Before any v_hat is installed it is v_hat_0 = eps (Algorithm 1 line 2).
    fresh = LocalLAMB([nn.Parameter(torch.ones(2))], eps=1e-8)
    assert torch.equal(global_v_hat(fresh)[0], torch.full((2,), 1e-8))


# ------------------------------------------------------------------------------------------- 8.7


def _run_tiny(scale, *, trust_ratio, v_hat_scale=None, steps=5, lr=0.01):
    model = _tiny_model(zero_bias=False)
    opt = LocalLAMB(model.parameters(), lr=lr, trust_ratio=trust_ratio)
    if v_hat_scale is not None:  # a later round: the server's v_hat came from c-scaled gradients
        set_global_v_hat(opt, [v_hat_scale * v for v in _vhat(list(model.parameters()))])
    moves = []
    x, y = _data()
    for t in range(steps):
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        _loss(model, x[t], y[t], scale).backward()
        opt.step()
        moves.append([p.detach() - b for p, b in zip(model.parameters(), before)])
    return model, opt, moves


def test_loss_scale_invariance_within_a_round():
    """Spec 8.7 (lambda = 0, c = 100): the LAMB steps do not see c; the Fed-AMS round-1 step scales by c."""
    c = 100.0
    # Round 1 (v_hat = eps): the per-layer normalisation cancels c.
    m1, _, _ = _run_tiny(1.0, trust_ratio=True)
    mc, _, _ = _run_tiny(c, trust_ratio=True)
    for a, b in zip(m1.parameters(), mc.parameters()):
        torch.testing.assert_close(a, b, rtol=0.0, atol=1e-12)
    # A later round, v_hat scaled by c^2 consistently: still the same, and the upload is c^2 v.
    m1, o1, _ = _run_tiny(1.0, trust_ratio=True, v_hat_scale=1.0)
    mc, oc, _ = _run_tiny(c, trust_ratio=True, v_hat_scale=c * c)
    for a, b in zip(m1.parameters(), mc.parameters()):
        torch.testing.assert_close(a, b, rtol=0.0, atol=1e-12)
    v1, vc = flat_local_v(o1, torch.float64), flat_local_v(oc, torch.float64)
    torch.testing.assert_close(vc, c * c * v1, rtol=1e-12, atol=0.0)
    # Fed-AMS (trust_ratio=False) in round 1: its first step is exactly c times longer, so it is not invariant.
    _, _, s1 = _run_tiny(1.0, trust_ratio=False, lr=1e-6)
    ac, _, sc = _run_tiny(c, trust_ratio=False, lr=1e-6)
    for a, b in zip(s1[0], sc[0]):
        torch.testing.assert_close(b, c * a, rtol=1e-9, atol=0.0)
    a1, _, _ = _run_tiny(1.0, trust_ratio=False, lr=1e-6)
    assert max((a - b).abs().max().item() for a, b in zip(a1.parameters(), ac.parameters())) > 1e-3


def _federated(scale, *, trust_ratio, eps, rounds=3, steps=4, lr=0.01):
    """One client, ``rounds`` rounds of Algorithm 1 (Fed-LAMB branch): v_hat_r = max(v_hat_{r-1}, v_i)."""
    model = _tiny_model(zero_bias=False)
    x, y = _data()
    saved, v_hat = None, None
    for _ in range(rounds):
        opt = LocalLAMB(model.parameters(), lr=lr, eps=eps, trust_ratio=trust_ratio)
        if saved is not None:
            opt.load_state_dict(saved)
            set_global_v_hat(opt, v_hat)
        for t in range(steps):
            opt.zero_grad()
            _loss(model, x[t], y[t], scale).backward()
            opt.step()
        previous = torch.cat([v.reshape(-1) for v in global_v_hat(opt)])
        v_hat = torch.maximum(previous, flat_local_v(opt, torch.float64))
        saved = opt.state_dict()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_loss_scale_invariance_over_rounds():
    """Spec 8.7 across rounds: Fed-LAMB's trajectory is unchanged by c = 100, Fed-AMS's is not.

    The spec's caveat: differences come only from coordinates where c^2 v < eps (the floor does not
    scale with c^2). An eps far below every v (1e-30) removes them, so the trajectories agree to
    rounding; Fed-AMS's does not (its round-1 step, m / sqrt(eps), is c times longer).
    """
    lamb_1, lamb_c = (_federated(c, trust_ratio=True, eps=1e-30) for c in (1.0, 100.0))
    torch.testing.assert_close(lamb_c, lamb_1, rtol=0.0, atol=1e-12)
    start = torch.cat([p.detach().reshape(-1) for p in _tiny_model(zero_bias=False).parameters()])
    assert (lamb_1 - start).abs().max() > 1e-2  # the model did move
    ams_1, ams_c = (_federated(c, trust_ratio=False, eps=1e-30, lr=1e-18) for c in (1.0, 100.0))
    assert (ams_1 - ams_c).abs().max() > 1e-3  # nine orders of magnitude above LAMB's difference


# ------------------------------------------------------------------------------------------- 8.8


def test_zero_initialised_tensor_moves_with_the_guard_and_not_without():
    """Spec 8.8 / §9 B3: with the guard (trust ratio 1) a zero bias moves by lr * u; literally, never."""
    for guard in (True, False):
        model = _tiny_model()  # model[2].bias starts at exactly 0
        opt = LocalLAMB(model.parameters(), lr=0.01, zero_norm_guard=guard)
        w0 = model[2].weight.detach().clone()
        x, y = _data()
        opt.zero_grad()
        _loss(model, x[0], y[0]).backward()
        opt.step()
        bias = model[2].bias.detach()
        if guard:
            psi = opt.state[model[2].bias]["m"] / math.sqrt(1e-8)
            torch.testing.assert_close(bias, -0.01 * psi, rtol=1e-12, atol=0.0)  # trust ratio exactly 1
        else:
            _train(model, opt, steps=4, first=1)
            assert torch.count_nonzero(model[2].bias) == 0  # stays exactly 0 for ever
        assert not torch.equal(model[2].weight, w0)  # the other layers move either way


def test_zero_direction_and_bounded_phi():
    """u = 0 (eq. (3) would be 0/0) leaves a tensor unchanged without NaN; phi(0) > 0 moves a zero tensor."""
    for guard in (True, False):
        p = nn.Parameter(torch.tensor([1.0, -2.0]))
        z = nn.Parameter(torch.zeros(2))
        opt = LocalLAMB([p, z], lr=0.1, zero_norm_guard=guard)
        p.grad, z.grad = torch.zeros(2), torch.zeros(2)
        opt.step()
        assert p.tolist() == [1.0, -2.0] and z.tolist() == [0.0, 0.0]
    # Assumption 4's phi(a) = min(a + zeta, phi_M) with zeta = 0.5: a zero tensor moves by lr * 0.5
    # even without the guard (eq. (3) applied literally), and the guard keeps that step.
    for guard in (True, False):
        z = nn.Parameter(torch.zeros(3, dtype=torch.float64))
        opt = LocalLAMB([z], lr=0.1, phi="clip", phi_shift=0.5, phi_clip=(0.0, 10.0), zero_norm_guard=guard)
        z.grad = torch.tensor([3.0, 0.0, -4.0], dtype=torch.float64)
        opt.step()
        torch.testing.assert_close(z.detach(), torch.tensor([-0.03, 0.0, 0.04], dtype=torch.float64))


# ------------------------------------------------------------------------------------- reference

CONFIGS = {
    "lamb": {"lr": 0.05, "weight_decay": 0.01},
    "lamb-literal": {"lr": 0.05, "weight_decay": 0.01, "zero_norm_guard": False},
    "lamb-clip": {"lr": 0.05, "phi": "clip", "phi_clip": (0.05, 0.5), "phi_shift": 0.01},
    "lamb-add-eps": {"lr": 0.05, "eps": 1e-3, "eps_mode": "add"},
    "fedams": {"lr": 1e-3, "trust_ratio": False},
    "fedams-decay": {"lr": 1e-3, "weight_decay": 0.1, "trust_ratio": False},
}


def _reference(thetas, grad_fn, v_hat, cfg, steps):
    """Spec §4.2 lines 10-13, per layer with explicit branches, in float64 numpy."""
    lr, wd = cfg["lr"], cfg.get("weight_decay", 0.0)
    eps, mode = cfg.get("eps", 1e-8), cfg.get("eps_mode", "floor")
    lo, hi = cfg.get("phi_clip", (0.0, math.inf))
    clip = cfg.get("phi", "identity") == "clip"

    def phi(a):
        return min(max(a + cfg["phi_shift"], lo), hi) if clip else a

    m = [np.zeros_like(t) for t in thetas]
    v = [vh.copy() for vh in v_hat]
    for t in range(steps):
        grads = grad_fn(thetas, t)
        for i, (theta, g) in enumerate(zip(thetas, grads)):
            m[i] = BETA1 * m[i] + (1 - BETA1) * g
            v[i] = BETA2 * v[i] + (1 - BETA2) * g * g
            den = np.sqrt(np.maximum(v_hat[i], eps)) if mode == "floor" else np.sqrt(v_hat[i]) + eps
            u = m[i] / den + wd * theta
            if not cfg.get("trust_ratio", True):
                thetas[i] = theta - lr * u
                continue
            a, b = np.linalg.norm(theta), np.linalg.norm(u)
            if b > 0 and phi(a) > 0:
                thetas[i] = theta - lr * phi(a) * u / b
            elif b > 0 and cfg.get("zero_norm_guard", True):
                thetas[i] = theta - lr * u
    return thetas, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_a_hand_written_per_layer_loop(name, dtype):
    """Linear(5,3)+Tanh+Linear(3,2) (second bias zero), 5 steps: parameters and uploaded v agree."""
    cfg = CONFIGS[name]
    model = _tiny_model(dtype)
    start = [p.detach().double().numpy().copy() for p in model.parameters()]
    v_hat = [v.numpy() for v in _vhat([p.double() for p in model.parameters()])]
    opt = LocalLAMB(model.parameters(), **cfg)
    flat = np.concatenate([v.reshape(-1) for v in v_hat])
    set_global_v_hat(opt, flat.astype(np.float32) if dtype == torch.float32 else flat)  # a numpy flat vector
    _train(model, opt, steps=5)

    ref_model = _tiny_model(torch.float64)
    x, y = _data()

    def grad_fn(thetas, t):
        with torch.no_grad():
            for p, theta in zip(ref_model.parameters(), thetas):
                p.copy_(torch.from_numpy(theta))
        ref_model.zero_grad()
        _loss(ref_model, x[t], y[t]).backward()
        return [p.grad.numpy().copy() for p in ref_model.parameters()]

    v_hat_used = [v.astype(np.float32).astype(np.float64) for v in v_hat] if dtype == torch.float32 else v_hat
    thetas, v = _reference(start, grad_fn, v_hat_used, cfg, steps=5)
    atol = 1e-6 if dtype == torch.float32 else 1e-12
    for p, theta in zip(model.parameters(), thetas):
        np.testing.assert_allclose(p.detach().double().numpy(), theta, rtol=0, atol=atol)
    for got, want in zip(local_v(opt), v):
        rtol = 1e-5 if dtype == torch.float32 else 1e-12
        np.testing.assert_allclose(got.double().numpy(), want, rtol=rtol, atol=0)
    if name == "lamb-literal":
        assert np.count_nonzero(thetas[3]) == 0  # the zero bias never moved in the literal rule


# ------------------------------------------------------------------------------------ state dict


def test_state_dict_round_trip_is_bit_for_bit():
    """Save after 3 steps, load into a fresh optimiser, 2 more steps == 5 steps uninterrupted."""
    kw = {"lr": 0.02, "weight_decay": 0.01}
    whole = _tiny_model()
    opt = LocalLAMB(whole.parameters(), **kw)
    set_global_v_hat(opt, _vhat(list(whole.parameters())))
    _train(whole, opt, steps=5)

    first = _tiny_model()
    opt1 = LocalLAMB(first.parameters(), **kw)
    set_global_v_hat(opt1, _vhat(list(first.parameters())))
    _train(first, opt1, steps=3)
    buffer = io.BytesIO()
    torch.save(opt1.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    kept = copy.deepcopy(saved)

    resumed = _tiny_model()
    resumed.load_state_dict(first.state_dict())
    opt2 = LocalLAMB(resumed.parameters(), lr=0.5)  # the saved lr comes back with the state
    opt2.load_state_dict(saved)
    assert opt2.param_groups[0]["lr"] == 0.02
    _train(resumed, opt2, steps=2, first=3)

    for a, b in zip(whole.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(whole.parameters(), resumed.parameters()):
        for key in ("m", "v", "v_hat"):
            assert torch.equal(opt.state[a][key], opt2.state[b][key]), key
    for i, state in saved["state"].items():  # the loaded optimiser does not write into the dict it was given
        for key, value in state.items():
            assert torch.equal(value, kept["state"][i][key])


def test_load_state_dict_rejects_a_state_of_another_model():
    opt = LocalLAMB(_tiny_model().parameters())
    other = LocalLAMB(nn.Linear(4, 3).double().parameters())
    with pytest.raises(ValueError, match="2 parameters; this optimiser has 4"):
        opt.load_state_dict(other.state_dict())
    two = nn.Sequential(nn.Linear(5, 4), nn.Linear(4, 2)).double()
    with pytest.raises(ValueError, match="shape"):
        opt.load_state_dict(LocalLAMB(two.parameters()).state_dict())


def test_groups_skip_params_without_grad_and_closure():
    """Per-group settings (no decay on biases, §4.7), a parameter without .grad is untouched, closure works."""
    model = _tiny_model()
    frozen = model[0].weight
    before = frozen.detach().clone()
    opt = LocalLAMB(
        [
            {"params": [model[0].weight, model[2].weight]},
            {"params": [model[0].bias, model[2].bias], "weight_decay": 0.0},
        ],
        lr=0.01,
        weight_decay=0.1,
    )
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    frozen.requires_grad_(False)
    x, y = _data()

    def closure():
        opt.zero_grad()
        loss = _loss(model, x[0], y[0])
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert torch.is_tensor(loss) and loss.item() > 0
    assert torch.equal(frozen, before) and torch.count_nonzero(opt.state[frozen]["m"]) == 0
    assert torch.count_nonzero(opt.state[model[2].weight]["m"]) > 0


# ----------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"lr": -0.1}, "lr=-0.1"),
        ({"lr": math.nan}, "lr=nan"),
        ({"betas": (1.0, 0.999)}, r"betas\[0\]=1.0"),
        ({"betas": (0.9, -0.1)}, r"betas\[1\]=-0.1"),
        ({"betas": (0.9,)}, "betas="),
        ({"weight_decay": -1.0}, "weight_decay=-1.0"),
        ({"eps": 0.0}, "eps=0.0"),
        ({"eps_mode": "inside"}, "eps_mode='inside'.*'floor' or 'add'"),
        ({"phi": "sqrt"}, "phi='sqrt'.*'identity' or 'clip'"),
        ({"phi": "clip", "phi_clip": (2.0, 1.0)}, r"phi_clip\[1\]=1.0"),
        ({"phi": "clip", "phi_shift": -1.0}, "phi_shift=-1.0"),
        ({"phi_clip": (0.0, 5.0)}, "no effect with phi='identity'"),
        ({"zero_norm_guard": 1}, "zero_norm_guard=1"),
    ],
)
def test_bad_settings_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LocalLAMB(_layers(), **kwargs)


def test_bad_group_and_parameter_raise():
    params = _layers()
    opt = LocalLAMB(params[:2])
    with pytest.raises(ValueError, match="lr=-1"):
        opt.add_param_group({"params": params[2:], "lr": -1})
    assert len(opt.param_groups) == 1
    with pytest.raises(ValueError, match="dtype torch.int64"):
        LocalLAMB([torch.zeros(3, dtype=torch.int64)])


@pytest.mark.parametrize(
    "v_hat, message",
    [
        ("list-short", "has 3 tensors; allowed: one per parameter \\(4\\)"),
        ("list-shape", r"v_hat\[1\] has shape \(4,\)"),
        ("flat-length", "1-D with 28 values"),
        ("flat-2d", "1-D with 28 values"),
        ("negative", "parameter 2 has a negative value"),
        ("nan", "parameter 0 holds NaN or Inf"),
        ("overflow", "holds NaN or Inf"),  # finite in float64, Inf once cast to the parameter's float32
        ("scalar", "type float"),
    ],
)
def test_bad_v_hat_raises_before_changing_state(v_hat, message):
    params = _layers()
    good = _vhat(params)
    opt = _installed(LocalLAMB(params), good)
    bad = {
        "list-short": good[:3],
        "list-shape": [good[0], torch.ones(4), good[2], good[3]],
        "flat-length": torch.ones(27),
        "flat-2d": torch.ones(28, 1),
        "negative": [good[0], good[1], -good[2], good[3]],
        "nan": [torch.full_like(good[0], math.nan)] + good[1:],
        "overflow": np.full(28, 1e300),
        "scalar": 0.5,
    }[v_hat]
    with pytest.raises(ValueError, match=message):
        set_global_v_hat(opt, bad)
    assert all(torch.equal(a, b) for a, b in zip(global_v_hat(opt), good))
    assert all(torch.equal(a, b) for a, b in zip(local_v(opt), good))


# ----------------------------------------------------------------------------------------- CUDA


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_cuda_matches_cpu_without_host_syncs():
    torch.backends.cuda.matmul.allow_tf32 = False
    results = []
    for device in ("cpu", "cuda"):
        model = _tiny_model(torch.float32).to(device)
        opt = LocalLAMB(model.parameters(), lr=0.05, weight_decay=0.01)
        set_global_v_hat(opt, [v.to(device) for v in _vhat(list(model.parameters()))])
        x, y = (t.to(device) for t in _data(torch.float32))
        for t in range(5):
            opt.zero_grad()
            _loss(model, x[t], y[t]).backward()
            if device == "cuda":
                torch.cuda.set_sync_debug_mode("error")  # a host round trip inside step() would raise
            try:
                opt.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        results.append(([p.detach().cpu() for p in model.parameters()], flat_local_v(opt)))
    (cpu_p, cpu_v), (gpu_p, gpu_v) = results
    for a, b in zip(cpu_p, gpu_p):
        torch.testing.assert_close(b, a, rtol=0.0, atol=1e-5)
    torch.testing.assert_close(gpu_v, cpu_v, rtol=1e-5, atol=0.0)


_FRESH_PROCESS = """
import sys, torch
from torch.utils.data import DataLoader, TensorDataset
from pollen.clientside.lamb import LocalLAMB
from pollen.task.train import train
model = torch.nn.Linear(6, 3)
optimizer = LocalLAMB(model.parameters(), lr=0.01, weight_decay=0.01)
data = TensorDataset(torch.randn(16, 6), torch.randint(0, 3, (16,)))
train(model, DataLoader(data, batch_size=4, shuffle=True), lr=0.01, local_steps=3, optimizer=optimizer)
optimizer.zero_grad(set_to_none=False)
LocalLAMB(model.parameters(), lr=0.01).load_state_dict(optimizer.state_dict())
print("torch._dynamo" in sys.modules)
"""


def test_lamb_local_training_in_a_fresh_process_does_not_import_the_compiler():
    """A deployed ClientApp is one process per message: torch.optim's methods import torch._dynamo (1.5-5 s) at
    their first call to keep the compiler out; LocalLAMB is never compiled and must not pay for it."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _FRESH_PROCESS], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "False"


def test_zero_grad_keeps_torchs_two_behaviours():
    params = _layers()
    optimizer = LocalLAMB(params, lr=0.01)
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in params)
    optimizer.zero_grad()
    assert all(p.grad is None for p in params)
