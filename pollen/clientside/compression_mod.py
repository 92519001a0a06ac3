"""``compression_mod``: a Flower mod that turns a ClientApp's trained model into a compressed update.

Add it to any ClientApp (``ClientApp(mods=[compression_mod])`` or
``@app.train(mods=[compression_mod])``). When a pollen strategy's train message asks
for a codec (``pollen.codec`` in its config), the mod lets the ClientApp train as
usual, then replaces the reply's full ``"arrays"`` by

    p = (x_local - x_global) + e;   payload = C(p);   e <- p - decode(payload)

i.e. FedCAMS Algorithm 2, line 12. The residual ``e`` lives in ``context.state``, so
Flower keeps it per node across rounds; a node that is not sampled never runs the
mod and its residual stays exactly as it was. Non-trainable buffers travel apart,
uncompressed. Without a codec in the config the reply passes through untouched, so
the same ClientApp also serves FedAvg/FedAMS.
"""

from __future__ import annotations

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.clientapp.typing import ClientAppCallable

from pollen import protocol
from pollen.compression import make_codec
from pollen.compression.error_feedback import ErrorFeedback, compress_with_feedback
from pollen.layout import ModelLayout
from pollen.wire import arrays_to_record, payload_to_records, record_to_arrays

RESIDUAL_STATE_KEY = "pollen.ef-residual"


def load_residual(context: Context, dim: int) -> np.ndarray | None:
    """This node's error-feedback residual, or ``None`` (zero) when it has none of size ``dim``."""
    record = context.state.array_records.get(RESIDUAL_STATE_KEY)
    if record is None or "e" not in record:
        return None
    residual = record["e"].numpy()
    return residual if residual.shape == (dim,) else None


def store_residual(context: Context, residual: np.ndarray) -> None:
    context.state[RESIDUAL_STATE_KEY] = arrays_to_record({"e": residual})


def compress_reply(
    msg: Message, reply: Message, context: Context, global_arrays: dict[str, np.ndarray], config: ConfigRecord
) -> Message:
    """Replace the full model in ``reply`` by the compressed update that ``config`` asks for."""
    local_arrays = record_to_arrays(reply.content.array_records[protocol.ARRAYS_RECORD])
    buffer_keys = protocol.split_keys(str(config.get(protocol.CFG_BUFFER_KEYS, "")))
    layout = ModelLayout.from_arrays(global_arrays, buffer_keys)
    layout.check_arrays(local_arrays, layout.trainable + layout.buffers)
    delta = layout.flatten(local_arrays) - layout.flatten(global_arrays)

    granularity = str(config.get(protocol.CFG_GRANULARITY, "model"))
    codec = make_codec(
        str(config[protocol.CFG_CODEC]),
        topk_ratio=float(config.get(protocol.CFG_TOPK_RATIO, 1 / 64)),
        segments=layout.segments,
        granularity=granularity,
    )
    use_feedback = bool(config.get(protocol.CFG_ERROR_FEEDBACK, True))
    feedback = ErrorFeedback(residual=load_residual(context, layout.dim) if use_feedback else None, enabled=use_feedback)
    payload, feedback = compress_with_feedback(codec, delta, feedback)
    if use_feedback:
        store_residual(context, feedback.residual)

    update, meta = payload_to_records(payload, granularity)
    content = RecordDict({protocol.UPDATE_RECORD: update, protocol.UPDATE_META_RECORD: meta})
    if layout.buffers:
        content[protocol.BUFFERS_RECORD] = arrays_to_record({k: local_arrays[k] for k in layout.buffer_keys})
    for name, record in reply.content.items():
        if name != protocol.ARRAYS_RECORD and not isinstance(record, ArrayRecord):
            content[name] = record
    return Message(content=content, reply_to=msg)


def compression_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Flower mod: compress the train reply with error feedback when the server asks for it."""
    is_train = msg.metadata.message_type.split(".")[0] == "train"
    config = msg.content.config_records.get(protocol.CONFIG_RECORD) if is_train else None
    if config is None or protocol.CFG_CODEC not in config:
        return call_next(msg, context)
    # Snapshot what the mod needs: the ClientApp may consume the incoming records.
    global_arrays = record_to_arrays(msg.content.array_records[protocol.ARRAYS_RECORD])
    config = ConfigRecord(dict(config))
    reply = call_next(msg, context)
    if reply.has_error() or protocol.ARRAYS_RECORD not in reply.content.array_records:
        return reply
    return compress_reply(msg, reply, context, global_arrays, config)
