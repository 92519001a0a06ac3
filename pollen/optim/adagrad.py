"""FedAdagrad (Reddi et al. 2021; FedAdaVR App. B Alg. 3), ε outside the sqrt.

Sign convention: ``delta = x_local - x_global`` (downhill); ``x_new = x + step``.

FedAdaVR eqs. 12-13 (no momentum, no bias correction), ``z_0 = 0``::

    z_t = z_{t-1} + Delta_t**2
    x_{t+1} = x_t + eta * Delta_t / (sqrt(z_t) + eps)

Reddi et al. (and Flower's ``FedAdagrad``) add a first moment
``m_t = beta1 * m_{t-1} + (1 - beta1) * Delta_t`` and step with ``m_t``; with the default
``beta1 = 0`` (Flower's value too) ``m_t = Delta_t`` and that is exactly FedAdaVR's form, and
no ``m`` slot is kept. ``initial_accumulator`` sets ``z_0`` (Reddi et al. use ``tau**2``; 0 here).
"""

from __future__ import annotations

import numpy as np

from .base import ServerOptimizer, adaptive_step, check_beta, check_eps, check_eta, check_real

__all__ = ["Adagrad"]


class Adagrad(ServerOptimizer):
    """FedAdagrad server optimiser.

    Parameters
    ----------
    eta : float, default 0.1
        Server learning rate (> 0).
    eps : float, default 1e-3
        Added to ``sqrt(z)`` (outside the sqrt), ``>= 0``.
    beta1 : float, default 0.0
        Optional first-moment decay (Reddi et al.), ``0 <= beta1 < 1``; 0 = FedAdaVR Alg. 3.
    initial_accumulator : float, default 0.0
        ``z_0`` for every coordinate, ``>= 0``.
    """

    name = "adagrad"

    def __init__(
        self,
        *,
        eta: float = 0.1,
        eps: float = 1e-3,
        beta1: float = 0.0,
        initial_accumulator: float = 0.0,
    ) -> None:
        self.eta = check_eta(self.name, eta)
        self.eps = check_eps(self.name, eps)
        self.beta1 = check_beta(self.name, "beta1", beta1)
        self.initial_accumulator = check_real(self.name, "initial_accumulator", initial_accumulator, low=0.0)
        self.slot_names = ("m", "z") if self.beta1 > 0.0 else ("z",)

    def _initial_slots(self, dim: int) -> dict[str, np.ndarray]:
        slots = super()._initial_slots(dim)
        slots["z"].fill(self.initial_accumulator)
        return slots

    def _step(
        self, t: int, slots: dict[str, np.ndarray], delta: np.ndarray, params: np.ndarray | None, out: np.ndarray
    ) -> None:
        z = slots["z"]
        if self.beta1 > 0.0:
            m = slots["m"]
            m *= self.beta1                                     # m = beta1 * m
            m += np.multiply(delta, 1.0 - self.beta1, out=out)  #     + (1 - beta1) * Delta
        else:
            m = delta                                           # m = Delta (FedAdaVR Alg. 3)
        z += np.multiply(delta, delta, out=out)                 # z = z + Delta**2
        adaptive_step(
            m, z, out, eta=self.eta, eps=self.eps, t=t,
            beta1=0.0, beta2=0.0, bias_correction=False,
        )
