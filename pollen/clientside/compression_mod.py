"""Compressed, error-fed uploads: a Flower mod for any ClientApp, and the function under it.

``compression_mod``: add it to any ClientApp (``ClientApp(mods=[compression_mod])`` or
``@app.train(mods=[compression_mod])``). When a pollen strategy's train message asks for a codec
(``pollen.codec`` in its config), the mod lets the ClientApp train as usual, then replaces the
reply's full ``"arrays"`` by

    p = (x_local - x_global) + e;   payload = C(p);   e <- p - decode(payload)

i.e. FedCAMS Algorithm 2, line 12. Every other record of the reply (metrics, extras, flags, the
client's own records) passes through untouched. Non-trainable buffers travel apart, uncompressed.
Without a codec in the config, or when the ClientApp already uploaded a compressed update, the
reply passes through untouched, so the same ClientApp also serves FedAvg/FedAMS. Inside one of
Flower's mods that read the reply's model arrays (``LocalDpMod``, ``fixedclipping_mod``,
``adaptiveclipping_mod``) it raises at once (a reason the server stops on) instead of handing them a
compressed reply they would answer with an error Flower cannot deliver.

``compress_update``: the same step for a ClientApp that already holds its update as one flat
vector (pollen's own ClientApp): no ``ArrayRecord`` of the full model is built only to be decoded
again. The residual ``e`` is kept with :class:`~pollen.clientside.state.ClientState` (in
``context.state``, and in a node-local file when node-config ``state-dir`` is set), so a node that
is not sampled keeps its residual exactly as it was.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.clientapp.typing import ClientAppCallable

from pollen.clientside.feedback import refused, settle
from pollen.clientside.identity import message_client_id, played_partition
from pollen.clientside.state import ClientState
from pollen.compression import decode_payload, make_codec
from pollen.compression.error_feedback import ErrorFeedback, compress_with_feedback
from pollen.compression.payload import Payload
from pollen.core.layout import ModelLayout
from pollen.wire import protocol
from pollen.wire.records import arrays_to_record, payload_to_records, record_to_arrays

try:  # Flower's Message API mods that read the reply's one ArrayRecord of model arrays (flwr >= 1.21)
    from flwr.clientapp.mod import LocalDpMod, adaptiveclipping_mod, fixedclipping_mod

    _REPLY_ARRAY_MOD_TYPES: tuple[type, ...] = (LocalDpMod,)
    _REPLY_ARRAY_MODS: tuple[object, ...] = (fixedclipping_mod, adaptiveclipping_mod)
except ImportError:  # pragma: no cover - a Flower without them
    _REPLY_ARRAY_MOD_TYPES, _REPLY_ARRAY_MODS = (), ()

RESIDUAL = "ef-residual"
# The last error-fed upload, as sent (its payload: a few bytes per value, not a dense vector) and its round.
PENDING_PREFIX = "ef-pending/"
PENDING_CODEC = "ef-pending.codec"
PENDING_ROUND = "ef-pending.round"


def _keep_pending(state: ClientState, payload: Payload, server_round: int) -> None:
    for name in [n for n in state.names() if n.startswith(PENDING_PREFIX)]:
        state.pop(name)
    for name, value in payload.arrays.items():
        state.set(PENDING_PREFIX + name, np.asarray(value))
    state.set(PENDING_CODEC, np.frombuffer(payload.codec.encode(), dtype=np.uint8))
    state.set(PENDING_ROUND, np.array(server_round, dtype=np.int64))


def _pending_upload(
    state: ClientState, dim: int, segments: Sequence[tuple[int, int]] | None
) -> tuple[np.ndarray | None, int | None]:
    """The last upload as the server would decode it, and its round; ``(None, None)`` when there is none."""
    codec = state.get(PENDING_CODEC, dtype=np.uint8)
    server_round = state.get(PENDING_ROUND, shape=(), dtype=np.int64)
    if codec is None or server_round is None:
        return None, None
    arrays = {n[len(PENDING_PREFIX) :]: state.get(n) for n in state.names() if n.startswith(PENDING_PREFIX)}
    try:
        payload = Payload(codec=bytes(np.asarray(codec, dtype=np.uint8)).decode(), dim=dim, arrays=arrays)
        return decode_payload(payload, dim, segments=segments), int(server_round)
    except ValueError:  # another model, or an edited file (a bad codec name or payload): nothing is owed on it
        return None, None


def wants_compression(config: ConfigRecord | None) -> bool:
    """Whether a train config asks for a compressed upload."""
    return config is not None and protocol.CFG_CODEC in config


def client_state_for(context: Context, config: ConfigRecord, *, first_message: bool = True) -> ClientState:
    """This node's :class:`ClientState` for the message whose config is ``config``.

    Node-config ``state-dir`` (else run-config ``state-dir``; presets do not set it) keeps it in a file that survives a
    SuperNode restart or a resumed run; ``client-id`` (else ``partition-<id>``) names the file and
    the strategy's ``pollen.run-key`` the run it belongs to. A message that names the partition its node
    plays (population mode, :mod:`pollen.clientside.identity`) is that partition's client, whose state lives
    in its file under the run-config ``state-dir`` only (a node's own would not follow the client to the next
    node that plays it): the node plays other clients between its messages.
    ``client-state-in-memory`` = false (node-config, else run-config) keeps it in that file only, none in
    ``context.state``.
    """
    node = context.node_config
    state_dir = str(node.get("state-dir") or context.run_config.get("state-dir") or "")
    client_id = message_client_id(node, config)
    in_memory = node.get("client-state-in-memory", context.run_config.get("client-state-in-memory", True))
    if played_partition(config) is not None:  # population mode: this node plays many clients; state follows the client
        state_dir = str(context.run_config.get("state-dir") or "")  # the run's, which every node reaches
        if not state_dir:
            raise ValueError(
                f"this node plays {client_id} (population mode), whose state must live in a file under the "
                "run-config state-dir; set it (a directory every node reaches)"
            )
        in_memory = False
    return ClientState(
        context,
        server_round=int(config.get(protocol.CFG_SERVER_ROUND, 0)),
        first_message=first_message,
        state_dir=state_dir or None,
        client_id=client_id,
        run_key=str(config.get(protocol.CFG_RUN_KEY, "")),
        in_memory=in_memory is not False,
    )


def compress_update(
    delta: np.ndarray,
    config: ConfigRecord,
    state: ClientState,
    *,
    segments: Sequence[tuple[int, int]] | None = None,
    buffers: Mapping[str, np.ndarray] | None = None,
) -> dict[str, ArrayRecord | ConfigRecord]:
    """The records of a compressed upload of ``delta`` (flat float32), as ``config`` asks.

    ``state`` holds the error-feedback residual and the last upload between rounds (updated here,
    committed by the caller; the part of the last upload the server says it did not apply goes back into
    the residual first, :mod:`pollen.clientside.feedback`); ``buffers`` (non-trainable arrays) travel
    uncompressed in ``pollen.buffers``.
    """
    granularity = str(config.get(protocol.CFG_GRANULARITY, "model"))
    codec = make_codec(
        str(config[protocol.CFG_CODEC]),
        topk_ratio=float(config.get(protocol.CFG_TOPK_RATIO, 1 / 64)),
        segments=segments,
        granularity=granularity,
    )
    use_feedback = bool(config.get(protocol.CFG_ERROR_FEEDBACK, True))
    residual = state.get(RESIDUAL) if use_feedback else None
    if residual is not None and residual.shape != delta.shape:
        residual = None  # the model changed size: start again from e = 0
    server_round = int(config.get(protocol.CFG_SERVER_ROUND, 0))
    if use_feedback:  # what the server did not apply of the last upload is owed, not lost
        pending, pending_round = _pending_upload(state, delta.shape[0], segments)
        if refused(config, pending_round):  # refused for its content: dropped with the residual, start from e = 0
            residual = None
        else:
            residual = settle(residual, pending, pending_round, config, server_round)
    payload, feedback = compress_with_feedback(codec, delta, ErrorFeedback(residual=residual, enabled=use_feedback))
    if use_feedback:
        state.set(RESIDUAL, feedback.residual)
        _keep_pending(state, payload, server_round)
    update, meta = payload_to_records(payload, granularity)
    records: dict[str, ArrayRecord | ConfigRecord] = {protocol.UPDATE_RECORD: update, protocol.UPDATE_META_RECORD: meta}
    if buffers:
        records[protocol.BUFFERS_RECORD] = arrays_to_record(buffers)
    return records


def compress_reply(
    msg: Message, reply: Message, context: Context, global_arrays: dict[str, np.ndarray], config: ConfigRecord
) -> Message:
    """Replace the full model in ``reply`` by the compressed update ``config`` asks for; keep the rest."""
    local_arrays = record_to_arrays(reply.content.array_records[protocol.ARRAYS_RECORD])
    buffer_keys = protocol.split_keys(str(config.get(protocol.CFG_BUFFER_KEYS, "")))
    layout = ModelLayout.from_arrays(global_arrays, buffer_keys)
    layout.check_arrays(local_arrays, layout.trainable + layout.buffers)
    delta = layout.flatten(local_arrays)
    delta -= layout.flatten(global_arrays)
    state = client_state_for(context, config)
    records = compress_update(
        delta, config, state, segments=layout.segments, buffers={k: local_arrays[k] for k in layout.buffer_keys}
    )
    if bool(config.get(protocol.CFG_ERROR_FEEDBACK, True)):
        state.commit()
    content = RecordDict(records)
    for name, record in reply.content.items():
        if name != protocol.ARRAYS_RECORD and name not in content:
            content[name] = record
    return Message(content=content, reply_to=msg)


def outer_mods(limit: int = 64) -> list[object]:
    """The mods Flower's ClientApp runs around the caller, innermost first, read from the call stack.

    Flower chains mods with ``make_ffn``: each is called from a ``new_ffn`` closure that holds it as ``_mod``.
    A mod cannot otherwise see the mods outside it; a Flower that chains them another way gives ``[]``.
    """
    frame, mods = sys._getframe(1), []
    for _ in range(limit):
        if frame is None:
            break
        if frame.f_code.co_name == "new_ffn" and (mod := frame.f_locals.get("_mod")) is not None:
            mods.append(mod)
        frame = frame.f_back
    return mods


def _check_outer_mods() -> None:
    """Refuse to run inside a Flower mod that reads the reply's model arrays: it cannot take a compressed reply,
    and the error it answers with is addressed to this mod's reply, not to the server's message, so Flower
    cannot deliver it and the server's round waits for its timeout."""
    for mod in outer_mods():
        if mod is not compression_mod and (isinstance(mod, _REPLY_ARRAY_MOD_TYPES) or mod in _REPLY_ARRAY_MODS):
            name = getattr(mod, "__name__", type(mod).__name__)
            raise ValueError(
                f"{protocol.SETUP_ERROR_PREFIX}compression_mod runs inside Flower's {name}, which reads the reply's "
                "model arrays and cannot take a compressed update (its error would not reach the server: the round "
                f"would wait for its timeout); allowed: compression_mod outside it, e.g. ClientApp(mods="
                f"[compression_mod]) with @app.train(mods=[{name}]) (docs/guides/drop-in.md)"
            )


def compression_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Flower mod: compress the train reply with error feedback when the server asks for it.

    Put it outside Flower's ``LocalDpMod`` / ``fixedclipping_mod`` / ``adaptiveclipping_mod`` (earlier in
    ``mods``): inside them it raises at once with the reason, which the server logs and stops on.
    """
    is_train = msg.metadata.message_type.split(".")[0] == "train"
    config = msg.content.config_records.get(protocol.CONFIG_RECORD) if is_train else None
    if not wants_compression(config) or protocol.ARRAYS_RECORD not in msg.content.array_records:
        return call_next(msg, context)
    _check_outer_mods()
    # Keep what the mod needs: the ClientApp may consume the incoming records. The arrays are
    # read-only views of the message bytes, not copies.
    global_arrays = record_to_arrays(msg.content.array_records[protocol.ARRAYS_RECORD])
    config = ConfigRecord(dict(config))
    reply = call_next(msg, context)
    if reply.has_error() or protocol.ARRAYS_RECORD not in reply.content.array_records:
        return reply  # nothing to compress, or the ClientApp compressed itself (compress_update)
    return compress_reply(msg, reply, context, global_arrays, config)
