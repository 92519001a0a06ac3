"""The shared base of pollen's server strategies (Flower Message API): one engine of parts.

``AdaptiveStrategy`` wires the parts every adaptive federated method needs; each part has one job
and a public surface, and no part touches another's private state:

- :class:`~pollen.strategies.engine.model.GlobalModel`: the global model as one flat float32 vector of
  trainable values plus the buffers (averaged, never fed to the optimiser), in and out of records;
- :class:`~pollen.strategies.engine.sampling.ClientSampler`: seeded sampling keyed by stable client ids;
- :class:`~pollen.strategies.engine.messages.Transport`: train, evaluate and mid-round messages, bytes;
- :class:`~pollen.strategies.engine.collector.ReplyCollector`: who was asked in each phase, one reply each,
  every reply read once against the method's :class:`~pollen.strategies.engine.replies.ReplySpec`,
  rejections with reasons;
- :class:`~pollen.strategies.engine.screening.UpdateScreen` and the sinks of :mod:`pollen.strategies.engine.sinks`
  (the running mean; FedAdaVR's table sink): outliers out, the round's aggregate in;
- :class:`~pollen.strategies.engine.step.ServerStep`: the server optimiser (:mod:`pollen.optim` transform)
  stepped as a transaction;
- :class:`~pollen.strategies.engine.uplink.Uplink` (optional): what clients upload;
- an :class:`~pollen.aggregate.Aggregator` (:mod:`pollen.strategies.engine.aggregation`): the mean (streamed) or a
  robust aggregate of the round's kept updates (median, trimmed mean, majority vote);
- :class:`~pollen.strategies.engine.accounting.Accounting`: per-round numbers measured on the wire;
- state by declaration (:mod:`pollen.strategies.engine.declared`): the parts and the fields a method
  declares in ``state_fields`` are written and restored for resume.

A method overrides small steps: ``train_config`` (extra client config), ``node_content`` (what one
node receives), ``mid_round`` (more exchanges), ``aggregate_deltas`` / ``round_sink`` (how updates
become one delta), ``after_round`` (per-client bookkeeping). Sign convention: a client's update is
``delta = x_local - x_global`` (points downhill); the server *adds* the optimiser's step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from logging import INFO, WARNING
from typing import Any, ClassVar

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from pollen.core.layout import ModelLayout
from pollen.optim import OptState, Transform
from pollen.strategies.engine.accounting import Accounting
from pollen.strategies.engine.collector import TRAIN_PHASE, ReplyCollector, reason_of
from pollen.strategies.engine.declared import restore_strategy_state, strategy_state
from pollen.strategies.engine.flower_wrappers import refuse_dp_wrapper
from pollen.strategies.engine.ledger import AppliedLedger
from pollen.strategies.engine.model import GlobalModel
from pollen.strategies.engine.replies import ClientUpdate, ReplyRejected, ReplySpec, screened_kinds
from pollen.strategies.engine.aggregation import Aggregator, check_codec, check_fits, make_aggregator, robust_delta
from pollen.strategies.engine.rounds import RoundLoop
from pollen.strategies.engine.sampling import ClientSampler
from pollen.strategies.engine.screening import DEFAULT_MAX_ABS, StreamedRound, UpdateScreen, all_finite
from pollen.strategies.engine.sinks import (
    AGGREGATIONS,
    RunningMean,
    ScreenedSink,
    aggregate_metrics,
    mean_of,
    records_first,
    weights_of,
)
from pollen.strategies.engine.step import ServerStep
from pollen.strategies.engine.messages import Transport
from pollen.strategies.engine.uplink import Uplink
from pollen.wire import protocol

__all__ = [
    "AGGREGATIONS",
    "FLOWER_ARGUMENTS",
    "OUTLIER_FACTOR",
    "OUTLIER_RULE",
    "OUTLIER_WINDOW",
    "TRAIN_PHASE",
    "AdaptiveStrategy",
    "ClientUpdate",
    "MetricsAggregationFn",
    "ReplyRejected",
    "ReplySpec",
    "RunningMean",
    "ScreenedSink",
    "aggregate_metrics",
]

#: Flower's metric aggregation function (``FedAvg``'s ``train_metrics_aggr_fn`` / ``evaluate_metrics_aggr_fn``):
#: the replies' RecordDicts and the weight's metric name in, the round's MetricRecord out.
MetricsAggregationFn = Callable[[list[RecordDict], str], MetricRecord]
#: Flower's ``FedAvg`` arguments, in its order: every pollen strategy takes them first, with their defaults.
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
#: The outlier screen's defaults, written once for every strategy's signature.
OUTLIER_RULE = "reject"
OUTLIER_FACTOR = 10.0
OUTLIER_WINDOW = 5


def _check_fraction(name: str, value: float, allow_zero: bool) -> None:
    low_ok = value >= 0.0 if allow_zero else value > 0.0
    if not (low_ok and value <= 1.0):
        interval = "[0, 1]" if allow_zero else "(0, 1]"
        raise ValueError(f"{name}={value!r} is out of range; allowed: a number in {interval}")


def _check_arguments(  # noqa: PLR0913 - the constructor's, checked in one place
    fraction_train: float,
    fraction_evaluate: float,
    min_train_nodes: int,
    min_evaluate_nodes: int,
    min_available_nodes: int,
    aggregation: str,
    min_replies: int,
    uplink: Uplink | None,
) -> None:
    """``ValueError`` naming the argument, its value and what is allowed, for the base's settings."""
    _check_fraction("fraction_train", fraction_train, allow_zero=False)
    if not isinstance(min_replies, int) or isinstance(min_replies, bool) or min_replies < 1:
        raise ValueError(f"min_replies={min_replies!r} is invalid; allowed: an integer >= 1")
    _check_fraction("fraction_evaluate", fraction_evaluate, allow_zero=True)
    for name, value in (
        ("min_train_nodes", min_train_nodes),
        ("min_evaluate_nodes", min_evaluate_nodes),
        ("min_available_nodes", min_available_nodes),
    ):
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"{name}={value!r} is invalid; allowed: an integer >= 0")
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation={aggregation!r} is unknown; allowed: {', '.join(AGGREGATIONS)}")
    if uplink is not None and not isinstance(uplink, Uplink):
        raise ValueError(f"uplink={uplink!r} is not an Uplink; allowed: pollen.strategies.Uplink(...) or None")


def _check_flower_arguments(
    weighted_by_key: str,
    arrayrecord_key: str,
    configrecord_key: str,
    train_metrics_aggr_fn: MetricsAggregationFn | None,
    evaluate_metrics_aggr_fn: MetricsAggregationFn | None,
) -> None:
    """``ValueError`` naming the argument, its value and what is allowed, for Flower's keys and functions."""
    for name, value in (
        ("weighted_by_key", weighted_by_key),
        ("arrayrecord_key", arrayrecord_key),
        ("configrecord_key", configrecord_key),
    ):
        if not isinstance(value, str) or not value:
            raise ValueError(f"{name}={value!r} is invalid; allowed: a non-empty string")
    for name, value in (("arrayrecord_key", arrayrecord_key), ("configrecord_key", configrecord_key)):
        if value.startswith(protocol.CLIENT_STATE_PREFIX):
            raise ValueError(
                f"{name}={value!r} is in pollen's own record names ('{protocol.CLIENT_STATE_PREFIX}...'); "
                "allowed: any other name"
            )
    if arrayrecord_key == configrecord_key:
        raise ValueError(
            f"arrayrecord_key and configrecord_key are both {arrayrecord_key!r}; allowed: two different names "
            "(a message holds both records)"
        )
    for name, fn in (
        ("train_metrics_aggr_fn", train_metrics_aggr_fn),
        ("evaluate_metrics_aggr_fn", evaluate_metrics_aggr_fn),
    ):
        if fn is not None and not callable(fn):
            raise ValueError(
                f"{name}={fn!r} is not callable; allowed: a function (list[RecordDict], str) -> MetricRecord, or None"
            )


class AdaptiveStrategy(RoundLoop, Strategy):
    """Base of pollen's strategies: flat-vector state, validated replies, bytes, state dict.

    The first ten arguments are Flower's ``FedAvg``'s, in its order, with its defaults and its meaning
    (a project that passes them swaps the class and nothing else); the rest are keyword-only.

    Parameters
    ----------
    fraction_train : float (default: 1.0)
        Fraction of connected nodes sampled for training each round, in (0, 1]: ``max(floor(fraction_train
        * n), min_train_nodes)`` of them (``n``: the connected nodes, or ``population``).
    fraction_evaluate : float (default: 1.0)
        Fraction of nodes sampled for federated evaluation, in [0, 1]; 0 skips it.
    min_train_nodes : int (default: 2)
        Minimum number of nodes sampled for training.
    min_evaluate_nodes : int (default: 2)
        Minimum number of nodes sampled for evaluation.
    min_available_nodes : int (default: 2)
        Minimum number of connected nodes before a round starts (sampling waits for them).
    weighted_by_key : str (default: "num-examples")
        The metric of each reply's MetricRecord that weighs it: in the averages of its metrics, in the
        model average when ``aggregation="weighted"``, and the name handed to the two metric
        aggregation functions. (pollen's default ``aggregation="mean"`` averages models unweighted, as
        the papers do.)
    arrayrecord_key : str (default: "arrays")
        Name of the ArrayRecord (the global model) in train and evaluate messages, and of the trained
        model in a reply (a reply with one ArrayRecord under another name is read too, as Flower does).
    configrecord_key : str (default: "config")
        Name of the ConfigRecord in train and evaluate messages.
    train_metrics_aggr_fn : Callable[[list[RecordDict], str], MetricRecord] | None (default: None)
        As Flower's: called as ``fn(replies, weighted_by_key)`` with the RecordDict of each reply whose
        update the round applied (its MetricRecords and ConfigRecords; the arrays were read as they
        came and are not kept), and its MetricRecord is the round's train metrics (``Result``, results
        files). ``None``: the ``weighted_by_key``-weighted mean of each metric every reply reports.
    evaluate_metrics_aggr_fn : Callable[[list[RecordDict], str], MetricRecord] | None (default: None)
        As Flower's: called as ``fn(replies, weighted_by_key)`` with the content of each usable
        evaluation reply; its MetricRecord is the round's federated evaluation metrics. ``None``: the
        ``weighted_by_key``-weighted mean of each metric every reply reports.
    optimizer : Transform | None
        The server optimiser (``pollen.optim``, e.g. ``amsgrad(...)`` or ``make_server_optimizer(name, ...)``)
        applied to the aggregated delta; ``None`` when a subclass builds it from the model layout
        (``build_optimizer``).
    aggregation : str (default: "mean")
        ``"mean"``: the papers' simple average ``(1/|S_t|) sum_i delta_i``;
        ``"weighted"``: weighted by ``weighted_by_key`` (Flower's FedAvg behaviour).
    aggregator : str | Aggregator (default: "mean")
        How the round's updates become one delta (:mod:`pollen.strategies.engine.aggregation`): ``"mean"``
        (streamed, as ``aggregation`` says), ``"median"``, ``"trimmed-mean"`` (or
        ``pollen.aggregate.TrimmedMean(beta)``) or ``"majority-vote"`` (scaled-sign uploads only). A
        robust one keeps the round's updates, gives each client one vote (``aggregation="mean"``
        only) and is refused with a reason by methods it does not fit (``robust_refusal``).
    uplink : Uplink | None (default: None)
        What clients upload (:class:`~pollen.strategies.engine.uplink.Uplink`: codec, error feedback,
        granularity); ``None`` asks for nothing and takes full models (any Flower ClientApp).
    buffer_keys : list[str] | None (default: None)
        Names of non-trainable arrays; ``None`` infers them (integer dtypes and
        PyTorch normalisation statistics).
    seed : int (default: 0)
        Seed of client sampling (and of the sampler's saved state).
    identify_clients : bool (default: False)
        Ask each new node once for its stable client id (pollen's ClientApp answers
        ``query.pollen_identify``; other ClientApps fall back to the node id). Stable
        ids make sampling reproducible across runs and survive a SuperNode
        reconnecting. Off by default so a ClientApp without that action sees no
        query it cannot answer; pollen's app turns it on.
    population : int (default: 0)
        0: one client per connected node. N > 0: N logical clients (``partition-0`` ..
        ``partition-<N-1>``) played by the connected nodes, bound anew each round; the
        fractions are of N and each message names the partition its node plays
        (:mod:`pollen.strategies.engine.sampling`). Needs pollen's ClientApp (or one that reads
        ``pollen.partition``) and at least as many nodes as a round samples.
    outlier_rule : str (default: "reject")
        Outlier screen of update norms (:mod:`pollen.strategies.engine.screening`): ``"reject"``,
        ``"clip"`` or ``"off"``.
    outlier_factor : float (default: 10.0)
        The screen's bound is this factor times the median accepted norm of the last
        ``outlier_window`` rounds, > 1.
    outlier_window : int (default: 5)
        Rounds of accepted norms the screen's median is taken over, >= 1.
    max_abs_update : float (default: 1e15)
        Hard limit on any coordinate of an update (always on).
    min_replies : int (default: 1)
        Fewer usable replies than this and the round is skipped (model unchanged), with a reason.
    transactional : bool (default: True)
        Put the model and optimiser state of before the server step back if the step fails or
        produces non-finite values (the round then counts as failed). Nothing is copied for it: the
        step writes the new model and optimiser state into spare arrays and swaps them in, so going
        back is keeping the old references.
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
        buffer_keys: Iterable[str] | None = None,
        seed: int = 0,
        identify_clients: bool = False,
        population: int = 0,
        outlier_rule: str = OUTLIER_RULE,
        outlier_factor: float = OUTLIER_FACTOR,
        outlier_window: int = OUTLIER_WINDOW,
        max_abs_update: float = DEFAULT_MAX_ABS,
        min_replies: int = 1,
        transactional: bool = True,
    ) -> None:
        _check_arguments(
            fraction_train,
            fraction_evaluate,
            min_train_nodes,
            min_evaluate_nodes,
            min_available_nodes,
            aggregation,
            min_replies,
            uplink,
        )
        _check_flower_arguments(
            weighted_by_key, arrayrecord_key, configrecord_key, train_metrics_aggr_fn, evaluate_metrics_aggr_fn
        )
        self.fraction_train = fraction_train
        self.fraction_evaluate = fraction_evaluate
        self.min_train_nodes = min_train_nodes
        self.min_evaluate_nodes = min_evaluate_nodes
        self.min_available_nodes = min_available_nodes
        self.aggregation = aggregation
        self.weighted_by_key = weighted_by_key
        self.seed = seed
        self.arrayrecord_key = arrayrecord_key
        self.configrecord_key = configrecord_key
        self.train_metrics_aggr_fn = train_metrics_aggr_fn
        self.evaluate_metrics_aggr_fn = evaluate_metrics_aggr_fn
        self.min_replies = min_replies
        self.transactional = transactional
        self.uplink = uplink
        self.aggregator = make_aggregator(aggregator)
        check_fits(self.aggregator, type(self).__name__, aggregation=aggregation, refusal=self.robust_refusal)
        check_codec(self.aggregator, type(self).__name__, self.upload_codec())

        self.server_step = ServerStep(optimizer)
        self.model = GlobalModel(buffer_keys)
        self.sampler = ClientSampler(
            seed=seed, min_available_nodes=min_available_nodes, identify_clients=identify_clients, population=population
        )
        self.screen = UpdateScreen(
            rule=outlier_rule, factor=outlier_factor, window=outlier_window, max_abs=max_abs_update
        )
        self.accounting = Accounting()
        self.replies = ReplyCollector(self.sampler, lambda: self.accounting)
        self.ledger = AppliedLedger()
        self.transport = Transport(self.replies, lambda: self.accounting, configrecord_key, self.sampler.partition)
        self._train_started: dict[int, float] = {}

    # ------------------------------------------------------------------ the model, through its collaborator
    @property
    def layout(self) -> ModelLayout | None:
        return self.model.layout

    @property
    def params(self) -> np.ndarray | None:
        return self.model.params

    @params.setter
    def params(self, value: np.ndarray) -> None:
        self.model.params = value

    @property
    def buffers(self) -> dict[str, np.ndarray]:
        return self.model.buffers

    @buffers.setter
    def buffers(self, value: dict[str, np.ndarray]) -> None:
        self.model.buffers = value

    @property
    def optimizer(self) -> Transform | None:
        return self.server_step.optimizer

    @property
    def opt_state(self) -> OptState | None:
        return self.server_step.state

    @property
    def node_keys(self) -> dict[int, str]:
        """Node id -> stable client id, as far as known (kept by the sampler)."""
        return self.sampler.node_keys

    # ------------------------------------------------------------------ summary
    def summary(self) -> None:
        """Log the strategy's settings; inside one of Flower's DP wrappers, refuse first (``flower_wrappers``)."""
        refuse_dp_wrapper(self, self._optimiser_words())
        log(INFO, "\t├──> %s settings:", type(self).__name__)
        if self.optimizer is not None:
            log(INFO, "\t│\t├── server optimiser: %s %s", self.optimizer.name, self.optimizer.hyperparameters())
        if self.uplink is not None:
            log(INFO, "\t│\t├── uplink: %s", self.uplink.describe())
        for key, value in self.extra_summary().items():
            log(INFO, "\t│\t├── %s: %s", key, value)
        log(INFO, "\t│\t├── aggregation: %s (weight key '%s')", self.aggregation, self.weighted_by_key)
        log(INFO, "\t│\t├── aggregator: %s", self.aggregator.describe())
        log(
            INFO,
            "\t│\t└── sampling: train %.2f (min %d) | evaluate %.2f (min %d) | seed %d",
            self.fraction_train,
            self.min_train_nodes,
            self.fraction_evaluate,
            self.min_evaluate_nodes,
            self.seed,
        )

    def _optimiser_words(self) -> str:
        return "its server optimiser" + (f" ({self.optimizer.name})" if self.optimizer is not None else "")

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

    def sample_train(self, server_round: int, grid: Grid) -> list[int]:
        """Hook: the nodes that train this round (default: ``fraction_train`` of them, uniformly)."""
        return self.sampler.sample(grid, self.fraction_train, self.min_train_nodes)

    def train_config(self, server_round: int) -> dict[str, Any]:
        """Hook: extra config entries sent to clients (e.g. the codec to upload with)."""
        return {}

    def round_config(self, server_round: int) -> dict[str, Any]:
        """Everything a train message's config adds for this method: :meth:`train_config` and the uplink's."""
        config = dict(self.train_config(server_round))
        if self.uplink is not None:
            config.update(self.uplink.train_config())
        return config

    def node_content(self, server_round: int, node: int, shared: RecordDict) -> RecordDict:
        """Hook: what ``node`` receives in this round's train message.

        The default sends every node the same ``shared`` content (the global model and the
        round's config, built once). A method that sends a node something of its own (a
        compressed increment, a moment only when it changed, its cluster's relay) returns a
        new ``RecordDict`` here; records it reuses from ``shared`` are not copied.
        """
        return shared

    def reports_applied(self) -> bool:
        """Whether each client is told what the server applied of its last upload (:mod:`~pollen.strategies.engine.ledger`).

        On for error-fed uploads: the client puts whatever was not applied (a rejected, lost, skipped,
        rolled-back or clipped upload) back into its residual, so error feedback loses nothing.
        """
        return self.uplink is not None and self.uplink.error_feedback and self.uplink.codec != "none"

    def keeps_ledger(self) -> bool:
        """Whether the ledger records committed uploads (whenever clients are told; a method may need it anyway)."""
        return self.reports_applied()

    def content_for(self, server_round: int, node: int, shared: RecordDict) -> RecordDict:
        """What ``node`` receives: :meth:`node_content`, with the ledger's word on its last upload if kept."""
        content = self.node_content(server_round, node, shared)
        if not self.reports_applied():
            return content
        if content is shared:
            content = RecordDict(dict(shared.items()))
        config = ConfigRecord(dict(content.config_records[self.configrecord_key]))
        config.update(self.ledger.config_for(self.sampler.key(node)))
        content[self.configrecord_key] = config
        return content

    def reply_spec_for(self, server_round: int) -> ReplySpec:
        """Hook: what a final reply of ``server_round`` carries (default: :attr:`reply_spec`)."""
        return self.reply_spec

    def upload_codec(self) -> str:
        """Hook: the codec every reply's update is a decoding of (a method with its own uplink says its own)."""
        return self.uplink.codec if self.uplink is not None else "none"

    def needs_weights(self) -> bool:
        """Whether a reply must carry a positive ``num-examples`` (weighted aggregation needs it)."""
        return self.aggregation == "weighted"

    def round_sink(self, server_round: int, bound: float) -> ScreenedSink:
        """Hook: what takes each screened update of a streamed round (default: the running mean of deltas)."""
        return RunningMean(self.layout.dim, self.screen, bound, weighted=self.aggregation == "weighted")

    def aggregate_deltas(self, server_round: int, updates: list[ClientUpdate]) -> np.ndarray:
        """Hook: the round's delta from kept updates (default: the mean, as the streaming path computes it,
        or the strategy's robust aggregator)."""
        if not self.aggregator.streams:
            return robust_delta(self.aggregator, [u.delta for u in updates if u.delta is not None], self.layout)
        return mean_of(updates, self.layout.dim, self.screen, weighted=self.aggregation == "weighted")

    def after_round(self, server_round: int, updates: list[ClientUpdate]) -> None:
        """Hook for subclasses that keep per-client state (called after the server step)."""

    # ------------------------------------------------------------------ the model
    def _adopt_global_model(self, arrays: ArrayRecord) -> None:
        """Take the global model Flower hands back; build the optimiser when the layout is new."""
        if self.model.adopt(arrays):
            self.server_step.start(self.build_optimizer(self.layout), self.layout.dim)
            self.on_layout(self.layout)
            log(
                INFO,
                "%s: model has d=%d trainable values in %d tensors, %d buffers",
                type(self).__name__,
                self.layout.dim,
                len(self.layout.trainable),
                len(self.layout.buffers),
            )

    def global_arrays(self) -> ArrayRecord:
        """The current global model as an ``ArrayRecord`` in the original key order."""
        return self.model.to_record()

    # ------------------------------------------------------------------ train
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Sample clients and send each its content (default: the global model and the round's config)."""
        refuse_dp_wrapper(self, self._optimiser_words())
        self._adopt_global_model(arrays)
        stats = self.accounting.round(server_round)
        self._train_started[server_round] = time.perf_counter()
        nodes = self.sample_train(server_round, grid)
        stats.sampled = len(nodes)
        config = ConfigRecord(dict(config))
        config[protocol.CFG_SERVER_ROUND] = server_round
        if self.layout.buffer_keys:  # Flower cannot count the bytes of an empty string
            config[protocol.CFG_BUFFER_KEYS] = protocol.join_keys(self.layout.buffer_keys)
        for key, value in self.round_config(server_round).items():
            config[key] = value
        shared = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: config})
        messages = self.transport.train_messages(
            server_round, nodes, lambda node: self.content_for(server_round, node, shared)
        )
        log(INFO, "configure_train: sampled %d nodes (out of %d)", len(nodes), len(self.sampler.known_clients))
        return messages

    def exchange(
        self, server_round: int, grid: Grid, contents: Mapping[int, RecordDict], *, phase: str, timeout: float
    ) -> list[Message]:
        """A mid-round exchange of ``phase`` (see :meth:`Transport.exchange`)."""
        return self.transport.exchange(server_round, grid, contents, phase=phase, timeout=timeout)

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
        return self.replies.read(
            server_round,
            replies,
            phase=phase,
            spec=self.reply_spec_for(server_round) if spec is None else spec,
            layout=self.layout,
            params=self.params,
            arrayrecord_key=self.arrayrecord_key,
            weighted_by_key=self.weighted_by_key,
            weight_required=self.needs_weights(),
            max_abs=self.screen.max_abs,
            scratch=self.server_step.scratch(self.layout.dim) if sink is not None else None,
            sink=sink,
        )

    def screened(self, server_round: int, updates: list[ClientUpdate]) -> list[ClientUpdate]:
        """The kept updates that pass the outlier screen; outliers are failures with a reason."""
        return self.screen.filter(
            updates, lambda u, why: self.replies.refuse(server_round, u.node_id, why), f"round {server_round}"
        )

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validate and screen replies, aggregate their deltas, take one server optimiser step.

        Nothing of the strategy's state changes before every reply was judged; if the step fails
        anyway (or yields non-finite values) the state is put back and the round counts as failed.
        """
        phase = self.replies.phase_of(server_round)
        self.screen.set_model_norm(float(np.linalg.norm(self.params)) if self.params is not None else 0.0)
        bound = self.screen.bound() if self.streaming and self.aggregator.streams else None
        kinds = screened_kinds(self.reply_spec_for(server_round), self.layout) if bound is not None else []
        record_bounds = self.screen.record_bounds(kinds) if bound is not None else None
        if bound is not None and record_bounds is not None:  # every screened kind has a history: stream
            running = self.round_sink(server_round, bound)
            streamed = StreamedRound(self.screen, bound, record_bounds)
            updates = self.collect(
                server_round, replies, phase=phase, sink=records_first(self.screen, record_bounds, running, streamed)
            )
            rejected = streamed.settle(lambda u, why: self.replies.refuse(server_round, u.node_id, why), running.admit)
            updates = [u for u in updates if id(u) not in rejected]
            result = self.apply_updates(server_round, updates, running)
            self.screen.drop_stale(streamed, f"round {server_round}")  # the next round judges itself, as round 1
            return result
        updates = self.screened(server_round, self.collect(server_round, replies, phase=phase))
        return self.apply_updates(server_round, updates)

    def apply_updates(
        self, server_round: int, updates: list[ClientUpdate], running: ScreenedSink | None = None
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Aggregate already-read (and screened) updates and take the round's server step.

        ``aggregate_train`` calls it with the replies it read; a method whose round ends with
        updates the server assembled itself (HA-Fed's mixed models) calls it directly.
        """
        stats = self.accounting.round(server_round)
        stats.replies = len(updates)
        for update in updates:
            if update_bytes := _update_bytes(update, self.arrayrecord_key):
                stats.uplink_update_bytes += update_bytes
                stats.uplink_fp32_bytes += 4 * self.layout.dim
        log(INFO, "aggregate_train: %d usable replies, %d failures", len(updates), stats.failures)
        applied: list[ClientUpdate] = []
        if len(updates) < self.min_replies:
            reason = f"{len(updates)} usable replies, fewer than min_replies={self.min_replies}"
            if updates:
                stats.fail(f"round skipped: {reason}")
            log(WARNING, "aggregate_train: round %d skipped (%s); the model is unchanged", server_round, reason)
        else:
            try:
                self._server_step(server_round, updates, running)
                applied = updates
            except Exception as err:  # noqa: BLE001 - the round fails, the run goes on with the old state
                stats.fail(f"server step failed and was rolled back: {reason_of(err)}")
                log(
                    WARNING,
                    "aggregate_train: server step of round %d failed (%s); state rolled back",
                    server_round,
                    err,
                )
        if self.keeps_ledger():
            self.ledger.refuse(server_round, self.replies.refused(server_round))
        if applied:
            if self.keeps_ledger():
                self.ledger.record(server_round, applied)
            self.screen.observe([u.norm for u in applied], [u.record_norms for u in applied])
            stats.count_grad_evals([u.metrics for u in applied])
        stats.train_seconds = time.perf_counter() - self._train_started.pop(server_round, time.perf_counter())
        self.after_round(server_round, applied)
        self.replies.forget(server_round)
        self.transport.forget(server_round)
        if not applied:
            return None, None
        # after the round's bookkeeping: a user's function that raises leaves a finished round behind
        metrics = self.train_metrics(applied)
        stats.train_metrics = {**dict(metrics or {}), **stats.train_metrics}  # with what after_round noted
        return self.model.returned(self.global_arrays()), metrics

    def train_metrics(self, applied: list[ClientUpdate]) -> MetricRecord | None:
        """The round's train metrics from the replies whose updates it applied: ``train_metrics_aggr_fn``'s, as
        Flower calls it, or (``None``) the ``weighted_by_key``-weighted mean of each metric they all report."""
        if self.train_metrics_aggr_fn is not None:
            contents = [u.reply for u in applied if u.reply is not None]
            if not contents:
                return None
            return _checked_metrics("train_metrics_aggr_fn", self.train_metrics_aggr_fn(contents, self.weighted_by_key))
        reported = [u for u in applied if u.metrics is not None]
        return aggregate_metrics([u.metrics for u in reported], [u.num_examples for u in reported])

    def _server_step(self, server_round: int, updates: list[ClientUpdate], running: ScreenedSink | None) -> None:
        """Aggregate, step, average buffers; all or nothing when ``transactional``.

        Nothing is copied to be able to go back: the step writes the new parameters and optimiser
        state into spare arrays (:class:`ServerStep`) and buffer averaging fills a new dict, so a
        failure only puts the references of before back.
        """
        params, opt_state, buffers = self.params, self.opt_state, self.buffers
        self.buffers = dict(buffers)
        try:
            delta = running.mean() if running is not None else self.aggregate_deltas(server_round, updates)
            self.apply_server_step(server_round, delta)
            with_buffers = [u for u in updates if u.buffers]
            if with_buffers:
                weights = weights_of(with_buffers, weighted=self.aggregation == "weighted")
                self.model.average_buffers([u.buffers for u in with_buffers], weights)
            if not all_finite(self.params):
                raise FloatingPointError("the server step produced NaN or Inf parameters")
        except Exception:
            if self.transactional:
                self.server_step.keep(params, opt_state, self.params)
                self.params, self.buffers = params, buffers
            raise

    def apply_server_step(self, server_round: int, delta: np.ndarray) -> None:
        """``x <- x + step`` with the optimiser's step for the aggregated delta (double-buffered)."""
        self.params = self.server_step.apply(self.params, delta)

    def aggregate_weights(self, updates: list[ClientUpdate]) -> np.ndarray:
        """Weight of each update: ``1/M`` (papers) or ``n_i / sum n`` (``aggregation="weighted"``)."""
        return weights_of(updates, weighted=self.aggregation == "weighted")

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
        """The round's evaluation metrics: ``evaluate_metrics_aggr_fn`` on the usable replies' contents, as Flower
        calls it, or (``None``) the ``weighted_by_key``-weighted mean of each metric they all report; failed or
        malformed replies are skipped with a reason."""
        usable = self.replies.evaluation_metrics(server_round, replies, self.weighted_by_key)
        if self.evaluate_metrics_aggr_fn is not None:
            aggregated = _checked_metrics(
                "evaluate_metrics_aggr_fn",
                self.evaluate_metrics_aggr_fn([content for content, _, _ in usable], self.weighted_by_key)
                if usable
                else None,
            )
        else:
            aggregated = aggregate_metrics([record for _, record, _ in usable], [weight for _, _, weight in usable])
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


def _checked_metrics(name: str, value: Any) -> MetricRecord | None:
    """What a user's metric aggregation function returned, if it is what a round reports (Flower's type)."""
    if value is not None and not isinstance(value, MetricRecord):
        raise TypeError(f"{name} returned a {type(value).__name__}; allowed: a flwr.app.MetricRecord or None")
    return value


def _update_bytes(update: ClientUpdate, arrayrecord_key: str) -> int:
    """Bytes of the record(s) carrying the model update of a reply (under any name a reply may use)."""
    names = {protocol.UPDATE_RECORD, arrayrecord_key, update.update_record} - {""}
    return sum(update.record_bytes.get(name, 0) for name in names)
