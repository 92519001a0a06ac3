"""FedYogi (Reddi et al. 2021; FedCAMS spec §3.4; FedAdaVR App. B Alg. 6), ε outside the sqrt.

Sign convention: ``delta = x_local - x_global`` (downhill); ``x_new = x + step``.

::

    m_t = beta1 * m_{t-1} + (1 - beta1) * Delta_t
    v_t = v_{t-1} - (1 - beta2) * Delta_t**2 * sign(v_{t-1} - Delta_t**2)
    x_{t+1} = x_t + eta * m_t / (sqrt(v_t) + eps)                     # bias_correction=False
    x_{t+1} = x_t + eta * m_hat / (sqrt(v_hat) + eps)                 # bias_correction=True
        m_hat = m_t / (1 - beta1**t),  v_hat = v_t / (1 - beta2**t)  # FedAdaVR eqs. 26-28

``v_0 = 0`` (FedAdaVR Alg. 2 and the FedCAMS code; Reddi et al. start at ``tau**2``).
``v`` never goes negative: when ``v_{t-1} > Delta**2`` it shrinks by less than
``(1-beta2) v_{t-1}``, otherwise it grows.

Bias correction: FedAdaVR corrects ``m`` and ``v`` as in Adam (ε outside ``sqrt(v_hat)``); this
is what ``bias_correction=True`` does. The FedCAMS code instead scales the step size by
``sqrt(1-beta2**t)/(1-beta1**t)`` and keeps ``sqrt(v) + eps`` (spec §3.4), i.e. an ε that is
``1/sqrt(1-beta2**t)`` times larger; the two agree when ``eps == 0`` and differ by that ε
scaling otherwise. We follow FedAdaVR (one bias-correction form for Adam, Yogi, AdaBelief, LAMB).
"""

from __future__ import annotations

import numpy as np

from .base import ServerOptimizer, adaptive_step

__all__ = ["Yogi"]


class Yogi(ServerOptimizer):
    """FedYogi server optimiser.

    Parameters
    ----------
    eta : float, default 0.01
        Server learning rate (> 0).
    beta1 : float, default 0.9
        First-moment decay, ``0 <= beta1 < 1``.
    beta2 : float, default 0.99
        Second-moment rate, ``0 <= beta2 < 1``.
    eps : float, default 1e-3
        Added to ``sqrt(v)`` (outside the sqrt), ``>= 0``.
    bias_correction : bool, default False
        True: FedAdaVR Alg. 6 (Adam-style correction of ``m`` and ``v`` with the round counter).
    """

    name = "yogi"
    slot_names = ("m", "v")

    def __init__(
        self,
        *,
        eta: float = 0.01,
        beta1: float = 0.9,
        beta2: float = 0.99,
        eps: float = 1e-3,
        bias_correction: bool = False,
    ) -> None:
        self._set_moment_settings(eta, beta1, beta2, eps, bias_correction)

    def _step(
        self, t: int, slots: dict[str, np.ndarray], delta: np.ndarray, params: np.ndarray | None, out: np.ndarray
    ) -> None:
        m, v = slots["m"], slots["v"]
        sgn = self._scratch(delta.shape[0])                 # block-sized buffer, not state
        m *= self.beta1                                     # m = beta1 * m
        m += np.multiply(delta, 1.0 - self.beta1, out=out)  #     + (1 - beta1) * Delta
        g2 = np.multiply(delta, delta, out=out)             # Delta**2
        np.sign(np.subtract(v, g2, out=sgn), out=sgn)       # sign(v_{t-1} - Delta**2)
        sgn *= g2                                           # Delta**2 * sign(...)
        sgn *= 1.0 - self.beta2
        v -= sgn                                            # v = v - (1 - beta2) * Delta**2 * sign(...)
        adaptive_step(
            m, v, out, eta=self.eta, eps=self.eps, t=t,
            beta1=self.beta1, beta2=self.beta2, bias_correction=self.bias_correction,
        )
