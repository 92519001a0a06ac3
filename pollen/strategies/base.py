"""The shared base of pollen's server strategies (Flower Message API).

``AdaptiveStrategy`` does the mechanics every adaptive federated method needs, once:

- keeps the global model as one contiguous float32 vector of trainable parameters
  plus the non-trainable buffers (averaged, never fed to the optimiser),
- samples clients with its own seeded generator, keyed by a stable client identity,
- validates every reply (shape, dtype, finite values, decodable payload); a reply
  that cannot be trusted is dropped with a logged reason and counted as a failure,
- decodes compressed updates transparently (any codec of ``pollen.compression``),
- counts bytes per direction and per round from the records on the wire,
- writes and reads back everything it holds (``state_dict`` / ``load_state_dict``).

Subclasses choose the server optimiser and may override the small steps
``aggregate_deltas`` (how client updates become one delta) and ``train_config``
(what extra config clients receive). Sign convention: a client's update is
``delta = x_local - x_global`` (points downhill); the server *adds* the optimiser's step.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from pollen import protocol
from pollen.compression import decode_payload
from pollen.compression.payload import PayloadError
from pollen.layout import ModelLayout
from pollen.optim import ServerOptimizer
from pollen.optim.base import OptimizerState
from pollen.strategies.accounting import Accounting, RoundStats
from pollen.wire import arrays_to_record, content_bytes, record_to_arrays, records_to_payload

AGGREGATIONS = ("mean", "weighted")


class ReplyRejected(ValueError):
    """A reply that cannot be used; the message is the logged reason."""


@dataclass
class ClientUpdate:
    """One client's validated contribution to a round."""

    client_key: str
    node_id: int
    delta: np.ndarray
    buffers: dict[str, np.ndarray]
    num_examples: float
    metrics: MetricRecord | None


def _check_fraction(name: str, value: float, allow_zero: bool) -> None:
    low_ok = value >= 0.0 if allow_zero else value > 0.0
    if not (low_ok and value <= 1.0):
        interval = "[0, 1]" if allow_zero else "(0, 1]"
        raise ValueError(f"{name}={value!r} is out of range; allowed: a number in {interval}")


def aggregate_metrics(records: list[MetricRecord], weights: list[float]) -> MetricRecord | None:
    """Weighted average of numeric metrics present in every record (lists are skipped)."""
    if not records:
        return None
    total = float(sum(weights)) or 1.0
    common = set.intersection(*(set(record.keys()) for record in records))
    out = MetricRecord()
    for key in sorted(common):
        values = [record[key] for record in records]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            out[key] = float(sum(w * float(v) for w, v in zip(weights, values)) / total)
    return out


class AdaptiveStrategy(Strategy):
    """Base of pollen's strategies: flat-vector state, validated replies, bytes, state dict.

    Parameters
    ----------
    optimizer : ServerOptimizer | None
        The server optimiser (``pollen.optim``) applied to the aggregated delta;
        ``None`` when a subclass builds it from the model layout (``build_optimizer``).
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
        Seed of client sampling.
    identify_clients : bool (default: False)
        Ask each new node once for its stable client id (pollen's ClientApp answers
        ``query.pollen_identify``; other ClientApps fall back to the node id). Stable
        ids make sampling reproducible across runs and survive a SuperNode
        reconnecting. Off by default so a ClientApp without that action sees no
        query it cannot answer; pollen's app turns it on.
    arrayrecord_key, configrecord_key : str
        Record names in train/evaluate messages (Flower's defaults).
    """

    def __init__(
        self,
        *,
        optimizer: ServerOptimizer | None = None,
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
    ) -> None:
        _check_fraction("fraction_train", fraction_train, allow_zero=False)
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
        self.identify_clients = identify_clients
        self.arrayrecord_key = arrayrecord_key
        self.configrecord_key = configrecord_key

        self.rng = np.random.default_rng(seed)
        self.layout: ModelLayout | None = None
        self.params: np.ndarray | None = None
        self.buffers: dict[str, np.ndarray] = {}
        self.opt_state: OptimizerState | None = None
        self.accounting = Accounting()
        self.node_keys: dict[int, str] = {}
        self._key_order: tuple[str, ...] = ()
        self.client_devices: dict[str, str] = {}
        self._last_returned: ArrayRecord | None = None
        self._sampled: dict[int, list[int]] = {}
        self._train_started: dict[int, float] = {}

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

    def build_optimizer(self, layout: ModelLayout) -> ServerOptimizer:
        """The server optimiser for this model (subclasses that need the layout override this)."""
        if self.optimizer is None:
            raise ValueError(f"{type(self).__name__} has no server optimiser")
        return self.optimizer

    def on_layout(self, layout: ModelLayout) -> None:
        """Hook: the model layout became known (first round; ``load_state_dict`` restores state itself)."""

    def global_arrays(self) -> ArrayRecord:
        """The current global model as an ``ArrayRecord`` in the original key order."""
        assert self.layout is not None and self.params is not None
        named = self.layout.unflatten(self.params)
        named.update(self.buffers)
        return arrays_to_record({key: named[key] for key in self._key_order})

    # ------------------------------------------------------------------ sampling
    def _wait_for_nodes(self, grid: Grid, needed: int) -> list[int]:
        while len(nodes := sorted(grid.get_node_ids())) < needed:
            log(INFO, "Waiting for nodes to connect: %d connected (minimum required: %d).", len(nodes), needed)
            time.sleep(1.0)
        return nodes

    def _identify(self, grid: Grid, nodes: list[int]) -> None:
        """Ask nodes seen for the first time for their stable client id."""
        unknown = [node for node in nodes if node not in self.node_keys]
        if not unknown:
            return
        if self.identify_clients:
            queries = [
                Message(content=RecordDict(), message_type=protocol.QUERY_IDENTIFY, dst_node_id=node)
                for node in unknown
            ]
            for reply in grid.send_and_receive(queries, timeout=60.0):
                node = reply.metadata.src_node_id
                if reply.has_error() or protocol.IDENTITY_RECORD not in reply.content:
                    continue
                client_id = reply.content[protocol.IDENTITY_RECORD].get(protocol.IDENTITY_CLIENT_ID)
                if isinstance(client_id, str) and client_id:
                    self.node_keys[node] = client_id
        for node in unknown:
            self.node_keys.setdefault(node, f"node-{node}")

    def _sample(self, grid: Grid, fraction: float, minimum: int) -> list[int]:
        nodes = self._wait_for_nodes(grid, max(self.min_available_nodes, minimum))
        self._identify(grid, nodes)
        size = min(max(int(len(nodes) * fraction), minimum), len(nodes))
        ordered = sorted(nodes, key=lambda node: (self.node_keys[node], node))
        picks = self.rng.choice(len(ordered), size=size, replace=False)
        return [ordered[i] for i in sorted(picks)]

    # ------------------------------------------------------------------ train
    def train_config(self, server_round: int) -> dict[str, Any]:
        """Extra config entries sent to clients (e.g. the codec to upload with)."""
        return {}

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Sample clients and send them the global model and the round's config."""
        self._adopt_global_model(arrays)
        stats = self.accounting.round(server_round)
        self._train_started[server_round] = time.perf_counter()
        nodes = self._sample(grid, self.fraction_train, self.min_train_nodes)
        self._sampled[server_round] = nodes
        stats.sampled = len(nodes)
        config = ConfigRecord(dict(config))
        config[protocol.CFG_SERVER_ROUND] = server_round
        if self.layout.buffer_keys:  # Flower cannot count the bytes of an empty string
            config[protocol.CFG_BUFFER_KEYS] = protocol.join_keys(self.layout.buffer_keys)
        for key, value in self.train_config(server_round).items():
            config[key] = value
        content = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: config})
        stats.downlink_bytes += content_bytes(content) * len(nodes)
        log(INFO, "configure_train: sampled %d nodes (out of %d)", len(nodes), len(self.node_keys))
        return [Message(content=content, message_type=MessageType.TRAIN, dst_node_id=n) for n in nodes]

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validate replies, aggregate their deltas, take one server optimiser step."""
        stats = self.accounting.round(server_round)
        updates = self._collect_updates(server_round, list(replies), stats)
        result: tuple[ArrayRecord | None, MetricRecord | None] = (None, None)
        if updates:
            delta = self.aggregate_deltas(server_round, updates)
            self.apply_server_step(server_round, delta)
            self._average_buffers(updates)
            weights = [u.num_examples for u in updates]
            metrics = aggregate_metrics([u.metrics for u in updates if u.metrics is not None], weights)
            stats.train_metrics = dict(metrics or {})
            self._last_returned = self.global_arrays()
            result = (self._last_returned, metrics)
        else:
            log(WARNING, "aggregate_train: no usable reply in round %d; the model is unchanged", server_round)
        stats.train_seconds = time.perf_counter() - self._train_started.get(server_round, time.perf_counter())
        self.after_round(server_round, updates)
        return result

    def after_round(self, server_round: int, updates: list[ClientUpdate]) -> None:
        """Hook for subclasses that keep per-client state (called after the server step)."""

    def apply_server_step(self, server_round: int, delta: np.ndarray) -> None:
        """``x <- x + step`` with the optimiser's step for the aggregated delta."""
        self.opt_state, step = self.optimizer.update(self.opt_state, delta, self.params)
        self.params += step

    def aggregate_deltas(self, server_round: int, updates: list[ClientUpdate]) -> np.ndarray:
        """Average of the client deltas: plain mean (papers) or weighted by examples."""
        if self.aggregation == "mean":
            weights = np.full(len(updates), 1.0 / len(updates))
        else:
            raw = np.array([u.num_examples for u in updates], dtype=np.float64)
            weights = raw / raw.sum()
        out = np.zeros_like(updates[0].delta)
        for weight, update in zip(weights, updates):
            out += np.float32(weight) * update.delta
        return out

    def _average_buffers(self, updates: list[ClientUpdate]) -> None:
        if not self.buffers:
            return
        weights = np.array([u.num_examples for u in updates], dtype=np.float64)
        weights = weights / weights.sum() if self.aggregation == "weighted" else np.full(len(updates), 1 / len(updates))
        for name, old in self.buffers.items():
            mean = np.zeros(old.shape, dtype=np.float64)
            for weight, update in zip(weights, updates):
                mean += weight * update.buffers[name]
            self.buffers[name] = (np.rint(mean) if np.issubdtype(old.dtype, np.integer) else mean).astype(old.dtype)

    # ------------------------------------------------------------------ reply validation
    def _collect_updates(self, server_round: int, replies: list[Message], stats: RoundStats) -> list[ClientUpdate]:
        updates: list[ClientUpdate] = []
        answered = set()
        for reply in replies:
            node = reply.metadata.src_node_id
            answered.add(node)
            if reply.has_error():
                self._reject(stats, node, f"client error: {reply.error.reason}")
                continue
            stats.uplink_bytes += content_bytes(reply.content)
            try:
                update = self.parse_reply(reply, stats)
            except (ReplyRejected, PayloadError, ValueError, KeyError, TypeError) as err:
                self._reject(stats, node, str(err))
                continue
            updates.append(update)
        for node in self._sampled.get(server_round, []):
            if node not in answered:
                self._reject(stats, node, "no reply before the timeout")
        stats.replies = len(updates)
        log(INFO, "aggregate_train: %d usable replies, %d failures", len(updates), stats.failures)
        return updates

    def _reject(self, stats: RoundStats, node: int, reason: str) -> None:
        client = self.node_keys.get(node, f"node-{node}")
        stats.fail(f"{client}: {reason}")
        log(WARNING, "\t> rejected reply from %s (node %d): %s", client, node, reason)

    def parse_reply(self, reply: Message, stats: RoundStats) -> ClientUpdate:
        """Turn one reply into a validated ``ClientUpdate`` or raise ``ReplyRejected``."""
        assert self.layout is not None and self.params is not None
        content = reply.content
        if protocol.UPDATE_RECORD in content.array_records:
            if protocol.UPDATE_META_RECORD not in content.config_records:
                raise ReplyRejected("compressed update without its meta record")
            payload = records_to_payload(
                content.array_records[protocol.UPDATE_RECORD], content.config_records[protocol.UPDATE_META_RECORD]
            )
            delta = decode_payload(payload, self.layout.dim, segments=self.layout.segments)
            stats.uplink_update_bytes += content.array_records[protocol.UPDATE_RECORD].count_bytes()
            buffers = {}
            if self.layout.buffers:
                if protocol.BUFFERS_RECORD not in content.array_records:
                    raise ReplyRejected("compressed update without the model's buffers")
                buffers = record_to_arrays(content.array_records[protocol.BUFFERS_RECORD])
                self.layout.check_arrays(buffers, self.layout.buffers)
                buffers = {spec.name: np.reshape(buffers[spec.name], spec.shape) for spec in self.layout.buffers}
        elif self.arrayrecord_key in content.array_records:
            record = content.array_records[self.arrayrecord_key]
            arrays = record_to_arrays(record)
            self.layout.check_arrays(arrays, self.layout.trainable + self.layout.buffers)
            delta = self.layout.flatten(arrays) - self.params
            buffers = {spec.name: np.reshape(arrays[spec.name], spec.shape) for spec in self.layout.buffers}
            stats.uplink_update_bytes += record.count_bytes()
        else:
            raise ReplyRejected(
                f"reply carries neither '{self.arrayrecord_key}' nor '{protocol.UPDATE_RECORD}' arrays"
            )
        if delta.shape != (self.layout.dim,) or not np.all(np.isfinite(delta)):
            raise ReplyRejected("decoded update is not a finite vector of the model's size")
        stats.uplink_fp32_bytes += 4 * self.layout.dim
        metrics = next(iter(content.metric_records.values()), None)
        num_examples = 1.0
        if metrics is not None and self.weighted_by_key in metrics:
            num_examples = float(metrics[self.weighted_by_key])
        elif self.aggregation == "weighted":
            raise ReplyRejected(f"metrics lack '{self.weighted_by_key}', needed for weighted aggregation")
        if not np.isfinite(num_examples) or num_examples <= 0:
            raise ReplyRejected(f"'{self.weighted_by_key}' must be a positive number, got {num_examples}")
        node = reply.metadata.src_node_id
        self._note_device(node, content)
        return ClientUpdate(
            client_key=self.node_keys.get(node, f"node-{node}"),
            node_id=node,
            delta=delta.astype(np.float32, copy=False),
            buffers=buffers,
            num_examples=num_examples,
            metrics=metrics,
        )

    def _note_device(self, node: int, content: RecordDict) -> None:
        """Log the device a client trained on (pollen's ClientApp reports it), once per change."""
        info = content.config_records.get(protocol.CLIENT_INFO_RECORD)
        device = info.get("device") if info is not None else None
        client = self.node_keys.get(node, f"node-{node}")
        if isinstance(device, str) and self.client_devices.get(client) != device:
            self.client_devices[client] = device
            log(INFO, "\t> %s trains on %s", client, device)

    # ------------------------------------------------------------------ evaluate
    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Sample clients for federated evaluation on their held-out data."""
        if self.fraction_evaluate == 0.0:
            return []
        nodes = self._sample(grid, self.fraction_evaluate, self.min_evaluate_nodes)
        config = ConfigRecord(dict(config))
        config[protocol.CFG_SERVER_ROUND] = server_round
        content = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: config})
        self.accounting.round(server_round).eval_downlink_bytes += content_bytes(content) * len(nodes)
        return [Message(content=content, message_type=MessageType.EVALUATE, dst_node_id=n) for n in nodes]

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Weighted average of the clients' evaluation metrics; failed replies are skipped."""
        stats = self.accounting.round(server_round)
        records, weights = [], []
        for reply in replies:
            if reply.has_error():
                log(WARNING, "\t> evaluation failed on node %d: %s", reply.metadata.src_node_id, reply.error.reason)
                continue
            stats.eval_uplink_bytes += content_bytes(reply.content)
            metrics = next(iter(reply.content.metric_records.values()), None)
            if metrics is None:
                continue
            weight = metrics.get(self.weighted_by_key, 1)
            if isinstance(weight, (int, float)) and weight > 0:
                records.append(metrics)
                weights.append(float(weight))
        aggregated = aggregate_metrics(records, weights)
        stats.evaluate_metrics = dict(aggregated or {})
        return aggregated

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Everything the strategy holds, as numpy arrays and plain Python values."""
        state: dict[str, Any] = {
            "strategy": type(self).__name__,
            "seed": self.seed,
            "rng": self.rng.bit_generator.state,
            "node_keys": {str(k): v for k, v in self.node_keys.items()},
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
        self.rng = np.random.default_rng()
        self.rng.bit_generator.state = state["rng"]
        self.node_keys = {int(k): v for k, v in state["node_keys"].items()}
        self.accounting = Accounting.from_dict(state["accounting"])
        if "params" in state:
            named = {
                name: np.zeros(state["shapes"][name], dtype=state["dtypes"][name]) for name in state["key_order"]
            }
            self.layout = ModelLayout.from_arrays(named, state["buffer_keys"])
            self._key_order = tuple(state["key_order"])
            self.params = np.array(state["params"], dtype=np.float32)
            self.buffers = {k: np.array(v) for k, v in state["buffers"].items()}
            self.optimizer = self.build_optimizer(self.layout)
            self.opt_state = OptimizerState.from_dict(state["optimizer"])
