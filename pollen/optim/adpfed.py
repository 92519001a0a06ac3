"""Adp-Fed's server Adam (Fed-LAMB paper, Algorithm 2; spec ``papers/fedlamb.md`` §4.5 (d), §9 D).

Sign convention: ``delta = x_local - x_global`` (downhill); ``x_new = x + step``.

Algorithm 2, lines 13-15, with ``m_0 = 0`` and ``v_0 = v0`` (the paper's ``eps``)::

    m_r = beta1 * m_{r-1} + (1 - beta1) * Delta_r
    v_r = beta2 * v_{r-1} + (1 - beta2) * Delta_r**2
    x_r = x_{r-1} + eta * m_r / sqrt(v_r)

No bias correction and no ``eps`` in the denominator: ``v_0`` is the only guard and it decays as
``beta2**r * v0``. A floor ``max(v_r, floor)`` (default 1e-16) only avoids ``0/0`` for a coordinate
that never changes (§9 D3); it is far below any ``v`` a changing coordinate has. This differs from
:class:`~pollen.optim.adam.Adam` (Reddi et al.'s FedAdam: ``sqrt(v) + eps`` with ``v_0 = 0``).
"""

from __future__ import annotations

import numpy as np

from .adam import update_moments
from .base import ServerOptimizer, check_beta, check_eta, check_real

__all__ = ["AdpFedAdam"]


class AdpFedAdam(ServerOptimizer):
    """Server Adam of Adp-Fed: ``v_0 = v0``, no bias correction, nothing added to ``sqrt(v)``.

    Parameters
    ----------
    eta : float, default 0.01
        Server learning rate eta_g (> 0); the paper tunes it in [1e-4, 0.1] (Table 2).
    beta1, beta2 : float, default 0.9, 0.999
        Moment decays, ``0 <= beta < 1`` (the paper's values for all adaptive methods).
    v0 : float, default 1e-8
        Initial second moment (the paper's ``eps``), > 0.
    floor : float, default 1e-16
        ``v`` is read as ``max(v, floor)`` in the denominator, ``>= 0``.
    """

    name = "adp-fed-adam"
    slot_names = ("m", "v")

    def __init__(
        self, *, eta: float = 0.01, beta1: float = 0.9, beta2: float = 0.999, v0: float = 1e-8, floor: float = 1e-16
    ) -> None:
        self.eta = check_eta(self.name, eta)
        self.beta1 = check_beta(self.name, "beta1", beta1)
        self.beta2 = check_beta(self.name, "beta2", beta2)
        self.v0 = check_real(self.name, "v0", v0, low=0.0, low_open=True)
        self.floor = check_real(self.name, "floor", floor, low=0.0)

    def _initial_slots(self, dim: int) -> dict[str, np.ndarray]:
        return {"m": np.zeros(dim, dtype=np.float32), "v": np.full(dim, self.v0, dtype=np.float32)}

    def _step(
        self, t: int, slots: dict[str, np.ndarray], delta: np.ndarray, params: np.ndarray | None, out: np.ndarray
    ) -> None:
        m, v = slots["m"], slots["v"]
        update_moments(m, v, delta, self.beta1, self.beta2, scratch=out)
        np.maximum(v, self.floor, out=out)             # max(v, floor)
        np.sqrt(out, out=out)
        np.divide(m, out, out=out)                     # m / sqrt(v)
        out *= self.eta                                # step = eta * m / sqrt(v)
