"""The shared base of pollen's server strategies (Flower Message API).

``AdaptiveStrategy`` does the mechanics every adaptive federated method needs, once:

- keeps the global model as one contiguous float32 vector of trainable parameters
  plus the non-trainable buffers (averaged, never fed to the optimiser),
- samples clients with a seeded :class:`~pollen.strategies.sampling.ClientSampler` keyed by
  stable client ids (per cluster when a method asks),
- sends each sampled node its content through one hook, :meth:`node_content` (default: the
  shared model and config, built once), and counts the bytes of every message sent,
- runs further exchanges inside a round through :meth:`mid_round` / :meth:`exchange`,
- reads every reply once with :func:`~pollen.strategies.replies.read_reply` against the
  method's :class:`~pollen.strategies.replies.ReplySpec` (update, named extras, flags); a reply
  that cannot be trusted is dropped with a logged reason and counted as a failure,
- counts bytes per direction, per record and per round from the records on the wire,
- writes and reads back everything it holds (``state_dict`` / ``load_state_dict``), which the
  round loop (:class:`~pollen.strategies.rounds.RoundLoop`) checkpoints each round for resume.

Subclasses choose the server optimiser and may override the small steps
``aggregate_deltas`` (how client updates become one delta), ``train_config`` (extra config
for clients), ``node_content``, ``mid_round`` and ``after_round``. Sign convention: a
client's update is ``delta = x_local - x_global`` (points downhill); the server *adds* the
optimiser's step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from logging import INFO, WARNING
from typing import Any, ClassVar

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from pollen import protocol
from pollen.layout import ModelLayout
from pollen.optim import OptState, Transform
from pollen.strategies.accounting import Accounting, RoundStats
from pollen.strategies.replies import ClientUpdate, ReplyRejected, ReplySpec, count_records, read_reply
from pollen.strategies.rounds import RoundLoop
from pollen.strategies.sampling import ClientSampler
from pollen.strategies.screening import DEFAULT_MAX_ABS, UpdateScreen, all_finite
from pollen.wire import arrays_to_record, record_to_arrays

AGGREGATIONS = ("mean", "weighted")
TRAIN_PHASE = "train"

__all__ = ["AGGREGATIONS", "AdaptiveStrategy", "ClientUpdate", "ReplyRejected", "ReplySpec", "aggregate_metrics"]


def _check_fraction(name: str, value: float, allow_zero: bool) -> None:
    low_ok = value >= 0.0 if allow_zero else value > 0.0
    if not (low_ok and value <= 1.0):
        interval = "[0, 1]" if allow_zero else "(0, 1]"
        raise ValueError(f"{name}={value!r} is out of range; allowed: a number in {interval}")


def aggregate_metrics(records: list[MetricRecord], weights: list[float]) -> MetricRecord | None:
    """Weighted average of each numeric metric present in every record.

    Lists are skipped; a non-finite value (a client reporting NaN) is left out of that metric's
    average instead of dropping the metric for everyone.
    """
    if not records:
        return None
    common = set.intersection(*(set(record.keys()) for record in records))
    out = MetricRecord()
    for key in sorted(common):
        pairs = [
            (w, float(record[key]))
            for w, record in zip(weights, records)
            if isinstance(record[key], (int, float)) and not isinstance(record[key], bool) and np.isfinite(record[key])
        ]
        total = float(sum(w for w, _ in pairs))
        if pairs and total > 0:
            value = float(sum(w * v for w, v in pairs) / total)
            if np.isfinite(value):
                out[key] = value
    return out


class AdaptiveStrategy(RoundLoop, Strategy):
    """Base of pollen's strategies: flat-vector state, validated replies, bytes, state dict.

    Parameters
    ----------
    optimizer : Transform | None
        The server optimiser (``pollen.optim``, e.g. ``amsgrad(...)`` or ``make_server_optimizer(name, ...)``)
        applied to the aggregated delta; ``None`` when a subclass builds it from the model layout
        (``build_optimizer``).
    fraction_train : float (default: 1.0)
        Fraction of connected nodes sampled for training each round, in (0, 1].
    fraction_evaluate : float (default: 1.0)
        Fraction of nodes sampled for federated evaluation, in [0, 1]; 0 skips it.
    min_train_nodes : int (default: 2)
        Minimum number of nodes sampled for training.
    min_evaluate_nodes : int (default: 2)
        Minimum number of nodes sampled for evaluation.
    min_available_nodes : int (default: 2)
        Minimum number of connected nodes before a round starts.
    aggregation : str (default: "mean")
        ``"mean"``: the papers' simple average ``(1/|S_t|) sum_i delta_i``;
        ``"weighted"``: weighted by ``weighted_by_key`` (Flower's FedAvg behaviour).
    weighted_by_key : str (default: "num-examples")
        Metric used as the weight of each reply.
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
    arrayrecord_key, configrecord_key : str
        Record names in train/evaluate messages (Flower's defaults).
    outlier_rule : str (default: "reject")
        Outlier screen of update norms (:mod:`pollen.strategies.screening`): ``"reject"``,
        ``"clip"`` or ``"off"``; ``outlier_factor`` (10) times the median accepted norm of the
        last ``outlier_window`` (5) rounds is the bound.
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

    def __init__(
        self,
        *,
        optimizer: Transform | None = None,
        fraction_train: float = 1.0,
        fraction_evaluate: float = 1.0,
        min_train_nodes: int = 2,
        min_evaluate_nodes: int = 2,
        min_available_nodes: int = 2,
        aggregation: str = "mean",
        weighted_by_key: str = protocol.NUM_EXAMPLES,
        buffer_keys: Iterable[str] | None = None,
        seed: int = 0,
        identify_clients: bool = False,
        arrayrecord_key: str = protocol.ARRAYS_RECORD,
        configrecord_key: str = protocol.CONFIG_RECORD,
        outlier_rule: str = "reject",
        outlier_factor: float = 10.0,
        outlier_window: int = 5,
        max_abs_update: float = DEFAULT_MAX_ABS,
        min_replies: int = 1,
        transactional: bool = True,
    ) -> None:
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
        self.optimizer = optimizer
        self.fraction_train = fraction_train
        self.fraction_evaluate = fraction_evaluate
        self.min_train_nodes = min_train_nodes
        self.min_evaluate_nodes = min_evaluate_nodes
        self.min_available_nodes = min_available_nodes
        self.aggregation = aggregation
        self.weighted_by_key = weighted_by_key
        self.buffer_keys = None if buffer_keys is None else tuple(buffer_keys)
        self.seed = seed
        self.arrayrecord_key = arrayrecord_key
        self.configrecord_key = configrecord_key

        self.sampler = ClientSampler(seed=seed, min_available_nodes=min_available_nodes, identify_clients=identify_clients)
        self.screen = UpdateScreen(rule=outlier_rule, factor=outlier_factor, window=outlier_window, max_abs=max_abs_update)
        self.min_replies = min_replies
        self.transactional = transactional
        self._scratch: np.ndarray | None = None
        self.layout: ModelLayout | None = None
        self.params: np.ndarray | None = None
        self.buffers: dict[str, np.ndarray] = {}
        self.opt_state: OptState | None = None
        # Double buffers of the server step: the model and optimiser state discarded last round, whose
        # arrays the next step writes into (see apply_server_step).
        self._spare_params: np.ndarray | None = None
        self._spare_state: OptState | None = None
        self.accounting = Accounting()
        self._key_order: tuple[str, ...] = ()
        self.client_devices: dict[str, str] = {}
        self._last_returned: ArrayRecord | None = None
        self._asked: dict[tuple[int, str], list[int]] = {}
        self._train_started: dict[int, float] = {}
        self._phases_sent: dict[int, int] = {}
        self._current_phase: dict[int, str] = {}

    @property
    def identify_clients(self) -> bool:
        return self.sampler.identify_clients

    @property
    def node_keys(self) -> dict[int, str]:
        """Node id -> stable client id, as far as known (kept by the sampler)."""
        return self.sampler.node_keys

    # ------------------------------------------------------------------ summary
    def summary(self) -> None:
        """Log the strategy's settings."""
        log(INFO, "\t├──> %s settings:", type(self).__name__)
        if self.optimizer is not None:
            log(INFO, "\t│\t├── server optimiser: %s %s", self.optimizer.name, self.optimizer.hyperparameters())
        for key, value in self.extra_summary().items():
            log(INFO, "\t│\t├── %s: %s", key, value)
        log(INFO, "\t│\t├── aggregation: %s (weight key '%s')", self.aggregation, self.weighted_by_key)
        log(
            INFO,
            "\t│\t└── sampling: train %.2f (min %d) | evaluate %.2f (min %d) | seed %d",
            self.fraction_train,
            self.min_train_nodes,
            self.fraction_evaluate,
            self.min_evaluate_nodes,
            self.seed,
        )

    def extra_summary(self) -> dict[str, Any]:
        """Subclass settings shown by ``summary()``."""
        return {}

    # ------------------------------------------------------------------ model state
    def _adopt_global_model(self, arrays: ArrayRecord) -> None:
        """Take the global model from the record Flower hands back each round.

        When it is the record this strategy returned last round, ``params`` already hold
        it and nothing is decoded again.
        """
        if arrays is self._last_returned and self.params is not None:
            return
        named = record_to_arrays(arrays)
        self._key_order = tuple(named)
        if self.layout is None:
            self.layout = ModelLayout.from_arrays(named, self.buffer_keys)
            self.optimizer = self.build_optimizer(self.layout)
            self.opt_state = self.optimizer.init(self.layout.dim)
            self._spare_params, self._spare_state = None, None
            self.on_layout(self.layout)
            log(
                INFO,
                "%s: model has d=%d trainable values in %d tensors, %d buffers",
                type(self).__name__,
                self.layout.dim,
                len(self.layout.trainable),
                len(self.layout.buffers),
            )
        self.layout.check_arrays(named, self.layout.trainable + self.layout.buffers)
        self.params = self.layout.flatten(named)
        self.buffers = {spec.name: np.array(named[spec.name]) for spec in self.layout.buffers}

    def build_optimizer(self, layout: ModelLayout) -> Transform:
        """The server optimiser for this model (subclasses that need the layout override this)."""
        if self.optimizer is None:
            raise ValueError(f"{type(self).__name__} has no server optimiser")
        return self.optimizer

    def on_layout(self, layout: ModelLayout) -> None:
        """Hook: the model layout became known (first round; ``load_state_dict`` restores state itself)."""

    def global_arrays(self) -> ArrayRecord:
        """The current global model as an ``ArrayRecord`` in the original key order."""
        assert self.layout is not None and self.params is not None
        named: dict[str, np.ndarray] = dict(self.buffers)
        for spec, (start, stop) in zip(self.layout.trainable, self.layout.segments):
            view = self.params[start:stop].reshape(spec.shape)  # a view: the record copies once
            named[spec.name] = view if view.dtype == spec.dtype else view.astype(spec.dtype)
        return arrays_to_record({key: named[key] for key in self._key_order})

    # ------------------------------------------------------------------ sampling
    def sample_train(self, server_round: int, grid: Grid) -> list[int]:
        """Hook: the nodes that train this round (default: ``fraction_train`` of them, uniformly)."""
        return self.sampler.sample(grid, self.fraction_train, self.min_train_nodes)

    # ------------------------------------------------------------------ train: downlink
    def train_config(self, server_round: int) -> dict[str, Any]:
        """Extra config entries sent to clients (e.g. the codec to upload with)."""
        return {}

    def node_content(self, server_round: int, node: int, shared: RecordDict) -> RecordDict:
        """Hook: what ``node`` receives in this round's train message.

        The default sends every node the same ``shared`` content (the global model and the
        round's config, built once). A method that sends a node something of its own (a
        compressed increment, a moment only when it changed, its cluster's relay) returns a
        new ``RecordDict`` here; records it reuses from ``shared`` are not copied.
        """
        return shared

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Sample clients and send each its content (default: the global model and the round's config)."""
        self._adopt_global_model(arrays)
        stats = self.accounting.round(server_round)
        self._train_started[server_round] = time.perf_counter()
        nodes = self.sample_train(server_round, grid)
        self._asked[(server_round, TRAIN_PHASE)] = list(nodes)
        stats.sampled = len(nodes)
        config = ConfigRecord(dict(config))
        config[protocol.CFG_SERVER_ROUND] = server_round
        if self.layout.buffer_keys:  # Flower cannot count the bytes of an empty string
            config[protocol.CFG_BUFFER_KEYS] = protocol.join_keys(self.layout.buffer_keys)
        for key, value in self.train_config(server_round).items():
            config[key] = value
        shared = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: config})
        messages = [
            Message(content=self.node_content(server_round, node, shared), message_type=MessageType.TRAIN, dst_node_id=node)
            for node in nodes
        ]
        self._count_sent(stats, messages)
        log(INFO, "configure_train: sampled %d nodes (out of %d)", len(nodes), len(self.sampler.known_clients))
        return messages

    @staticmethod
    def _count_sent(stats: RoundStats, messages: list[Message], prefix: str = "") -> None:
        """Count each message's records once per message sent (a shared record is measured once)."""
        measured: dict[int, int] = {}
        for message in messages:
            sizes = {}
            for name, record in message.content.items():
                if id(record) not in measured:
                    measured[id(record)] = int(record.count_bytes())
                sizes[name] = measured[id(record)]
            stats.add_downlink(sizes, prefix)

    # ------------------------------------------------------------------ train: more phases
    def exchange(
        self,
        server_round: int,
        grid: Grid,
        contents: Mapping[int, RecordDict],
        *,
        phase: str,
        timeout: float,
    ) -> list[Message]:
        """Send ``contents[node]`` to each node as a mid-round message of ``phase``; return the replies.

        The messages have type ``train.pollen_phase`` and carry ``pollen.phase`` and the round in
        their ``"config"`` record (added here when missing), so pollen's ClientApp can route them.
        Bytes both ways are counted under ``<phase>/<record>``; only one reply per asked node is
        kept (others are dropped with a logged reason).
        """
        stats = self.accounting.round(server_round)
        phase_index = self._phases_sent[server_round] = self._phases_sent.get(server_round, 0) + 1
        messages = []
        for node, content in contents.items():
            content = RecordDict(dict(content.items()))
            config = ConfigRecord(dict(content.config_records.get(self.configrecord_key, ConfigRecord())))
            config[protocol.CFG_PHASE] = phase
            config[protocol.CFG_PHASE_INDEX] = phase_index
            config[protocol.CFG_SERVER_ROUND] = server_round
            content[self.configrecord_key] = config
            messages.append(Message(content=content, message_type=protocol.PHASE_MESSAGE_TYPE, dst_node_id=node))
        self._asked[(server_round, phase)] = list(contents)
        self._current_phase[server_round] = phase
        self._count_sent(stats, messages, prefix=f"{phase}/")
        stats.exchange_messages += len(messages)
        replies = list(grid.send_and_receive(messages, timeout=timeout)) if messages else []
        return self._from_asked(server_round, phase, replies, stats)

    def _from_asked(self, server_round: int, phase: str, replies: list[Message], stats: RoundStats) -> list[Message]:
        """Replies from nodes asked in this phase, one each; the rest are failures with a reason."""
        asked = set(self._asked.get((server_round, phase), []))
        kept, seen = [], set()
        for reply in replies:
            node = reply.metadata.src_node_id
            if node not in asked:
                self._reject(stats, node, f"reply from a node not asked in {phase} of round {server_round}")
            elif node in seen:
                self._reject(stats, node, f"second reply in {phase} of round {server_round}")
            else:
                seen.add(node)
                kept.append(reply)
        return kept

    # ------------------------------------------------------------------ train: replies
    def collect(
        self,
        server_round: int,
        replies: Iterable[Message],
        *,
        phase: str = TRAIN_PHASE,
        spec: ReplySpec | None = None,
        sink: Callable[[ClientUpdate], None] | None = None,
    ) -> list[ClientUpdate]:
        """Read every reply of ``phase`` once against ``spec`` (default: :attr:`reply_spec`).

        Counts each reply's bytes by record, rejects what cannot be trusted with a logged
        reason, and counts nodes that were asked but did not answer as failures. With a ``sink``,
        each update is handed to it as soon as it is read (into one reused buffer) and not kept;
        the sink may reject it by raising ``ReplyRejected``.
        """
        assert self.layout is not None and self.params is not None
        stats = self.accounting.round(server_round)
        spec = self.reply_spec_for(server_round) if spec is None else spec
        prefix = "" if phase == TRAIN_PHASE else f"{phase}/"
        replies = self._from_asked(server_round, phase, list(replies), stats)
        updates: list[ClientUpdate] = []
        for reply in replies:
            node = reply.metadata.src_node_id
            try:
                if not reply.has_error():
                    stats.add_uplink(count_records(reply), prefix)
                update = read_reply(
                    reply,
                    client_key=self.sampler.key(node),
                    layout=self.layout,
                    params=self.params,
                    spec=spec,
                    arrayrecord_key=self.arrayrecord_key,
                    weighted_by_key=self.weighted_by_key,
                    weight_required=self.needs_weights(),
                    max_abs=self.screen.max_abs,
                    scratch=self._scratch_vector() if sink is not None else None,
                )
                if sink is not None:
                    sink(update)
            except Exception as err:  # noqa: BLE001 - every failure is a rejected reply, never a crash
                self._reject(stats, node, _reason(err))
                continue
            self._note_device(node, reply.content)
            updates.append(update)
        answered = {reply.metadata.src_node_id for reply in replies}
        for node in self._asked.get((server_round, phase), []):
            if node not in answered:
                self._reject(stats, node, f"no reply before the timeout ({phase})")
        return updates

    def reply_spec_for(self, server_round: int) -> ReplySpec:
        """Hook: what a final reply of ``server_round`` carries (default: :attr:`reply_spec`)."""
        return self.reply_spec

    def needs_weights(self) -> bool:
        """Whether a reply must carry a positive ``num-examples`` (weighted aggregation needs it)."""
        return self.aggregation == "weighted"

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validate and screen replies, aggregate their deltas, take one server optimiser step.

        Nothing of the strategy's state changes before every reply was judged; if the step fails
        anyway (or yields non-finite values) the state is put back and the round counts as failed.
        """
        stats = self.accounting.round(server_round)
        phase = self._current_phase.get(server_round, TRAIN_PHASE)
        bound = self.screen.bound() if self.streaming else None
        if bound is not None:
            running = self.round_sink(server_round, bound)
            updates = self.collect(server_round, replies, phase=phase, sink=running)
        else:
            running = None
            updates = self._screen_updates(server_round, self.collect(server_round, replies, phase=phase), stats)
        return self.apply_updates(server_round, updates, running)

    def round_sink(self, server_round: int, bound: float) -> ScreenedSink:
        """Hook: what takes each screened update of a streamed round (default: the running mean of deltas)."""
        return RunningMean(self.layout.dim, self.screen, bound, weighted=self.aggregation == "weighted")

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
            if update_bytes := _update_bytes(update.record_bytes, self.arrayrecord_key):
                stats.uplink_update_bytes += update_bytes
                stats.uplink_fp32_bytes += 4 * self.layout.dim
        log(INFO, "aggregate_train: %d usable replies, %d failures", len(updates), stats.failures)
        result: tuple[ArrayRecord | None, MetricRecord | None] = (None, None)
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
                stats.fail(f"server step failed and was rolled back: {_reason(err)}")
                log(WARNING, "aggregate_train: server step of round %d failed (%s); state rolled back", server_round, err)
        if applied:
            self.screen.observe([u.norm for u in applied])
            weights = [u.num_examples for u in applied]
            metrics = aggregate_metrics([u.metrics for u in applied if u.metrics is not None], weights)
            stats.train_metrics = dict(metrics or {})
            stats.count_grad_evals([u.metrics for u in applied])
            self._last_returned = self.global_arrays()
            result = (self._last_returned, metrics)
        stats.train_seconds = time.perf_counter() - self._train_started.get(server_round, time.perf_counter())
        self.after_round(server_round, applied)
        self._forget_round(server_round)
        return result

    def _server_step(self, server_round: int, updates: list[ClientUpdate], running: ScreenedSink | None) -> None:
        """Aggregate, step, average buffers; all or nothing when ``transactional``.

        Nothing is copied to be able to go back: the step writes the new parameters and optimiser
        state into spare arrays (``apply_server_step``) and buffer averaging replaces the arrays of a
        new dict, so a failure only puts the references of before back.
        """
        before = (self.params, self.opt_state, self.buffers)
        self.buffers = dict(self.buffers)
        try:
            delta = running.mean() if running is not None else self.aggregate_deltas(server_round, updates)
            self.apply_server_step(server_round, delta)
            self._average_buffers(updates)
            if not all_finite(self.params):
                raise FloatingPointError("the server step produced NaN or Inf parameters")
        except Exception:
            if self.transactional:
                self._roll_back(*before)
            raise

    def _roll_back(self, params: np.ndarray, opt_state: OptState, buffers: dict[str, np.ndarray]) -> None:
        """Go back to the model and optimiser state of before the step; the discarded ones become the spares."""
        if self.params is not params:
            self._spare_params = self.params
        if self.opt_state is not opt_state:
            self._spare_state = self.opt_state
        self.params, self.opt_state, self.buffers = params, opt_state, buffers

    def _screen_updates(self, server_round: int, updates: list[ClientUpdate], stats: RoundStats) -> list[ClientUpdate]:
        """The outlier screen on kept updates: history bound, else each against the others' median."""
        with_delta = [u for u in updates if u.delta is not None]
        bound = self.screen.bound()
        bounds = [bound] * len(with_delta) if bound is not None else self.screen.within_round_bounds([u.norm for u in with_delta])
        rejected = set()
        for update, limit in zip(with_delta, bounds):
            verdict, scale = self.screen.judge(update.norm, limit)
            if verdict == "reject":
                rejected.add(id(update))
                self._reject(stats, update.node_id, self.screen.reason(update.norm, limit))
            elif verdict == "clip":
                update.delta = update.delta * np.float32(scale)
                update.norm *= scale
        return [u for u in updates if id(u) not in rejected]

    def _scratch_vector(self) -> np.ndarray:
        if self._scratch is None or self._scratch.shape != (self.layout.dim,):
            self._scratch = np.empty(self.layout.dim, dtype=np.float32)
        return self._scratch

    def _forget_round(self, server_round: int) -> None:
        for key in [key for key in self._asked if key[0] <= server_round]:
            del self._asked[key]
        self._phases_sent.pop(server_round, None)
        self._current_phase.pop(server_round, None)

    def after_round(self, server_round: int, updates: list[ClientUpdate]) -> None:
        """Hook for subclasses that keep per-client state (called after the server step)."""

    def apply_server_step(self, server_round: int, delta: np.ndarray) -> None:
        """``x <- x + step`` with the optimiser's step for the aggregated delta.

        Double-buffered: the optimiser writes its new state into the spare state (the one discarded
        a round ago) and the new model goes into the spare parameter vector; both are swapped in, and
        what they replace becomes the spares. Neither the old model nor the old state is written, so
        ``_server_step`` can go back to them; no ``d``-sized memory is allocated after round 1.
        """
        scratch = self._scratch_vector() if self.layout is not None else None
        if scratch is delta:
            scratch = None
        step, new_state = self.optimizer.update(
            self.opt_state, delta, self.params, into=self._spare_state, out=scratch
        )
        new_params = self._spare_params
        if new_params is None or new_params.shape != self.params.shape or new_params is self.params:
            new_params = np.empty_like(self.params)
        np.add(self.params, step, out=new_params)
        self._spare_state, self.opt_state = self.opt_state, new_state
        self._spare_params, self.params = self.params, new_params

    def aggregate_weights(self, updates: list[ClientUpdate]) -> np.ndarray:
        """Weight of each update: ``1/M`` (papers) or ``n_i / sum n`` (``aggregation="weighted"``)."""
        if self.aggregation == "mean":
            return np.full(len(updates), 1.0 / len(updates))
        raw = np.array([u.num_examples for u in updates], dtype=np.float64)
        return raw / raw.sum()

    def aggregate_deltas(self, server_round: int, updates: list[ClientUpdate]) -> np.ndarray:
        """Average of the client deltas: plain mean (papers) or weighted by examples.

        Computed as :class:`RunningMean` does on the streaming path (sum of raw-weighted deltas,
        then one multiplication), so both paths give the same bits.
        """
        running = RunningMean(self.layout.dim, self.screen, float("inf"), weighted=self.aggregation == "weighted")
        for update in updates:
            if update.delta is not None:
                running.add(update.delta, update.num_examples)
        return running.mean()

    def _average_buffers(self, updates: list[ClientUpdate]) -> None:
        updates = [u for u in updates if u.buffers]
        if not self.buffers or not updates:
            return
        weights = self.aggregate_weights(updates)
        for name, old in self.buffers.items():
            mean = np.zeros(old.shape, dtype=np.float64)
            for weight, update in zip(weights, updates):
                mean += weight * update.buffers[name]
            self.buffers[name] = (np.rint(mean) if np.issubdtype(old.dtype, np.integer) else mean).astype(old.dtype)

    def _reject(self, stats: RoundStats, node: int, reason: str) -> None:
        client = self.sampler.key(node)
        stats.fail(f"{client}: {reason}")
        log(WARNING, "\t> rejected reply from %s (node %d): %s", client, node, reason)

    def _note_device(self, node: int, content: RecordDict) -> None:
        """Log the device a client trained on (pollen's ClientApp reports it), once per change."""
        info = content.config_records.get(protocol.CLIENT_INFO_RECORD)
        device = info.get("device") if info is not None else None
        client = self.sampler.key(node)
        if isinstance(device, str) and len(device) < 64 and self.client_devices.get(client) != device:
            self.client_devices[client] = device
            log(INFO, "\t> %s trains on %s", client, device)

    # ------------------------------------------------------------------ evaluate
    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Sample clients for federated evaluation on their held-out data."""
        if self.fraction_evaluate == 0.0:
            return []
        nodes = self.sampler.sample(grid, self.fraction_evaluate, self.min_evaluate_nodes)
        config = ConfigRecord(dict(config))
        config[protocol.CFG_SERVER_ROUND] = server_round
        content = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: config})
        stats = self.accounting.round(server_round)
        stats.eval_downlink_bytes += int(sum(record.count_bytes() for record in content.values())) * len(nodes)
        self._asked[(server_round, "evaluate")] = list(nodes)
        return [Message(content=content, message_type=MessageType.EVALUATE, dst_node_id=n) for n in nodes]

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Weighted average of the clients' evaluation metrics; failed or malformed replies are skipped."""
        stats = self.accounting.round(server_round)
        records, weights = [], []
        for reply in self._from_asked(server_round, "evaluate", list(replies), stats):
            node = reply.metadata.src_node_id
            try:
                if reply.has_error():
                    raise ReplyRejected(f"client error: {reply.error.reason}")
                stats.eval_uplink_bytes += sum(count_records(reply).values())
                metrics = reply.content.metric_records.get(protocol.METRICS_RECORD)
                if metrics is None:
                    metrics = next(iter(reply.content.metric_records.values()), None)
                if metrics is None:
                    continue
                weight = metrics.get(self.weighted_by_key, 1)
                if isinstance(weight, (int, float)) and not isinstance(weight, bool) and 0 < weight < 1e12:
                    records.append(metrics)
                    weights.append(float(weight))
            except Exception as err:  # noqa: BLE001 - evaluation never crashes the server either
                log(WARNING, "\t> evaluation reply from %s (node %d) skipped: %s", self.sampler.key(node), node, _reason(err))
        self._asked.pop((server_round, "evaluate"), None)
        aggregated = aggregate_metrics(records, weights)
        stats.evaluate_metrics = dict(aggregated or {})
        return aggregated

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Everything the strategy holds, as numpy arrays and plain Python values."""
        state: dict[str, Any] = {
            "strategy": type(self).__name__,
            "seed": self.seed,
            "sampler": self.sampler.state_dict(),
            "screen": self.screen.state_dict(),
            "accounting": self.accounting.to_dict(),
        }
        if self.layout is not None:
            state["key_order"] = list(self._key_order)
            state["buffer_keys"] = list(self.layout.buffer_keys)
            specs = self.layout.trainable + self.layout.buffers
            state["shapes"] = {spec.name: list(spec.shape) for spec in specs}
            state["dtypes"] = {spec.name: spec.dtype.str for spec in specs}
            state["params"] = self.params.copy()
            state["buffers"] = {k: v.copy() for k, v in self.buffers.items()}
            state["optimizer"] = self.opt_state.to_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict()`` wrote (same strategy class and model)."""
        if state.get("strategy") != type(self).__name__:
            raise ValueError(f"state was written by {state.get('strategy')!r}, not {type(self).__name__}")
        self.seed = state["seed"]
        self.sampler.load_state_dict(state["sampler"])
        self.screen.load_state_dict(state.get("screen", {}))
        self.accounting = Accounting.from_dict(state["accounting"])
        self._last_returned = None
        if "params" in state:
            named = {
                name: np.zeros(state["shapes"][name], dtype=np.dtype(state["dtypes"][name])) for name in state["key_order"]
            }
            self.layout = ModelLayout.from_arrays(named, state["buffer_keys"])
            self._key_order = tuple(state["key_order"])
            params = np.asarray(state["params"])
            if params.shape != (self.layout.dim,) or params.dtype != np.float32 or not all_finite(params):
                raise ValueError(f"state params must be {self.layout.dim} finite float32 values, got {params.shape} {params.dtype}")
            buffers = {k: np.array(v) for k, v in state["buffers"].items()}
            if sorted(buffers) != sorted(self.layout.buffer_keys) or any(
                buffers[spec.name].shape != spec.shape for spec in self.layout.buffers
            ):
                raise ValueError("state buffers do not match the model's buffers")
            opt_state = OptState.from_dict(state["optimizer"])
            for name, slot in opt_state.slots.items():
                if slot.shape != (self.layout.dim,) or not all_finite(slot):
                    raise ValueError(f"state optimiser slot '{name}' is not {self.layout.dim} finite values")
            optimizer = self.build_optimizer(self.layout)
            optimizer.check_state(opt_state, self.layout.dim)
            self.params = np.array(params)
            self.buffers = buffers
            self.optimizer = optimizer
            self.opt_state = opt_state
            self._spare_params, self._spare_state = None, None


class ScreenedSink:
    """Takes each update of a streamed round as it is read: screens it against the history bound,
    hands it to :meth:`take`, then drops its vector (the reader reuses one buffer). ``mean()`` is
    the round's aggregated delta."""

    def __init__(self, screen: UpdateScreen, bound: float) -> None:
        self.screen = screen
        self.bound = bound

    def __call__(self, update: ClientUpdate) -> None:
        """Screen ``update`` (``ReplyRejected`` if it is an outlier), take it, drop its vector."""
        if update.delta is None:
            return
        verdict, scale = self.screen.judge(update.norm, self.bound)
        if verdict == "reject":
            raise ReplyRejected(self.screen.reason(update.norm, self.bound))
        if verdict == "clip":
            update.delta *= np.float32(scale)
            update.norm *= scale
        self.take(update)
        update.delta = None

    def take(self, update: ClientUpdate) -> None:
        raise NotImplementedError

    def mean(self) -> np.ndarray:
        raise NotImplementedError


class RunningMean(ScreenedSink):
    """The round's (weighted) mean of deltas, summed as replies are read; screens each one first.

    ``sum_i float32(w_i) * delta_i`` with raw weights (1 for the mean, ``num-examples`` when
    weighted), then one multiplication by ``1 / sum w``: a rejected reply never touched the sum,
    so the result equals a round where that client stayed silent, bit for bit.
    """

    def __init__(self, dim: int, screen: UpdateScreen, bound: float, *, weighted: bool) -> None:
        super().__init__(screen, bound)
        self.total = np.zeros(dim, dtype=np.float32)
        self.weight = 0.0
        self.weighted = weighted

    def take(self, update: ClientUpdate) -> None:
        self.add(update.delta, update.num_examples)

    def add(self, delta: np.ndarray, num_examples: float) -> None:
        weight = num_examples if self.weighted else 1.0
        if weight == 1.0:
            self.total += delta
        else:
            self.total += np.float32(weight) * delta
        self.weight += weight

    def mean(self) -> np.ndarray:
        self.total *= np.float32(1.0 / self.weight)
        return self.total


def _reason(err: BaseException) -> str:
    """A short, one-line reason for a rejected reply."""
    text = str(err).replace("\n", " ")
    reason = text if isinstance(err, ReplyRejected | ValueError) and text else f"{type(err).__name__}: {text}"
    return reason[:200]


def _update_bytes(record_bytes: Mapping[str, int], arrayrecord_key: str) -> int:
    """Bytes of the record(s) carrying the model update of a reply."""
    return record_bytes.get(protocol.UPDATE_RECORD, 0) + record_bytes.get(arrayrecord_key, 0)
