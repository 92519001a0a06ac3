"""The named server optimisers, one :func:`~pollen.optim.transforms.chain` each (optax's ``alias.py``).

Each alias takes the optimiser's settings by keyword (``eta`` is the server learning rate, ``beta1`` /
``beta2`` the moment decays) and returns a :class:`~pollen.optim.transforms.Chain` named after it; a bad
value raises ``ValueError`` naming the alias, the piece, the key, the value and what is allowed.
:data:`BY_NAME` maps each name to its alias and :func:`make_server_optimizer` is the one way to build
one by name (the run-config, FedAdaVR). The equations are in the pieces' docstrings
(:mod:`pollen.optim.transforms`).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

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
    "BY_NAME",
    "SERVER_OPTIMIZERS",
    "adabelief",
    "adagrad",
    "adam",
    "adpfed_adam",
    "amsgrad",
    "lamb",
    "make_server_optimizer",
    "sgd",
    "yogi",
]

#: name -> alias (a function of keyword settings returning the optimiser)
BY_NAME: dict[str, Callable[..., Chain]] = {}


def _alias(fn: Callable[..., Chain]) -> Callable[..., Chain]:
    """Register ``fn`` under its name; what it builds carries that name, errors are prefixed with it."""
    name = fn.__name__
    order = tuple(inspect.signature(fn).parameters)

    @functools.wraps(fn)
    def build(**hyper: Any) -> Chain:
        try:
            built = fn(**hyper)
        except ValueError as err:
            raise ValueError(f"{name}: {err}") from None
        return built.named(name, order)

    BY_NAME[name] = build
    return build


@_alias
def sgd(*, eta: float = 1.0, momentum: float = 0.0) -> Chain:
    """FedAvg (``momentum=0``; ``eta=1`` is plain model averaging, ``step == delta``) or FedAvgM (heavy ball)."""
    return chain(trace(momentum), scale(eta))


@_alias
def adam(
    *, eta: float = 0.1, beta1: float = 0.9, beta2: float = 0.99, eps: float = 1e-3, bias_correction: bool = False
) -> Chain:
    """FedAdam (Reddi et al. 2021 / FedCAMS eq. 3.4; ``bias_correction=True``: FedAdaVR Alg. 4)."""
    return chain(scale_by_adam(beta1=beta1, beta2=beta2, eps=eps, bias_correction=bias_correction), scale(eta))


@_alias
def yogi(
    *, eta: float = 0.01, beta1: float = 0.9, beta2: float = 0.99, eps: float = 1e-3, bias_correction: bool = False
) -> Chain:
    """FedYogi (Reddi et al. 2021; ``bias_correction=True``: FedAdaVR Alg. 6)."""
    return chain(scale_by_yogi(beta1=beta1, beta2=beta2, eps=eps, bias_correction=bias_correction), scale(eta))


@_alias
def adagrad(*, eta: float = 0.1, eps: float = 1e-3, beta1: float = 0.0, initial_accumulator: float = 0.0) -> Chain:
    """FedAdagrad (FedAdaVR Alg. 3; ``beta1 > 0``: Reddi et al.'s first moment)."""
    return chain(scale_by_rss(eps=eps, beta1=beta1, initial_accumulator=initial_accumulator), scale(eta))


@_alias
def adabelief(
    *,
    eta: float = 0.01,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    bias_correction: bool = True,
    inner_eps: bool = False,
) -> Chain:
    """AdaBelief as FedAdaVR App. B, Alg. 5 (``inner_eps=True``: the original's ``+ eps`` inside ``z``)."""
    return chain(
        scale_by_belief(beta1=beta1, beta2=beta2, eps=eps, bias_correction=bias_correction, inner_eps=inner_eps),
        scale(eta),
    )


@_alias
def lamb(
    *,
    eta: float = 0.01,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    bias_correction: bool = True,
    segments: Sequence[tuple[int, int]] | None = None,
    layerwise: bool = True,
) -> Chain:
    """LAMB as FedAdaVR App. B, Alg. 7: Adam's direction (rate 1), the per-tensor trust ratio, then ``eta``."""
    return chain(
        scale_by_adam(beta1=beta1, beta2=beta2, eps=eps, bias_correction=bias_correction),
        scale_by_trust_ratio(segments=segments, layerwise=layerwise),
        scale(eta),
    )


@_alias
def amsgrad(
    *,
    eta: float = 1.0,
    beta1: float = 0.9,
    beta2: float = 0.99,
    eps: float = 1e-3,
    eps_mode: str = "max",
    bias_correction: bool = False,
    max_stabilisation: bool = True,
) -> Chain:
    """FedAMS (``eps_mode="max"``, Option 1), FedAMSGrad (``"add"``, Option 2), HA-Fed's (``"inside"``)."""
    return chain(
        scale_by_amsgrad(
            beta1=beta1,
            beta2=beta2,
            eps=eps,
            eps_mode=eps_mode,
            bias_correction=bias_correction,
            max_stabilisation=max_stabilisation,
        ),
        scale(eta),
    )


@_alias
def adpfed_adam(
    *, eta: float = 0.01, beta1: float = 0.9, beta2: float = 0.999, v0: float = 1e-8, floor: float = 1e-16
) -> Chain:
    """Adp-Fed's server Adam (Fed-LAMB paper, Alg. 2): ``v_0 = v0``, no bias correction, no ``eps`` in the step."""
    return chain(scale_by_adpfed(beta1=beta1, beta2=beta2, v0=v0, floor=floor), scale(eta))


#: names accepted by :func:`make_server_optimizer` (the keys of :data:`BY_NAME`)
SERVER_OPTIMIZERS: tuple[str, ...] = tuple(BY_NAME)


def make_server_optimizer(name: str, **hyper: Any) -> Chain:
    """Build a server optimiser by name: ``BY_NAME[name](**hyper)`` with clear errors.

    Parameters
    ----------
    name : str
        One of :data:`SERVER_OPTIMIZERS`.
    **hyper
        Keyword hyper-parameters of that optimiser (see its alias); unset ones keep
        their defaults.

    Raises
    ------
    ValueError
        For an unknown name, an unknown hyper-parameter, or a value out of range; the
        message names the key, the value and what is allowed.
    """
    build = BY_NAME.get(name) if isinstance(name, str) else None
    if build is None:
        raise ValueError(f"server optimizer {name!r} is unknown; allowed: {', '.join(SERVER_OPTIMIZERS)}")
    allowed = list(inspect.signature(build).parameters)
    unknown = sorted(set(hyper) - set(allowed))
    if unknown:
        raise ValueError(
            f"{name}: unknown hyper-parameter {unknown[0]}={hyper[unknown[0]]!r}; allowed: {', '.join(allowed)}"
        )
    return build(**hyper)
