"""Server optimisers over flat ``float32`` vectors as optax-shaped transforms (pure numpy, no Flower imports).

An optimiser is ``state = opt.init(d)`` then, once per round,
``step, new_state = opt.update(state, delta, params=None)``; ``state`` is never modified, so rolling a
round back is keeping the old reference. ``into=spare`` writes the new state into a spare state's arrays
(the state discarded a round ago), so no ``d``-sized memory is allocated per round.

Sign convention: ``delta`` is the aggregated client update ``x_local - x_global`` (it points
downhill) and ``step`` is what the server **adds**: ``x_new = x + step``.

>>> opt = make_server_optimizer("amsgrad", eta=1.0, eps=1e-3, eps_mode="max")   # or amsgrad(eta=1.0, ...)
>>> state, spare = opt.init(d), None                                           # doctest: +SKIP
>>> step, new = opt.update(state, mean_delta, into=spare)                       # doctest: +SKIP
>>> x += step; spare, state = state, new                                        # doctest: +SKIP

Pieces (:mod:`pollen.optim.transforms`): ``scale_by_adam``, ``scale_by_amsgrad``, ``scale_by_yogi``,
``scale_by_belief``, ``scale_by_rss``, ``scale_by_adpfed``, ``scale_by_trust_ratio``, ``trace``,
``scale`` and ``chain``. Named optimisers (:mod:`pollen.optim.aliases`), one chain each: ``sgd``,
``adam``, ``yogi``, ``adagrad``, ``adabelief``, ``lamb``, ``amsgrad``, ``adpfed_adam``. By name
(:mod:`pollen.optim.by_name`): :func:`settings_of` (what a name takes), :func:`make_server_optimizer`
(one built from settings spelt as Flower's ``FedAdam``: ``eta``, ``beta_1``, ``beta_2``; ``eps`` for its ``tau``).
"""

from __future__ import annotations

from .aliases import (
    SERVER_OPTIMIZERS,
    adabelief,
    adagrad,
    adam,
    adpfed_adam,
    amsgrad,
    lamb,
    sgd,
    yogi,
)
from .base import OptState, Transform, spare_like
from .by_name import BY_NAME, make_server_optimizer, refuse_unused, settings_of
from .transforms import (
    EPS_MODES,
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
    segments_from_sizes,
    trace,
)

__all__ = [
    "BY_NAME",
    "EPS_MODES",
    "SERVER_OPTIMIZERS",
    "Chain",
    "OptState",
    "Transform",
    "adabelief",
    "adagrad",
    "adam",
    "adpfed_adam",
    "amsgrad",
    "chain",
    "lamb",
    "make_server_optimizer",
    "refuse_unused",
    "scale",
    "scale_by_adam",
    "scale_by_adpfed",
    "scale_by_amsgrad",
    "scale_by_belief",
    "scale_by_rss",
    "scale_by_trust_ratio",
    "scale_by_yogi",
    "segments_from_sizes",
    "settings_of",
    "sgd",
    "spare_like",
    "trace",
    "yogi",
]
