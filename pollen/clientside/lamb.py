"""The local optimiser of Fed-LAMB, Mime-LAMB, Fed-AMS and Mime as a ``torch.optim.Optimizer``.

Karimi, Li, Li (UAI 2023), Algorithm 1. Flower-free: any PyTorch training loop can use it. One local
step (lines 10-13; ``g`` is the minibatch gradient at the current ``theta``)::

    m     <- beta_1 * m + (1 - beta_1) * g                # line 10
    v     <- beta_2 * v + (1 - beta_2) * g**2             # line 11 (typo-corrected); uploaded, not used here
    psi   <- m / sqrt(v_hat)                              # line 12; v_hat = the server's, fixed in a round
                                                          # (local_vhat: m / sqrt(max(v_hat, v)))
    for each parameter tensor ("layer"):
        u      <- psi + lambda * theta                    # decoupled decay (AdamW), not in g, m or v
        theta  <- theta - lr * phi(||theta||) * u / ||u||   # line 13, eq. (3)

With ``trust_ratio=False`` it is the Fed-AMS / Mime step ``theta <- theta - lr * u`` (``u = psi`` when
``weight_decay=0``). ``step()`` subtracts the direction (a descent step); the update a client uploads,
``theta_local - theta_global``, is not the optimiser's business.

State per parameter (``self.state[p]``, tensors of the parameter's shape, device and dtype):

``m``
    First moment; it persists across rounds through ``state_dict()`` / ``load_state_dict()``.
``v_hat``
    The only denominator (line 12); ``step()`` never changes it. ``eps`` everywhere until the caller
    puts the server's ``v_hat`` there (``v_hat_0 = eps``, line 2).
``v``
    The local second moment (``track_v=True`` only). It does not enter the update; Fed-LAMB and Fed-AMS
    upload it, Mime-LAMB and Mime do not need it.

Filling ``v_hat`` from the server's broadcast and reading ``v`` back for the upload are the round's I/O,
done by the Fed-LAMB client step (:mod:`pollen.clientside.steps.fedlamb`, which also describes a round).
``eps``, ``phi`` and the zero-norm guard are settings (:class:`LocalLAMB`). A parameter whose ``.grad``
is ``None`` is skipped, as in ``torch.optim``. ``step()`` runs on the parameter's device in its dtype;
norms and the zero-norm branches stay tensors (``torch.where``), so a step never waits for the device.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from numbers import Real
from typing import Any

import torch

__all__ = ["EPS_MODES", "PHIS", "LocalLAMB"]

EPS_MODES = ("floor", "add")
PHIS = ("identity", "clip")
_FLAGS = ("zero_norm_guard", "trust_ratio", "track_v", "local_vhat")
_NOT_SETTINGS = ("params", "param_names")
_NAME = "LocalLAMB"


def _fail(key: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"{_NAME}: {key}={value!r} is not allowed; allowed: {allowed}")


def _real(key: str, value: Any, allowed: str) -> float:
    if isinstance(value, bool) or not isinstance(value, Real) or math.isnan(float(value)):
        raise _fail(key, value, allowed)
    return float(value)


def _without_compiler_guard(method: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.optim.Optimizer``'s ``method`` without its ``torch._disable_dynamo`` wrapper.

    The wrapper imports ``torch._dynamo`` (the compiler) at its first call, to keep the compiler out of the
    method: 1.5 to 5 s of a small machine's CPU in a process that compiles nothing, which a deployed
    ClientApp (a fresh process per message) paid on every Fed-LAMB message. The body does the same work
    either way. ``functools.wraps`` keeps it as ``__wrapped__``; a torch without the wrapper has none, and
    the method is used as it is.
    """
    return getattr(method, "__wrapped__", method)


def _check_settings(s: dict[str, Any]) -> None:
    """Raise ``ValueError`` naming the first setting of one parameter group that is out of range."""
    lr = _real("lr", s["lr"], "a finite number >= 0")
    if not (math.isfinite(lr) and lr >= 0.0):
        raise _fail("lr", s["lr"], "a finite number >= 0")
    betas = s["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise _fail("betas", betas, "a pair (beta_1, beta_2), each in [0, 1)")
    for i, beta in enumerate(betas):
        b = _real(f"betas[{i}]", beta, "a number in [0, 1)")
        if not 0.0 <= b < 1.0:
            raise _fail(f"betas[{i}]", beta, "a number in [0, 1)")
    wd = _real("weight_decay", s["weight_decay"], "a finite number >= 0")
    if not (math.isfinite(wd) and wd >= 0.0):
        raise _fail("weight_decay", s["weight_decay"], "a finite number >= 0")
    eps = _real("eps", s["eps"], "a finite number > 0")
    if not (math.isfinite(eps) and eps > 0.0):
        raise _fail("eps", s["eps"], "a finite number > 0 (the floor of v_hat, or the added denominator term)")
    if s["eps_mode"] not in EPS_MODES:
        raise _fail("eps_mode", s["eps_mode"], " or ".join(repr(m) for m in EPS_MODES))
    if s["phi"] not in PHIS:
        raise _fail("phi", s["phi"], " or ".join(repr(p) for p in PHIS))
    clip = s["phi_clip"]
    if not isinstance(clip, (tuple, list)) or len(clip) != 2:
        raise _fail("phi_clip", clip, "a pair (lo, hi) with 0 <= lo <= hi, lo finite, hi > 0 (may be inf)")
    lo = _real("phi_clip[0]", clip[0], "a finite number >= 0")
    hi = _real("phi_clip[1]", clip[1], "a number > 0 and >= phi_clip[0] (may be inf)")
    if not (math.isfinite(lo) and lo >= 0.0):
        raise _fail("phi_clip[0]", clip[0], "a finite number >= 0")
    if not (hi > 0.0 and hi >= lo):
        raise _fail("phi_clip[1]", clip[1], f"a number > 0 and >= phi_clip[0]={lo!r} (may be inf)")
    shift = _real("phi_shift", s["phi_shift"], "a finite number >= 0")
    if not (math.isfinite(shift) and shift >= 0.0):
        raise _fail("phi_shift", s["phi_shift"], "a finite number >= 0")
    if s["phi"] == "identity" and (lo != 0.0 or hi != math.inf or shift != 0.0):
        raise ValueError(
            f"{_NAME}: phi_clip={tuple(clip)!r}, phi_shift={s['phi_shift']!r} have no effect with "
            "phi='identity'; allowed: phi='clip' to use them, or leave them at (0.0, inf) and 0.0"
        )
    for flag in _FLAGS:
        if not isinstance(s[flag], bool):
            raise _fail(flag, s[flag], "True or False")
    if s["local_vhat"] and not s["track_v"]:
        raise _fail("local_vhat", True, "False when track_v=False (the local denominator is the tracked v)")


class LocalLAMB(torch.optim.Optimizer):
    """Client-side LAMB of Fed-LAMB / Mime-LAMB (Algorithm 1, lines 10-13, eq. (3)), or Fed-AMS / Mime.

    See the module docstring for the update and the state. Every setting below can differ per parameter
    group (e.g. ``weight_decay=0`` for biases and norms).

    Parameters
    ----------
    params : iterable of tensors or of dicts
        Floating-point parameters (or parameter groups), as for any ``torch.optim`` optimiser. Their
        order (groups in order, then parameters) is the order in which the Fed-LAMB step fills ``v_hat``
        and reads ``v``; it must match how the server flattens its ``v_hat``.
    lr : float, default 1e-3
        Local learning rate ``alpha_r`` (>= 0). With the trust ratio each layer moves by exactly
        ``lr * phi(||theta_l||)`` per step.
    betas : (float, float), default (0.9, 0.999)
        ``(beta_1, beta_2)``, each in ``[0, 1)``: decay of ``m`` (line 10) and of the uploaded ``v`` (line 11).
    weight_decay : float, default 0.0
        ``lambda`` (>= 0; the paper tunes it in {0, 0.01, 0.1}), decoupled: added to the direction
        (``u = psi + lambda * theta``), never to the gradient or the moments.
    eps : float, default 1e-8
        ``> 0``. The floor of ``v_hat`` (``eps_mode="floor"``: the Fed-LAMB step floors the server's
        ``v_hat`` at ``eps`` when it fills it) or the term added to ``sqrt(v_hat)`` (``eps_mode="add"``);
        also the ``v_hat`` before one is filled in.
    eps_mode : {"floor", "add"}, default "floor"
        ``"floor"``: ``psi = m / sqrt(max(v_hat, eps))`` (the paper). ``"add"``:
        ``psi = m / (sqrt(v_hat) + eps)`` (ablation).
    phi : {"identity", "clip"}, default "identity"
        Scaling of the weight norm: ``phi(a) = a`` (the paper's experiments), or
        ``min(max(a + phi_shift, lo), hi)``: the paper's Assumption 4 ``min(a + zeta, phi_M)`` is
        ``phi_shift=zeta, phi_clip=(0, phi_M)``, LAMB's ``min(max(a, gamma_l), gamma_u)`` is
        ``phi_clip=(gamma_l, gamma_u)``.
    phi_clip : (float, float), default (0.0, inf)
        ``(lo, hi)`` of ``phi="clip"``: ``0 <= lo <= hi``, ``hi > 0``.
    phi_shift : float, default 0.0
        ``zeta`` of Assumption 4's ``min(a + zeta, phi_M)`` (``phi="clip"`` only), ``>= 0``.
    zero_norm_guard : bool, default True
        Trust ratio 1 for a tensor with ``phi(||theta||) = 0`` (a zero-initialised bias moves by
        ``lr * u``); False applies eq. (3) literally and such a tensor never moves. A tensor with
        ``u = 0`` (eq. (3) would be 0/0) is left unchanged either way.
    trust_ratio : bool, default True
        True: the LAMB step of eq. (3) (Fed-LAMB, Mime-LAMB). False: ``theta -= lr * u``, the locally
        adaptive AMSGrad step of Fed-AMS and Mime (``phi``, ``phi_clip`` and the guard are unused).
    track_v : bool, default True
        Keep the local ``v`` to upload (Fed-LAMB, Fed-AMS). False for Mime-LAMB and Mime. The Fed-LAMB step
        resets ``v`` to ``v_hat`` when it fills ``v_hat`` (line 6).
    local_vhat : bool, default False
        The denominator is ``sqrt(max(v_hat, v))`` with the local running ``v`` (the spec's ``local_vhat``
        flag, §9 A4; needs ``track_v``) instead of line 12's ``sqrt(v_hat)``. The Fed-LAMB step turns it on
        while the server's ``v_hat`` is still its initial ``eps`` when run-config ``round1-denominator`` is
        ``local-v``, the authors' code's round 1, which never makes the ``alpha * m / sqrt(eps)`` jump.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        *,
        eps: float = 1e-8,
        eps_mode: str = "floor",
        phi: str = "identity",
        phi_clip: tuple[float, float] = (0.0, math.inf),
        phi_shift: float = 0.0,
        zero_norm_guard: bool = True,
        trust_ratio: bool = True,
        track_v: bool = True,
        local_vhat: bool = False,
    ) -> None:
        defaults = {
            "lr": lr,
            "betas": tuple(betas) if isinstance(betas, list) else betas,
            "weight_decay": weight_decay,
            "eps": eps,
            "eps_mode": eps_mode,
            "phi": phi,
            "phi_clip": tuple(phi_clip) if isinstance(phi_clip, list) else phi_clip,
            "phi_shift": phi_shift,
            "zero_norm_guard": zero_norm_guard,
            "trust_ratio": trust_ratio,
            "track_v": track_v,
            "local_vhat": local_vhat,
        }
        _check_settings(defaults)
        super().__init__(params, defaults)

    # ----------------------------------------------------------------------------------- set-up

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (validated before anything changes) and give its parameters fresh state."""
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, but got {type(param_group)}")
        check = {**self.defaults, **{k: v for k, v in param_group.items() if k != "params"}}
        _check_settings(check)
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else params
        if not isinstance(params, set):  # a set is rejected by torch below, with its own message
            params = list(params)
            for i, p in enumerate(params):
                t = p[1] if isinstance(p, tuple) else p
                if isinstance(t, torch.Tensor) and not t.is_floating_point():
                    raise ValueError(
                        f"{_NAME}: parameter {i} of the group has dtype {t.dtype}; allowed: a real floating-point dtype"
                    )
        _without_compiler_guard(torch.optim.Optimizer.add_param_group)(self, {**param_group, "params": params})
        group = self.param_groups[-1]
        for key in ("betas", "phi_clip"):
            if isinstance(group[key], list):
                group[key] = tuple(group[key])
        for p in group["params"]:
            self._init_state(p, group)

    def _init_state(self, p: torch.Tensor, group: dict[str, Any]) -> dict[str, torch.Tensor]:
        state = self.state[p]
        if "m" not in state:
            state["m"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if "v_hat" not in state:
            state["v_hat"] = torch.full_like(p, group["eps"], memory_format=torch.preserve_format)
        if group["track_v"] and "v" not in state:
            state["v"] = state["v_hat"].clone()
        return state

    def _params(self) -> list[tuple[torch.Tensor, dict[str, Any]]]:
        return [(p, g) for g in self.param_groups for p in g["params"]]

    def state_dict(self) -> dict[str, Any]:
        """``torch.optim``'s state dict: ``{"state": {index: {"m", "v_hat"[, "v"]}}, "param_groups": [...]}``."""
        return _without_compiler_guard(torch.optim.Optimizer.state_dict)(self)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear every parameter's gradient (``None``, or zeros with ``set_to_none=False``), as ``torch.optim``."""
        _without_compiler_guard(torch.optim.Optimizer.zero_grad)(self, set_to_none)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict`; the state is checked first and copied (never shared with the dict).

        As for every ``torch.optim`` optimiser the saved group settings (``lr``, ...) are restored too.
        """
        params = [p for p, _ in self._params()]
        saved_groups = state_dict.get("param_groups")
        saved_state = state_dict.get("state")
        if not isinstance(saved_groups, list) or not isinstance(saved_state, dict):
            raise ValueError(  # noqa: TRY004  torch raises ValueError for a mismatched state_dict too
                f"{_NAME}: state_dict must have 'state' (dict) and 'param_groups' (list)"
            )
        saved = [(g, i) for g in saved_groups for i in g.get("params", ())]
        if len(saved) != len(params):
            raise ValueError(f"{_NAME}: state_dict has {len(saved)} parameters; this optimiser has {len(params)}")
        for g in saved_groups:
            _check_settings({**self.defaults, **{k: v for k, v in g.items() if k not in _NOT_SETTINGS}})
        for n, ((g, i), p) in enumerate(zip(saved, params)):
            s = saved_state.get(i, {})
            needed = ("m", "v_hat", "v") if g.get("track_v", self.defaults["track_v"]) else ("m", "v_hat")
            for key in needed:
                value = s.get(key)
                if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(p.shape):
                    got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                    raise ValueError(
                        f"{_NAME}: state_dict state of parameter {n} has {key}={got}; allowed: a tensor of "
                        f"shape {tuple(p.shape)}"
                    )
        _without_compiler_guard(torch.optim.Optimizer.load_state_dict)(self, state_dict)
        for state in self.state.values():
            for key, value in list(state.items()):
                if isinstance(value, torch.Tensor):
                    state[key] = value.clone()

    # ----------------------------------------------------------------------------------- the step

    @staticmethod
    def _trust_ratio(p: torch.Tensor, u: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        """``phi(||theta||) / ||u||`` as a 0-dim tensor, with the zero-norm cases (see ``zero_norm_guard``)."""
        a = torch.linalg.vector_norm(p)
        b = torch.linalg.vector_norm(u)
        if group["phi"] == "identity":
            phi_a = a
        else:
            lo, hi = group["phi_clip"]
            phi_a = torch.clamp(a + group["phi_shift"], min=lo, max=hi)
        ratio = phi_a / b
        if group["zero_norm_guard"]:
            ratio = torch.where(phi_a > 0, ratio, torch.ones_like(ratio))
        return torch.where(b > 0, ratio, torch.zeros_like(ratio))  # u = 0: no change

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One local step (lines 10-13); ``closure`` re-evaluates the loss as in ``torch.optim``."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta_1, beta_2 = group["betas"]
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                if g.is_sparse:
                    raise RuntimeError(f"{_NAME} does not support sparse gradients")
                state = self._init_state(p, group)
                m, v_hat = state["m"], state["v_hat"]
                m.mul_(beta_1).add_(g, alpha=1.0 - beta_1)  # line 10
                if group["track_v"]:
                    state["v"].mul_(beta_2).addcmul_(g, g, value=1.0 - beta_2)  # line 11, uploaded only
                denom = torch.maximum(v_hat, state["v"]).sqrt() if group.get("local_vhat") else v_hat.sqrt()
                if group["eps_mode"] == "add":
                    denom.add_(group["eps"])
                u = m / denom  # line 12: psi
                if wd != 0.0:
                    u.add_(p, alpha=wd)  # psi + lambda * theta
                if group["trust_ratio"]:
                    p.addcmul_(u, self._trust_ratio(p, u, group), value=-lr)  # line 13, eq. (3)
                else:
                    p.add_(u, alpha=-lr)  # Fed-AMS / Mime
        return loss
