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

Differential privacy (privacy spec §4, §6; :mod:`pollen.privacy.mechanisms`): when the train config asks for it
(``pollen.dp.mode``, ``pollen.dp.clip``, ``pollen.dp.noise-multiplier``, ``pollen.dp.seed``;
:mod:`pollen.wire.protocol`), the error-compensated update is privatised before it is compressed and the residual
is measured from the privatised vector::

    q = privatize(p);   payload = C(q);   e <- q - decode(payload)

``"central"`` clips ``p`` jointly to ``C`` (the trusted server re-clips, sums and noises); the decoded upload's
norm is then ``<= C`` for every codec (float16's rounding gets a margin, see :func:`compress_update`).
``"local"`` clips and adds ``N(0, (z*C)^2)`` per coordinate, fresh for every upload; a train message that asks
for local DP without a codec gets a dense upload (codec ``"none"``, no error feedback), so a ClientApp with this
mod gets local DP without an uplink codec. Central DP without a codec leaves the reply alone (the server clips).
A node can insist on local DP whatever the server says: node-config ``dp-min-noise-multiplier`` and/or
``dp-max-clip`` make it refuse (with an error naming the setting) every train message that asks for less.

``compress_update``: the same step for a ClientApp that already holds its update as one flat
vector (pollen's own ClientApp): no ``ArrayRecord`` of the full model is built only to be decoded
again. The residual ``e`` is kept with :class:`~pollen.clientside.state.ClientState` (in
``context.state``, and in a node-local file when node-config ``state-dir`` is set), so a node that
is not sampled keeps its residual exactly as it was.
"""

from __future__ import annotations

import hashlib
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.clientapp.typing import ClientAppCallable

from pollen.clientside.feedback import owed, refused, settle
from pollen.clientside.identity import message_client_id, played_partition
from pollen.clientside.state import ClientState
from pollen.compression import decode_payload, make_codec
from pollen.compression.codecs import Codec
from pollen.compression.error_feedback import ErrorFeedback, compress_with_feedback
from pollen.compression.payload import Payload
from pollen.core.layout import ModelLayout
from pollen.privacy.mechanisms import DP_MODES, SENT_NORM_TOLERANCE, l2_norm, noise_generator, privatize
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


def _pending_round(state: ClientState) -> int | None:
    """The round of the last upload kept in ``state`` (None when there is none), without decoding the upload."""
    server_round = state.get(PENDING_ROUND, shape=(), dtype=np.int64)
    return None if server_round is None or state.get(PENDING_CODEC, dtype=np.uint8) is None else int(server_round)


def _pending_upload(
    state: ClientState, dim: int, segments: Sequence[tuple[int, int]] | None
) -> tuple[np.ndarray | None, int | None]:
    """The last upload as the server would decode it, and its round; ``(None, None)`` when there is none."""
    server_round = _pending_round(state)
    if server_round is None:
        return None, None
    codec = state.get(PENDING_CODEC, dtype=np.uint8)
    arrays = {n[len(PENDING_PREFIX) :]: state.get(n) for n in state.names() if n.startswith(PENDING_PREFIX)}
    try:
        payload = Payload(codec=bytes(np.asarray(codec, dtype=np.uint8)).decode(), dim=dim, arrays=arrays)
        return decode_payload(payload, dim, segments=segments), server_round
    except ValueError:  # another model, or an edited file (a bad codec name or payload): nothing is owed on it
        return None, None


def wants_compression(config: ConfigRecord | None) -> bool:
    """Whether a train config asks for an upload this module builds: a codec, or local DP (then dense, codec "none")."""
    return config is not None and (protocol.CFG_CODEC in config or config.get(protocol.CFG_DP_MODE) == "local")


# ---------------------------------------------------------------------------------------------- differential privacy
#: Node-config keys of the node's own DP floor: when either is set, the node refuses any train message that asks for
#: weaker local DP (or none), whatever the server says.
NODE_DP_MIN_NOISE = "dp-min-noise-multiplier"
NODE_DP_MAX_CLIP = "dp-max-clip"
# float16 rounds each entry to within 2**-11 of itself (relative, normal range): clipping to C * (1 - 2**-10) keeps
# the decoded upload's norm <= C; a vector deep in float16's subnormal range may still exceed it, and is clipped
# again, tighter (at most _MAX_CLIP_TRIES times).
_FP16_CLIP_MARGIN = 1.0 - 2.0**-10
_MAX_CLIP_TRIES = 16


@dataclass(frozen=True)
class DpRequest:
    """The client-side DP a train message asks for (checked): mode, clip norm ``C``, noise multiplier ``z``
    (0.0 in central mode) and the simulation seed (``None``: fresh unpredictable noise)."""

    mode: str
    clip: float
    noise_multiplier: float = 0.0
    seed: int | None = None


def _setup_error(text: str) -> ValueError:
    return ValueError(f"{protocol.SETUP_ERROR_PREFIX}{text}")


def _finite_positive(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        return None
    number = float(value)
    return number if math.isfinite(number) and number > 0 else None


def _config_number(config: Mapping[str, Any], key: str, why: str) -> float:
    if key not in config:
        raise _setup_error(f"the train config asks for DP but has no '{key}'; allowed: a finite number > 0 ({why})")
    number = _finite_positive(config[key])
    if number is None:
        raise _setup_error(f"train config '{key}' = {config[key]!r}; allowed: a finite number > 0 ({why})")
    return number


def node_dp_floor(node_config: Mapping[str, Any] | None) -> tuple[float | None, float | None]:
    """The node's own DP floor: (``dp-min-noise-multiplier``, ``dp-max-clip``), ``None`` where unset.

    Values may be numbers or numeric strings; anything else is a ``ValueError`` naming the setting.
    """
    out: list[float | None] = []
    for key in (NODE_DP_MIN_NOISE, NODE_DP_MAX_CLIP):
        value = (node_config or {}).get(key)
        if value in (None, ""):
            out.append(None)
            continue
        number = value
        if isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                number = None
        checked = _finite_positive(number)
        if checked is None:
            raise _setup_error(f"node-config '{key}' = {value!r}; allowed: a finite number > 0, or unset")
        out.append(checked)
    return out[0], out[1]


def dp_request(config: Mapping[str, Any] | None, node_config: Mapping[str, Any] | None = None) -> DpRequest | None:
    """The DP a train config asks for (``None``: none), checked, and held against the node's own floor.

    Raises ``ValueError`` (text starting with :data:`pollen.wire.protocol.SETUP_ERROR_PREFIX`, so the server logs
    it and stops when no client can answer) for a bad value, and when node-config ``dp-min-noise-multiplier`` /
    ``dp-max-clip`` is set and the message asks for no DP, central DP, a smaller noise multiplier or a larger clip:
    the node does not trust the server to decide its privacy.
    """
    config = config or {}
    request = None
    mode = config.get(protocol.CFG_DP_MODE)
    if mode is None:
        stray = [k for k in (protocol.CFG_DP_CLIP, protocol.CFG_DP_NOISE, protocol.CFG_DP_SEED) if k in config]
        if stray:
            raise _setup_error(
                f"the train config sets {stray} but not '{protocol.CFG_DP_MODE}'; allowed: "
                f"'{protocol.CFG_DP_MODE}' = one of {list(DP_MODES)} with them, or none of them"
            )
    elif mode not in DP_MODES:
        raise _setup_error(f"train config '{protocol.CFG_DP_MODE}' = {mode!r}; allowed: one of {list(DP_MODES)}")
    else:
        clip = _config_number(config, protocol.CFG_DP_CLIP, "the L2 clip norm of the whole update")
        noise, seed = 0.0, None
        if mode == "local":
            noise = _config_number(config, protocol.CFG_DP_NOISE, "local DP's noise multiplier z, noise std z*C")
            if protocol.CFG_DP_SEED in config:
                seed = config[protocol.CFG_DP_SEED]
                if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
                    raise _setup_error(
                        f"train config '{protocol.CFG_DP_SEED}' = {seed!r}; allowed: an integer >= 0 "
                        "(reproducible simulations only), or absent (fresh unpredictable noise)"
                    )
                seed = int(seed)
        request = DpRequest(mode=str(mode), clip=clip, noise_multiplier=noise, seed=seed)
    _hold_to_floor(request, node_config)
    return request


def _hold_to_floor(request: DpRequest | None, node_config: Mapping[str, Any] | None) -> None:
    min_noise, max_clip = node_dp_floor(node_config)
    if min_noise is None and max_clip is None:
        return
    needs = []
    if min_noise is not None:
        needs.append(f"a noise multiplier >= {min_noise:g}")
    if max_clip is not None:
        needs.append(f"a clip norm <= {max_clip:g}")
    settings = " and ".join(
        f"node-config '{key}' = {value:g}"
        for key, value in ((NODE_DP_MIN_NOISE, min_noise), (NODE_DP_MAX_CLIP, max_clip))
        if value is not None
    )
    allowed = (
        f"allowed: a server run that asks for local DP ('{protocol.CFG_DP_MODE}' = 'local') with "
        f"{' and '.join(needs)}, or a node without these settings"
    )
    if request is None or request.mode != "local":
        asked = (
            f"no DP ('{protocol.CFG_DP_MODE}' absent)"
            if request is None
            else "central DP (the server would see this node's un-noised update)"
        )
        raise _setup_error(
            f"this node refuses the train message: its {settings} requires local DP on every upload, but the server "
            f"asked for {asked}; {allowed}"
        )
    if min_noise is not None and request.noise_multiplier < min_noise:
        raise _setup_error(
            f"this node refuses the train message: its node-config '{NODE_DP_MIN_NOISE}' = {min_noise:g}, but the "
            f"server asked for local DP with '{protocol.CFG_DP_NOISE}' = {request.noise_multiplier:g}; {allowed}"
        )
    if max_clip is not None and request.clip > max_clip:
        raise _setup_error(
            f"this node refuses the train message: its node-config '{NODE_DP_MAX_CLIP}' = {max_clip:g}, but the "
            f"server asked for local DP with '{protocol.CFG_DP_CLIP}' = {request.clip:g}; {allowed}"
        )


def _client_word(client_id: str) -> int:
    """A 64-bit word naming a client in a seeded noise key (the same id always gives the same word)."""
    return int.from_bytes(hashlib.sha256(client_id.encode()).digest()[:8], "big")


def upload_noise_generator(dp: DpRequest, config: Mapping[str, Any], client_id: str) -> np.random.Generator:
    """The generator of one upload's local noise: fresh from the OS, or, with ``pollen.dp.seed`` (simulation
    only), keyed from (seed, client id, server round, message index within the round)."""
    if dp.seed is None:
        return noise_generator(None)
    server_round = int(config.get(protocol.CFG_SERVER_ROUND, 0))
    phase_index = int(config.get(protocol.CFG_PHASE_INDEX, 0))
    return noise_generator(dp.seed, _client_word(client_id), max(server_round, 0), max(phase_index, 0))


def private_upload(
    codec: Codec, delta: np.ndarray, feedback: ErrorFeedback, dp: DpRequest, rng: np.random.Generator | None = None
) -> tuple[Payload, ErrorFeedback]:
    """:func:`compress_with_feedback` with ``dp``'s privatisation of ``p = delta + e`` before the codec.

    Local: clip to ``C``, add ``N(0, (z*C)^2)`` from ``rng`` (what is sent is post-processing of that).
    Central: clip, and check the decoded upload's norm is ``<= C * (1 + 1e-6)``: scaled sign and top-k never
    exceed ``C`` (up to float32 rounding); float16 is clipped to ``C * (1 - 2**-10)`` first, which covers its
    rounding in the normal range, and if the decoded upload still exceeds ``C`` (entries in float16's subnormal
    range) it is clipped again, tighter, from the same ``p`` and residual.
    """
    if dp.mode == "local":
        if rng is None:
            raise ValueError("local DP needs the upload's noise generator")
        return compress_with_feedback(
            codec, delta, feedback, privatize=lambda p: privatize(p, "local", dp.clip, dp.noise_multiplier, rng)
        )
    bound = dp.clip * (1.0 + SENT_NORM_TOLERANCE)
    target = dp.clip * _FP16_CLIP_MARGIN if codec.name == "fp16" else dp.clip
    for _ in range(_MAX_CLIP_TRIES):
        clip = target
        payload, new_feedback = compress_with_feedback(
            codec, delta, feedback, privatize=lambda p, clip=clip: privatize(p, "central", clip)
        )
        sent = l2_norm(codec.decode(payload, delta.shape[0]))
        if sent <= bound:
            return payload, new_feedback
        target *= min(1.0, dp.clip / sent) * _FP16_CLIP_MARGIN
    raise ValueError(
        f"the {codec.name} upload's norm stays above the DP clip norm {dp.clip:g} after {_MAX_CLIP_TRIES} clips"
    )


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
        session=str(config.get(protocol.CFG_SESSION, ""))[:64],
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

    Differential privacy, when ``config`` asks for it (:func:`dp_request`, which also holds it to the node's own
    floor from ``state.context.node_config``): ``p = delta + e`` is privatised before the codec and the residual
    is measured from the privatised vector (:func:`private_upload`). Without a codec, local DP sends a dense
    upload (codec ``"none"``, no error feedback). Local DP refuses non-trainable ``buffers`` (BatchNorm running
    statistics are computed from the data and would leave the node un-noised).
    """
    dp = dp_request(config, state.context.node_config)
    if protocol.CFG_CODEC in config:
        codec_name = str(config[protocol.CFG_CODEC])
        use_feedback = bool(config.get(protocol.CFG_ERROR_FEEDBACK, True))
    elif dp is not None and dp.mode == "local":
        codec_name, use_feedback = "none", False  # local DP without an uplink codec: a dense, noised upload
    else:
        raise ValueError(
            f"the train config asks for no codec ('{protocol.CFG_CODEC}') and no local DP: nothing to compress"
        )
    if dp is not None and dp.mode == "local" and buffers:
        raise _setup_error(
            f"local DP cannot privatise the model's non-trainable buffers {sorted(buffers)}: they are computed from "
            "the data (e.g. BatchNorm running statistics) and would leave the node un-noised; allowed: a model "
            "without such buffers (e.g. GroupNorm instead of BatchNorm), or central DP"
        )
    granularity = str(config.get(protocol.CFG_GRANULARITY, "model"))
    codec = make_codec(
        codec_name,
        topk_ratio=float(config.get(protocol.CFG_TOPK_RATIO, 1 / 64)),
        segments=segments,
        granularity=granularity,
    )
    residual = state.get(RESIDUAL) if use_feedback else None
    if residual is not None and residual.shape != delta.shape:
        residual = None  # the model changed size: start again from e = 0
    server_round = int(config.get(protocol.CFG_SERVER_ROUND, 0))
    if use_feedback:  # what the server did not apply of the last upload is owed, not lost
        pending, pending_round = None, _pending_round(state)
        if refused(config, pending_round) or owed(config, pending_round, server_round):  # else nothing to decode
            pending, pending_round = _pending_upload(state, delta.shape[0], segments)
        if refused(config, pending_round):  # refused for its content: dropped with the residual, start from e = 0
            residual = None
        else:
            residual = settle(residual, pending, pending_round, config, server_round)
    feedback = ErrorFeedback(residual=residual, enabled=use_feedback)
    if dp is None:
        payload, feedback = compress_with_feedback(codec, delta, feedback)
    else:
        rng = None
        if dp.mode == "local":
            rng = upload_noise_generator(dp, config, message_client_id(state.context.node_config, config))
        payload, feedback = private_upload(codec, delta, feedback, dp, rng)
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
    if protocol.CFG_CODEC in config and bool(config.get(protocol.CFG_ERROR_FEEDBACK, True)):
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

    Differential privacy (module docstring): a train message's DP entries are checked, and held to the node's
    floor, before the ClientApp trains; a refusal or a bad value raises with the reason. A train reply that still
    carries the full model un-noised when local DP is asked for (a message without a global model to measure
    the update from) raises instead of leaving the node.
    """
    is_train = msg.metadata.message_type.split(".")[0] == "train"
    config = msg.content.config_records.get(protocol.CONFIG_RECORD) if is_train else None
    dp = dp_request(config, context.node_config) if is_train else None
    local = dp is not None and dp.mode == "local"
    if local and config is not None and protocol.CFG_LAZY_UP_RULE in config:
        raise _setup_error(
            "the lazy family's uplink (lazy_mod: skip / send judged on the update) does not take client-side local DP; "
            "allowed: local DP with the other methods, or central DP"
        )
    if not wants_compression(config) or protocol.ARRAYS_RECORD not in msg.content.array_records:
        reply = call_next(msg, context)
        if local and not reply.has_error() and protocol.ARRAYS_RECORD in reply.content.array_records:
            raise _setup_error(
                "the train message asks for local DP but carries no global model to measure the update from, and "
                "the ClientApp replied with its full model: it would leave the node un-noised"
            )
        return reply
    _check_outer_mods()
    # Keep what the mod needs: the ClientApp may consume the incoming records. The arrays are
    # read-only views of the message bytes, not copies.
    global_arrays = record_to_arrays(msg.content.array_records[protocol.ARRAYS_RECORD])
    config = ConfigRecord(dict(config))
    reply = call_next(msg, context)
    if reply.has_error() or protocol.ARRAYS_RECORD not in reply.content.array_records:
        return reply  # nothing to compress, or the ClientApp compressed itself (compress_update)
    return compress_reply(msg, reply, context, global_arrays, config)
