"""FedAMS / FedAMSGrad: server AMSGrad with max stabilisation (FedCAMS Algorithm 1).

Sign convention: ``delta = x_local - x_global`` (downhill); ``x_new = x + step``
(the paper's convention too).

FedCAMS spec §3.5, Algorithm 1 lines 14-17, ``m_0 = v_0 = 0``::

    m_t = beta1 * m_{t-1} + (1 - beta1) * Delta_t                          # line 14
    v_t = beta2 * v_{t-1} + (1 - beta2) * Delta_t**2                       # line 15
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

    x_{t+1} = x_t + (eta / (1 - beta1**t)) * m_t / (sqrt(v_hat_t) / sqrt(1 - beta2**t) + eps')

with ``eps' = eps`` for Option 2 and ``eps' = 0`` for Option 1 (the code runs Option 1 as
``eps=0, max_init=eps``). At ``t = 1`` with ``beta1 = 0.9, beta2 = 0.99`` Option 1 takes the same
step with and without correction (``1 - beta1 == sqrt(1 - beta2) == 0.1``, equal up to float
rounding); Option 2 then differs only in ε's scale (``eps`` vs ``0.1 * eps``).

``max_stabilisation=False`` drops ``v_hat_{t-1}`` from the max and keeps no ``v_hat`` slot:
Option 2 becomes ``v_hat = v`` (exactly FedAdam, bit for bit), Option 1 keeps its ε floor,
``v_hat = max(v, eps)``.
"""

from __future__ import annotations

import numpy as np

from .adam import update_moments
from .base import (
    ServerOptimizer,
    adaptive_step,
    check_beta,
    check_bool,
    check_choice,
    check_eps,
    check_eta,
    check_real,
)

__all__ = ["AMSGrad", "EPS_MODES"]

EPS_MODES = ("max", "add", "inside")


class AMSGrad(ServerOptimizer):
    """FedAMS (Option 1, ``eps_mode="max"``) and FedAMSGrad (Option 2, ``eps_mode="add"``).

    Parameters
    ----------
    eta : float, default 1.0
        Server learning rate (> 0).
    beta1 : float, default 0.9
        First-moment decay, ``0 <= beta1 < 1``.
    beta2 : float, default 0.99
        Second-moment decay, ``0 <= beta2 < 1``.
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

    name = "amsgrad"

    def __init__(
        self,
        *,
        eta: float = 1.0,
        beta1: float = 0.9,
        beta2: float = 0.99,
        eps: float = 1e-3,
        eps_mode: str = "max",
        bias_correction: bool = False,
        max_stabilisation: bool = True,
    ) -> None:
        self.eta = check_eta(self.name, eta)
        self.beta1 = check_beta(self.name, "beta1", beta1)
        self.beta2 = check_beta(self.name, "beta2", beta2)
        self.eps_mode = check_choice(self.name, "eps_mode", eps_mode, EPS_MODES)
        if self.eps_mode == "max":
            self.eps = check_real(self.name, "eps", eps, low=0.0, low_open=True)
        else:
            self.eps = check_eps(self.name, eps)
        self.bias_correction = check_bool(self.name, "bias_correction", bias_correction)
        self.max_stabilisation = check_bool(self.name, "max_stabilisation", max_stabilisation)
        self.slot_names = ("m", "v", "v_hat") if self.max_stabilisation else ("m", "v")

    def _initial_slots(self, dim: int) -> dict[str, np.ndarray]:
        slots = super()._initial_slots(dim)
        if self.max_stabilisation and self.eps_mode == "max":
            slots["v_hat"].fill(self.eps)                   # v_hat_0 = eps (spec §8 A.1)
        return slots

    def _step(
        self, t: int, slots: dict[str, np.ndarray], delta: np.ndarray, params: np.ndarray | None, out: np.ndarray
    ) -> None:
        m, v = slots["m"], slots["v"]
        update_moments(m, v, delta, self.beta1, self.beta2, scratch=out)    # lines 14-15
        option1 = self.eps_mode == "max"
        if self.max_stabilisation:
            v_hat = slots["v_hat"]
            np.maximum(v_hat, v, out=v_hat)                 # v_hat = max(v_hat, v
            if option1:
                np.maximum(v_hat, self.eps, out=v_hat)      #                      , eps)   (Option 1)
        elif option1:
            v_hat = np.maximum(v, self.eps, out=out)        # v_hat = max(v, eps)   (no running max)
        else:
            v_hat = v                                       # v_hat = v             (= FedAdam)
        if self.eps_mode == "inside":                       # eta * m / sqrt(v_hat + eps)
            np.add(v_hat, self.eps, out=out)
            adaptive_step(
                m, out, out, eta=self.eta, eps=0.0, t=t, beta1=self.beta1, beta2=self.beta2,
                bias_correction=self.bias_correction, denominator_positive=self.eps > 0,
            )
            return
        # Option 1: eta * m / sqrt(v_hat);  Option 2: eta * m / (sqrt(v_hat) + eps)
        adaptive_step(
            m, v_hat, out, eta=self.eta, eps=0.0 if option1 else self.eps, t=t,
            beta1=self.beta1, beta2=self.beta2, bias_correction=self.bias_correction,
            denominator_positive=option1,                   # Option 1: v_hat >= eps > 0
        )
