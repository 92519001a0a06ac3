"""FedAdam (Reddi et al. 2021), ε outside the square root.

Sign convention: ``delta = x_local - x_global`` (downhill); ``x_new = x + step``.

FedCAMS spec §3.3, eqs. (3.2)-(3.4), ``m_0 = v_0 = 0``::

    m_t = beta1 * m_{t-1} + (1 - beta1) * Delta_t
    v_t = beta2 * v_{t-1} + (1 - beta2) * Delta_t**2
    x_{t+1} = x_t + eta * m_t / (sqrt(v_t) + eps)

``bias_correction=True`` is FedAdaVR App. B, Alg. 4 (eqs. 14-18) with the round counter
``t`` (1 in the first round)::

    m_hat = m_t / (1 - beta1**t);  v_hat = v_t / (1 - beta2**t)
    x_{t+1} = x_t + eta * m_hat / (sqrt(v_hat) + eps)

(FedAdaVR subtracts because its ``G = -Delta``.) The FedCAMS code's form (spec §3.9),
``denom = sqrt(v)/sqrt(1 - beta2**t) + eps``, ``x += (eta/(1 - beta1**t)) * m/denom``,
is the same expression, since ``sqrt(v/(1-beta2**t)) = sqrt(v)/sqrt(1-beta2**t)``: the two
readings agree, ε included. (Flower's ``FedAdam`` instead scales ``eta`` by
``sqrt(1-beta2**t)/(1-beta1**t)`` and keeps ``sqrt(v) + eps``, which puts ε on a different
scale; that is not what either paper writes.)
"""

from __future__ import annotations

import numpy as np

from .base import ServerOptimizer, adaptive_step

__all__ = ["Adam"]


class Adam(ServerOptimizer):
    """FedAdam server optimiser.

    Parameters
    ----------
    eta : float, default 0.1
        Server learning rate (> 0).
    beta1 : float, default 0.9
        First-moment decay, ``0 <= beta1 < 1``.
    beta2 : float, default 0.99
        Second-moment decay, ``0 <= beta2 < 1``.
    eps : float, default 1e-3
        Added to ``sqrt(v)`` (outside the sqrt), ``>= 0``.
    bias_correction : bool, default False
        False: Reddi et al. / FedCAMS eq. (3.4). True: FedAdaVR Alg. 4 (= FedCAMS code).
    """

    name = "adam"
    slot_names = ("m", "v")

    def __init__(
        self,
        *,
        eta: float = 0.1,
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
        update_moments(m, v, delta, self.beta1, self.beta2, scratch=out)
        adaptive_step(
            m, v, out, eta=self.eta, eps=self.eps, t=t,
            beta1=self.beta1, beta2=self.beta2, bias_correction=self.bias_correction,
        )


def update_moments(
    m: np.ndarray, v: np.ndarray, delta: np.ndarray, beta1: float, beta2: float, *, scratch: np.ndarray
) -> None:
    """In place: ``m = beta1*m + (1-beta1)*delta`` and ``v = beta2*v + (1-beta2)*delta**2``.

    Shared by Adam, AMSGrad and LAMB so that they agree bit for bit.
    """
    m *= beta1                                          # m = beta1 * m
    m += np.multiply(delta, 1.0 - beta1, out=scratch)   #     + (1 - beta1) * Delta
    np.multiply(delta, delta, out=scratch)              # Delta**2
    scratch *= 1.0 - beta2
    v *= beta2                                          # v = beta2 * v
    v += scratch                                        #     + (1 - beta2) * Delta**2
