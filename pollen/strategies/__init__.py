"""Server strategies (Flower Message API) that drop in where ``FedAvg``/``FedAdam`` are used.

>>> from pollen.strategies import FedAMS
>>> strategy = FedAMS(fraction_train=0.5, eta=1.0, eps=1e-3)       # doctest: +SKIP
>>> result = strategy.start(grid=grid, initial_arrays=arrays, num_rounds=10)  # doctest: +SKIP
"""

from pollen.strategies.accounting import Accounting, RoundStats
from pollen.strategies.base import AdaptiveStrategy, ClientUpdate, ReplyRejected
from pollen.strategies.baselines import MeteredFedAdagrad, MeteredFedAdam, MeteredFedAvg, MeteredFedYogi
from pollen.strategies.fedadavr import FedAdaVR
from pollen.strategies.fedams import FedAMS
from pollen.strategies.fedcams import FedCAMS

__all__ = [
    "Accounting",
    "AdaptiveStrategy",
    "ClientUpdate",
    "FedAMS",
    "FedAdaVR",
    "FedCAMS",
    "MeteredFedAdagrad",
    "MeteredFedAdam",
    "MeteredFedAvg",
    "MeteredFedYogi",
    "ReplyRejected",
    "RoundStats",
]
