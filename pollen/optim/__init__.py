"""Server optimisers over flat ``float32`` vectors (pure numpy, no Flower imports).

An optimiser is ``state = opt.init(d)`` then, once per round,
``state, step = opt.update(state, delta, params=None)``.

Sign convention: ``delta`` is the aggregated client update ``x_local - x_global`` (it points
downhill) and ``step`` is what the server **adds**: ``x_new = x + step``.

>>> opt = make_server_optimizer("amsgrad", eta=1.0, eps=1e-3, eps_mode="max")
>>> state = opt.init(d)                                        # doctest: +SKIP
>>> state, step = opt.update(state, mean_delta)                # doctest: +SKIP
>>> x += step                                                  # doctest: +SKIP
"""

from __future__ import annotations

import inspect
from typing import Any

from .adabelief import AdaBelief
from .adagrad import Adagrad
from .adam import Adam
from .adpfed import AdpFedAdam
from .amsgrad import EPS_MODES, AMSGrad
from .base import OptimizerState, ServerOptimizer
from .lamb import Lamb, segments_from_sizes
from .sgd import SGD
from .yogi import Yogi

__all__ = [
    "SERVER_OPTIMIZERS",
    "EPS_MODES",
    "AMSGrad",
    "AdaBelief",
    "AdpFedAdam",
    "Adagrad",
    "Adam",
    "Lamb",
    "OptimizerState",
    "SGD",
    "ServerOptimizer",
    "Yogi",
    "make_server_optimizer",
    "segments_from_sizes",
]

_REGISTRY: dict[str, type[ServerOptimizer]] = {
    cls.name: cls for cls in (SGD, Adam, Yogi, Adagrad, AdaBelief, Lamb, AMSGrad)
}

#: names accepted by :func:`make_server_optimizer`
SERVER_OPTIMIZERS: tuple[str, ...] = tuple(_REGISTRY)


def make_server_optimizer(name: str, **hyper: Any) -> ServerOptimizer:
    """Build a server optimiser by name.

    Parameters
    ----------
    name : str
        One of :data:`SERVER_OPTIMIZERS`.
    **hyper
        Keyword hyper-parameters of that optimiser (see its class); unset ones keep
        their defaults.

    Raises
    ------
    ValueError
        For an unknown name, an unknown hyper-parameter, or a value out of range; the
        message names the key, the value and what is allowed.
    """
    cls = _REGISTRY.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(f"server optimizer {name!r} is unknown; allowed: {', '.join(SERVER_OPTIMIZERS)}")
    allowed = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    unknown = sorted(set(hyper) - set(allowed))
    if unknown:
        raise ValueError(
            f"{name}: unknown hyper-parameter {unknown[0]}={hyper[unknown[0]]!r}; allowed: {', '.join(allowed)}"
        )
    return cls(**hyper)
