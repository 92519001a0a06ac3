"""The hostile-reply matrix, generated from the method table: one bad client, every strategy, every record.

A new method in :data:`pollen.app.methods.METHODS` is covered without new test code: each method is
built from a small validated run-config (:func:`build_method`), an honest client answers every message
the strategy sends (:class:`HonestClients`: a tiny model with BatchNorm buffers, the upload in the wire
form the round's config asks for, through pollen's own client mods, plus every extra the strategy's
:meth:`reply_spec_for` declares), and in one round one client's replies are replaced by hostile ones.

What is attacked is read from the strategy's declarations and from the honest reply itself, never from
a per-method list (:func:`record_kinds`): the update in each wire form the reader accepts (Flower's full
``arrays`` and pollen's codec payload), the model's buffers, each declared extra and flag, the metrics
(the weight ``num-examples`` and the others), the replies of a mid-round phase (a strategy that overrides
``mid_round``), and the envelope (missing, extra or renamed records, duplicates, unasked nodes, a
previous round's reply, an error).

The oracle (:func:`judge`) is the same for every case: after the run, the strategy's state (its
``state_dict()`` flattened: model, optimiser slots, method state, screen history, sampler) is
bit-identical to a run where the attacker stayed silent from that reply on and the rejection is counted
with a reason (``rejected``), or bit-identical to the honest run (``harmless``: the reply meant the same,
or a duplicate / foreign reply was dropped with a reason); anything else escaped: the server raised
(``crashed``), a state value is NaN or Inf or differs from both references (``corrupted``), or the
round took no step with the honest replies (``stalled``).

No torch: the "training" of the honest clients is a seeded random step on numpy arrays.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict

from pollen.app.config import AppConfig, schema_defaults
from pollen.app.experiment import build_strategy
from pollen.app.methods import METHODS
from pollen.clientside.compression_mod import compression_mod
from pollen.clientside.lazy_mod import lazy_mod
from pollen.strategies.engine.replies import ReplySpec
from pollen.strategies.engine.rounds import RoundLoop
from pollen.testing.fakes import FakeGrid, config_of, full_model_reply, model_record, named_arrays
from pollen.wire import protocol

#: The nodes of every run; four make HA-Fed's one ring cluster (two uploaders) and leave three honest.
NODES = (11, 12, 13, 14)
CLIENT_IDS = {node: f"client-{i}" for i, node in enumerate(NODES)}
CLUSTERS = {node: "0" for node in NODES}
ROUNDS = 2
ATTACK_ROUND = 2
#: A node that is connected to no grid (its replies are never asked for).
STRANGER = 99
#: The round drivers the matrix runs on.
DRIVERS = ("sync", "async")
#: The asynchronous driver's settings in the matrix: every client in flight, a step when all have answered,
#: new jobs only at a step. Each step is then the synchronous round (``async.md`` §9.1), so the references
#: mean the same, and a hostile reply meets the asynchronous driver's binding of replies to jobs first.
ASYNC_CONFIG = {"driver": "async", "concurrency": len(NODES), "buffer-size": len(NODES), "refill": "flush"}
#: A silent client's job is dropped after this many seconds (the asynchronous driver waits for it).
ASYNC_TIMEOUT_S = 0.2

#: What every method is built with on top of its own recommended values: all clients train, no
#: federated evaluation, two local steps (HA-Fed gossips after each), one cluster of four.
RUN_CONFIG = {
    "fraction-train": 1.0,
    "fraction-evaluate": 0.0,
    "min-train-nodes": len(NODES),
    "local-steps": 2,
    "cluster-size": len(NODES),
    "uploaders-per-cluster": 2,
    "seed": 0,
}


# --------------------------------------------------------------------------- the model and the methods
def tiny_bn_model(seed: int = 0) -> OrderedDict[str, np.ndarray]:
    """A conv layer and a BatchNorm: 312 trainable values, BatchNorm's three buffers."""
    rng = np.random.default_rng(seed)
    return OrderedDict(
        [
            ("conv.weight", (rng.standard_normal((8, 4, 3, 3)) * 0.1).astype(np.float32)),
            ("conv.bias", np.zeros(8, np.float32)),
            ("bn.weight", np.ones(8, np.float32)),
            ("bn.bias", np.zeros(8, np.float32)),
            ("bn.running_mean", np.zeros(8, np.float32)),
            ("bn.running_var", np.ones(8, np.float32)),
            ("bn.num_batches_tracked", np.array(0, np.int64)),
        ]
    )


def method_names() -> list[str]:
    """Every registered method, in the table's order."""
    return list(METHODS)


def async_method_names() -> list[str]:
    """The registered methods that run on the asynchronous driver (the rest refuse it with their reason)."""
    names = []
    for name in METHODS:
        strategy = build_method(name)
        if hasattr(strategy, "job_messages") and getattr(strategy, "async_refusal", None) is None:
            names.append(name)
    return names


def build_method(name: str, **overrides: Any) -> Any:
    """The strategy of method ``name`` from a validated run-config (:data:`RUN_CONFIG` and ``overrides``)."""
    given = {"strategy": name, **RUN_CONFIG, **overrides}
    return build_strategy(AppConfig.from_run_config({**schema_defaults(), **given}, given=set(given)))


def has_mid_round(strategy: Any) -> bool:
    """Whether the strategy exchanges further messages inside a round (it overrides ``mid_round``)."""
    return getattr(type(strategy), "mid_round", RoundLoop.mid_round) is not RoundLoop.mid_round


def spec_of(strategy: Any, server_round: int) -> ReplySpec:
    """What a final reply of ``server_round`` declares (Flower's baselines: nothing beyond the model)."""
    spec_for = getattr(strategy, "reply_spec_for", None)
    return spec_for(server_round) if spec_for is not None else ReplySpec()


# --------------------------------------------------------------------------- honest clients
def phase_of(msg: Message) -> tuple[int, int]:
    """(round, phase index) of a train or mid-round message (0: the round's train message)."""
    config = config_of(msg)
    return int(config.get(protocol.CFG_SERVER_ROUND, 0)), int(config.get(protocol.CFG_PHASE_INDEX, 0))


_HONEST: dict[tuple, RecordDict] = {}
_HONEST_LIMIT = 4096


class HonestClients:
    """Every node's honest answers: a seeded small step from the model it got, in the form the config asks.

    A train message goes through pollen's client mods (``lazy_mod``, ``compression_mod``) as in pollen's
    ClientApp; a mid-round message through ``compression_mod``. The reply carries every extra the
    strategy declares for the round (non-negative ones drawn >= 0) and ``num-examples``.
    """

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy
        self.contexts: dict[int, Context] = {}
        #: The reply each node built before pollen's mods, by (node, round, phase): the full-model form.
        self.plain: dict[tuple[int, int, int], Message] = {}

    def context(self, node: int) -> Context:
        if node not in self.contexts:
            node_config = {"client-id": CLIENT_IDS.get(node, f"node-{node}")}
            self.contexts[node] = Context(1, node, node_config, RecordDict(), {})
        return self.contexts[node]

    def __call__(self, msg: Message) -> Message:
        context = self.context(msg.metadata.dst_node_id)
        if msg.metadata.message_type == protocol.PHASE_MESSAGE_TYPE:
            return compression_mod(msg, context, self._train)
        return lazy_mod(msg, context, lambda m, c: compression_mod(m, c, self._train))

    def _train(self, msg: Message, context: Context) -> Message:
        """The honest reply; memoised on everything it depends on (most runs share their first round)."""
        node = msg.metadata.dst_node_id
        server_round, phase = phase_of(msg)
        key = (
            node,
            server_round,
            phase,
            msg.metadata.message_type,
            repr(spec_of(self.strategy, server_round)),
            b"".join(a.data for a in msg.content.array_records[protocol.ARRAYS_RECORD].values()),
        )
        cached = _HONEST.get(key)
        if cached is None:
            cached = _HONEST[key] = self._fresh(msg)
            if len(_HONEST) > _HONEST_LIMIT:
                _HONEST.pop(next(iter(_HONEST)))
        out = Message(content=RecordDict(dict(cached.items())), reply_to=msg)
        self.plain[(node, server_round, phase)] = out
        return out

    def _fresh(self, msg: Message) -> RecordDict:
        node = msg.metadata.dst_node_id
        server_round, phase = phase_of(msg)
        rng = np.random.default_rng([node, server_round, phase])
        local = named_arrays(msg.content.array_records[protocol.ARRAYS_RECORD])
        for name, value in local.items():
            if name == "bn.running_mean":
                local[name] = (0.9 * value + 0.1 * rng.standard_normal(value.shape)).astype(np.float32)
            elif name == "bn.running_var":
                local[name] = (0.9 * value + 0.1 * rng.uniform(0.5, 1.5, value.shape)).astype(np.float32)
            elif value.dtype.kind in "iu":
                local[name] = (value + 2).astype(value.dtype)
            else:
                local[name] = (value + 0.01 * rng.standard_normal(value.shape)).astype(np.float32)
        out = full_model_reply(msg, local, num_examples=20 + node % 3, loss=1.0 + 0.1 * (node % 2))
        if msg.metadata.message_type != protocol.PHASE_MESSAGE_TYPE:
            layout = self.strategy_layout(local)
            for extra in spec_of(self.strategy, server_round).extras:
                size = extra.length(layout) if layout is not None else 0
                value = rng.uniform(0, 1e-3, size) if extra.nonnegative else rng.standard_normal(size) * 1e-2
                out.content[extra.record_name] = ArrayRecord(
                    OrderedDict([(protocol.EXTRA_ARRAY, Array(value.astype(np.float32)))])
                )
        return out.content

    def strategy_layout(self, local: Mapping[str, np.ndarray]) -> Any:
        from pollen.core.layout import ModelLayout

        layout = getattr(self.strategy, "layout", None)
        return layout if layout is not None else ModelLayout.from_arrays(local)


# --------------------------------------------------------------------------- the grid with an attacker
Tamper = Callable[["Attack", Message, Message], list[Message]]


@dataclass
class Attack:
    """Who is hostile, from which reply on, and what its replies become.

    ``tamper(attack, msg, honest)`` returns the replies the grid delivers instead of ``honest`` (none:
    silent). From the first message of round ``server_round`` and phase ``phase`` on, every reply of the
    attacker in that round is tampered with. ``history`` keeps every honest reply by (node, round, phase),
    for replays.
    """

    tamper: Tamper | None
    server_round: int = ATTACK_ROUND
    phase: int = 0
    attacker: int | None = None
    history: dict[tuple[int, int, int], Message] = field(default_factory=dict)
    clients: HonestClients | None = None
    asked: tuple[int, ...] = ()
    hit: int = 0
    #: An error raised by ``tamper`` itself (a bad case, not the server's fault).
    tamper_error: BaseException | None = None

    def active(self, msg: Message) -> bool:
        server_round, phase = phase_of(msg)
        return server_round == self.server_round and phase >= self.phase


def hide_refusal(msg: Message) -> None:
    """Take the ledger's refusal (``pollen.refused-round``) out of a message to the attacker's honest client.

    (In place; the hostile-reply tests call it too.)

    Told that its (tampered) upload was refused, pollen's mod would drop its residual, and the attacker's own
    client state would then differ from the silent reference's: the judge compares runs whose clients evolve
    alike, and what an attacker's ClientApp does with being told is its own business, not the server's state.
    """
    for name, record in list(msg.content.config_records.items()):
        if protocol.CFG_REFUSED_ROUND in record:
            msg.content.config_records[name] = ConfigRecord(
                {k: v for k, v in record.items() if k != protocol.CFG_REFUSED_ROUND}
            )


class AttackGrid(FakeGrid):
    """``FakeGrid`` whose attacker's replies pass through an :class:`Attack`.

    The attacker is the lowest node asked in the attacked round's first train batch (so it was sampled);
    every honest reply is computed first, so clients' own state evolves alike in every run.
    """

    def __init__(self, clients: HonestClients, attack: Attack) -> None:
        super().__init__(list(NODES), clients, client_ids=CLIENT_IDS, cluster_ids=CLUSTERS, keep_history=False)
        self.attack = attack

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        return self.deliver(list(messages))

    def deliver(self, messages: list[Message]) -> list[Message]:
        """Every message answered: honest replies, the attacker's through its tamper (none: silent)."""
        attack = self.attack
        replies: list[Message] = []
        for msg in messages:
            self._stamp(msg)
        attack.asked = tuple(m.metadata.dst_node_id for m in messages)
        trained = [m.metadata.dst_node_id for m in messages if m.metadata.message_type == "train"]
        if trained and attack.attacker is None and phase_of(messages[0])[0] == attack.server_round:
            attack.attacker = min(trained)
        for msg in messages:
            if msg.metadata.message_type == protocol.QUERY_IDENTIFY:
                replies.append(self._identify(msg))
                continue
            if msg.metadata.dst_node_id == attack.attacker:
                hide_refusal(msg)
            honest = self.client_fn(msg)
            node = msg.metadata.dst_node_id
            server_round, phase = phase_of(msg)
            attack.history[(node, server_round, phase)] = honest
            if node == attack.attacker and attack.active(msg):
                attack.hit += 1
                if attack.tamper is not None:
                    try:
                        replies.extend(attack.tamper(attack, msg, honest))
                    except Exception as err:  # noqa: BLE001 - the case is broken; the judge reports it
                        attack.tamper_error = err
            else:
                replies.append(honest)
        return replies


class AsyncAttackGrid(AttackGrid):
    """:class:`AttackGrid` for the asynchronous driver: ``push_messages`` answers every message at once, and
    ``pull_messages`` hands back every reply waiting, whatever message it claims to answer (a transport that
    does not check, so the driver's own binding of replies to jobs is what is tested)."""

    def __init__(self, clients: HonestClients, attack: Attack) -> None:
        super().__init__(clients, attack)
        self._waiting_replies: list[Message] = []

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        messages = list(messages)
        self._waiting_replies += self.deliver(messages)
        return [m.metadata.message_id for m in messages]

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        out, self._waiting_replies = self._waiting_replies, []
        return out


def run(name: str, attack: Attack, *, rounds: int = ROUNDS, driver: str = "sync", **overrides: Any) -> Any:
    """Run method ``name`` for ``rounds`` rounds (steps) on round ``driver`` against ``attack``; the strategy."""
    random.seed(0)  # Flower's baselines sample with the global generator
    asynchronous = driver == "async"
    strategy = build_method(name, **{**(ASYNC_CONFIG if asynchronous else {}), **overrides})
    attack.clients = HonestClients(strategy)
    grid = (AsyncAttackGrid if asynchronous else AttackGrid)(attack.clients, attack)
    initial = model_record(tiny_bn_model())
    timeout = ASYNC_TIMEOUT_S if asynchronous else 60.0
    result = strategy.start(grid=grid, initial_arrays=initial, num_rounds=rounds, timeout=timeout)
    strategy.hostile_result_arrays = result.arrays  # the global model Flower's FedAvg keeps no state of
    return strategy


# --------------------------------------------------------------------------- state
def state_arrays(strategy: Any) -> dict[str, np.ndarray]:
    """Every array of the strategy's ``state_dict()`` (numbers too), flattened to path -> array.

    The accounting (bytes, failure counts, timings) is left out: it differs between runs by design. So are
    the ledger's refusals (:mod:`~pollen.strategies.engine.ledger`): telling a client that its upload was refused
    is part of the counted rejection, not a trace of the reply in the model's state.
    """
    out: dict[str, np.ndarray] = {}
    ledger = getattr(strategy, "ledger", None)
    refused = getattr(ledger, "refused", None)
    if refused:
        ledger.refused = {}
        try:
            return state_arrays(strategy)
        finally:
            ledger.refused = refused

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, ArrayRecord):
            for key, item in value.items():
                out[f"{prefix}/{key}"] = np.asarray(item.numpy())
        elif isinstance(value, Mapping):
            for key, item in value.items():
                if key != "accounting":
                    walk(f"{prefix}/{key}", item)
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                walk(f"{prefix}/{index}", item)
        elif isinstance(value, np.ndarray) and value.dtype.kind != "O":
            out[prefix] = value
        elif isinstance(value, int) and not -(2**63) <= value < 2**63:  # a generator's 128-bit state
            out[prefix] = np.frombuffer(str(value).encode(), np.uint8)
        elif isinstance(value, (bool, int, float, np.number)):
            out[prefix] = np.asarray(value)
        elif isinstance(value, (str, bytes, np.ndarray)) or value is None:
            out[prefix] = np.frombuffer(repr(value).encode(), np.uint8)

    walk("", strategy.state_dict())
    walk("/result", getattr(strategy, "hostile_result_arrays", None))
    return out


def differences(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> list[str]:
    """The paths whose arrays are not bit-identical (dtype, shape and bytes), and those only one side has."""
    diff = sorted(set(a) ^ set(b))
    for key in sorted(set(a) & set(b)):
        x, y = a[key], b[key]
        if x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes():
            diff.append(key)
    return diff


def non_finite(state: Mapping[str, np.ndarray]) -> list[str]:
    return [key for key, value in state.items() if value.dtype.kind in "fc" and not np.isfinite(value).all()]
