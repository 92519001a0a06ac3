"""The local optimiser of Fed-LAMB, Mime-LAMB, Fed-AMS and Mime as a ``torch.optim.Optimizer``.

Spec: ``papers/fedlamb.md`` (Karimi, Li, Li, UAI 2023), Algorithm 1 and the clean pseudocode of §4.2
(Fed-LAMB), §4.3 (Mime-LAMB) and §4.5b (Fed-AMS). Flower-free: any PyTorch training loop can use it.

One local step (Algorithm 1, lines 10-13; ``g`` is the minibatch gradient at the current ``theta``)::

    m     <- beta1 * m + (1 - beta1) * g                  # line 10
    v     <- beta2 * v + (1 - beta2) * g**2               # line 11 (typo-corrected, §9 A1); uploaded only
    psi   <- m / sqrt(v_hat)                              # line 12; v_hat = the server's v_hat_{r-1}
    for each parameter tensor ("layer", §4.7 / §9 B4):
        u      <- psi + lambda * theta                    # decoupled decay (AdamW), not in g, m or v
        theta  <- theta - lr * phi(||theta||) * u / ||u||   # line 13, eq. (3)

and with ``trust_ratio=False`` the Fed-AMS / Mime local step (§4.5b, c): ``theta <- theta - lr * u``
(``u = psi`` when ``weight_decay=0``, the paper's baselines).

Sign convention: ``step()`` *subtracts* the direction from ``theta`` (a descent step, as the paper
writes it). The update a client uploads is, as everywhere in pollen, ``Delta = theta_local -
theta_global``; the optimiser itself never sees it.

What is fixed within a round and what moves
-------------------------------------------
Per parameter the optimiser keeps three tensors of the parameter's shape, device and dtype:

``m``
    First moment. Persists across rounds (Algorithm 1 line 6, ``m^0_{r,i} = m^T_{r-1,i}``; §9 A3): the
    caller keeps it with :meth:`~torch.optim.Optimizer.state_dict` / :meth:`load_state_dict`.
``v_hat``
    The global ``v_hat_{r-1}`` the server broadcast, installed with :meth:`set_global_v_hat`. It is the
    only denominator (line 12) and ``step()`` never changes it. Before any ``v_hat`` is installed it is
    ``eps * 1`` (``v_hat_0 = eps``, Algorithm 1 line 2).
``v``
    The local second moment. It does **not** enter the update (line 12 uses the global ``v_hat``, §9 A4);
    it is tracked only so that Fed-LAMB / Fed-AMS can upload it (line 16, :meth:`local_v`,
    :meth:`flat_local_v`). :meth:`set_global_v_hat` resets it to ``v_hat`` (line 6,
    ``v^0_{r,i} = v_hat_{r-1}``), so after ``T`` steps it is
    ``beta2**T v_hat + (1 - beta2) sum_t beta2**(T-t) g_t**2`` (§4.2). Mime-LAMB and Mime build their
    ``v_hat`` on the server from full-batch gradients and need no local ``v``: pass ``track_v=False``.

A round on a client therefore reads::

    opt = LocalLAMB(model.parameters(), lr=lr_r, weight_decay=lam)
    if saved is not None:
        opt.load_state_dict(saved)            # m (and the last v_hat) of this client's last round
        opt.param_groups[0]["lr"] = lr_r      # load_state_dict restores the saved group settings too
    opt.set_global_v_hat(v_hat_flat)          # the broadcast v_hat_{r-1}; also resets v to it
    for x, y in batches:                      # T local steps
        opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
    upload(model, opt.flat_local_v()); saved = opt.state_dict()

Choices where the spec leaves room (each is a setting)
------------------------------------------------------
* ``eps`` (§9 B1): ``eps_mode="floor"`` (the paper): ``v_hat`` is floored at ``eps`` when it is installed
  (a no-op for a ``v_hat`` the server built, which is ``>= eps`` by construction) and nothing is added to
  the denominator. ``eps_mode="add"`` (ablation): ``psi = m / (sqrt(v_hat) + eps)`` with ``v_hat`` as given.
* ``phi`` (§4.7, §9 B2, Assumption 4): ``"identity"`` (the experiments) or ``"clip"``:
  ``phi(a) = min(max(a + phi_shift, lo), hi)`` with ``phi_clip = (lo, hi)``. Assumption 4's example
  ``min(a + zeta, phi_M)`` is ``phi_shift=zeta, phi_clip=(0, phi_M)``; LAMB's (You et al. 2020)
  ``min(max(a, gamma_l), gamma_u)`` is ``phi_shift=0, phi_clip=(gamma_l, gamma_u)``; check 8.1's
  ``min(a, phi_M)`` is ``phi_clip=(0, phi_M)``.
* Zero norms (§4.7, §9 B3): with ``zero_norm_guard=True`` (recommended) a tensor whose scaled norm
  ``phi(||theta||)`` is 0 (with ``phi`` the identity: ``||theta|| = 0``, e.g. a zero-initialised bias or
  BatchNorm beta) gets trust ratio 1 and moves by ``lr * u``; with ``False`` eq. (3) is applied literally
  and such a tensor never moves (check 8.8). With a ``phi`` bounded below (``phi(0) > 0``, Assumption 4)
  eq. (3) already moves a zero tensor, and the guard leaves that step as it is. Either way a tensor with
  ``u = 0`` (eq. (3) would be 0/0) is left unchanged.
* Layer = parameter tensor; to exclude biases and norms from the decay (§4.7), give them their own
  parameter group with ``weight_decay=0``. Every setting can be set per group.

A parameter whose ``.grad`` is ``None`` is skipped (``m`` and ``v`` unchanged), as in ``torch.optim``.
``step()`` runs on the parameter's device in its dtype; norms and the zero-norm branches stay tensors
(``torch.where``), so a step never waits for the device.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from numbers import Real
from typing import Any

import numpy as np
import torch

__all__ = ["EPS_MODES", "PHIS", "LocalLAMB"]

EPS_MODES = ("floor", "add")
PHIS = ("identity", "clip")
_FLAGS = ("zero_norm_guard", "trust_ratio", "track_v")
_NOT_SETTINGS = ("params", "param_names")
_NAME = "LocalLAMB"


def _fail(key: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"{_NAME}: {key}={value!r} is not allowed; allowed: {allowed}")


def _real(key: str, value: Any, allowed: str) -> float:
    if isinstance(value, bool) or not isinstance(value, Real) or math.isnan(float(value)):
        raise _fail(key, value, allowed)
    return float(value)


def _check_settings(s: dict[str, Any]) -> None:
    """Raise ``ValueError`` naming the first setting of one parameter group that is out of range."""
    lr = _real("lr", s["lr"], "a finite number >= 0")
    if not (math.isfinite(lr) and lr >= 0.0):
        raise _fail("lr", s["lr"], "a finite number >= 0")
    betas = s["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise _fail("betas", betas, "a pair (beta1, beta2), each in [0, 1)")
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


class LocalLAMB(torch.optim.Optimizer):
    """Client-side LAMB of Fed-LAMB / Mime-LAMB (Algorithm 1, lines 10-13, eq. (3)), or Fed-AMS / Mime.

    See the module docstring for the update, what is fixed within a round and the choices made where
    the paper leaves room. Every setting below except ``v_hat`` can differ per parameter group.

    Parameters
    ----------
    params : iterable of tensors or of dicts
        Floating-point parameters (or parameter groups), as for any ``torch.optim`` optimiser. Their
        order (groups in order, then parameters) is the order of :meth:`set_global_v_hat`,
        :meth:`local_v` and :meth:`flat_local_v`; it must match how the server flattens its ``v_hat``.
    lr : float, default 1e-3
        Local learning rate ``alpha_r`` (>= 0). With the trust ratio each layer moves by exactly
        ``lr * phi(||theta_l||)`` per step.
    betas : (float, float), default (0.9, 0.999)
        ``(beta1, beta2)``, each in ``[0, 1)``: decay of ``m`` (line 10) and of the uploaded ``v`` (line 11).
    weight_decay : float, default 0.0
        ``lambda`` (>= 0; the paper tunes it in {0, 0.01, 0.1}), decoupled: added to the direction
        (``u = psi + lambda * theta``), never to the gradient or the moments.
    v_hat : sequence of tensors or a flat tensor / array, optional
        Initial global ``v_hat`` (as for :meth:`set_global_v_hat`). Default: ``eps`` everywhere.
    eps : float, default 1e-8
        ``> 0``. The floor of ``v_hat`` (``eps_mode="floor"``) or the term added to ``sqrt(v_hat)``
        (``eps_mode="add"``); also the default ``v_hat``.
    eps_mode : {"floor", "add"}, default "floor"
        ``"floor"``: ``psi = m / sqrt(max(v_hat, eps))`` (the paper, §9 B1). ``"add"``:
        ``psi = m / (sqrt(v_hat) + eps)`` (ablation).
    phi : {"identity", "clip"}, default "identity"
        Scaling of the weight norm: ``phi(a) = a``, or ``min(max(a + phi_shift, lo), hi)``.
    phi_clip : (float, float), default (0.0, inf)
        ``(lo, hi)`` of ``phi="clip"``: ``0 <= lo <= hi``, ``hi > 0``.
    phi_shift : float, default 0.0
        ``zeta`` of Assumption 4's ``min(a + zeta, phi_M)`` (``phi="clip"`` only), ``>= 0``.
    zero_norm_guard : bool, default True
        Trust ratio 1 for a tensor with ``phi(||theta||) = 0``; False applies eq. (3) literally.
    trust_ratio : bool, default True
        True: the LAMB step of eq. (3) (Fed-LAMB, Mime-LAMB). False: ``theta -= lr * u``, the locally
        adaptive AMSGrad step of Fed-AMS and Mime (``phi``, ``phi_clip`` and the guard are unused).
    track_v : bool, default True
        Keep the local ``v`` to upload (Fed-LAMB, Fed-AMS). False for Mime-LAMB and Mime.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        *,
        v_hat: Sequence[torch.Tensor | np.ndarray] | torch.Tensor | np.ndarray | None = None,
        eps: float = 1e-8,
        eps_mode: str = "floor",
        phi: str = "identity",
        phi_clip: tuple[float, float] = (0.0, math.inf),
        phi_shift: float = 0.0,
        zero_norm_guard: bool = True,
        trust_ratio: bool = True,
        track_v: bool = True,
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
        }
        _check_settings(defaults)
        super().__init__(params, defaults)
        if v_hat is not None:
            self.set_global_v_hat(v_hat)

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
                        f"{_NAME}: parameter {i} of the group has dtype {t.dtype}; allowed: a real "
                        "floating-point dtype"
                    )
        super().add_param_group({**param_group, "params": params})
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

    # ----------------------------------------------------------------------------------- round I/O

    def set_global_v_hat(self, v_hat: Sequence[torch.Tensor | np.ndarray] | torch.Tensor | np.ndarray) -> None:
        """Install the server's ``v_hat_{r-1}`` for this round and reset the local ``v`` to it (line 6).

        ``v_hat`` is either one tensor or array per parameter (shapes equal to the parameters'), or one
        flat 1-D tensor or array of all parameters in order. Values must be finite and ``>= 0`` after
        conversion to each parameter's dtype; with ``eps_mode="floor"`` values below ``eps`` are raised
        to ``eps``. Everything is checked before any state changes. Call it at the start of every round,
        also in a round that brings no new ``v_hat`` (skip-sync, §9 C2): pass :meth:`global_v_hat` again.
        """
        pairs = self._params()
        pieces = self._split(v_hat, [p for p, _ in pairs])
        for i, ((p, group), piece) in enumerate(zip(pairs, pieces)):
            if not bool(torch.isfinite(piece).all()):
                raise ValueError(f"{_NAME}: v_hat for parameter {i} holds NaN or Inf (as {p.dtype})")
            if bool((piece < 0).any()):
                raise ValueError(
                    f"{_NAME}: v_hat for parameter {i} has a negative value (min {float(piece.min())!r}); "
                    "allowed: values >= 0"
                )
        for (p, group), piece in zip(pairs, pieces):
            if group["eps_mode"] == "floor":
                piece.clamp_(min=group["eps"])
            state = self._init_state(p, group)
            state["v_hat"] = piece
            if group["track_v"]:
                state["v"] = piece.clone()

    @staticmethod
    def _split(v_hat: Any, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """``v_hat`` as one owned tensor per parameter (its device, dtype and shape), or ``ValueError``."""
        sizes = [p.numel() for p in params]
        if isinstance(v_hat, (torch.Tensor, np.ndarray)):
            flat = torch.as_tensor(v_hat)
            if flat.dim() != 1 or flat.numel() != sum(sizes):
                raise ValueError(
                    f"{_NAME}: a flat v_hat must be 1-D with {sum(sizes)} values (all parameters in "
                    f"order); got shape {tuple(flat.shape)}"
                )
            chunks = [c.reshape(p.shape) for c, p in zip(flat.split(sizes), params)]
        elif isinstance(v_hat, (list, tuple)):
            if len(v_hat) != len(params):
                raise ValueError(
                    f"{_NAME}: v_hat has {len(v_hat)} tensors; allowed: one per parameter ({len(params)}), "
                    "or one flat vector"
                )
            chunks = []
            for i, (c, p) in enumerate(zip(v_hat, params)):
                c = torch.as_tensor(c)
                if tuple(c.shape) != tuple(p.shape):
                    raise ValueError(
                        f"{_NAME}: v_hat[{i}] has shape {tuple(c.shape)}; allowed: the parameter's shape "
                        f"{tuple(p.shape)}"
                    )
                chunks.append(c)
        else:  # ValueError like every other bad v_hat: one except clause for a bad broadcast
            raise ValueError(  # noqa: TRY004
                f"{_NAME}: v_hat of type {type(v_hat).__name__} is not allowed; allowed: a list of tensors "
                "(one per parameter) or one flat tensor / numpy array"
            )
        return [
            c.detach().to(device=p.device, dtype=p.dtype, copy=True).contiguous()
            for c, p in zip(chunks, params)
        ]

    def global_v_hat(self) -> list[torch.Tensor]:
        """A copy of the installed ``v_hat``, one tensor per parameter in order."""
        return [self._init_state(p, g)["v_hat"].clone() for p, g in self._params()]

    def local_v(self) -> list[torch.Tensor]:
        """A copy of the local ``v`` (what Fed-LAMB / Fed-AMS upload), one tensor per parameter in order."""
        pairs = self._params()
        if not all(g["track_v"] for _, g in pairs):
            raise RuntimeError(f"{_NAME}: local_v() needs track_v=True in every parameter group")
        return [self._init_state(p, g)["v"].clone() for p, g in pairs]

    def flat_local_v(self, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
        """The local ``v`` of all parameters in order as one 1-D tensor (default: ``float32`` on the CPU)."""
        return torch.cat([v.reshape(-1).to(device=device, dtype=dtype) for v in self.local_v()])

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
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for key, value in list(state.items()):
                if isinstance(value, torch.Tensor):
                    state[key] = value.clone()

    # ----------------------------------------------------------------------------------- the step

    @staticmethod
    def _trust_ratio(p: torch.Tensor, u: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        """``phi(||theta||) / ||u||`` as a 0-dim tensor, with the zero-norm cases of §9 B3."""
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
            beta1, beta2 = group["betas"]
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                if g.is_sparse:
                    raise RuntimeError(f"{_NAME} does not support sparse gradients")
                state = self._init_state(p, group)
                m, v_hat = state["m"], state["v_hat"]
                m.mul_(beta1).add_(g, alpha=1.0 - beta1)                        # line 10
                if group["track_v"]:
                    state["v"].mul_(beta2).addcmul_(g, g, value=1.0 - beta2)    # line 11, uploaded only
                denom = v_hat.sqrt()
                if group["eps_mode"] == "add":
                    denom.add_(group["eps"])
                u = m / denom                                                   # line 12: psi
                if wd != 0.0:
                    u.add_(p, alpha=wd)                                         # psi + lambda * theta
                if group["trust_ratio"]:
                    p.addcmul_(u, self._trust_ratio(p, u, group), value=-lr)    # line 13, eq. (3)
                else:
                    p.add_(u, alpha=-lr)                                        # Fed-AMS / Mime
        return loss
