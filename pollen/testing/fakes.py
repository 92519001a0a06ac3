"""Test doubles for driving pollen's strategies and mods without a SuperLink.

- :class:`FakeGrid`: a Flower ``Grid`` whose ``send_and_receive`` calls a plain Python
  function once per outgoing message (the "client"), in-process. It gives each message a
  message id (as the SuperLink would), records what was sent, answers pollen's
  identify query itself, and drops replies the client function does not produce
  (``None`` = the node never answered).
- helpers to build reply messages (``Message(content=..., reply_to=msg)``), a client
  ``Context``, a tiny model with a BatchNorm-like float buffer and an integer buffer.
- :func:`capture_flwr_logs`: collect what Flower's logger (which pollen logs through) says.

No torch here: these fakes are used by the ``flower_compat`` tests, which also run
against the newest Flower in an environment without torch.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Error, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid

from pollen.wire import protocol


# --------------------------------------------------------------------------- task identity
def ensure_task_identity(run_id: int = 1, node_id: int = 0, task_id: int = 1) -> None:
    """Set Flower's process-wide task identity if this Flower has one and it is unset.

    From some Flower versions on, ``Message(content, dst_node_id, message_type)`` reads
    the run id / source node id from ``flwr.supercore.task_identity.TaskIdentity``,
    which the ServerApp runtime sets. In-process tests must set it themselves. Older
    Flower versions do not have it; then there is nothing to do.
    """
    try:
        from flwr.supercore.task_identity import TaskIdentity
    except ImportError:  # older / other Flower: Message does not need it
        return
    for name, value in (("run_id", run_id), ("node_id", node_id), ("task_id", task_id)):
        if getattr(TaskIdentity, f"_{name}", None) is None:
            setattr(TaskIdentity, name, value)


ensure_task_identity()


# --------------------------------------------------------------------------- grid
ClientFn = Callable[[Message], "Message | None"]


class FakeGrid(Grid):
    """An in-process ``Grid``: ``send_and_receive`` calls ``client_fn(message)`` per message.

    Parameters
    ----------
    node_ids : list[int]
        The connected nodes.
    client_fn : callable
        ``client_fn(msg) -> Message | None`` for every train/evaluate message; ``None``
        means the node did not reply before the timeout.
    client_ids : mapping node -> str, optional
        Answers to pollen's identify query (``query.pollen_identify``). Without it the
        query gets an error reply, as from a ClientApp that does not know the query,
        and the strategy falls back to ``node-<id>``.
    cluster_ids : mapping node -> str, optional
        The cluster id each node reports with its client id (HA-Fed).
    keep_history : bool (default: True)
        Keep every message sent and received in ``sent`` / ``calls`` / ``replies`` (what tests inspect).
        ``False`` behaves like a real ServerApp: nothing outlives the round that used it, so a benchmark
        does not page-fault every round on fresh memory (a grid that keeps every message made Flower's
        FedAdam look twice as slow: 907 vs 428 ms on the same replies).
    shuffle_seed : int | None (default: None)
        Hand each call's replies back in a seeded random order (a new order every call), as a SuperLink
        does when clients finish in a different order; ``None`` keeps the order the messages were sent in.
    arrival_seed : int | None (default: None)
        ``push_messages`` / ``pull_messages`` (an asynchronous driver): each pull hands back each waiting reply
        with probability 1/2 (seeded), as clients that finish at arbitrary times; ``None``: all at once.
    """

    def __init__(
        self,
        node_ids: Iterable[int],
        client_fn: ClientFn,
        *,
        client_ids: Mapping[int, str] | None = None,
        cluster_ids: Mapping[int, str] | None = None,
        keep_history: bool = True,
        shuffle_seed: int | None = None,
        arrival_seed: int | None = None,
    ) -> None:
        self.node_ids = list(node_ids)
        self._arrival = None if arrival_seed is None else np.random.default_rng(arrival_seed)
        self._waiting: dict[str, Message] = {}  # pushed message id -> its reply, until pulled
        self._shuffle = None if shuffle_seed is None else np.random.default_rng(shuffle_seed)
        self.client_fn = client_fn
        self.client_ids = dict(client_ids or {})
        self.cluster_ids = dict(cluster_ids or {})
        self.sent: list[Message] = []  # every message pushed, in order
        self.calls: list[list[Message]] = []  # one list per send_and_receive call
        self.replies: list[Message] = []  # every reply handed back, in order
        self.timeouts: list[float | None] = []
        self.keep_history = keep_history

    # -- what the strategies use
    def get_node_ids(self) -> Iterable[int]:
        return list(self.node_ids)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        messages = list(messages)
        if self.keep_history:
            self.calls.append(messages)
            self.timeouts.append(timeout)
        replies = []
        for msg in messages:
            self._stamp(msg)
            if self.keep_history:
                self.sent.append(msg)
            if msg.metadata.message_type == protocol.QUERY_IDENTIFY:
                reply = self._identify(msg)
            else:
                reply = self.client_fn(msg)
            if reply is not None:
                replies.append(reply)
        if self._shuffle is not None:
            replies = [replies[i] for i in self._shuffle.permutation(len(replies))]
        if self.keep_history:
            self.replies.extend(replies)
        return replies

    # -- the rest of Flower's Grid interface, minimal
    def set_run(self, run) -> None:  # noqa: ANN001
        self._run = run

    @property
    def run(self):  # noqa: ANN201
        return getattr(self, "_run", None)

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):  # noqa: ANN001, ANN201
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Stamp each message, compute its reply now (``client_fn``) and keep it until pulled; the ids."""
        ids = []
        for msg in messages:
            self._stamp(msg)
            if self.keep_history:
                self.sent.append(msg)
            reply = self._identify(msg) if msg.metadata.message_type == protocol.QUERY_IDENTIFY else self.client_fn(msg)
            if reply is not None:
                self._waiting[msg.metadata.message_id] = reply
            ids.append(msg.metadata.message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """The waiting replies to ``message_ids`` (with ``arrival_seed``: each one with probability 1/2)."""
        out = []
        for mid in message_ids:
            if mid in self._waiting and (self._arrival is None or self._arrival.random() < 0.5):
                out.append(self._waiting.pop(mid))
        if self.keep_history:
            self.replies.extend(out)
        return out

    # -- helpers
    @staticmethod
    def _stamp(msg: Message) -> None:
        """Give the message an id, as the SuperLink does on push (replies point to it)."""
        if not msg.metadata.message_id:
            try:  # Flower's own grids set it the same way (InMemoryGrid.push_messages)
                msg.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            except (AttributeError, TypeError):  # a Metadata without __dict__: replies keep ""
                pass

    def _identify(self, msg: Message) -> Message:
        node = msg.metadata.dst_node_id
        if node in self.client_ids:
            record = ConfigRecord({protocol.IDENTITY_CLIENT_ID: self.client_ids[node]})
            if node in self.cluster_ids:
                record[protocol.IDENTITY_CLUSTER_ID] = self.cluster_ids[node]
            return Message(RecordDict({protocol.IDENTITY_RECORD: record}), reply_to=msg)
        return Message(Error(code=0, reason=f"unknown message type {msg.metadata.message_type}"), reply_to=msg)

    # -- inspection
    def train_messages(self) -> list[Message]:
        return [m for m in self.sent if m.metadata.message_type == MessageType.TRAIN]

    def sampled_per_call(self, message_type: str = MessageType.TRAIN) -> list[list[int]]:
        """Destination nodes of each send_and_receive call that carried ``message_type``."""
        out = []
        for call in self.calls:
            nodes = [m.metadata.dst_node_id for m in call if m.metadata.message_type == message_type]
            if nodes:
                out.append(nodes)
        return out


# Flower's Grid is abstract; its set of abstract methods changes between versions. The
# strategies only call get_node_ids() and send_and_receive(), which FakeGrid implements.
FakeGrid.__abstractmethods__ = frozenset()


# --------------------------------------------------------------------------- messages
def named_arrays(record: ArrayRecord) -> dict[str, np.ndarray]:
    """An ArrayRecord as ``{name: numpy array}`` (copies, in record order)."""
    return OrderedDict((name, np.array(array.numpy())) for name, array in record.items())


def model_record(arrays: Mapping[str, np.ndarray]) -> ArrayRecord:
    return ArrayRecord(OrderedDict((name, Array(np.require(a, requirements="C"))) for name, a in arrays.items()))


def global_arrays_of(msg: Message) -> dict[str, np.ndarray]:
    """The global model a train/evaluate message carries."""
    return named_arrays(msg.content.array_records[protocol.ARRAYS_RECORD])


def config_of(msg: Message) -> ConfigRecord:
    return msg.content.config_records[protocol.CONFIG_RECORD]


def reply(msg: Message, records: Mapping[str, object]) -> Message:
    """A reply to ``msg`` carrying ``records``."""
    return Message(content=RecordDict(dict(records)), reply_to=msg)


def full_model_reply(
    msg: Message, arrays: Mapping[str, np.ndarray], num_examples: float | int = 10, **metrics: float
) -> Message:
    """What any Flower ClientApp sends after training: ``"arrays"`` + ``"metrics"``."""
    metric = MetricRecord({protocol.NUM_EXAMPLES: num_examples, **metrics})
    return reply(msg, {protocol.ARRAYS_RECORD: model_record(arrays), protocol.METRICS_RECORD: metric})


def error_reply(msg: Message, reason: str = "client crashed", code: int = 0) -> Message:
    return Message(Error(code=code, reason=reason), reply_to=msg)


def train_message(
    arrays: Mapping[str, np.ndarray],
    config: Mapping[str, object] | None = None,
    node_id: int = 1,
    message_type: str = MessageType.TRAIN,
) -> Message:
    """An outgoing message as a strategy would build it (with a message id)."""
    content = RecordDict(
        {protocol.ARRAYS_RECORD: model_record(arrays), protocol.CONFIG_RECORD: ConfigRecord(dict(config or {}))}
    )
    msg = Message(content=content, message_type=message_type, dst_node_id=node_id)
    FakeGrid._stamp(msg)
    return msg


def make_context(node_id: int, run_id: int = 1) -> Context:
    """A client Context with an empty ``state`` (Flower keeps it per node across rounds)."""
    return Context(run_id=run_id, node_id=node_id, node_config={}, state=RecordDict(), run_config={})


# --------------------------------------------------------------------------- a tiny model
TRAINABLE = ("conv.weight", "conv.bias", "bn.weight")
BUFFERS = ("bn.running_mean", "bn.num_batches_tracked")


def tiny_model(seed: int = 0) -> OrderedDict[str, np.ndarray]:
    """Three float32 trainable arrays (d = 12 + 3 + 4 = 19), a float and an int64 buffer."""
    rng = np.random.default_rng(seed)
    return OrderedDict(
        [
            ("conv.weight", rng.standard_normal((3, 4)).astype(np.float32)),
            ("conv.bias", rng.standard_normal(3).astype(np.float32)),
            ("bn.weight", np.ones(4, dtype=np.float32)),
            ("bn.running_mean", np.zeros(4, dtype=np.float32)),
            ("bn.num_batches_tracked", np.array(0, dtype=np.int64)),
        ]
    )


def flat_trainable(arrays: Mapping[str, np.ndarray], names: Iterable[str] = TRAINABLE) -> np.ndarray:
    """Concatenate the trainable arrays in model order (float64, for reference maths)."""
    return np.concatenate([np.asarray(arrays[n], dtype=np.float64).reshape(-1) for n in names])


def split_trainable(
    vector: np.ndarray, like: Mapping[str, np.ndarray], names: Iterable[str] = TRAINABLE
) -> dict[str, np.ndarray]:
    out, start = {}, 0
    for name in names:
        shape = np.asarray(like[name]).shape
        size = int(np.prod(shape, dtype=np.int64))
        out[name] = vector[start : start + size].reshape(shape)
        start += size
    return out


# --------------------------------------------------------------------------- logs
@contextlib.contextmanager
def capture_flwr_logs(level: int = logging.DEBUG) -> Iterator[list[logging.LogRecord]]:
    """Collect records logged through Flower's logger (``flwr``), which pollen uses."""
    records: list[logging.LogRecord] = []

    class _Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = _Collect(level)
    logger = logging.getLogger("flwr")
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


def messages_text(records: list[logging.LogRecord]) -> str:
    return "\n".join(r.getMessage() for r in records)


# --------------------------------------------------------------------------- driving a strategy
def run_train_round(strategy, grid: FakeGrid, server_round: int, arrays: ArrayRecord, config=None):  # noqa: ANN001, ANN201
    """One training round the way ``Strategy.start`` does it; returns (arrays, metrics, replies).

    ``arrays`` is what the next round should send: the aggregate, or the input when the
    strategy returned ``None``.
    """
    messages = strategy.configure_train(server_round, arrays, ConfigRecord(dict(config or {})), grid)
    replies = list(grid.send_and_receive(messages, timeout=5.0))
    new_arrays, metrics = strategy.aggregate_train(server_round, replies)
    return (arrays if new_arrays is None else new_arrays), metrics, replies
