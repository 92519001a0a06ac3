"""The pieces server optimisers are made of, and :func:`chain`, which composes them (pure numpy, no Flower).

Shaped like optax's ``scale_by_adam`` / ``scale_by_trust_ratio`` / ``scale`` / ``chain``: each piece is a
:class:`~pollen.optim.base.Transform` (``init`` / ``update`` returning a new state); a chain runs each
piece on the output of the one before, and the named optimisers of :mod:`pollen.optim.aliases` are one
chain each, e.g. LAMB = ``chain(scale_by_adam(...), scale_by_trust_ratio(...), scale(eta))``.

Sign convention: ``delta = x_local - x_global`` (downhill); ``x_new = x + step``. Unlike optax, whose
``scale(-lr)`` turns a gradient into a descent step, every piece here keeps the direction of its input:
the client update already points downhill, and ``scale(eta)`` takes ``eta > 0``.

Scalar factors are folded, not applied twice: in a chain, a ``scale(c)`` that follows a piece which can
take it (``folds_scale``: every piece here) becomes that piece's own last multiply. So
``chain(scale_by_adam(...), scale(eta))`` multiplies by ``eta / (1 - beta_1**t)`` once (one float64
scalar, one float32 multiply) and LAMB multiplies each tensor's step by ``eta * ratio`` once: the numbers
of the fused chains are those of the single-class optimisers this package had before, bit for bit
(``tests/unit/test_optim_transforms.py``). Consecutive scales fold into one factor, their product.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from numbers import Integral
from typing import Any

import numpy as np

from pollen.core.layout import segments_from_sizes

from .base import (
    Transform,
    _Stage,
    adaptive_step,
    check_beta,
    check_bool,
    check_choice,
    check_eps,
    check_eta,
    check_real,
)

__all__ = [
    "EPS_MODES",
    "Chain",
    "Scale",
    "ScaleByAMSGrad",
    "ScaleByAdam",
    "ScaleByAdpFed",
    "ScaleByBelief",
    "ScaleByRss",
    "ScaleByTrustRatio",
    "ScaleByYogi",
    "Trace",
    "chain",
    "scale",
    "scale_by_adam",
    "scale_by_adpfed",
    "scale_by_amsgrad",
    "scale_by_belief",
    "scale_by_rss",
    "scale_by_trust_ratio",
    "scale_by_yogi",
    "segments_from_sizes",
    "trace",
    "update_moments",
]

#: where AMSGrad puts its ε (see :class:`ScaleByAMSGrad`)
EPS_MODES = ("max", "add", "inside")

Slots = Mapping[str, np.ndarray]


def update_moments(
    m_old: np.ndarray,
    v_old: np.ndarray,
    m: np.ndarray,
    v: np.ndarray,
    delta: np.ndarray,
    beta_1: float,
    beta_2: float,
    *,
    scratch: np.ndarray,
) -> None:
    """``m = beta_1*m_old + (1-beta_1)*delta`` and ``v = beta_2*v_old + (1-beta_2)*delta**2``, into ``m``, ``v``.

    Shared by Adam, AMSGrad, LAMB and Adp-Fed's Adam so that they agree bit for bit. ``scratch`` may be
    ``out`` of the caller; it must not be ``delta``.
    """
    np.multiply(m_old, beta_1, out=m)  # m = beta_1 * m
    m += np.multiply(delta, 1.0 - beta_1, out=scratch)  #     + (1 - beta_1) * Delta
    np.multiply(delta, delta, out=scratch)  # Delta**2
    scratch *= 1.0 - beta_2
    np.multiply(v_old, beta_2, out=v)  # v = beta_2 * v
    v += scratch  #     + (1 - beta_2) * Delta**2


# -------------------------------------------------------------------------------- scale, trace


class Scale(Transform):
    """``step = eta * u``: the server learning rate.

    In a chain it is folded into the piece before it when that piece can take it (``folds_scale``),
    so that the rate is applied in that piece's last multiply, as the single-class optimisers did.

    Parameters
    ----------
    eta : float
        The factor, > 0 (the step keeps the direction of its input; see the module docstring).
    """

    name = "scale"
    folds_scale = True  # scale(a) then scale(b) is one multiply by a * b

    def __init__(self, eta: float) -> None:
        self.eta = check_eta(self.name, eta)
        self._hyper = {"eta": self.eta}

    def _stages(self) -> tuple[_Stage, ...]:
        return (_Stage(self, self.eta),)

    def _block(
        self,
        t: int,
        old: Slots,
        new: Slots,
        u: np.ndarray,
        params: np.ndarray | None,
        out: np.ndarray,
        factor: float,
        scratch: np.ndarray,
    ) -> None:
        np.multiply(u, factor, out=out)  # step = eta * u


class Trace(Transform):
    """FedAvg / FedAvgM direction: ``u`` itself, or heavy-ball momentum over it (the ``sgd`` alias).

    FedAvg (FedCAMS §3.2): ``x_{t+1} = x_t + eta * Delta_t``; with ``eta = 1`` this is plain
    model averaging, ``x_{t+1} = mean_i x^i_{t,K}``.

    FedAvgM (Hsu et al. 2019; Flower ``FedAvgM``): ``buf_t = momentum * buf_{t-1} + Delta_t``,
    ``x_{t+1} = x_t + eta * buf_t``, ``buf_0 = 0``. Flower writes it with the pseudo-gradient
    ``x - mean`` and subtracts; that is the same update. (optax: ``trace(decay=momentum)``.)

    Parameters
    ----------
    momentum : float, default 0.0
        Heavy-ball coefficient, ``0 <= momentum < 1``. With 0 no slot is kept.
    """

    name = "trace"
    folds_scale = True

    def __init__(self, momentum: float = 0.0) -> None:
        self.momentum = check_beta(self.name, "momentum", momentum)
        self.slot_names = ("momentum_buffer",) if self.momentum > 0.0 else ()
        self._hyper = {"momentum": self.momentum}

    def _block(
        self,
        t: int,
        old: Slots,
        new: Slots,
        u: np.ndarray,
        params: np.ndarray | None,
        out: np.ndarray,
        factor: float,
        scratch: np.ndarray,
    ) -> None:
        if self.momentum > 0.0:
            buf = new["momentum_buffer"]
            np.multiply(old["momentum_buffer"], self.momentum, out=buf)  # buf = momentum * buf
            buf += u  #       + Delta_t
            np.multiply(buf, factor, out=out)  # step = eta * buf
        else:
            np.multiply(u, factor, out=out)  # step = eta * Delta_t


# -------------------------------------------------------------------------------- Adam


class ScaleByAdam(Transform):
    """FedAdam's direction (Reddi et al. 2021), ε outside the square root.

    Sign convention: ``delta = x_local - x_global`` (downhill); ``x_new = x + step``.

    FedCAMS spec §3.3, eqs. (3.2)-(3.4), ``m_0 = v_0 = 0``::

        m_t = beta_1 * m_{t-1} + (1 - beta_1) * Delta_t
        v_t = beta_2 * v_{t-1} + (1 - beta_2) * Delta_t**2
        x_{t+1} = x_t + eta * m_t / (sqrt(v_t) + eps)

    ``bias_correction=True`` is FedAdaVR App. B, Alg. 4 (eqs. 14-18) with the round counter
    ``t`` (1 in the first round)::

        m_hat = m_t / (1 - beta_1**t);  v_hat = v_t / (1 - beta_2**t)
        x_{t+1} = x_t + eta * m_hat / (sqrt(v_hat) + eps)

    (FedAdaVR subtracts because its ``G = -Delta``.) The FedCAMS code's form (spec §3.9),
    ``denom = sqrt(v)/sqrt(1 - beta_2**t) + eps``, ``x += (eta/(1 - beta_1**t)) * m/denom``,
    is the same expression, since ``sqrt(v/(1-beta_2**t)) = sqrt(v)/sqrt(1-beta_2**t)``: the two
    readings agree, ε included. (Flower's ``FedAdam`` instead scales ``eta`` by
    ``sqrt(1-beta_2**t)/(1-beta_1**t)`` and keeps ``sqrt(v) + eps``, which puts ε on a different
    scale; that is not what either paper writes.)

    This piece is the direction ``m_hat / (sqrt(v_hat) + eps)``; ``eta`` is a following ``scale(eta)``,
    folded into the bias-correction factor.

    Parameters
    ----------
    beta_1 : float, default 0.9
        First-moment decay, ``0 <= beta_1 < 1``.
    beta_2 : float, default 0.99
        Second-moment decay, ``0 <= beta_2 < 1``.
    eps : float, default 1e-3
        Added to ``sqrt(v)`` (outside the sqrt), ``>= 0``.
    bias_correction : bool, default False
        False: Reddi et al. / FedCAMS eq. (3.4). True: FedAdaVR Alg. 4 (= FedCAMS code).
    """

    name = "scale_by_adam"
    slot_names = ("m", "v")
    reads_input_late = True
    folds_scale = True

    def __init__(
        self, *, beta_1: float = 0.9, beta_2: float = 0.99, eps: float = 1e-3, bias_correction: bool = False
    ) -> None:
        _set_moment_settings(self, beta_1, beta_2, eps, bias_correction)

    def _block(
        self,
        t: int,
        old: Slots,
        new: Slots,
        u: np.ndarray,
        params: np.ndarray | None,
        out: np.ndarray,
        factor: float,
        scratch: np.ndarray,
    ) -> None:
        m, v = new["m"], new["v"]
        update_moments(old["m"], old["v"], m, v, u, self.beta_1, self.beta_2, scratch=out)
        adaptive_step(  # [eta *] m_hat / (sqrt(v_hat) + eps)
            m,
            v,
            out,
            eta=factor,
            eps=self.eps,
            t=t,
            beta_1=self.beta_1,
            beta_2=self.beta_2,
            bias_correction=self.bias_correction,
        )


def _set_moment_settings(tr: Transform, beta_1: Any, beta_2: Any, eps: Any, bias_correction: Any) -> None:
    """Check and keep the settings the Adam family shares (Adam, Yogi, AdaBelief)."""
    tr.beta_1 = check_beta(tr.name, "beta_1", beta_1)
    tr.beta_2 = check_beta(tr.name, "beta_2", beta_2)
    tr.eps = check_eps(tr.name, eps)
    tr.bias_correction = check_bool(tr.name, "bias_correction", bias_correction)
    tr._hyper = {"beta_1": tr.beta_1, "beta_2": tr.beta_2, "eps": tr.eps, "bias_correction": tr.bias_correction}


# -------------------------------------------------------------------------------- AMSGrad


class ScaleByAMSGrad(Transform):
    """FedAMS / FedAMSGrad's direction: server AMSGrad with max stabilisation (FedCAMS Algorithm 1).

    Sign convention: ``delta = x_local - x_global`` (downhill); ``x_new = x + step``
    (the paper's convention too).

    FedCAMS spec §3.5, Algorithm 1 lines 14-17, ``m_0 = v_0 = 0``::

        m_t = beta_1 * m_{t-1} + (1 - beta_1) * Delta_t                        # line 14
        v_t = beta_2 * v_{t-1} + (1 - beta_2) * Delta_t**2                     # line 15
        Option 1 (eps_mode="max", "FedAMS"):
            v_hat_t = max(v_hat_{t-1}, v_t, eps);  x_{t+1} = x_t + eta * m_t / sqrt(v_hat_t)          # line 16
        Option 2 (eps_mode="add", "FedAMSGrad"):
            v_hat_t = max(v_hat_{t-1}, v_t);       x_{t+1} = x_t + eta * m_t / (sqrt(v_hat_t) + eps)  # line 17
        HA-Fed's form (eps_mode="inside", HA-Fed spec eq. 3.2 and Algorithm 1 line 18):
            v_hat_t = max(v_hat_{t-1}, v_t);       x_{t+1} = x_t + eta * m_t / sqrt(v_hat_t + eps)

    ``v_hat_0`` is not set by the paper; spec §8 A.1: ``v_hat_0 = eps`` for Option 1 (any value in
    ``[0, eps]`` gives the same iterates; the code's ``max_init``) and ``v_hat_0 = 0`` for Option 2.

    ``bias_correction=True`` is the official code's form (spec §3.9), off by default (the paper has
    none): the max is taken on the *un*-corrected ``v`` and ::

        x_{t+1} = x_t + (eta / (1 - beta_1**t)) * m_t / (sqrt(v_hat_t) / sqrt(1 - beta_2**t) + eps')

    with ``eps' = eps`` for Option 2 and ``eps' = 0`` for Option 1 (the code runs Option 1 as
    ``eps=0, max_init=eps``). At ``t = 1`` with ``beta_1 = 0.9, beta_2 = 0.99`` Option 1 takes the same
    step with and without correction (``1 - beta_1 == sqrt(1 - beta_2) == 0.1``, equal up to float
    rounding); Option 2 then differs only in ε's scale (``eps`` vs ``0.1 * eps``).

    ``max_stabilisation=False`` drops ``v_hat_{t-1}`` from the max and keeps no ``v_hat`` slot:
    Option 2 becomes ``v_hat = v`` (exactly FedAdam, bit for bit), Option 1 keeps its ε floor,
    ``v_hat = max(v, eps)``.

    ``eta`` is a following ``scale(eta)``, folded in.

    Parameters
    ----------
    beta_1 : float, default 0.9
        First-moment decay, ``0 <= beta_1 < 1``.
    beta_2 : float, default 0.99
        Second-moment decay, ``0 <= beta_2 < 1``.
    eps : float, default 1e-3
        Option 1: floor inside the max (``> 0``; the denominator is at least ``sqrt(eps)``).
        Option 2: added outside the sqrt (``>= 0``). "inside": added to ``v_hat`` under the sqrt (``>= 0``).
    eps_mode : {"max", "add", "inside"}, default "max"
        Where ε goes: "max" = Option 1 (FedAMS), "add" = Option 2 (FedAMSGrad), "inside" =
        ``sqrt(v_hat + eps)`` (HA-Fed's FedAMSGrad, ``v_hat_0 = 0``).
    bias_correction : bool, default False
        The official code's Adam-style correction (spec §3.9).
    max_stabilisation : bool, default True
        False drops the running max (``v_hat = v``, or ``max(v, eps)`` for Option 1).
    """

    name = "scale_by_amsgrad"
    reads_input_late = True
    folds_scale = True

    def __init__(
        self,
        *,
        beta_1: float = 0.9,
        beta_2: float = 0.99,
        eps: float = 1e-3,
        eps_mode: str = "max",
        bias_correction: bool = False,
        max_stabilisation: bool = True,
    ) -> None:
        self.beta_1 = check_beta(self.name, "beta_1", beta_1)
        self.beta_2 = check_beta(self.name, "beta_2", beta_2)
        self.eps_mode = check_choice(self.name, "eps_mode", eps_mode, EPS_MODES)
        if self.eps_mode == "max":
            self.eps = check_real(self.name, "eps", eps, low=0.0, low_open=True)
        else:
            self.eps = check_eps(self.name, eps)
        self.bias_correction = check_bool(self.name, "bias_correction", bias_correction)
        self.max_stabilisation = check_bool(self.name, "max_stabilisation", max_stabilisation)
        self.slot_names = ("m", "v", "v_hat") if self.max_stabilisation else ("m", "v")
        self._hyper = {
            "beta_1": self.beta_1,
            "beta_2": self.beta_2,
            "eps": self.eps,
            "eps_mode": self.eps_mode,
            "bias_correction": self.bias_correction,
            "max_stabilisation": self.max_stabilisation,
        }

    def _initial_slots(self, dim: int) -> dict[str, np.ndarray]:
        slots = super()._initial_slots(dim)
        if self.max_stabilisation and self.eps_mode == "max":
            slots["v_hat"].fill(self.eps)  # v_hat_0 = eps (spec §8 A.1)
        return slots

    def _block(
        self,
        t: int,
        old: Slots,
        new: Slots,
        u: np.ndarray,
        params: np.ndarray | None,
        out: np.ndarray,
        factor: float,
        scratch: np.ndarray,
    ) -> None:
        m, v = new["m"], new["v"]
        update_moments(old["m"], old["v"], m, v, u, self.beta_1, self.beta_2, scratch=out)  # lines 14-15
        option1 = self.eps_mode == "max"
        if self.max_stabilisation:
            v_hat = new["v_hat"]
            np.maximum(old["v_hat"], v, out=v_hat)  # v_hat = max(v_hat, v
            if option1:
                np.maximum(v_hat, self.eps, out=v_hat)  #                      , eps)   (Option 1)
        elif option1:
            v_hat = np.maximum(v, self.eps, out=out)  # v_hat = max(v, eps)   (no running max)
        else:
            v_hat = v  # v_hat = v             (= FedAdam)
        if self.eps_mode == "inside":  # eta * m / sqrt(v_hat + eps)
            np.add(v_hat, self.eps, out=out)
            adaptive_step(
                m,
                out,
                out,
                eta=factor,
                eps=0.0,
                t=t,
                beta_1=self.beta_1,
                beta_2=self.beta_2,
                bias_correction=self.bias_correction,
                denominator_positive=self.eps > 0,
            )
            return
        # Option 1: eta * m / sqrt(v_hat);  Option 2: eta * m / (sqrt(v_hat) + eps)
        adaptive_step(
            m,
            v_hat,
            out,
            eta=factor,
            eps=0.0 if option1 else self.eps,
            t=t,
            beta_1=self.beta_1,
            beta_2=self.beta_2,
            bias_correction=self.bias_correction,
            denominator_positive=option1,  # Option 1: v_hat >= eps > 0
        )


# -------------------------------------------------------------------------------- Yogi


class ScaleByYogi(Transform):
    """FedYogi's direction (Reddi et al. 2021; FedCAMS spec §3.4; FedAdaVR App. B Alg. 6), ε outside the sqrt.

    Sign convention: ``delta = x_local - x_global`` (downhill); ``x_new = x + step``.

    ::

        m_t = beta_1 * m_{t-1} + (1 - beta_1) * Delta_t
        v_t = v_{t-1} - (1 - beta_2) * Delta_t**2 * sign(v_{t-1} - Delta_t**2)
        x_{t+1} = x_t + eta * m_t / (sqrt(v_t) + eps)                     # bias_correction=False
        x_{t+1} = x_t + eta * m_hat / (sqrt(v_hat) + eps)                 # bias_correction=True
            m_hat = m_t / (1 - beta_1**t),  v_hat = v_t / (1 - beta_2**t)  # FedAdaVR eqs. 26-28

    ``v_0 = 0`` (FedAdaVR Alg. 2 and the FedCAMS code; Reddi et al. start at ``tau**2``).
    ``v`` never goes negative: when ``v_{t-1} > Delta**2`` it shrinks by less than
    ``(1-beta_2) v_{t-1}``, otherwise it grows.

    Bias correction: FedAdaVR corrects ``m`` and ``v`` as in Adam (ε outside ``sqrt(v_hat)``); this
    is what ``bias_correction=True`` does. The FedCAMS code instead scales the step size by
    ``sqrt(1-beta_2**t)/(1-beta_1**t)`` and keeps ``sqrt(v) + eps`` (spec §3.4), i.e. an ε that is
    ``1/sqrt(1-beta_2**t)`` times larger; the two agree when ``eps == 0`` and differ by that ε
    scaling otherwise. We follow FedAdaVR (one bias-correction form for Adam, Yogi, AdaBelief, LAMB).

    ``eta`` is a following ``scale(eta)``, folded in.

    Parameters
    ----------
    beta_1 : float, default 0.9
        First-moment decay, ``0 <= beta_1 < 1``.
    beta_2 : float, default 0.99
        Second-moment rate, ``0 <= beta_2 < 1``.
    eps : float, default 1e-3
        Added to ``sqrt(v)`` (outside the sqrt), ``>= 0``.
    bias_correction : bool, default False
        True: FedAdaVR Alg. 6 (Adam-style correction of ``m`` and ``v`` with the round counter).
    """

    name = "scale_by_yogi"
    slot_names = ("m", "v")
    reads_input_late = True
    folds_scale = True

    def __init__(
        self, *, beta_1: float = 0.9, beta_2: float = 0.99, eps: float = 1e-3, bias_correction: bool = False
    ) -> None:
        _set_moment_settings(self, beta_1, beta_2, eps, bias_correction)

    def _block(
        self,
        t: int,
        old: Slots,
        new: Slots,
        u: np.ndarray,
        params: np.ndarray | None,
        out: np.ndarray,
        factor: float,
        scratch: np.ndarray,
    ) -> None:
        m, v = new["m"], new["v"]
        sgn = scratch  # block-sized buffer, not state
        np.multiply(old["m"], self.beta_1, out=m)  # m = beta_1 * m
        m += np.multiply(u, 1.0 - self.beta_1, out=out)  #     + (1 - beta_1) * Delta
        g2 = np.multiply(u, u, out=out)  # Delta**2
        np.sign(np.subtract(old["v"], g2, out=sgn), out=sgn)  # sign(v_{t-1} - Delta**2)
        sgn *= g2  # Delta**2 * sign(...)
        sgn *= 1.0 - self.beta_2
        np.subtract(old["v"], sgn, out=v)  # v = v - (1 - beta_2) * Delta**2 * sign(...)
        adaptive_step(
            m,
            v,
            out,
            eta=factor,
            eps=self.eps,
            t=t,
            beta_1=self.beta_1,
            beta_2=self.beta_2,
            bias_correction=self.bias_correction,
        )


# -------------------------------------------------------------------------------- AdaBelief


class ScaleByBelief(Transform):
    """AdaBelief's direction exactly as FedAdaVR App. B, Alg. 5 (eqs. 19-23).

    Sign convention: ``delta = x_local - x_global`` (downhill); ``x_new = x + step``.
    (FedAdaVR writes ``G = -Delta`` and subtracts; ``(G - m)**2`` is unchanged by the flip.)

    ::

        m_t = beta_1 * m_{t-1} + (1 - beta_1) * Delta_t
        z_t = beta_2 * z_{t-1} + (1 - beta_2) * (Delta_t - m_t)**2     # uses the NEW m_t
        m_hat = m_t / (1 - beta_1**t);  z_hat = z_t / (1 - beta_2**t)
        x_{t+1} = x_t + eta * m_hat / (sqrt(z_hat) + eps)

    ``m_0 = z_0 = 0``, ``t`` is the round counter (1 in the first round). The paper has no
    ``+ eps`` inside ``z_t``; the original AdaBelief (Zhuang et al. 2020) has
    ``z_t = ... + eps``: ``inner_eps=True`` adds it (spec §7 item 10).
    First step (``t=1``, ``|Delta| >> eps``): ``z_1 = (1-beta_2) beta_1**2 Delta**2`` so
    ``step ~= eta * sign(Delta) / beta_1`` (``1.11 eta`` for ``beta_1 = 0.9``).

    ``eta`` is a following ``scale(eta)``, folded in.

    Parameters
    ----------
    beta_1 : float, default 0.9
        First-moment decay, ``0 <= beta_1 < 1``.
    beta_2 : float, default 0.999
        Belief (second-moment) decay, ``0 <= beta_2 < 1``.
    eps : float, default 1e-8
        Added to ``sqrt(z_hat)`` (outside the sqrt), ``>= 0``.
    bias_correction : bool, default True
        Correct ``m`` and ``z`` with the round counter (as FedAdaVR).
    inner_eps : bool, default False
        Also add ``eps`` inside ``z_t`` (original AdaBelief).
    """

    name = "scale_by_belief"
    slot_names = ("m", "z")
    reads_input_late = True
    folds_scale = True

    def __init__(
        self,
        *,
        beta_1: float = 0.9,
        beta_2: float = 0.999,
        eps: float = 1e-8,
        bias_correction: bool = True,
        inner_eps: bool = False,
    ) -> None:
        _set_moment_settings(self, beta_1, beta_2, eps, bias_correction)
        self.inner_eps = check_bool(self.name, "inner_eps", inner_eps)
        self._hyper["inner_eps"] = self.inner_eps

    def _block(
        self,
        t: int,
        old: Slots,
        new: Slots,
        u: np.ndarray,
        params: np.ndarray | None,
        out: np.ndarray,
        factor: float,
        scratch: np.ndarray,
    ) -> None:
        m, z = new["m"], new["z"]
        np.multiply(old["m"], self.beta_1, out=m)  # m = beta_1 * m
        m += np.multiply(u, 1.0 - self.beta_1, out=out)  #     + (1 - beta_1) * Delta
        s = np.subtract(u, m, out=out)  # Delta - m_t
        s *= s  # (Delta - m_t)**2
        s *= 1.0 - self.beta_2
        np.multiply(old["z"], self.beta_2, out=z)  # z = beta_2 * z
        z += s  #     + (1 - beta_2) * (Delta - m_t)**2
        if self.inner_eps:
            z += self.eps  #     (+ eps, original AdaBelief)
        adaptive_step(
            m,
            z,
            out,
            eta=factor,
            eps=self.eps,
            t=t,
            beta_1=self.beta_1,
            beta_2=self.beta_2,
            bias_correction=self.bias_correction,
        )


# -------------------------------------------------------------------------------- Adagrad


class ScaleByRss(Transform):
    """FedAdagrad's direction (Reddi et al. 2021; FedAdaVR App. B Alg. 3), ε outside the sqrt.

    Sign convention: ``delta = x_local - x_global`` (downhill); ``x_new = x + step``.

    FedAdaVR eqs. 12-13 (no momentum, no bias correction), ``z_0 = 0``::

        z_t = z_{t-1} + Delta_t**2
        x_{t+1} = x_t + eta * Delta_t / (sqrt(z_t) + eps)

    Reddi et al. (and Flower's ``FedAdagrad``) add a first moment
    ``m_t = beta_1 * m_{t-1} + (1 - beta_1) * Delta_t`` and step with ``m_t``; with the default
    ``beta_1 = 0`` (Flower's value too) ``m_t = Delta_t`` and that is exactly FedAdaVR's form, and
    no ``m`` slot is kept. ``initial_accumulator`` sets ``z_0`` (Reddi et al. use ``tau**2``; 0 here).
    (optax: ``scale_by_rss``, the root of the sum of squares.)

    ``eta`` is a following ``scale(eta)``, folded in.

    Parameters
    ----------
    eps : float, default 1e-3
        Added to ``sqrt(z)`` (outside the sqrt), ``>= 0``.
    beta_1 : float, default 0.0
        Optional first-moment decay (Reddi et al.), ``0 <= beta_1 < 1``; 0 = FedAdaVR Alg. 3.
    initial_accumulator : float, default 0.0
        ``z_0`` for every coordinate, ``>= 0``.
    """

    name = "scale_by_rss"
    reads_input_late = True
    folds_scale = True

    def __init__(self, *, eps: float = 1e-3, beta_1: float = 0.0, initial_accumulator: float = 0.0) -> None:
        self.eps = check_eps(self.name, eps)
        self.beta_1 = check_beta(self.name, "beta_1", beta_1)
        self.initial_accumulator = check_real(self.name, "initial_accumulator", initial_accumulator, low=0.0)
        self.slot_names = ("m", "z") if self.beta_1 > 0.0 else ("z",)
        self._hyper = {"eps": self.eps, "beta_1": self.beta_1, "initial_accumulator": self.initial_accumulator}

    def _initial_slots(self, dim: int) -> dict[str, np.ndarray]:
        slots = super()._initial_slots(dim)
        slots["z"].fill(self.initial_accumulator)
        return slots

    def _block(
        self,
        t: int,
        old: Slots,
        new: Slots,
        u: np.ndarray,
        params: np.ndarray | None,
        out: np.ndarray,
        factor: float,
        scratch: np.ndarray,
    ) -> None:
        z = new["z"]
        if self.beta_1 > 0.0:
            m = new["m"]
            np.multiply(old["m"], self.beta_1, out=m)  # m = beta_1 * m
            m += np.multiply(u, 1.0 - self.beta_1, out=out)  #     + (1 - beta_1) * Delta
        else:
            m = u  # m = Delta (FedAdaVR Alg. 3)
        np.add(old["z"], np.multiply(u, u, out=out), out=z)  # z = z + Delta**2
        adaptive_step(
            m,
            z,
            out,
            eta=factor,
            eps=self.eps,
            t=t,
            beta_1=0.0,
            beta_2=0.0,
            bias_correction=False,
        )


# -------------------------------------------------------------------------------- Adp-Fed's Adam


class ScaleByAdpFed(Transform):
    """Adp-Fed's server Adam direction (Fed-LAMB paper, Algorithm 2; spec ``papers/fedlamb.md`` §4.5 (d), §9 D).

    Sign convention: ``delta = x_local - x_global`` (downhill); ``x_new = x + step``.

    Algorithm 2, lines 13-15, with ``m_0 = 0`` and ``v_0 = v0`` (the paper's ``eps``)::

        m_r = beta_1 * m_{r-1} + (1 - beta_1) * Delta_r
        v_r = beta_2 * v_{r-1} + (1 - beta_2) * Delta_r**2
        x_r = x_{r-1} + eta * m_r / sqrt(v_r)

    No bias correction and no ``eps`` in the denominator: ``v_0`` is the only guard and it decays as
    ``beta_2**r * v0``. A floor ``max(v_r, floor)`` (default 1e-16) only avoids ``0/0`` for a coordinate
    that never changes (§9 D3); it is far below any ``v`` a changing coordinate has. This differs from
    :class:`ScaleByAdam` (Reddi et al.'s FedAdam: ``sqrt(v) + eps`` with ``v_0 = 0``).

    ``eta`` is a following ``scale(eta)``, folded in.

    Parameters
    ----------
    beta_1, beta_2 : float, default 0.9, 0.999
        Moment decays, ``0 <= beta < 1`` (the paper's values for all adaptive methods).
    v0 : float, default 1e-8
        Initial second moment (the paper's ``eps``), > 0.
    floor : float, default 1e-16
        ``v`` is read as ``max(v, floor)`` in the denominator, ``>= 0``.
    """

    name = "scale_by_adpfed"
    slot_names = ("m", "v")
    reads_input_late = True
    folds_scale = True

    def __init__(self, *, beta_1: float = 0.9, beta_2: float = 0.999, v0: float = 1e-8, floor: float = 1e-16) -> None:
        self.beta_1 = check_beta(self.name, "beta_1", beta_1)
        self.beta_2 = check_beta(self.name, "beta_2", beta_2)
        self.v0 = check_real(self.name, "v0", v0, low=0.0, low_open=True)
        self.floor = check_real(self.name, "floor", floor, low=0.0)
        self._hyper = {"beta_1": self.beta_1, "beta_2": self.beta_2, "v0": self.v0, "floor": self.floor}

    def _initial_slots(self, dim: int) -> dict[str, np.ndarray]:
        return {"m": np.zeros(dim, dtype=np.float32), "v": np.full(dim, self.v0, dtype=np.float32)}

    def _block(
        self,
        t: int,
        old: Slots,
        new: Slots,
        u: np.ndarray,
        params: np.ndarray | None,
        out: np.ndarray,
        factor: float,
        scratch: np.ndarray,
    ) -> None:
        m, v = new["m"], new["v"]
        update_moments(old["m"], old["v"], m, v, u, self.beta_1, self.beta_2, scratch=out)
        np.maximum(v, self.floor, out=out)  # max(v, floor)
        np.sqrt(out, out=out)
        np.divide(m, out, out=out)  # m / sqrt(v)
        if factor != 1.0:  # skipping a multiply by 1 is exact
            out *= factor  # step = eta * m / sqrt(v)


# -------------------------------------------------------------------------------- LAMB's trust ratio


class ScaleByTrustRatio(Transform):
    """LAMB's trust ratio exactly as FedAdaVR App. B, Alg. 7 (eqs. 29-37); ``update`` needs ``params``.

    Sign convention: ``delta = x_local - x_global`` (downhill); ``x_new = x + step``.
    (FedAdaVR writes ``G = -Delta`` and subtracts; norms do not see the sign.)

    LAMB is ``chain(scale_by_adam(bias_correction=True, ...), scale_by_trust_ratio(...), scale(eta))``::

        m_t, v_t as in Adam;  m_hat = m_t / (1 - beta_1**t);  v_hat = v_t / (1 - beta_2**t)
        r_hat = m_hat / (sqrt(v_hat) + eps)                      # scale_by_adam, eta 1
        weight_norm = ||x_t||,  update_norm = ||r_hat||          # per tensor (default) or whole model
        r = weight_norm / update_norm  if both > 0  else 1.0     # this piece
        x_{t+1} = x_t + eta * r * r_hat                          # scale(eta), folded: one multiply by eta * r

    No ``lambda * x`` inside ``r_hat`` and no clipping function ``phi`` (as in the paper).
    The paper does not say whether the norms are per layer; the spec recommends per tensor
    (You et al. 2020): ``segments`` gives one ``(start, stop)`` slice of the flat vector per
    tensor, and ``layerwise=False`` uses whole-model norms instead. With per-tensor norms each
    tensor with non-zero weights and update moves by exactly ``eta * ||x_l||`` per round; a
    tensor whose weights are all zero (e.g. freshly initialised biases) or whose update is all
    zero falls back to ``r = 1`` (spec §7 item 11).

    Parameters
    ----------
    segments : sequence of (int, int), optional
        ``(start, stop)`` slices of the flat vector, one per tensor, in order, tiling
        ``[0, d)`` without gaps (see :func:`segments_from_sizes`). Required when
        ``layerwise=True``.
    layerwise : bool, default True
        True: one trust ratio per segment. False: one trust ratio from whole-model norms.
    """

    name = "scale_by_trust_ratio"
    needs_params = True
    elementwise = False  # the norms need the whole input: a pass after the element-wise pieces before it
    folds_scale = True

    def __init__(self, *, segments: Sequence[tuple[int, int]] | None = None, layerwise: bool = True) -> None:
        self.layerwise = check_bool(self.name, "layerwise", layerwise)
        self.segments = None if segments is None else self._check_segments(segments)
        if self.layerwise and self.segments is None:
            raise ValueError(
                f"{self.name}: segments=None with layerwise=True; allowed: segments=[(start, stop), ...] "
                "one per tensor (see segments_from_sizes), or layerwise=False for whole-model norms"
            )
        self._hyper = {
            "layerwise": self.layerwise,
            "num_segments": len(self.segments) if self.segments is not None else 0,
        }

    def _check_segments(self, segments: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
        try:
            pairs = [tuple(p) for p in segments]
        except TypeError:
            raise ValueError(f"{self.name}: segments={segments!r} is not a sequence of (start, stop) pairs") from None
        expected = 0
        for i, p in enumerate(pairs):
            if len(p) != 2 or not all(isinstance(x, Integral) and not isinstance(x, bool) for x in p):
                raise ValueError(f"{self.name}: segments[{i}]={p!r} is not an (int start, int stop) pair")
            start, stop = int(p[0]), int(p[1])
            if start != expected or stop < start:
                raise ValueError(
                    f"{self.name}: segments[{i}]=({start}, {stop}) is invalid; allowed: start == {expected} "
                    "(the previous stop) and stop >= start (segments must tile [0, d) in order)"
                )
            expected = stop
        if not pairs or expected == 0:
            raise ValueError(f"{self.name}: segments={segments!r} covers no elements")
        return tuple((int(a), int(b)) for a, b in pairs)

    def _check_dim(self, dim: int) -> None:
        if self.segments is not None and self.segments[-1][1] != dim:
            raise ValueError(
                f"{self.name}: segments cover [0, {self.segments[-1][1]}) but the vector has d={dim}; "
                "allowed: segments that tile exactly [0, d)"
            )

    def _whole(
        self,
        t: int,
        old: Slots,
        new: Slots,
        u: np.ndarray,
        params: np.ndarray | None,
        out: np.ndarray,
        factor: float,
    ) -> None:
        assert params is not None  # checked in update()
        segments = self.segments if self.layerwise else ((0, u.shape[0]),)
        for start, stop in segments:
            w, r = params[start:stop], u[start:stop]
            weight_norm = math.sqrt(float(np.dot(w, w)))  # ||x_t||
            update_norm = math.sqrt(float(np.dot(r, r)))  # ||r_hat||
            ratio = weight_norm / update_norm if weight_norm > 0.0 and update_norm > 0.0 else 1.0
            np.multiply(r, factor * ratio, out=out[start:stop])  # step = eta * r * r_hat


# -------------------------------------------------------------------------------- chain


class Chain(Transform):
    """Run transforms one after the other, each on the output of the one before (optax's ``chain``).

    The state is one :class:`~pollen.optim.base.OptState`: one step counter (every piece sees the same
    round ``t``) and the pieces' slots side by side under their own names (two pieces may not keep a slot
    of the same name); this keeps the checkpoint format ``{"step", "slots": {"m", "v", ...}}``.

    Runs of element-wise pieces are evaluated together block by block (one pass over memory for the
    lot); a piece that needs the whole vector (the trust ratio) runs after the blocks before it.

    Scalar factors are fused: a ``scale(c)`` right after a piece with ``folds_scale`` is not a
    separate pass but that piece's own last multiply (by ``c`` times what it multiplied by anyway,
    e.g. ``c / (1 - beta_1**t)`` in Adam), and consecutive scales become one factor, their product.
    That is what keeps the aliases bit-identical to the single-class optimisers they replaced.

    Parameters
    ----------
    *transforms : Transform
        The pieces, in order (chains are flattened).
    name : str, optional
        The name in messages and ``repr`` (default ``chain(piece, ...)``).
    """

    def __init__(self, *transforms: Transform, name: str | None = None) -> None:
        for i, tr in enumerate(transforms):
            if not isinstance(tr, Transform):
                raise ValueError(f"chain: argument {i} is {tr!r}, not a Transform; allowed: pieces of pollen.optim")
        owner: dict[str, str] = {}
        for tr in transforms:
            for k in tr.slot_names:
                if k in owner:
                    raise ValueError(
                        f"chain: slot {k!r} is kept by both {owner[k]} and {tr.name}; "
                        "allowed: pieces whose slot names differ"
                    )
                owner[k] = tr.name
        self.transforms = tuple(transforms)
        self.name = name or f"chain({', '.join(tr.name for tr in transforms)})"
        self.slot_names = tuple(owner)
        self.needs_params = any(tr.needs_params for tr in transforms)
        self._fused = _fuse(stage for tr in transforms for stage in tr._stages())
        hyper: dict[str, Any] = {}
        for tr in transforms:
            for k, v in tr.hyperparameters().items():
                hyper[k if k not in hyper or hyper[k] == v else f"{tr.name}.{k}"] = v
        self._hyper = hyper

    def named(self, name: str, order: Sequence[str] = ()) -> Chain:
        """The same chain under ``name``, its settings listed in ``order`` first (the aliases use this)."""
        named = Chain(*self.transforms, name=name)
        first = {k: named._hyper[k] for k in order if k in named._hyper}
        named._hyper = {**first, **{k: v for k, v in named._hyper.items() if k not in first}}
        return named

    def _stages(self) -> tuple[_Stage, ...]:
        return self._fused

    def _initial_slots(self, dim: int) -> dict[str, np.ndarray]:
        slots: dict[str, np.ndarray] = {}
        for tr in self.transforms:
            slots.update(tr._initial_slots(dim))
        return slots

    def _check_dim(self, dim: int) -> None:
        for tr in self.transforms:
            tr._check_dim(dim)


def _fuse(stages: Iterable[_Stage]) -> tuple[_Stage, ...]:
    """Fold every ``scale`` into the stage before it when that stage can take it (see :class:`Chain`)."""
    fused: list[_Stage] = []
    for stage in stages:
        if isinstance(stage.transform, Scale) and fused and fused[-1].transform.folds_scale:
            before = fused[-1]
            fused[-1] = _Stage(before.transform, before.factor * stage.factor)
        else:
            fused.append(stage)
    return tuple(fused)


# The pieces under optax's lower-case names: ``scale_by_adam(beta_1=0.9, ...)`` builds one.
chain = Chain
scale = Scale
trace = Trace
scale_by_adam = ScaleByAdam
scale_by_amsgrad = ScaleByAMSGrad
scale_by_yogi = ScaleByYogi
scale_by_belief = ScaleByBelief
scale_by_rss = ScaleByRss
scale_by_adpfed = ScaleByAdpFed
scale_by_trust_ratio = ScaleByTrustRatio
