"""The parts a strategy is built from, handed in by a caller or built with their defaults.

A strategy's constructor takes Flower's ``FedAvg`` arguments, its method's own, and ``parts``: an
:class:`EngineParts` naming any collaborator the caller wants to build itself. Every part left ``None`` is
built with its defaults (a method may change a default, as FedAdaVR asks each new node for its client id).

>>> from pollen.strategies import FedAMS
>>> from pollen.strategies.engine.parts import EngineParts
>>> from pollen.strategies.engine.screening import UpdateScreen
>>> from pollen.strategies.engine.sampling import ClientSampler
>>> strategy = FedAMS(fraction_train=0.5, eta=1.0, parts=EngineParts(
...     sampler=ClientSampler(seed=7), screen=UpdateScreen(rule="clip")))

A part holds one strategy's state (the sampler's generator, the screen's history): hand each strategy its own.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, fields, replace
from typing import Any

from pollen.strategies.engine.accounting import Accounting
from pollen.strategies.engine.ledger import AppliedLedger
from pollen.strategies.engine.model import GlobalModel
from pollen.strategies.engine.resume import RunCheckpoint
from pollen.strategies.engine.round_aggregate import MeanAggregate
from pollen.strategies.engine.rounds import SyncRounds
from pollen.strategies.engine.sampling import ClientSampler
from pollen.strategies.engine.screening import UpdateScreen
from pollen.strategies.engine.sinks import AGGREGATIONS
from pollen.strategies.engine.transaction import RoundTransaction
from pollen.wire import protocol

#: Flower's ``FedAvg`` arguments, in its order: every pollen strategy takes them first, with their defaults.
__all__ = [
    "FLOWER_ARGUMENTS",
    "AppliedLedger",
    "Accounting",
    "ClientSampler",
    "EngineParts",
    "GlobalModel",
    "MeanAggregate",
    "RoundTransaction",
    "RunCheckpoint",
    "SyncRounds",
    "UpdateScreen",
]

FLOWER_ARGUMENTS = (
    "fraction_train",
    "fraction_evaluate",
    "min_train_nodes",
    "min_evaluate_nodes",
    "min_available_nodes",
    "weighted_by_key",
    "arrayrecord_key",
    "configrecord_key",
    "train_metrics_aggr_fn",
    "evaluate_metrics_aggr_fn",
)


@dataclass
class EngineParts:
    """The engine's collaborators; each ``None`` is built with its defaults.

    Parameters
    ----------
    model : GlobalModel | None
        The global model as one flat vector plus buffers; ``GlobalModel(buffer_keys=[...])`` names the
        non-trainable arrays (default: inferred: integer dtypes and normalisation statistics).
    sampler : ClientSampler | None
        Who trains and evaluates: ``ClientSampler(seed=0, identify_clients=False, population=0)``; the
        strategy's ``min_available_nodes`` is the sampler's when it sets none.
    screen : UpdateScreen | None
        The outlier screen: ``UpdateScreen(rule="reject", factor=10.0, window=5, max_abs=1e15)``.
    ledger : AppliedLedger | None
        What the server applied of each client's upload (told to error-fed clients).
    transaction : RoundTransaction | None
        A round's changes all or nothing: ``RoundTransaction(min_replies=1, rollback=True)``.
    accounting : Accounting | None
        Per-round numbers measured on the wire.
    driver : SyncRounds | None
        The round driver that ``start`` hands the run to (default: lock-step rounds).
    checkpoint : RunCheckpoint | None
        Where every round is checkpointed (and what to resume from); ``start(checkpoint=...)`` overrides it.
    round_aggregate : MeanAggregate | None
        How a round's screened updates become one delta (default: their mean; FedAdaVR's: its table's).
    privacy : CentralPrivacy | LocalPrivacy | None
        Differential privacy. Central (:mod:`~pollen.strategies.engine.private`): each update clipped, the sum
        noised, before the optimiser; the screen then defaults to ``UpdateScreen(rule="off")`` and the round
        aggregate is its noised mean. Local (:mod:`~pollen.strategies.engine.local_privacy`): each client clips
        and noises its own upload. ``None`` (default): none.
    secagg : SecureAggregation | None
        Secure aggregation (:mod:`~pollen.strategies.engine.secure`): SecAgg+ over each round's sample with a
        summable codec; the server steps on the decoded mean of the round's sum and never holds one client's
        update. The screen then defaults to ``UpdateScreen(rule="off")``. ``None`` (default): none.
    """

    model: GlobalModel | None = None
    sampler: ClientSampler | None = None
    screen: UpdateScreen | None = None
    ledger: AppliedLedger | None = None
    transaction: RoundTransaction | None = None
    accounting: Accounting | None = None
    driver: SyncRounds | None = None
    checkpoint: RunCheckpoint | None = None
    round_aggregate: Any = None
    privacy: Any = None
    secagg: Any = None

    def filled(self, defaults: EngineParts | None = None) -> EngineParts:
        """These parts, each ``None`` taken from ``defaults`` (a method's) or built with its defaults."""
        built = {
            "model": GlobalModel,
            "sampler": ClientSampler,
            "screen": UpdateScreen,
            "ledger": AppliedLedger,
            "transaction": RoundTransaction,
            "accounting": Accounting,
            "driver": SyncRounds,
            "round_aggregate": MeanAggregate,
        }
        chosen: dict[str, Any] = {}
        for item in fields(self):
            value = getattr(self, item.name)
            if value is None and defaults is not None:
                value = getattr(defaults, item.name)
            if value is None and item.name == "screen" and getattr(self.privacy, "mode", None) == "central":
                value = UpdateScreen(rule="off")  # central DP: the clip bounds each client, not the others' norms
            if value is None and item.name == "screen" and self.secagg is not None:
                value = UpdateScreen(rule="off")  # secure aggregation: no norm of one client reaches the server
            if value is None and item.name in built:
                value = built[item.name]()
            _check_part(item.name, value)
            chosen[item.name] = value
        return replace(self, **chosen)


#: The parts that hold one strategy's state: handing one to a second strategy is refused.
STATEFUL = ("model", "sampler", "screen", "ledger", "transaction", "accounting")


def claim(parts: EngineParts, owner: object) -> None:
    """Mark each stateful part as ``owner``'s; ``ValueError`` if one already serves another strategy (two
    strategies sharing a sampler or a screen would draw from one generator and judge by one history)."""
    for name in STATEFUL:  # every part checked before any is marked: a refusal claims none
        part = getattr(parts, name)
        holder = getattr(part, "_serves", None)
        if holder is not None and holder() is not None and holder() is not owner:
            raise ValueError(
                f"parts.{name} ({type(part).__name__}) already serves another strategy; allowed: a part of its "
                "own for each strategy (build a new one)"
            )
    for name in STATEFUL:
        getattr(parts, name)._serves = weakref.ref(owner)


_KINDS: dict[str, type] = {
    "model": GlobalModel,
    "sampler": ClientSampler,
    "screen": UpdateScreen,
    "ledger": AppliedLedger,
    "transaction": RoundTransaction,
    "accounting": Accounting,
    "checkpoint": RunCheckpoint,
}


def _check_part(name: str, value: Any) -> None:
    kind = _KINDS.get(name)
    if kind is not None and value is not None and not isinstance(value, kind):
        raise ValueError(f"parts.{name}={value!r} is not a {kind.__name__}; allowed: a {kind.__name__}(...) or None")
    if name == "driver" and not callable(getattr(value, "run", None)):
        raise ValueError(f"parts.driver={value!r} has no run(strategy, grid, ...); allowed: a round driver or None")
    if name == "privacy" and value is not None and getattr(value, "mode", None) not in ("central", "local"):
        raise ValueError(
            f"parts.privacy={value!r} is not a privacy part; allowed: CentralPrivacy(...), LocalPrivacy(...) or None"
        )
    if name == "secagg" and value is not None and getattr(value, "mode", None) != "secagg":
        raise ValueError(
            f"parts.secagg={value!r} is not a secure-aggregation part; allowed: SecureAggregation(...) or None"
        )
    if name == "round_aggregate" and not (
        callable(getattr(value, "sink", None)) and callable(getattr(value, "delta", None))
    ):
        raise ValueError(
            f"parts.round_aggregate={value!r} has no sink(...) and delta(...); allowed: a round aggregate "
            "(MeanAggregate) "
            "or None"
        )


def _check_fraction(name: str, value: float, allow_zero: bool) -> None:
    low_ok = value >= 0.0 if allow_zero else value > 0.0
    if not (low_ok and value <= 1.0):
        interval = "[0, 1]" if allow_zero else "(0, 1]"
        raise ValueError(f"{name}={value!r} is out of range; allowed: a number in {interval}")


def check_flower_arguments(values: dict[str, Any]) -> None:
    """``ValueError`` naming the argument, its value and what is allowed, for Flower's ``FedAvg`` arguments."""
    _check_fraction("fraction_train", values["fraction_train"], allow_zero=False)
    _check_fraction("fraction_evaluate", values["fraction_evaluate"], allow_zero=True)
    for name in ("min_train_nodes", "min_evaluate_nodes", "min_available_nodes"):
        if not isinstance(values[name], int) or values[name] < 0:
            raise ValueError(f"{name}={values[name]!r} is invalid; allowed: an integer >= 0")
    for name in ("weighted_by_key", "arrayrecord_key", "configrecord_key"):
        if not isinstance(values[name], str) or not values[name]:
            raise ValueError(f"{name}={values[name]!r} is invalid; allowed: a non-empty string")
    for name in ("arrayrecord_key", "configrecord_key"):
        if values[name].startswith(protocol.CLIENT_STATE_PREFIX):
            raise ValueError(
                f"{name}={values[name]!r} is in pollen's own record names ('{protocol.CLIENT_STATE_PREFIX}...'); "
                "allowed: any other name"
            )
    if values["arrayrecord_key"] == values["configrecord_key"]:
        raise ValueError(
            f"arrayrecord_key and configrecord_key are both {values['arrayrecord_key']!r}; allowed: two different "
            "names (a message holds both records)"
        )
    for name in ("train_metrics_aggr_fn", "evaluate_metrics_aggr_fn"):
        if values[name] is not None and not callable(values[name]):
            raise ValueError(
                f"{name}={values[name]!r} is not callable; allowed: a function (list[RecordDict], str) -> "
                "MetricRecord, or None"
            )


def check_aggregation(aggregation: str) -> None:
    """``ValueError`` unless ``aggregation`` is one of :data:`~pollen.strategies.engine.sinks.AGGREGATIONS`."""
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation={aggregation!r} is unknown; allowed: {', '.join(AGGREGATIONS)}")


def assemble(  # noqa: PLR0913 - the base's arguments, checked and wired in one place
    strategy: Any,
    flower: dict[str, Any],
    *,
    optimizer: Any,
    aggregation: str,
    aggregator: Any,
    uplink: Any,
    parts: EngineParts | None,
) -> None:
    """Check a strategy's arguments (``ValueError`` naming the argument and what is allowed) and wire its parts:
    Flower's arguments as its attributes, the aggregator (refused by a method it does not fit), the handed-in or
    default parts (claimed by this strategy), the ledger's policy, the server step, the reply collector and the
    messages."""
    from pollen.strategies.engine.aggregation import check_codec, check_fits, make_aggregator
    from pollen.strategies.engine.collector import ReplyCollector
    from pollen.strategies.engine.messages import Transport
    from pollen.strategies.engine.step import ServerStep
    from pollen.strategies.engine.uplink import Uplink

    check_flower_arguments(flower)
    check_aggregation(aggregation)
    if uplink is not None and not isinstance(uplink, Uplink):
        raise ValueError(f"uplink={uplink!r} is not an Uplink; allowed: pollen.strategies.Uplink(...) or None")
    if parts is not None and not isinstance(parts, EngineParts):
        raise ValueError(f"parts={parts!r} is not an EngineParts; allowed: EngineParts(...) or None")
    vars(strategy).update(flower)
    strategy.aggregation, strategy.uplink = aggregation, uplink
    strategy.aggregator = make_aggregator(aggregator)
    name = type(strategy).__name__
    check_fits(strategy.aggregator, name, aggregation=aggregation, refusal=strategy.robust_refusal)
    check_codec(strategy.aggregator, name, uplink.decodes if uplink is not None else "none")
    chosen = (parts or EngineParts()).filled(strategy.default_parts())
    if chosen.privacy is not None:  # before any part is claimed: a refusal claims none
        from pollen.strategies.engine.private import PrivateMean

        chosen.privacy.check_fits(strategy, chosen.round_aggregate, chosen.screen)
        if chosen.privacy.mode == "central":
            chosen.round_aggregate = PrivateMean(chosen.privacy)
    if chosen.secagg is not None:
        chosen.secagg.check_fits(
            strategy, round_aggregate=chosen.round_aggregate, screen=chosen.screen, privacy=chosen.privacy
        )
        chosen.secagg.check_driver(chosen.driver, type(strategy).__name__)
        strategy.uplink = uplink = None  # per-client scales and supports cannot be summed: the codec is secagg's
    claim(chosen, strategy)
    for item in fields(chosen):
        setattr(strategy, item.name, getattr(chosen, item.name))
    error_fed = uplink is not None and uplink.error_feedback and uplink.codec != "none"
    strategy.ledger.decide(error_fed or chosen.secagg is not None, owner=strategy)  # secagg's codec is error-fed
    if strategy.sampler.min_available_nodes is None:
        strategy.sampler.min_available_nodes = flower["min_available_nodes"]
    strategy.server_step = ServerStep(optimizer)
    strategy.replies = ReplyCollector(strategy.sampler, lambda: strategy.accounting)
    strategy.transport = Transport(
        strategy.replies, lambda: strategy.accounting, flower["configrecord_key"], strategy.sampler.partition
    )
