"""AdaBelief server optimiser exactly as FedAdaVR App. B, Alg. 5 (eqs. 19-23).

Sign convention: ``delta = x_local - x_global`` (downhill); ``x_new = x + step``.
(FedAdaVR writes ``G = -Delta`` and subtracts; ``(G - m)**2`` is unchanged by the flip.)

::

    m_t = beta1 * m_{t-1} + (1 - beta1) * Delta_t
    z_t = beta2 * z_{t-1} + (1 - beta2) * (Delta_t - m_t)**2     # uses the NEW m_t
    m_hat = m_t / (1 - beta1**t);  z_hat = z_t / (1 - beta2**t)
    x_{t+1} = x_t + eta * m_hat / (sqrt(z_hat) + eps)

``m_0 = z_0 = 0``, ``t`` is the round counter (1 in the first round). The paper has no
``+ eps`` inside ``z_t``; the original AdaBelief (Zhuang et al. 2020) has
``z_t = ... + eps``: ``inner_eps=True`` adds it (spec §7 item 10).
First step (``t=1``, ``|Delta| >> eps``): ``z_1 = (1-beta2) beta1**2 Delta**2`` so
``step ~= eta * sign(Delta) / beta1`` (``1.11 eta`` for ``beta1 = 0.9``).
"""

from __future__ import annotations

import numpy as np

from .base import ServerOptimizer, adaptive_step, check_bool

__all__ = ["AdaBelief"]


class AdaBelief(ServerOptimizer):
    """AdaBelief server optimiser (FedAdaVR App. B).

    Parameters
    ----------
    eta : float, default 0.01
        Server learning rate (> 0).
    beta1 : float, default 0.9
        First-moment decay, ``0 <= beta1 < 1``.
    beta2 : float, default 0.999
        Belief (second-moment) decay, ``0 <= beta2 < 1``.
    eps : float, default 1e-8
        Added to ``sqrt(z_hat)`` (outside the sqrt), ``>= 0``.
    bias_correction : bool, default True
        Correct ``m`` and ``z`` with the round counter (as FedAdaVR).
    inner_eps : bool, default False
        Also add ``eps`` inside ``z_t`` (original AdaBelief).
    """

    name = "adabelief"
    slot_names = ("m", "z")

    def __init__(
        self,
        *,
        eta: float = 0.01,
        beta1: float = 0.9,
        beta2: float = 0.999,
        eps: float = 1e-8,
        bias_correction: bool = True,
        inner_eps: bool = False,
    ) -> None:
        self._set_moment_settings(eta, beta1, beta2, eps, bias_correction)
        self.inner_eps = check_bool(self.name, "inner_eps", inner_eps)

    def _step(
        self, t: int, slots: dict[str, np.ndarray], delta: np.ndarray, params: np.ndarray | None, out: np.ndarray
    ) -> None:
        m, z = slots["m"], slots["z"]
        m *= self.beta1                                     # m = beta1 * m
        m += np.multiply(delta, 1.0 - self.beta1, out=out)  #     + (1 - beta1) * Delta
        s = np.subtract(delta, m, out=out)                  # Delta - m_t
        s *= s                                              # (Delta - m_t)**2
        s *= 1.0 - self.beta2
        z *= self.beta2                                     # z = beta2 * z
        z += s                                              #     + (1 - beta2) * (Delta - m_t)**2
        if self.inner_eps:
            z += self.eps                                   #     (+ eps, original AdaBelief)
        adaptive_step(
            m, z, out, eta=self.eta, eps=self.eps, t=t,
            beta1=self.beta1, beta2=self.beta2, bias_correction=self.bias_correction,
        )
