"""Variance reduction with a stored-update table (FedAdaVR, FedVARP, MIFA): pure numpy, no Flower.

One server round, in this order (spec ``papers/fedadavr.md`` section 3.5)::

    ys = {key: (x_local - x_global) / client_lr for each reply}          # pollen sign convention
    delta = vr_aggregate(ys, table, num_clients=N, weights=n, client_lr=client_lr)   # old table, pure
    step, state = optimizer.update(state, delta, x); x = x + step       # pollen.optim: new state returned
    table.replace_many(ys, weights=n)                                     # after the step; repliers only

Clients that were sampled but did not reply are left out of ``ys`` and keep their rows.
"""

from pollen.vr.aggregate import WEIGHTINGS, check_weighting, population_size, population_weight, vr_aggregate
from pollen.vr.table import UpdateTable, client_key
from pollen.vr.variants import VARIANTS, VRVariant, get_variant

__all__ = [
    "UpdateTable",
    "VARIANTS",
    "VRVariant",
    "WEIGHTINGS",
    "check_weighting",
    "client_key",
    "get_variant",
    "population_size",
    "population_weight",
    "vr_aggregate",
]
