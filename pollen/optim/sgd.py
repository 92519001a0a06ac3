"""FedAvg / FedAvgM server step: ``step = eta * Delta`` (heavy-ball momentum optional).

Sign convention: ``delta = x_local - x_global`` (downhill); ``x_new = x + step``.

FedAvg (FedCAMS §3.2): ``x_{t+1} = x_t + eta * Delta_t``; with ``eta = 1`` this is plain
model averaging, ``x_{t+1} = mean_i x^i_{t,K}``.

FedAvgM (Hsu et al. 2019; Flower ``FedAvgM``): ``buf_t = momentum * buf_{t-1} + Delta_t``,
``x_{t+1} = x_t + eta * buf_t``, ``buf_0 = 0``. Flower writes it with the pseudo-gradient
``x - mean`` and subtracts; that is the same update.
"""

from __future__ import annotations

import numpy as np

from .base import ServerOptimizer, check_beta, check_eta

__all__ = ["SGD"]


class SGD(ServerOptimizer):
    """Server SGD: FedAvg (``momentum=0``) or FedAvgM (heavy-ball, ``momentum>0``).

    Parameters
    ----------
    eta : float, default 1.0
        Server learning rate (> 0). ``eta=1, momentum=0`` is FedAvg: ``step == delta``.
    momentum : float, default 0.0
        Heavy-ball coefficient, ``0 <= momentum < 1``. With 0 no slot is kept.
    """

    name = "sgd"

    def __init__(self, *, eta: float = 1.0, momentum: float = 0.0) -> None:
        self.eta = check_eta(self.name, eta)
        self.momentum = check_beta(self.name, "momentum", momentum)
        self.slot_names = ("momentum_buffer",) if self.momentum > 0.0 else ()

    def _step(
        self, t: int, slots: dict[str, np.ndarray], delta: np.ndarray, params: np.ndarray | None, out: np.ndarray
    ) -> None:
        if self.momentum > 0.0:
            buf = slots["momentum_buffer"]
            buf *= self.momentum                       # buf = momentum * buf
            buf += delta                               #       + Delta_t
            np.multiply(buf, self.eta, out=out)        # step = eta * buf
        else:
            np.multiply(delta, self.eta, out=out)      # step = eta * Delta_t
