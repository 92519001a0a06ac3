"""The client side of the lazy / bidirectional family (FedNLAA ... FedBACA) as a Flower mod.

Add it to any ClientApp that trains on the ``"arrays"`` it receives and replies with its trained
``"arrays"`` (``@app.train(mods=[lazy_mod])``; pollen's own ClientApp has it). For a message of the
family (its config has ``pollen.lazy.up-rule``) the mod:

1. **Downlink** (Algorithm 2, increment reading, spec ``papers/fedbaca.md`` §5.3): builds the model the
   client trains from. ``dense``: the message's full model (FedNLAA ... FedACA). ``full``: first contact
   or a resync; the model becomes this client's stored copy ``x_i``. ``send`` / ``skip`` / ``aa`` /
   ``keep``: a (compressed) increment, or only a flag, applied to the stored copy exactly as the
   server applies it to its mirror (:func:`pollen.lazy.apply_downlink`); the result must match the
   checksum the server sent. The client also keeps its copy of one round back, so a reply the server
   never got (the client moved on, the server did not) costs nothing: the checksum picks the copy the
   server holds. A client without a matching copy trains on nothing and replies only the flag
   ``lazy-resync``: the server sends the full model the next time.
2. lets the ClientApp train from that model (the message's ``"arrays"`` is replaced by it);
3. **Uplink** (Algorithms 1 and 3): ``Delta = x_trained - x_start``; the candidate is ``Delta`` or, with
   a codec, ``C(Delta + e)``; it is judged against the last vector this client transmitted (used only
   when its checksum equals the server's, so both sides reuse the same copy; again the one of a round back
   counts too) and replaced by a one-bit
   ``lazy-skip`` flag (NLA), sent with ``lazy-aa`` (AA) or sent as is. The error-feedback residual
   ``e`` keeps what the server did not apply (``applied`` EF, the default) or what the codec dropped
   (``compressed``); what the server says it did not apply of the last upload goes back into ``e``
   (:func:`pollen.clientside.feedback.settle`).

Everything the client keeps (its model copy, the last increment, the last upload, the residual) lives in
:class:`~pollen.clientside.state.ClientState`; nothing is written unless the reply is built.
"""

from __future__ import annotations

import numpy as np
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp.typing import ClientAppCallable

from pollen.clientside.compression_mod import RESIDUAL, client_state_for
from pollen.clientside.feedback import refused, settle
from pollen.clientside.state import ClientState
from pollen.compression import decode_payload, make_codec
from pollen.core.layout import ModelLayout
from pollen.lazy.rules import apply_downlink, checksum, judge, uplink_residual
from pollen.wire import protocol
from pollen.wire.records import arrays_to_record, payload_to_records, record_to_arrays, records_to_payload

COPY_PREFIX = "lazy.x/"  # the stored model copy, one entry per array
ORDER = "lazy.order"  # the copy's array names (utf-8 bytes): the server's flattening order
C_PREV = "lazy.c-prev"  # the last downlink vector applied (increment, or Variant C's model)
UP_REF = "lazy.up-ref"  # the last vector this client transmitted
# One round back: the reference and model copy the server held if it never got this client's last reply
# (a lost reply); the server's checksums say which of the two it holds.
PREV_X = "lazy.x-prev"
PREV_C_PREV = "lazy.c-prev-prev"
UP_REF_PREV = "lazy.up-ref-prev"
UP_USED = "lazy.up-used"  # what the server applies if it gets this client's last reply
UP_ROUND = "lazy.up-round"  # the round of that reply
DOWN_KINDS = ("dense", "full", "send", "skip", "aa", "keep")


def is_lazy(msg: Message) -> bool:
    """Whether ``msg`` is a train message of the lazy family."""
    if msg.metadata.message_type.split(".")[0] != "train":
        return False
    config = msg.content.config_records.get(protocol.CONFIG_RECORD)
    return config is not None and protocol.CFG_LAZY_UP_RULE in config


def lazy_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Flower mod: the lazy family's downlink before training and its judged uplink after."""
    if not is_lazy(msg):
        return call_next(msg, context)
    config = ConfigRecord(dict(msg.content.config_records[protocol.CONFIG_RECORD]))
    state = client_state_for(context, config)
    start = _start_model(msg, config, state)
    if start is None:
        return _resync_reply(msg)
    layout, start_arrays = start
    for name in (protocol.DOWN_RECORD, protocol.DOWN_META_RECORD, protocol.DOWN_BUFFERS_RECORD):
        if name in msg.content:
            del msg.content[name]
    msg.content[protocol.ARRAYS_RECORD] = arrays_to_record(start_arrays)
    reply = call_next(msg, context)
    if reply.has_error() or protocol.ARRAYS_RECORD not in reply.content.array_records:
        return reply
    # The ClientApp may have kept its own client state for this message: continue from what it wrote,
    # with this mod's vectors on top, so one commit keeps both.
    after = client_state_for(context, config, first_message=False)
    for name in set(state.names()) | set(after.names()):
        if name.startswith("lazy.") or name == RESIDUAL:
            _keep(after, name, state.get(name))
    content = _judged_upload(reply, config, after, layout, start_arrays)
    after.commit()
    return Message(content=content, reply_to=msg)


# ---------------------------------------------------------------------------- downlink
def _start_model(
    msg: Message, config: ConfigRecord, state: ClientState
) -> tuple[ModelLayout, dict[str, np.ndarray]] | None:
    """The layout and the named arrays to train from; ``None`` when the client must be resynced."""
    kind = str(config.get(protocol.CFG_LAZY_DOWN, "dense"))
    if kind not in DOWN_KINDS:
        raise ValueError(f"downlink kind {kind!r} is unknown; allowed: {', '.join(DOWN_KINDS)}")
    buffer_keys = protocol.split_keys(str(config.get(protocol.CFG_BUFFER_KEYS, "")))
    if kind in ("dense", "full"):
        arrays = {
            name: np.array(value)
            for name, value in record_to_arrays(msg.content.array_records[protocol.ARRAYS_RECORD]).items()
        }
        layout = ModelLayout.from_arrays(arrays, buffer_keys)
        if kind == "full":
            _store_copy(state, arrays)
            for name in (C_PREV, PREV_X, PREV_C_PREV):
                state.pop(name)
        return layout, arrays
    copy = _stored_copy(state)
    if copy is None:
        return None
    layout = ModelLayout.from_arrays(copy, buffer_keys)
    received = None
    if protocol.DOWN_RECORD in msg.content:
        payload = records_to_payload(
            msg.content.array_records[protocol.DOWN_RECORD], msg.content.config_records[protocol.DOWN_META_RECORD]
        )
        received = decode_payload(payload, layout.dim, segments=layout.segments)
    apply, target = str(config.get(protocol.CFG_LAZY_APPLY, "add")), str(config.get(protocol.CFG_LAZY_X_SUM, ""))
    bases = [(layout.flatten(copy), state.get(C_PREV))]
    previous = state.get(PREV_X)
    if previous is not None and previous.shape == (layout.dim,):  # the server may not have seen our last reply
        bases.append((np.array(previous), state.get(PREV_C_PREV)))
    for base, base_c_prev in bases:
        try:
            new_x, new_c_prev = apply_downlink(kind, received, base, base_c_prev, apply)
        except ValueError:  # e.g. a skip against an increment this base does not hold
            continue
        if checksum(new_x) == target:
            break
    else:
        return None
    _keep(state, PREV_X, base)
    _keep(state, PREV_C_PREV, base_c_prev)
    arrays = dict(copy)
    arrays.update(layout.unflatten(new_x))
    if protocol.DOWN_BUFFERS_RECORD in msg.content:
        arrays.update(
            {
                k: np.array(v)
                for k, v in record_to_arrays(msg.content.array_records[protocol.DOWN_BUFFERS_RECORD]).items()
            }
        )
    _store_copy(state, arrays)
    _keep(state, C_PREV, new_c_prev)
    return layout, arrays


def _keep(state: ClientState, name: str, value: np.ndarray | None) -> None:
    if value is None:
        state.pop(name)
    else:
        state.set(name, value)


def _store_copy(state: ClientState, arrays: dict[str, np.ndarray]) -> None:
    for name in [n for n in state.names() if n.startswith(COPY_PREFIX)]:
        state.pop(name)
    for name, value in arrays.items():
        state.set(COPY_PREFIX + name, value)
    state.set(ORDER, np.frombuffer(protocol.join_keys(list(arrays)).encode(), dtype=np.uint8))


def _stored_copy(state: ClientState) -> dict[str, np.ndarray] | None:
    order = state.get(ORDER)
    if order is None:
        return None
    names = protocol.split_keys(bytes(np.asarray(order, dtype=np.uint8)).decode())
    copy = {name: state.get(COPY_PREFIX + name) for name in names}
    if any(value is None for value in copy.values()):
        return None
    return {name: np.array(value) for name, value in copy.items()}


def _resync_reply(msg: Message) -> Message:
    content = RecordDict(
        {
            protocol.FLAGS_RECORD: ConfigRecord({protocol.FLAG_RESYNC: True}),
            protocol.METRICS_RECORD: MetricRecord({protocol.NUM_EXAMPLES: 1, "num-steps": 0}),
        }
    )
    return Message(content=content, reply_to=msg)


# ---------------------------------------------------------------------------- uplink
def _judged_upload(
    reply: Message, config: ConfigRecord, state: ClientState, layout: ModelLayout, start: dict[str, np.ndarray]
) -> RecordDict:
    local = record_to_arrays(reply.content.array_records[protocol.ARRAYS_RECORD])
    layout.check_arrays(local, layout.trainable + layout.buffers)
    delta = layout.difference(local, start)
    granularity = str(config.get(protocol.CFG_GRANULARITY, "model"))
    codec = make_codec(
        str(config.get(protocol.CFG_LAZY_UP_CODEC, "none")),
        topk_ratio=float(config.get(protocol.CFG_LAZY_UP_TOPK, 1 / 8)),
        segments=layout.segments,
        granularity=granularity,
    )
    feedback = bool(config.get(protocol.CFG_ERROR_FEEDBACK, False))
    residual = state.get(RESIDUAL) if feedback else None
    if residual is not None and residual.shape != delta.shape:
        residual = None
    last_used = state.get(UP_USED, shape=delta.shape, dtype=np.float32)
    last_round = state.get(UP_ROUND, shape=(), dtype=np.int64)
    server_round = int(config.get(protocol.CFG_SERVER_ROUND, 0))
    if feedback and last_used is not None and refused(config, None if last_round is None else int(last_round)):
        residual = None  # refused for its content (the outlier screen): dropped with the residual, not owed
    elif feedback and last_used is not None:
        # what the server did not apply of our last upload (skipped, rolled back, lost, clipped) is owed
        residual = settle(residual, last_used, None if last_round is None else int(last_round), config, server_round)
    compensated = delta if residual is None else np.add(delta, residual, dtype=np.float32)
    payload = codec.encode(compensated)
    cand = codec.decode(payload, layout.dim)
    ref = None  # the server holds no copy (or another one) unless a checksum matches: judge as a first upload
    for name in (UP_REF, UP_REF_PREV):
        stored = state.get(name)
        if (
            stored is not None
            and stored.shape == cand.shape
            and checksum(stored) == str(config.get(protocol.CFG_LAZY_REF_SUM, ""))
        ):
            ref = np.array(stored)
            break
    verdict = judge(cand, ref, str(config[protocol.CFG_LAZY_UP_RULE]), float(config.get(protocol.CFG_LAZY_UP_TAU, 0.0)))
    if feedback:
        state.set(
            RESIDUAL,
            uplink_residual(delta, residual, verdict.used, cand, str(config.get(protocol.CFG_LAZY_EF_MODE, "applied"))),
        )
    _keep(state, UP_REF_PREV, ref)
    _keep(state, UP_REF, verdict.new_ref)
    state.set(UP_USED, verdict.used)
    state.set(UP_ROUND, np.array(server_round, dtype=np.int64))
    content = RecordDict()
    if verdict.transmit:
        update, meta = payload_to_records(payload, granularity)
        content[protocol.UPDATE_RECORD] = update
        content[protocol.UPDATE_META_RECORD] = meta
    if layout.buffer_keys:
        content[protocol.BUFFERS_RECORD] = arrays_to_record({k: local[k] for k in layout.buffer_keys})
    if verdict.kind != "send":
        content[protocol.FLAGS_RECORD] = ConfigRecord(
            {protocol.FLAG_SKIP if verdict.kind == "skip" else protocol.FLAG_AA: True}
        )
    for name, record in reply.content.items():
        if name != protocol.ARRAYS_RECORD and name not in content:
            content[name] = record
    return content


__all__ = ["is_lazy", "lazy_mod"]
