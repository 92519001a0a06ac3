"""FedAdaVR and FedAdaVR-Quant (and MIFA, FedVARP, the NoVR/NoOPT ablations) as a Flower strategy.

The server keeps every client's latest update ``y_j = (x_j - x_global) / eta_c`` in a
stored-update table (FP32/FP16/Int8/Int4, in RAM or memory-mapped on disk) and uses
it as a control variate under low participation (spec ``fedadavr.md`` §3.4–3.5):

    r = sum_{i in S} c_i (y_i - y_i_old) + sum_j p_j y_j_old,     delta = eta_c * r

then an adaptive server optimiser steps on ``delta``. A client's row is replaced only
after the server step of the round it took part in; a sampled client that sends no
usable reply keeps its row. Per-round work is O(M d): the table keeps a running sum
of its dequantised rows and updates it by difference. The math is in ``pollen.vr``
and ``pollen.optim``; this class only wires it.

Rows are keyed by the stable client id each pollen ClientApp reports (node-config
``client-id``, else ``partition-<id>``), not by Flower's node id, which changes when a
SuperNode reconnects; clients that cannot say fall back to ``node-<id>``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from pollen.core.layout import ModelLayout
from pollen.optim import Transform, make_server_optimizer, settings_of
from pollen.strategies.engine.aggregation import Aggregator
from pollen.strategies.engine.declared import PART
from pollen.strategies.engine.parts import EngineParts
from pollen.strategies.engine.replies import ReplySpec
from pollen.strategies.engine.round_aggregate import MeanAggregate
from pollen.strategies.engine.sampling import ClientSampler
from pollen.strategies.engine.strategy import (
    AdaptiveStrategy,
    ClientUpdate,
    MetricsAggregationFn,
    ScreenedSink,
)
from pollen.strategies.engine.uplink import Uplink
from pollen.strategies.fedadavr_store import StoredUpdates
from pollen.vr import VARIANTS, UpdateTable, get_variant
from pollen.vr.aggregate import VRRound, check_weighting, population_size
from pollen.wire import protocol

OPTIMIZERS = ("adagrad", "adam", "adabelief", "yogi", "lamb", "sgd")
#: Adam's ``eta`` and ``eps`` when none is given, measured for drop-in use (docs/results/dropin.md): the paper's
#: 0.01 with ``eps=1e-8`` was 11 points behind FedAvg after 5 rounds of advanced-pytorch over ten seeds, 0.015 with
#: 1e-8 7 behind after 5 of quickstart-pytorch; 0.02 with 3e-4 (on the table's ``update / client_lr``) is within 3 in
#: both. The other optimisers keep their variant's ``eta`` and 1e-8.
DROP_IN_ADAM_ETA = 0.02
DROP_IN_ADAM_EPS = 3e-4
#: How the table counts a client it has never heard from (``unseen_clients``): ``"left-out"`` averages over the
#: clients with a row (``N`` grows as clients first reply; round 1 is the replies' plain mean), ``"zero"`` gives
#: such a client a zero row and counts it in ``N`` (the papers' reading, spec ``papers/fedadavr.md`` item 29).
UNSEEN_CLIENTS = ("left-out", "zero")


class FedAdaVR(AdaptiveStrategy):
    """Adaptive server optimiser on a variance-reduced aggregate over a stored-update table.

    Replies stream (:class:`pollen.vr.VRRound`): each is read into one reused buffer, added to the
    round's float64 sum against its old row, and encoded into a staged row of the table's precision;
    the staged rows replace the table's after the server step, and are dropped if the round fails.

    Parameters
    ----------
    variant : str (default: "fedadavr")
        One of ``pollen.vr.VARIANTS``: ``fedadavr``, ``fedadavr-quant``, ``fedvarp``,
        ``mifa``, ``novr``, ``noopt``. It sets the defaults below; explicit
        arguments win.
    server_optimizer : str | None
        ``adagrad | adam | adabelief | yogi | lamb | sgd`` (paper's Appendix B), built by
        :func:`pollen.optim.make_server_optimizer` with the settings below that it takes.
    eta : float | None
        Server learning rate eta_s (run-config ``server-lr``); ``None`` takes 0.02 with Adam
        (:data:`DROP_IN_ADAM_ETA`, measured with benchmarks/bench_dropin.py; the paper's is 0.01, which the app
        passes), otherwise the variant's (``mifa`` / ``fedvarp`` 1.0 with plain SGD, the papers' values, which also
        drop in).
    client_lr : float (default: 0.01)
        The clients' learning rate eta_c; the table stores ``update / eta_c``.
    client_lr_factor : Callable[[int], float] | None (default: None)
        The clients' schedule (run-config ``lr-schedule``): round ``r`` uses
        ``client_lr * client_lr_factor(r)``, so the table stays in gradient units when it decays.
    beta_1, beta_2, eps : float (default: 0.9, 0.99, None)
        Optimiser settings, eps outside the sqrt. ``beta_1`` and ``beta_2`` go to the optimisers with a
        second-moment decay ``beta_2`` (Adam, Yogi, AdaBelief, LAMB); Adagrad (Alg. 3) takes ``eps`` only,
        SGD neither. ``eps=None`` is 3e-4 with Adam (:data:`DROP_IN_ADAM_EPS`: a coordinate whose stored update
        is below it takes a step in proportion to it, not a whole eta), 1e-8 otherwise. The paper's are 0.9,
        0.999, 1e-8 with bias correction (the app's ``fedadavr`` method passes them); the defaults here are the
        drop-in's (below).
    bias_correction : bool (default: False)
        Appendix B's bias correction by round count. Off, with ``beta_2=0.99``, the moments are read as
        FedAMS reads them: measured in three of Flower's examples (docs/results/dropin.md), the paper's
        0.999 with bias correction was 11 points behind FedAvg after 5 rounds of quickstart-pytorch and 9
        after 20 of advanced-pytorch; these defaults are within 2 and 5.
    vr_weighting : str | None
        ``sampled-normalised`` (default), ``horvitz-thompson``, ``literal`` or ``none``.
    table_precision : str | None
        ``fp32 | fp16 | int8 | int4``.
    table_path : str | None
        File for a memory-mapped table (N x d larger than RAM); ``None`` keeps it in RAM.
    num_clients : int | None
        N, the total number of clients, for ``unseen_clients="zero"``; ``None`` takes the nodes the grid has
        connected (or the clients heard from, if more).
    unseen_clients : str | None
        ``"left-out"`` or ``"zero"`` (:data:`UNSEEN_CLIENTS`): whether a client never heard from is left out of
        the table's average or counts in ``N`` with a zero row. ``None`` is ``"zero"`` when ``num_clients`` is
        given, otherwise ``"left-out"`` (the drop-in's: measured in advanced-pytorch, where half the clients
        reply each round, MIFA with zero rows was 6 points behind FedAvg after 5 rounds and 0.3 behind left out,
        docs/results/dropin.md). The app passes ``"zero"``, the papers' reading. Once every client has replied
        the two are the same.
    lamb_layerwise : bool (default: True)
        LAMB trust ratio per tensor (paper) or over the whole model.
    fraction_train, fraction_evaluate, min_train_nodes, min_evaluate_nodes, min_available_nodes : float, int
        Sampling: Flower's ``FedAvg`` arguments, with its defaults and meaning (:class:`AdaptiveStrategy`).
    weighted_by_key, arrayrecord_key, configrecord_key : str
        Flower's weight metric and record names, with its defaults and meaning (:class:`AdaptiveStrategy`).
    train_metrics_aggr_fn, evaluate_metrics_aggr_fn : Callable[[list[RecordDict], str], MetricRecord] | None
        Flower's metric aggregation functions; ``None``: each metric's weighted mean (:class:`AdaptiveStrategy`).
    aggregation, aggregator, uplink, parts
        The engine's settings and parts (:class:`AdaptiveStrategy`,
        :class:`~pollen.strategies.engine.parts.EngineParts`); its default
        sampler asks each new node for its client id (rows need stable client ids).
    """

    state_fields = {"store": PART}

    @classmethod
    def default_parts(cls) -> EngineParts:
        """A sampler that asks each new node for its stable client id, and the table's round aggregate."""
        return EngineParts(sampler=ClientSampler(identify_clients=True), round_aggregate=TableAggregate())

    def __init__(  # noqa: PLR0913 - Flower's FedAvg arguments, the method's, the engine's
        self,
        fraction_train: float = 1.0,
        fraction_evaluate: float = 1.0,
        min_train_nodes: int = 2,
        min_evaluate_nodes: int = 2,
        min_available_nodes: int = 2,
        weighted_by_key: str = protocol.NUM_EXAMPLES,
        arrayrecord_key: str = protocol.ARRAYS_RECORD,
        configrecord_key: str = protocol.CONFIG_RECORD,
        train_metrics_aggr_fn: MetricsAggregationFn | None = None,
        evaluate_metrics_aggr_fn: MetricsAggregationFn | None = None,
        *,
        variant: str = "fedadavr",
        server_optimizer: str | None = None,
        eta: float | None = None,
        client_lr: float = 0.01,
        beta_1: float = 0.9,
        beta_2: float = 0.99,
        eps: float | None = None,
        bias_correction: bool = False,
        vr_weighting: str | None = None,
        table_precision: str | None = None,
        table_path: str | None = None,
        num_clients: int | None = None,
        unseen_clients: str | None = None,
        lamb_layerwise: bool = True,
        client_lr_factor: Callable[[int], float] | None = None,
        aggregation: str = "mean",
        aggregator: str | Aggregator = "mean",
        uplink: Uplink | None = None,
        parts: EngineParts | None = None,
    ) -> None:
        spec = get_variant(variant)
        if spec.uses_table:
            self.robust_refusal = (
                f"variant {spec.name!r} aggregates a control-variate sum over its stored-update table, not a "
                "mean of this round's updates (allowed with a robust aggregator: variant 'novr')"
            )
        super().__init__(
            fraction_train=fraction_train,
            fraction_evaluate=fraction_evaluate,
            min_train_nodes=min_train_nodes,
            min_evaluate_nodes=min_evaluate_nodes,
            min_available_nodes=min_available_nodes,
            weighted_by_key=weighted_by_key,
            arrayrecord_key=arrayrecord_key,
            configrecord_key=configrecord_key,
            train_metrics_aggr_fn=train_metrics_aggr_fn,
            evaluate_metrics_aggr_fn=evaluate_metrics_aggr_fn,
            optimizer=None,
            aggregation=aggregation,
            aggregator=aggregator,
            uplink=uplink,
            parts=parts,
        )
        self.variant = spec
        if not spec.equal_weights:  # example-weighted variants need every reply's num-examples
            self.reply_spec = ReplySpec(weight=True)
        self.optimizer_name = server_optimizer or spec.optimizer
        if self.optimizer_name not in OPTIMIZERS:
            raise ValueError(f"server_optimizer={self.optimizer_name!r} is unknown; allowed: {', '.join(OPTIMIZERS)}")
        adam = self.optimizer_name == "adam"
        self.eta = float(eta if eta is not None else DROP_IN_ADAM_ETA if adam else spec.server_lr)
        if not client_lr > 0:
            raise ValueError(f"client_lr={client_lr!r} is out of range; allowed: a number > 0")
        self.client_lr = float(client_lr)
        self.client_lr_factor = client_lr_factor
        self.beta_1, self.beta_2 = beta_1, beta_2
        self.eps = eps if eps is not None else DROP_IN_ADAM_EPS if adam else 1e-8
        self.bias_correction = bool(bias_correction)
        self.vr_weighting = check_weighting(vr_weighting or spec.weighting)
        self.table_precision = table_precision or spec.precision
        self.table_path = table_path
        if num_clients is not None and num_clients < 1:
            raise ValueError(f"num_clients={num_clients!r} is out of range; allowed: an integer >= 1 or None")
        self.num_clients = num_clients
        self.unseen_clients = unseen_clients or ("zero" if num_clients is not None else "left-out")
        if self.unseen_clients not in UNSEEN_CLIENTS:
            raise ValueError(
                f"unseen_clients={unseen_clients!r} is not supported; allowed: {', '.join(UNSEEN_CLIENTS)}"
            )
        if self.unseen_clients == "left-out" and num_clients is not None:
            raise ValueError(
                f"num_clients={num_clients} is the N of unseen_clients='zero'; with 'left-out' N is the number of "
                "clients heard from (allowed: num_clients=None, or unseen_clients='zero')"
            )
        self.lamb_layerwise = lamb_layerwise
        self.store = StoredUpdates(self.table_precision, table_path) if spec.uses_table else None
        # Build once now so bad optimiser settings fail at construction, not in round 1 (a transform
        # holds no state; the one used is built with the model's layout, for LAMB's per-tensor norms).
        make_server_optimizer(self.optimizer_name, **self._optimizer_kwargs(None))

    def _optimizer_kwargs(self, layout: ModelLayout | None) -> dict[str, Any]:
        """This strategy's settings that the chosen optimiser takes (:func:`pollen.optim.settings_of`):
        ``eta`` and ``eps``; ``beta_1``, ``beta_2`` and Appendix B's bias correction where it has a
        second-moment decay ``beta_2``; LAMB's per-tensor ``segments`` (whole-model norms until the
        layout is known)."""
        takes = settings_of(self.optimizer_name)
        settings: dict[str, Any] = {"eta": self.eta, "eps": self.eps}
        if "beta_2" in takes:
            settings.update(beta_1=self.beta_1, beta_2=self.beta_2, bias_correction=self.bias_correction)
        if "segments" in takes:
            settings.update(
                segments=layout.segments if layout is not None else None,
                layerwise=self.lamb_layerwise and layout is not None,
            )
        return {key: value for key, value in settings.items() if key in takes}

    def build_optimizer(self, layout: ModelLayout) -> Transform:
        return make_server_optimizer(self.optimizer_name, **self._optimizer_kwargs(layout))

    @property
    def table(self) -> UpdateTable | None:
        """The stored-update table (``None`` for variants without one, or before round 1)."""
        return self.store.table if self.store is not None else None

    def on_layout(self, layout: ModelLayout) -> None:
        if self.store is not None:
            self.store.ensure(layout)

    def extra_summary(self) -> dict[str, Any]:
        return {
            "variant": f"{self.variant.name} (weighting {self.vr_weighting}, "
            f"{'equal' if self.variant.equal_weights else 'example'} weights)",
            "server optimiser": f"{self.optimizer_name} eta_s={self.eta:g} eta_c={self.client_lr:g}",
            "unseen clients": self.unseen_clients if self.variant.uses_table else "none",
            "table": f"{self.table_precision} in {'RAM' if self.table_path is None else self.table_path}"
            if self.variant.uses_table
            else "none",
        }

    def client_lr_at(self, server_round: int) -> float:
        """The clients' learning rate in ``server_round`` (their schedule applied)."""
        factor = self.client_lr_factor(server_round) if self.client_lr_factor is not None else 1.0
        return self.client_lr * factor

    def after_round(self, server_round: int, updates: list[ClientUpdate]) -> None:
        """The table's size (its rows were written by the round's transaction, none if the round failed)."""
        if self.table is not None:
            self.accounting.round(server_round).server_state_bytes = self.table.memory_bytes()


class TableAggregate:
    """FedAdaVR's round aggregate (the strategy's ``round_aggregate``): each update enters the round's
    :class:`~pollen.vr.VRRound` as ``y = delta / eta_c``, the round's delta is the variance-reduced ``eta_c * r``
    over the stored-update table, and the clients' new rows are staged in the round's transaction (written only if
    the round commits). With a robust aggregator (``novr`` only: no table) the round's delta is that aggregator's.
    """

    #: Why secure aggregation does not fit this aggregate (:class:`~pollen.strategies.engine.secure.SecureAggregation`).
    secagg_refusal = (
        "its stored-update table keeps each client's latest update, which secure aggregation never shows the "
        "server (a client-held table is the spec's way, not built)"
    )
    #: Why central DP does not fit this aggregate (:class:`~pollen.strategies.engine.private.CentralPrivacy`).
    privacy_refusal = (
        "its stored-update table puts each client's update back into every later round's aggregate, so one "
        "client's privacy cost would compound with each release (privacy.md section 7); local DP (dp='local', "
        "LocalPrivacy) works with it: the table then holds noised uploads"
    )

    def sink(self, strategy: FedAdaVR, server_round: int, bound: float) -> ScreenedSink:
        """A streamed round: each screened update goes into the round's ``VRRound``."""
        return _VRSink(strategy.screen, bound, self, strategy, server_round, self.new_round(strategy, server_round))

    def delta(self, strategy: FedAdaVR, server_round: int, updates: list[ClientUpdate]) -> np.ndarray:
        """The variance-reduced delta of updates read without streaming (round 1), or the robust aggregator's."""
        if not strategy.aggregator.streams:
            return MeanAggregate().delta(strategy, server_round, updates)
        vr_round = self.new_round(strategy, server_round)
        for update in updates:
            if update.delta is not None:
                self.add(strategy, vr_round, server_round, update)
        return self.round_delta(strategy, server_round, vr_round)

    @staticmethod
    def new_round(strategy: FedAdaVR, server_round: int) -> VRRound:
        """The round's VR aggregate; its staged rows are written only if the round's transaction commits."""
        vr_round = VRRound(strategy.table, strategy.layout.dim, weighting=strategy.vr_weighting)
        if strategy.store is not None:
            store = strategy.store
            strategy.transaction.stage(
                server_round, lambda: store.write(server_round, vr_round) if vr_round.staged else None
            )
        return vr_round

    @staticmethod
    def add(strategy: FedAdaVR, vr_round: VRRound, server_round: int, update: ClientUpdate) -> None:
        """Add ``update`` as ``y = delta / eta_c`` (formed in place in the reply's buffer)."""
        y = np.divide(update.delta, np.float32(strategy.client_lr_at(server_round)), out=update.delta)
        weight = float(update.num_examples) if not strategy.variant.equal_weights else 1.0
        vr_round.add(update.client_key, y, weight)

    @staticmethod
    def round_delta(strategy: FedAdaVR, server_round: int, vr_round: VRRound) -> np.ndarray:
        """``eta_c * r`` over ``N`` clients: with ``unseen_clients="zero"`` the run's, the sampler's, the table's or
        the round's, the largest; with ``"left-out"`` the clients heard from (table rows and this round's new)."""
        if strategy.unseen_clients == "left-out":
            num_clients = population_size(vr_round.table, vr_round.weights, 1)
        else:
            known = strategy.store.known_clients if strategy.store is not None else 0
            num_clients = max(strategy.num_clients or 0, len(strategy.sampler.known_clients), known, len(vr_round))
        return vr_round.delta(num_clients=num_clients, client_lr=strategy.client_lr_at(server_round))


class _VRSink(ScreenedSink):
    """A streamed FedAdaVR round: each screened update goes into the round's :class:`VRRound`."""

    def __init__(  # noqa: PLR0913 - the sink's round, in full
        self,
        screen: Any,
        bound: float,
        aggregate: TableAggregate,
        strategy: FedAdaVR,
        server_round: int,
        vr_round: VRRound,
    ) -> None:
        super().__init__(screen, bound)
        self.aggregate, self.strategy, self.server_round, self.vr_round = aggregate, strategy, server_round, vr_round

    def take(self, update: ClientUpdate) -> None:
        self.aggregate.add(self.strategy, self.vr_round, self.server_round, update)

    def mean(self) -> np.ndarray:
        return self.aggregate.round_delta(self.strategy, self.server_round, self.vr_round)


__all__ = ["OPTIMIZERS", "UNSEEN_CLIENTS", "VARIANTS", "FedAdaVR", "TableAggregate"]
