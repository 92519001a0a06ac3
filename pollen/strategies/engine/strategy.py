"""The shared base of pollen's server strategies (Flower Message API): Flower's API and the order of a round.

``AdaptiveStrategy`` keeps Flower's ``Strategy`` methods and what happens in which order; the work is done by
its parts (:mod:`pollen.strategies.engine`), each handed in by a caller through
:class:`~pollen.strategies.engine.parts.EngineParts` or built with its defaults: the global model, the sampler,
the messages and the reply collector, the outlier screen and the round's sink, the aggregator, the server step,
the round's transaction, the ledger, the accounting and the round driver.

A method overrides small steps: ``train_config`` (extra client config), ``node_content`` (what one node
receives), ``mid_round`` (more exchanges), ``aggregate_deltas`` / ``round_sink`` (how updates become one
delta), and stages what it would change with ``self.transaction.stage(round, commit)``; ``after_round`` is
bookkeeping that runs whether the round committed or not. Sign convention: a client's update is
``delta = x_local - x_global`` (points downhill); the server *adds* the optimiser's step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from logging import INFO
from typing import Any, ClassVar

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from pollen.core.layout import ModelLayout
from pollen.optim import Transform
from pollen.strategies.engine import metrics as round_metrics
from pollen.strategies.engine.aggregation import Aggregator
from pollen.strategies.engine.collector import TRAIN_PHASE
from pollen.strategies.engine.declared import restore_strategy_state, strategy_state
from pollen.strategies.engine.flower_wrappers import refuse_dp_wrapper
from pollen.strategies.engine.jobs import StepJobs
from pollen.strategies.engine.messages import train_config, with_config
from pollen.strategies.engine.metrics import MetricsAggregationFn
from pollen.strategies.engine.parts import FLOWER_ARGUMENTS, EngineParts, assemble
from pollen.strategies.engine.replies import ClientUpdate, ReplyRejected, ReplySpec, screened_kinds
from pollen.strategies.engine.rounds import RoundLoop
from pollen.strategies.engine.screening import all_finite
from pollen.strategies.engine.sinks import (
    AGGREGATIONS,
    RunningMean,
    ScreenedSink,
    aggregate_metrics,
    records_first,
    weights_of,
)
from pollen.strategies.engine.summary import log_summary, optimiser_words
from pollen.strategies.engine.transaction import model_saved
from pollen.strategies.engine.uplink import Uplink
from pollen.wire import protocol

__all__ = [
    "AGGREGATIONS",
    "FLOWER_ARGUMENTS",
    "TRAIN_PHASE",
    "AdaptiveStrategy",
    "ClientUpdate",
    "EngineParts",
    "MetricsAggregationFn",
    "ReplyRejected",
    "ReplySpec",
    "RunningMean",
    "ScreenedSink",
    "aggregate_metrics",
]


class AdaptiveStrategy(RoundLoop, Strategy):
    """Base of pollen's strategies: Flower's ``Strategy`` on a flat-vector model, built from parts.

    Parameters
    ----------
    fraction_train, fraction_evaluate, min_train_nodes, min_evaluate_nodes, min_available_nodes : float, int
        Flower's ``FedAvg`` arguments, in its order, with its defaults and meaning (a project that passes them
        swaps the class and nothing else); ``min_available_nodes`` is the sampler's unless it sets its own.
    weighted_by_key, arrayrecord_key, configrecord_key : str
        Flower's weight metric (the metric averages; the model average with ``aggregation="weighted"``) and
        record names.
    train_metrics_aggr_fn, evaluate_metrics_aggr_fn : Callable[[list[RecordDict], str], MetricRecord] | None
        Called as Flower calls them, with the contents of the applied (train) or usable (evaluate) replies;
        ``None``: each metric's weighted mean.
    optimizer : Transform | None
        The server optimiser (``pollen.optim``) applied to the aggregated delta; ``None`` when a method builds
        it from the model layout (``build_optimizer``).
    aggregation : str (default: "mean")
        ``"mean"``: the papers' simple average; ``"weighted"``: by ``weighted_by_key`` (Flower's FedAvg).
    aggregator : str | Aggregator (default: "mean")
        How the round's updates become one delta (:mod:`pollen.strategies.engine.aggregation`): ``"mean"``
        (streamed), ``"median"``, ``"trimmed-mean"`` or ``"majority-vote"``; refused with a reason by methods
        it does not fit (``robust_refusal``).
    uplink : Uplink | None (default: None)
        What clients upload (codec, error feedback, granularity); ``None`` takes full models (any ClientApp).
    parts : EngineParts | None (default: None)
        The other parts, handed in or built with their defaults: sampler (seed, client ids, population),
        screen (outlier rule, factor, window, hard limit), model (buffer keys), transaction (min replies,
        rollback), ledger, accounting, round driver, checkpoint (:class:`EngineParts`).
    """

    #: What this method expects in a training reply; subclasses declare their extras and flags.
    reply_spec: ClassVar[ReplySpec] = ReplySpec()
    #: The aggregate is the (weighted) mean of the deltas: replies are summed as they are read, none
    #: is kept (``aggregate_deltas`` is not called). Methods that need each delta set this False.
    streaming: bool = True
    #: What the method keeps across rounds beyond the base's parts, by attribute name and kind
    #: (:mod:`pollen.strategies.engine.declared`): written, restored and checked by the base.
    state_fields: ClassVar[Mapping[str, str]] = {}
    #: Why a robust aggregator does not fit this method (``None``: its aggregate is a mean of updates).
    robust_refusal: ClassVar[str | None] = None
    #: Why the buffered asynchronous driver does not fit this method (``None``: it does).
    async_refusal: ClassVar[str | None] = None
    #: Why the method cannot take central DP (:mod:`~pollen.strategies.engine.private`); ``None``: it can.
    privacy_refusal: ClassVar[str | None] = None
    #: Why the method cannot aggregate securely (:mod:`~pollen.strategies.engine.secure`); ``None``: it can.
    secagg_refusal: ClassVar[str | None] = None
    #: The jobs behind the replies of the step being read, while an asynchronous driver sets them.
    jobs: StepJobs | None = None

    def __init__(  # noqa: PLR0913 - Flower's FedAvg arguments, then the engine's
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
        optimizer: Transform | None = None,
        aggregation: str = "mean",
        aggregator: str | Aggregator = "mean",
        uplink: Uplink | None = None,
        parts: EngineParts | None = None,
    ) -> None:
        flower = {name: value for name, value in locals().items() if name in FLOWER_ARGUMENTS}
        assemble(
            self,
            flower,
            optimizer=optimizer,
            aggregation=aggregation,
            aggregator=aggregator,
            uplink=uplink,
            parts=parts,
        )
        self._train_started: dict[int, float] = {}

    @classmethod
    def default_parts(cls) -> EngineParts | None:
        """The parts this method builds differently from the engine's defaults (a caller's own still win)."""
        return None

    # ------------------------------------------------------------------ the parts' values, read through
    seed = property(lambda self: self.sampler.seed, doc="The sampler's seed (the run's).")
    min_replies = property(lambda self: self.transaction.min_replies, doc="The transaction's minimum of replies.")
    layout = property(lambda self: self.model.layout, doc="The model's layout (``None`` before round 1).")
    optimizer = property(lambda self: self.server_step.optimizer, doc="The server optimiser.")
    opt_state = property(lambda self: self.server_step.state, doc="The server optimiser's state.")
    node_keys = property(lambda self: self.sampler.node_keys, doc="Node id -> stable client id, as far as known.")

    params = property(lambda self: self.model.params, lambda self, v: setattr(self.model, "params", v))
    buffers = property(lambda self: self.model.buffers, lambda self, v: setattr(self.model, "buffers", v))

    def summary(self) -> None:
        """Log the strategy's settings; inside one of Flower's DP wrappers, refuse first (``flower_wrappers``)."""
        refuse_dp_wrapper(self, optimiser_words(self))
        log_summary(self)

    def extra_summary(self) -> dict[str, Any]:
        """Subclass settings shown by ``summary()``."""
        return {}

    # ------------------------------------------------------------------ hooks
    def build_optimizer(self, layout: ModelLayout) -> Transform:
        """The server optimiser for this model (subclasses that need the layout override this)."""
        if self.optimizer is None:
            raise ValueError(f"{type(self).__name__} has no server optimiser")
        return self.optimizer

    def on_layout(self, layout: ModelLayout) -> None:
        """Hook: the model layout became known (first round, or a checkpoint was loaded)."""

    def check_setup(self, grid: Grid) -> None:
        """What the sampler's plan needs of the connected nodes, checked before the first round (``SetupError``)."""
        self.sampler.check_setup(grid)

    def train_config(self, server_round: int) -> dict[str, Any]:
        """Hook: extra config entries sent to clients (e.g. the codec to upload with)."""
        return {}

    def round_config(self, server_round: int) -> dict[str, Any]:
        """Everything a train message's config adds for this method: :meth:`train_config` and the uplink's."""
        config = dict(self.train_config(server_round))
        for part in (self.uplink, self.privacy):  # what clients are asked to upload, and how privately
            config.update(part.train_config() if part is not None else {})
        return config

    def node_content(self, server_round: int, node: int, shared: RecordDict) -> RecordDict:
        """Hook: what ``node`` receives in this round's train message (default: the ``shared`` content, built once;
        a method that sends a node something of its own returns a new ``RecordDict`` reusing ``shared``'s records)."""
        return shared

    def content_for(self, server_round: int, node: int, shared: RecordDict) -> RecordDict:
        """What ``node`` receives: :meth:`node_content`, with the ledger's word on its last upload if it tells."""
        content = self.node_content(server_round, node, shared)
        if self.secagg is not None:  # the node's part of the round's SecAgg+ setup
            content = with_config(content, self.configrecord_key, self.secagg.node_config(server_round, node))
        return self.ledger.told(content, shared, self.configrecord_key, self.sampler.key(node))

    def reply_spec_for(self, server_round: int) -> ReplySpec:
        """What a final reply of ``server_round`` carries: the method's spec for that round."""
        return self.reply_spec.for_round(server_round)

    def aggregate_deltas(self, server_round: int, updates: list[ClientUpdate]) -> np.ndarray:
        """The round's delta from kept updates (the round aggregate's; a method may stage around it)."""
        return self.round_aggregate.delta(self, server_round, updates)

    def after_round(self, server_round: int, updates: list[ClientUpdate]) -> None:
        """Hook for subclasses that keep per-client state (called after the server step)."""

    # ------------------------------------------------------------------ the model
    def _adopt_global_model(self, arrays: ArrayRecord) -> None:
        """Take the global model Flower hands back; build the optimiser when the layout is new."""
        if self.model.adopt(arrays):
            for part in (self.privacy, self.secagg):  # a part whose guarantee cannot cover float buffers refuses them
                if part is not None:
                    part.check_layout(self.layout, type(self).__name__)
            self.server_step.start(self.build_optimizer(self.layout), self.layout.dim)
            self.on_layout(self.layout)
            layout, name = self.layout, type(self).__name__
            counts = (layout.dim, len(layout.trainable), len(layout.buffers))
            log(INFO, "%s: model has d=%d trainable values in %d tensors, %d buffers", name, *counts)

    def global_arrays(self) -> ArrayRecord:
        """The current global model as an ``ArrayRecord`` in the original key order."""
        return self.model.to_record()

    # ------------------------------------------------------------------ train
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Sample clients and send each its content (default: the global model and the round's config)."""
        refuse_dp_wrapper(self, optimiser_words(self))
        self._adopt_global_model(arrays)
        self._train_started[server_round] = time.perf_counter()
        nodes = self.sampler.train_nodes(server_round, grid, self.fraction_train, self.min_train_nodes)
        self.accounting.round(server_round).sampled = len(nodes)
        if self.privacy is not None:
            self.privacy.sent([self.sampler.key(node) for node in nodes], self.accounting.round(server_round))
        if self.secagg is not None:
            self.secagg.begin(server_round, nodes, self.layout.dim)
        content_for = self._train_content(server_round, arrays, config)
        log(INFO, "configure_train: sampled %d nodes (out of %d)", len(nodes), len(self.sampler.known_clients))
        return self.transport.train_messages(server_round, nodes, content_for)

    def job_messages(
        self, rnd: int, jobs: list, arrays: ArrayRecord, config: ConfigRecord, *, count_in: Any = None
    ) -> list:
        """An asynchronous driver's ``(node, group id)`` jobs of round ``rnd``: a round's content, counted in
        that step (or in ``count_in``: a job of an earlier step sent again after a resume)."""
        refuse_dp_wrapper(self, optimiser_words(self))
        self._adopt_global_model(arrays)
        counted = rnd if count_in is None else count_in
        self._train_started.setdefault(counted, time.perf_counter())
        self.accounting.round(counted).sampled += len(jobs)
        if self.privacy is not None:
            self.privacy.sent([self.sampler.key(node) for node, _ in jobs], self.accounting.round(counted))
        return self.transport.job_messages(counted, jobs, self._train_content(rnd, arrays, config))

    def _train_content(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord) -> Callable:
        """What a node's train message of ``server_round`` carries: the model and the round's config, shared."""
        config = train_config(config, server_round, self.layout.buffer_keys, self.round_config(server_round))
        shared = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: config})
        return lambda node: self.content_for(server_round, node, shared)

    def exchange(self, server_round: int, grid: Grid, contents: Mapping[int, RecordDict], **how: Any) -> list[Message]:
        """A mid-round exchange (:meth:`Transport.exchange`; ``how``: its ``phase``, ``timeout``, ``message_type``)."""
        return self.transport.exchange(server_round, grid, contents, **how)

    def collect(
        self,
        server_round: int,
        replies: Iterable[Message],
        *,
        phase: str = TRAIN_PHASE,
        spec: ReplySpec | None = None,
        sink: Callable[[ClientUpdate], None] | None = None,
    ) -> list[ClientUpdate]:
        """Read every reply of ``phase`` once against ``spec`` (default: :meth:`reply_spec_for`).

        See :meth:`ReplyCollector.read`: bytes counted, untrusted replies rejected with a reason,
        silent nodes counted as failures; with a ``sink`` each update is streamed into it.
        """
        assert self.layout is not None and self.params is not None
        spec = self.reply_spec_for(server_round) if spec is None else spec
        return self.replies.read(
            server_round,
            replies,
            phase=phase,
            spec=spec,
            layout=self.layout,
            params=self.params,
            arrayrecord_key=self.arrayrecord_key,
            weighted_by_key=self.weighted_by_key,
            weight_required=spec.weight or self.aggregation == "weighted",
            max_abs=self.screen.max_abs,
            scratch=self.server_step.scratch(self.layout.dim) if sink is not None else None,
            sink=sink,
            jobs=self.jobs if phase == TRAIN_PHASE else None,
        )

    def screened(self, server_round: int, updates: list[ClientUpdate]) -> list[ClientUpdate]:
        """The kept updates that pass the outlier screen; outliers are failures with a reason."""
        return self.screen.filter(
            updates, lambda u, why: self.replies.refuse(server_round, u.node_id, why), f"round {server_round}"
        )

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Read and screen the replies (streamed into the round's sink when the screen has a history to judge
        by), then settle the round: aggregate, one server step, commit or roll back (:meth:`apply_updates`)."""
        if self.secagg is not None:  # the round's sum was taken in mid_round's exchanges
            survivors, secure_mean = self.secagg.finish(server_round)
            return self.apply_updates(server_round, survivors, secure_mean)
        phase = self.replies.phase_of(server_round)
        self.screen.set_model_norm(float(np.linalg.norm(self.params)) if self.params is not None else 0.0)
        kinds = screened_kinds(self.reply_spec_for(server_round), self.layout)
        streamed = self.screen.streaming(kinds) if self.streaming and self.aggregator.streams else None
        if streamed is None:
            updates = self.collect(server_round, replies, phase=phase)
            return self.apply_updates(server_round, self.screened(server_round, updates))
        running = self.round_aggregate.sink(self, server_round, streamed.bound)
        sink = records_first(self.screen, streamed.record_bounds, running, streamed)
        updates = self.collect(server_round, replies, phase=phase, sink=sink)
        rejected = streamed.settle(lambda u, why: self.replies.refuse(server_round, u.node_id, why), running.admit)
        result = self.apply_updates(server_round, [u for u in updates if id(u) not in rejected], running)
        self.screen.drop_stale(streamed, f"round {server_round}")  # the next round judges itself, as round 1
        return result

    def apply_updates(
        self, server_round: int, updates: list[ClientUpdate], running: ScreenedSink | None = None
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Aggregate already-read (and screened) updates and settle the round's transaction.

        ``aggregate_train`` calls it with the replies it read; a method whose round ends with
        updates the server assembled itself (HA-Fed's mixed models) calls it directly.
        """
        stats = self.accounting.round(server_round)
        stats.count_uploads(updates, self.arrayrecord_key, self.layout.dim)
        log(INFO, "aggregate_train: %d usable replies, %d failures", len(updates), stats.failures)
        if self.ledger.keep:
            sent_round = self.jobs.sent_round if self.jobs is not None else None
            self.ledger.refuse(server_round, self.replies.refused(server_round), sent_round)
            self.transaction.stage(server_round, lambda: self.ledger.record(server_round, updates))
        self.transaction.stage(
            server_round, lambda: self.screen.observe([u.norm for u in updates], [u.record_norms for u in updates])
        )
        outcome = self.transaction.settle(
            server_round,
            updates,
            lambda: self._server_step(server_round, updates, running),
            saved=lambda: model_saved(self.model, self.server_step),
        )
        outcome.report(stats, server_round, bool(updates))
        applied = outcome.applied
        if applied:
            stats.count_grad_evals([u.metrics for u in applied])
            self.screen.count_clipped(server_round, applied)
        stats.train_seconds = time.perf_counter() - self._train_started.pop(server_round, time.perf_counter())
        self.after_round(server_round, applied)
        self.replies.forget(server_round)
        self.transport.forget(server_round)
        if not applied:
            return None, None
        # after the round's bookkeeping: a user's function that raises leaves a finished round behind
        metrics = round_metrics.train_metrics(applied, self.train_metrics_aggr_fn, self.weighted_by_key)
        stats.train_metrics = {**dict(metrics or {}), **stats.train_metrics}  # with what after_round noted
        return self.model.returned(self.global_arrays()), metrics

    def _server_step(self, server_round: int, updates: list[ClientUpdate], running: ScreenedSink | None) -> None:
        """Aggregate, step, average buffers (inside the round's transaction: writes go to spare arrays)."""
        delta = running.mean() if running is not None else self.aggregate_deltas(server_round, updates)
        if self.jobs is not None:  # an asynchronous step: its rule may scale the learning rate (FADAS)
            self.server_step.lr_scale = self.jobs.lr_scale([u.node_id for u in updates])
        self.apply_server_step(server_round, delta)
        with_buffers = [u for u in updates if u.buffers]
        if with_buffers:
            weights = weights_of(with_buffers, weighted=self.aggregation == "weighted")
            self.model.average_buffers([u.buffers for u in with_buffers], weights)
        if not all_finite(self.params):
            raise FloatingPointError("the server step produced NaN or Inf parameters")

    def apply_server_step(self, server_round: int, delta: np.ndarray) -> None:
        """``x <- x + step`` with the optimiser's step for the aggregated delta (double-buffered)."""
        self.params = self.server_step.apply(self.params, delta)

    # ------------------------------------------------------------------ evaluate
    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Sample clients for federated evaluation on their held-out data."""
        if self.fraction_evaluate == 0.0:
            return []
        nodes = self.sampler.sample(grid, self.fraction_evaluate, self.min_evaluate_nodes)
        config = ConfigRecord({**config, protocol.CFG_SERVER_ROUND: server_round})
        return self.transport.evaluate_messages(
            server_round, nodes, RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: config})
        )

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """The round's evaluation metrics from the usable replies (:mod:`~pollen.strategies.engine.metrics`);
        failed or malformed replies are skipped with a reason."""
        usable = self.replies.evaluation_metrics(server_round, replies, self.weighted_by_key, self.screen.metric_bounds)
        aggregated = round_metrics.evaluate_metrics(usable, self.evaluate_metrics_aggr_fn, self.weighted_by_key)
        self.accounting.round(server_round).evaluate_metrics = dict(aggregated or {})
        return aggregated

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Everything the strategy holds: its collaborators' parts and the fields it declares."""
        return strategy_state(self)

    def load_state_dict(self, state: dict[str, Any], *, server_round: int | None = None) -> None:
        """Restore what ``state_dict()`` wrote (same class and model), every field checked before any changes.

        ``server_round`` (the checkpoint's round) bounds the rounds the state may hold; a refusal is a
        ``ValueError`` naming the field, and then nothing of the strategy has changed.
        """
        restore_strategy_state(self, state, server_round=server_round)

    def check_loaded(self, values: Mapping[str, Any], layout: ModelLayout | None, server_round: int | None) -> None:
        """Hook: raise :class:`~pollen.core.state_fields.StateError` when the checked declared ``values`` of a
        state being loaded break an invariant of the method (called before anything is set)."""
