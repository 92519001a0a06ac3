"""The named server optimisers, one :func:`~pollen.optim.transforms.chain` each (optax's ``alias.py``).

Each alias takes the optimiser's settings by keyword, in Flower's spelling (``eta`` is the server learning
rate, ``beta_1`` / ``beta_2`` the moment decays; ``eps`` is Flower's ``tau``) and returns a
:class:`~pollen.optim.transforms.Chain` named after it; a bad value raises ``ValueError`` naming the
alias, the piece, the key, the value and what is allowed. Each is registered by name
(:mod:`pollen.optim.by_name`: what a name takes, and :func:`~pollen.optim.by_name.make_server_optimizer`,
the one way to build one by name). The equations are in the pieces' docstrings
(:mod:`pollen.optim.transforms`).
"""

from __future__ import annotations

from collections.abc import Sequence

from .by_name import BY_NAME, register
from .transforms import (
    Chain,
    chain,
    scale,
    scale_by_adam,
    scale_by_adpfed,
    scale_by_amsgrad,
    scale_by_belief,
    scale_by_rss,
    scale_by_trust_ratio,
    scale_by_yogi,
    trace,
)

__all__ = [
    "SERVER_OPTIMIZERS",
    "adabelief",
    "adagrad",
    "adam",
    "adpfed_adam",
    "amsgrad",
    "lamb",
    "sgd",
    "yogi",
]


@register
def sgd(*, eta: float = 1.0, momentum: float = 0.0) -> Chain:
    """FedAvg (``momentum=0``; ``eta=1`` is plain model averaging, ``step == delta``) or FedAvgM (heavy ball)."""
    return chain(trace(momentum), scale(eta))


@register
def adam(
    *, eta: float = 0.1, beta_1: float = 0.9, beta_2: float = 0.99, eps: float = 1e-3, bias_correction: bool = False
) -> Chain:
    """FedAdam (Reddi et al. 2021 / FedCAMS eq. 3.4; ``bias_correction=True``: FedAdaVR Alg. 4)."""
    return chain(scale_by_adam(beta_1=beta_1, beta_2=beta_2, eps=eps, bias_correction=bias_correction), scale(eta))


@register
def yogi(
    *, eta: float = 0.01, beta_1: float = 0.9, beta_2: float = 0.99, eps: float = 1e-3, bias_correction: bool = False
) -> Chain:
    """FedYogi (Reddi et al. 2021; ``bias_correction=True``: FedAdaVR Alg. 6)."""
    return chain(scale_by_yogi(beta_1=beta_1, beta_2=beta_2, eps=eps, bias_correction=bias_correction), scale(eta))


@register
def adagrad(*, eta: float = 0.1, eps: float = 1e-3, beta_1: float = 0.0, initial_accumulator: float = 0.0) -> Chain:
    """FedAdagrad (FedAdaVR Alg. 3; ``beta_1 > 0``: Reddi et al.'s first moment)."""
    return chain(scale_by_rss(eps=eps, beta_1=beta_1, initial_accumulator=initial_accumulator), scale(eta))


@register
def adabelief(
    *,
    eta: float = 0.01,
    beta_1: float = 0.9,
    beta_2: float = 0.999,
    eps: float = 1e-8,
    bias_correction: bool = True,
    inner_eps: bool = False,
) -> Chain:
    """AdaBelief as FedAdaVR App. B, Alg. 5 (``inner_eps=True``: the original's ``+ eps`` inside ``z``)."""
    return chain(
        scale_by_belief(beta_1=beta_1, beta_2=beta_2, eps=eps, bias_correction=bias_correction, inner_eps=inner_eps),
        scale(eta),
    )


@register
def lamb(
    *,
    eta: float = 0.01,
    beta_1: float = 0.9,
    beta_2: float = 0.999,
    eps: float = 1e-8,
    bias_correction: bool = True,
    segments: Sequence[tuple[int, int]] | None = None,
    layerwise: bool = True,
) -> Chain:
    """LAMB as FedAdaVR App. B, Alg. 7: Adam's direction (rate 1), the per-tensor trust ratio, then ``eta``."""
    return chain(
        scale_by_adam(beta_1=beta_1, beta_2=beta_2, eps=eps, bias_correction=bias_correction),
        scale_by_trust_ratio(segments=segments, layerwise=layerwise),
        scale(eta),
    )


@register
def amsgrad(
    *,
    eta: float = 1.0,
    beta_1: float = 0.9,
    beta_2: float = 0.99,
    eps: float = 1e-3,
    eps_mode: str = "max",
    bias_correction: bool = False,
    max_stabilisation: bool = True,
) -> Chain:
    """FedAMS (``eps_mode="max"``, Option 1), FedAMSGrad (``"add"``, Option 2), HA-Fed's (``"inside"``)."""
    return chain(
        scale_by_amsgrad(
            beta_1=beta_1,
            beta_2=beta_2,
            eps=eps,
            eps_mode=eps_mode,
            bias_correction=bias_correction,
            max_stabilisation=max_stabilisation,
        ),
        scale(eta),
    )


@register
def adpfed_adam(
    *, eta: float = 0.01, beta_1: float = 0.9, beta_2: float = 0.999, v0: float = 1e-8, floor: float = 1e-16
) -> Chain:
    """Adp-Fed's server Adam (Fed-LAMB paper, Alg. 2): ``v_0 = v0``, no bias correction, no ``eps`` in the step."""
    return chain(scale_by_adpfed(beta_1=beta_1, beta_2=beta_2, v0=v0, floor=floor), scale(eta))


#: every registered name, in the order above (the names :func:`~pollen.optim.by_name.make_server_optimizer` accepts)
SERVER_OPTIMIZERS: tuple[str, ...] = tuple(BY_NAME)
