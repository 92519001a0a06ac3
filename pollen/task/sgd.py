"""Plain SGD for local training, without ``torch.optim``'s first-use cost.

On a SuperNode, Flower starts a fresh ``flwr-clientapp`` process for every message. The first
``torch.optim.Optimizer`` a process builds imports ``torch._dynamo`` (its methods are wrapped to keep
the compiler out), which costs about 1.5 s of a small machine's CPU, in every message, for a step that
needs none of it. :class:`PlainSGD` takes the same step as ``torch.optim.SGD`` (its single-tensor
path: coupled weight decay, heavy-ball momentum without dampening, the buffer started as a copy of the
first gradient), bit for bit, and imports nothing.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["PlainSGD"]


class PlainSGD:
    """``torch.optim.SGD(params, lr, momentum, weight_decay)`` without the optimiser machinery.

    Parameters
    ----------
    params : iterable of torch.Tensor
        The parameters to train; those without a gradient at a step are skipped, as torch does.
    lr : float
        Learning rate, >= 0.
    momentum : float (default: 0.0)
        Heavy-ball momentum in [0, 1); the buffer starts as the first gradient (torch's rule).
    weight_decay : float (default: 0.0)
        Coupled L2 decay, >= 0: ``g <- g + weight_decay * p`` before the momentum.
    """

    def __init__(
        self, params: Iterable[torch.Tensor], *, lr: float, momentum: float = 0.0, weight_decay: float = 0.0
    ) -> None:
        if not lr >= 0:
            raise ValueError(f"lr={lr!r} is out of range; allowed: a number >= 0")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum={momentum!r} is out of range; allowed: a number in [0, 1)")
        if not weight_decay >= 0:
            raise ValueError(f"weight_decay={weight_decay!r} is out of range; allowed: a number >= 0")
        self.params = [p for p in params if p.requires_grad]
        self.lr, self.momentum, self.weight_decay = float(lr), float(momentum), float(weight_decay)
        self.buffers: list[torch.Tensor | None] = [None] * len(self.params)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear every gradient (``None``, or zeros in place with ``set_to_none=False``)."""
        for p in self.params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_().zero_()

    @torch.no_grad()
    def step(self) -> None:
        """One SGD step on every parameter that has a gradient."""
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            grad = p.grad
            if self.weight_decay != 0:
                grad = grad.add(p, alpha=self.weight_decay)
            if self.momentum != 0:
                buf = self.buffers[i]
                if buf is None:
                    buf = self.buffers[i] = grad.detach().clone()
                else:
                    buf.mul_(self.momentum).add_(grad)
                grad = buf
            p.add_(grad, alpha=-self.lr)
