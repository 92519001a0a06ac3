"""Server strategies (Flower Message API) that drop in where ``FedAvg``/``FedAdam`` are used.

Exported: the strategies, Flower's baselines with pollen's metering, and what a user builds a new
method from or catches (``AdaptiveStrategy``, ``Uplink``, ``Downlink``, ``ReplySpec``, ``Extra``, ``ClientUpdate``,
``ReplyRejected``, ``RunCheckpoint``, ``RunInterrupted``), the parts a caller hands in most (``EngineParts``) and the
round drivers (``SyncRounds``, ``BufferedAsync`` with its ``AsyncRule``). The parts of the engine (model, transport,
reply collector, sinks, server step, sampler, accounting) are imported from their modules.

>>> from pollen.strategies import FedAMS
>>> strategy = FedAMS(fraction_train=0.5, eta=1.0, eps=1e-3)       # doctest: +SKIP
>>> result = strategy.start(grid=grid, initial_arrays=arrays, num_rounds=10)  # doctest: +SKIP
"""

from pollen.strategies.baselines import MeteredFedAdagrad, MeteredFedAdam, MeteredFedAvg, MeteredFedYogi
from pollen.strategies.engine.buffered import AsyncRule, BufferedAsync
from pollen.strategies.engine.downlink import Downlink
from pollen.strategies.engine.local_privacy import LocalPrivacy
from pollen.strategies.engine.parts import EngineParts
from pollen.strategies.engine.private import CentralPrivacy
from pollen.strategies.engine.replies import ClientUpdate, Extra, ReplyRejected, ReplySpec
from pollen.strategies.engine.resume import RunCheckpoint
from pollen.strategies.engine.rounds import RunInterrupted, SyncRounds
from pollen.strategies.engine.strategy import AdaptiveStrategy
from pollen.strategies.engine.uplink import Uplink
from pollen.strategies.fedadavr import FedAdaVR
from pollen.strategies.fedams import FedAMS
from pollen.strategies.fedcams import FedCAMS
from pollen.strategies.fedlamb import FedLAMB
from pollen.strategies.fedopt import FedOpt
from pollen.strategies.hafed import HAFed
from pollen.strategies.lazy import FedLazy

__all__ = [
    "CentralPrivacy",
    "LocalPrivacy",
    "AdaptiveStrategy",
    "AsyncRule",
    "BufferedAsync",
    "EngineParts",
    "SyncRounds",
    "ClientUpdate",
    "Downlink",
    "Extra",
    "FedAMS",
    "FedAdaVR",
    "FedLazy",
    "FedCAMS",
    "FedOpt",
    "FedLAMB",
    "HAFed",
    "MeteredFedAdagrad",
    "MeteredFedAdam",
    "MeteredFedAvg",
    "MeteredFedYogi",
    "ReplyRejected",
    "ReplySpec",
    "Uplink",
    "RunCheckpoint",
    "RunInterrupted",
]
