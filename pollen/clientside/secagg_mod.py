"""Secure aggregation on the client: a Flower mod for any ClientApp (pollen's own runs it too).

``secagg_mod``: add it to a ClientApp (``ClientApp(mods=[secagg_mod])``) whose server runs a pollen strategy with
secure aggregation (``EngineParts(secagg=SecureAggregation(...))``, run-config ``secagg=true``). A train message
that carries a SecAgg+ setup (``pollen.secagg.*`` in its config, :mod:`pollen.strategies.engine.secure`) is
trained by the ClientApp as usual; then the mod

1. measures ``p = (x_local - x_global) + e`` over the trainable arrays (``e``: this client's error-feedback
   residual) and encodes it with the round's summable codec into integers, ``e <- p - decode(integers)``
   (:class:`~pollen.secagg.codec.SummableCodec`): the integers stay on the node (``context.state``), never sent;
2. answers with its public keys and the ClientApp's metrics, without the model.

The round's three later messages (``train`` messages whose config names the phase, ``secagg-share-keys``,
``secagg-masked-input``, ``secagg-unmask``, so that any ClientApp's train function receives them) are answered
by the mod alone from the node's state (:class:`~pollen.secagg.protocol.
SecAggClient`): its sealed shares, its masked integers, its shares for the unmasking. Every other message passes
through untouched, so the same ClientApp serves a server without secure aggregation.

The residual lives with the client's other state (:class:`~pollen.clientside.state.ClientState`: a file under
``state-dir`` when one is set), with what the round's integers stood for: error feedback is exact, as pollen's
other error-fed uploads. The server's ledger tells the next train message whether the round's sum took this
client's integers; a round that aborted, or one this client dropped out of before its masked integers arrived,
puts them back into the residual (:func:`pollen.clientside.feedback.settle`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.clientapp.typing import ClientAppCallable

from pollen.clientside.compression_mod import client_state_for
from pollen.clientside.feedback import settle
from pollen.core.layout import ModelLayout
from pollen.secagg.crypto import SecAggError
from pollen.secagg.protocol import SecAggClient
from pollen.wire import protocol
from pollen.wire.records import arrays_to_record, record_to_arrays

RESIDUAL = "secagg-residual"
#: What the last integers stood for (float32) and their round: owed back when the server says it did not take them.
PENDING = "secagg-pending"
PENDING_ROUND = "secagg-pending.round"
#: The node's round in ``context.state``: the protocol's client (JSON) and the encoded update (never sent).
STATE_CLIENT = "pollen.secagg-client"
STATE_UPDATE = "pollen.secagg-update"


def wants_secagg(config: ConfigRecord | None) -> bool:
    """Whether a train config carries a SecAgg+ setup (or says the round is too small for one)."""
    return config is not None and (protocol.CFG_SECAGG_ROUND in config or protocol.CFG_SECAGG_OFF in config)


def _setup_of(config: ConfigRecord) -> dict[str, Any]:
    """The protocol's setup from a train config; :class:`SecAggError` naming what is missing or malformed."""
    try:
        return {
            "neighbours": [int(v) for v in config.get(protocol.CFG_SECAGG_NEIGHBOURS, [])],
            "threshold": int(config[protocol.CFG_SECAGG_THRESHOLD]),
            "codec": {
                "clip": float(config[protocol.CFG_SECAGG_CLIP]),
                "bits": int(config[protocol.CFG_SECAGG_BITS]),
                "max_clients": int(config[protocol.CFG_SECAGG_MAX_CLIENTS]),
            },
            "dim": int(config[protocol.CFG_SECAGG_DIM]),
            "round": bytes(config[protocol.CFG_SECAGG_ROUND]),
        }
    except (KeyError, TypeError, ValueError) as err:
        raise SecAggError(
            f"the train message's secure-aggregation setup is incomplete: {type(err).__name__}: {err}"
        ) from None


def _sole_arrays(content: RecordDict, what: str) -> dict[str, np.ndarray]:
    records = [r for name, r in content.array_records.items() if not name.startswith(protocol.CLIENT_STATE_PREFIX)]
    if len(records) != 1:
        raise SecAggError(f"{what} carries {len(records)} model ArrayRecords; secure aggregation needs exactly one")
    return record_to_arrays(records[0])


def _rounding_rng(config: ConfigRecord, node_id: int) -> np.random.Generator:
    """The stochastic rounding's generator: from the round's seed and the node when the server sets one."""
    seed = config.get(protocol.CFG_SECAGG_SEED)
    if isinstance(seed, int) and not isinstance(seed, bool):
        return np.random.default_rng([seed, node_id & 0xFFFFFFFF, node_id >> 32])
    return np.random.default_rng()


def encode_and_advertise(delta: np.ndarray, config: ConfigRecord, context: Context, node_id: int) -> ConfigRecord:
    """Encode ``delta`` (flat float32) with error feedback, start the round's protocol, keep both in
    ``context.state``; the keys record of the reply.

    Error feedback is exact, as pollen's other error-fed uploads (:mod:`pollen.clientside.feedback`): the client
    keeps what its last integers stood for and their round; the server's ledger says in this message whether that
    round's sum took them, and what it did not take (an aborted round, a drop-out) goes back into the residual
    before this round's update is encoded."""
    setup = _setup_of(config)
    client = SecAggClient(node_id)
    keys = client.advertise(setup)
    if delta.shape != (client.dim,):
        raise SecAggError(f"the model has {delta.shape[0]} trainable values; the server's setup says {client.dim}")
    state = client_state_for(context, config)
    residual = state.get(RESIDUAL)
    pending = state.get(PENDING)
    pending_round = state.get(PENDING_ROUND, shape=(), dtype=np.int64)
    if residual is not None and residual.shape != delta.shape:
        residual = None  # another model: start again from e = 0
    if pending is not None and pending_round is not None and pending.shape == delta.shape:
        residual = settle(residual, pending, int(pending_round), config, int(config.get(protocol.CFG_SERVER_ROUND, 0)))
    wire, residual = client.codec.encode(delta, residual, _rounding_rng(config, node_id))
    state.set(RESIDUAL, residual)
    state.set(PENDING, client.codec.dequantize(client.codec.signed_sum(wire, 1)))
    state.set(PENDING_ROUND, np.array(int(config.get(protocol.CFG_SERVER_ROUND, 0)), dtype=np.int64))
    state.commit()
    _save(context, client, wire)
    return ConfigRecord(keys)


def _save(context: Context, client: SecAggClient, wire: np.ndarray | None = None) -> None:
    """Keep the round's protocol client (and, at the train message, its encoded update) in ``context.state``."""
    context.state[STATE_CLIENT] = ConfigRecord({"client": client.to_bytes()})
    if wire is not None:
        context.state[STATE_UPDATE] = arrays_to_record({"wire": wire})


def _load(context: Context, node_id: int) -> SecAggClient:
    """The round's protocol client :func:`_save` kept; :class:`SecAggError` when there is none."""
    saved = context.state.config_records.get(STATE_CLIENT) if STATE_CLIENT in context.state else None
    if not isinstance(saved, ConfigRecord) or not isinstance(saved.get("client"), bytes):
        raise SecAggError("a secure-aggregation phase arrived, but this node holds no round (its train message?)")
    return SecAggClient.from_bytes(saved["client"], node_id)


def _wire_of(context: Context, client: SecAggClient) -> np.ndarray:
    """The encoded update the train message kept, checked against the round's codec and size."""
    saved = context.state.array_records.get(STATE_UPDATE) if STATE_UPDATE in context.state else None
    if saved is None:
        raise SecAggError("this node's encoded update is missing from its state")
    wire = record_to_arrays(saved).get("wire")
    if wire is None or wire.dtype != client.codec.dtype or wire.shape != (client.dim,):
        raise SecAggError("this node's encoded update in its state does not fit the round")
    return wire


def _forget(context: Context) -> None:
    """Drop the round's protocol state from ``context.state`` (the round is over, or a new one begins)."""
    for name in (STATE_CLIENT, STATE_UPDATE):
        if name in context.state:
            del context.state[name]


def _pairs(record: ConfigRecord, ids_key: str, blobs_key: str) -> dict[int, bytes]:
    """``{id: blob}`` from the server's two parallel lists (both absent: empty); :class:`SecAggError` if malformed."""
    ids, blobs = record.get(ids_key, []), record.get(blobs_key, [])
    if not (isinstance(ids, list) and isinstance(blobs, list) and len(ids) == len(blobs)):
        raise SecAggError(f"the server's '{ids_key}' and '{blobs_key}' do not pair up")
    if not all(isinstance(v, int) for v in ids) or not all(isinstance(b, bytes) for b in blobs):
        raise SecAggError(f"the server's '{ids_key}' are not node ids or its '{blobs_key}' not bytes")
    return dict(zip(ids, blobs))


def answer_phase(msg: Message, context: Context) -> Message:
    """A secure-aggregation phase message, answered from the node's round; :class:`SecAggError` if it does not
    fit (the ClientApp's error reply tells the server, which counts this client as dropped)."""
    config = msg.content.config_records.get(protocol.CONFIG_RECORD, ConfigRecord())
    phase = str(config.get(protocol.CFG_PHASE, ""))
    node_id = msg.metadata.dst_node_id
    record = msg.content.config_records.get(protocol.SECAGG_RECORD)
    if record is None:
        raise SecAggError(f"the {phase} message carries no '{protocol.SECAGG_RECORD}' record")
    client = _load(context, node_id)
    if record.get(protocol.SECAGG_ROUND_ENTRY) != client.round_key:
        raise SecAggError(f"a {phase} message of another round (its round key is not this node's round's): refused")
    if phase == protocol.SECAGG_SHARE_PHASE:
        ids = record.get("ids", [])
        columns = {name: record.get(name, []) for name in ("c_pk", "s_pk", "b_commit")}
        if not isinstance(ids, list) or not all(
            isinstance(c, list) and len(c) == len(ids) and all(isinstance(b, bytes) for b in c)
            for c in columns.values()
        ):
            raise SecAggError("the server's neighbour keys do not pair up with their ids")
        keys = {int(v): {name: columns[name][i] for name in columns} for i, v in enumerate(ids)}
        sealed = client.share_keys(keys)
        reply = ConfigRecord({"to": sorted(sealed), "sealed": [sealed[v] for v in sorted(sealed)]} if sealed else {})
        _save(context, client)
        return Message(content=RecordDict({protocol.SECAGG_RECORD: reply}), reply_to=msg)
    if phase == protocol.SECAGG_MASKED_PHASE:
        masked = client.masked_input(_pairs(record, "from", "sealed"), _wire_of(context, client))
        _save(context, client)
        context.state[STATE_UPDATE] = ArrayRecord()  # the integers left the node masked; nothing keeps them
        reply_array = arrays_to_record({"masked": masked})
        return Message(content=RecordDict({protocol.SECAGG_RECORD: reply_array}), reply_to=msg)
    if phase == protocol.SECAGG_UNMASK_PHASE:
        alive, dropped = record.get("alive", []), record.get("dropped", [])
        survivors = record.get("survivors")
        if not (isinstance(alive, list) and isinstance(dropped, list) and isinstance(survivors, int)):
            raise SecAggError("the server's unmask request is malformed (alive, dropped, survivors)")
        shares = client.unmask(alive, dropped, survivors)
        _forget(context)  # the round is over for this client
        out = ConfigRecord()
        for kind in ("b", "s"):
            if shares[kind]:
                out[f"{kind}_ids"] = sorted(shares[kind])
                out[kind] = [shares[kind][v] for v in sorted(shares[kind])]
        return Message(content=RecordDict({protocol.SECAGG_RECORD: out}), reply_to=msg)
    raise SecAggError(f"unknown secure-aggregation phase {phase!r}; allowed: {', '.join(protocol.SECAGG_PHASES)}")


def secure_reply(msg: Message, reply: Message, context: Context, global_arrays: dict[str, np.ndarray]) -> Message:
    """Replace the model in a train ``reply`` by this client's keys, its update encoded and kept on the node."""
    config = msg.content.config_records[protocol.CONFIG_RECORD]
    local_arrays = _sole_arrays(reply.content, "the ClientApp's reply")
    buffer_keys = protocol.split_keys(str(config.get(protocol.CFG_BUFFER_KEYS, "")))
    layout = ModelLayout.from_arrays(global_arrays, buffer_keys)
    layout.check_arrays(local_arrays, layout.trainable + layout.buffers)
    delta = layout.flatten(local_arrays)
    delta -= layout.flatten(global_arrays)
    content = RecordDict()
    if protocol.CFG_SECAGG_OFF not in config:
        content[protocol.SECAGG_RECORD] = encode_and_advertise(delta, config, context, msg.metadata.dst_node_id)
    for name, record in reply.content.items():
        if not isinstance(record, ArrayRecord) and name not in content:
            content[name] = record
    return Message(content=content, reply_to=msg)


def secagg_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Flower mod: take part in a pollen server's secure aggregation when its messages ask for it.

    A train message with a SecAgg+ setup: the ClientApp trains, the mod encodes the update, keeps it on the node
    and answers with its keys and the ClientApp's metrics. A secure-aggregation phase message: answered by the mod
    from the node's state (the ClientApp is not called). Anything else passes through.
    """
    kind = msg.metadata.message_type
    config = msg.content.config_records.get(protocol.CONFIG_RECORD) if kind.startswith("train") else None
    if config is not None and str(config.get(protocol.CFG_PHASE, "")) in protocol.SECAGG_PHASES:
        return answer_phase(msg, context)
    if kind == protocol.PHASE_MESSAGE_TYPE or not wants_secagg(config):
        return call_next(msg, context)
    _forget(context)  # a new round: whatever an earlier, unfinished one left is dropped
    global_arrays = _sole_arrays(msg.content, "the train message")
    reply = call_next(msg, context)
    if reply.has_error():
        return reply
    return secure_reply(msg, reply, context, global_arrays)


__all__ = ["RESIDUAL", "answer_phase", "encode_and_advertise", "secagg_mod", "secure_reply", "wants_secagg"]
