"""Reading a client's reply, once, for every strategy: model update, buffers, named extras and flags.

A method says what it expects in a :class:`ReplySpec` (its update, extra vectors such as a second
moment ``v_i`` or a gradient, one-bit flags such as "skip"); :func:`read_reply` checks the reply against
the model layout and that spec and returns a :class:`ClientUpdate`, or raises :class:`ReplyRejected`
with a short reason. Nothing in a reply is trusted: record kinds, names, dtypes (real floating point
for trained values, the model's own kind for buffers), shapes, byte lengths against the declared
shape (before anything is allocated, see :func:`pollen.wire.array_to_numpy`), finiteness after the
cast to the dtype that is used, and the weight metric. The strategy's state is not touched here, so
a rejected reply leaves no trace but a failure count.

Wire forms of the update (``protocol``): Flower's ordinary full model under ``"arrays"`` (what any
ClientApp sends; the update is ``x_local - x_global``; the strategy's ``arrayrecord_key``, or as in
Flower the reply's one ArrayRecord whatever its name), or a codec payload ``pollen.update`` +
``pollen.update-meta`` with the buffers apart in ``pollen.buffers``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from pollen.compression import decode_payload
from pollen.core.layout import ModelLayout
from pollen.strategies.engine.client_errors import client_error_text
from pollen.strategies.engine.screening import peak_magnitude, vector_stats
from pollen.wire import protocol
from pollen.wire.records import record_to_arrays, records_to_payload

#: Largest weight (``num-examples``) a reply may claim; keeps weighted sums finite in float64.
MAX_WEIGHT = 1e12
UPDATE_MODES = ("required", "optional")
#: Buffers that are second moments by name (PyTorch's normalisation layers' ``running_var``): never negative.
NONNEGATIVE_BUFFERS = ("running_var",)
#: How a record is screened against the same record of other replies: by its L2 norm, or not at all.
SCREEN_MODES = ("norm", "off")
#: Prefixes of the record kinds the outlier screen keeps a history for (``"extra:v"``, ``"buffer:bn.running_var"``).
EXTRA_KIND, BUFFER_KIND = "extra:", "buffer:"


class ReplyRejected(ValueError):
    """A reply that cannot be used; the message is the logged reason."""


class ClientErrorReply(ReplyRejected):
    """A client's Flower error reply; the reason is the exception its ClientApp raised, logged at length."""


@dataclass(frozen=True)
class Extra:
    """A named extra vector a method exchanges with its clients (in ``pollen.x.<name>``).

    Parameters
    ----------
    name : str
        The extra's name (``"v"``, ``"grad"``, ...).
    size : int | str
        Its length: a number, ``"model"`` (the number of trainable values d) or ``"tensors"`` (one
        value per trainable tensor).
    required : bool (default: True)
        A reply without it is rejected; otherwise it is simply absent from ``ClientUpdate.extras``.
    nonnegative : bool (default: False)
        Reject negative values (second moments, squared norms).
    screen : str (default: "norm")
        ``"norm"``: the outlier screen judges its L2 norm against the same extra of the other
        replies (and its history), with the update screen's rule and factor; ``"off"``: only the
        hard limit and the checks above (for values whose scale legitimately differs per client).
    """

    name: str
    size: int | str = "model"
    required: bool = True
    nonnegative: bool = False
    screen: str = "norm"

    def __post_init__(self) -> None:
        if self.screen not in SCREEN_MODES:
            raise ValueError(
                f"extra {self.name!r}: screen={self.screen!r} is unknown; allowed: {', '.join(SCREEN_MODES)}"
            )

    @property
    def kind(self) -> str:
        """Its record kind in the outlier screen's history."""
        return EXTRA_KIND + self.name

    @property
    def record_name(self) -> str:
        return protocol.extra_record(self.name)

    def length(self, layout: ModelLayout) -> int:
        if self.size == "model":
            return layout.dim
        if self.size == "tensors":
            return len(layout.trainable)
        if isinstance(self.size, int) and not isinstance(self.size, bool) and self.size >= 0:
            return self.size
        raise ValueError(f"extra {self.name!r}: size {self.size!r} is not an int, 'model' or 'tensors'")


@dataclass(frozen=True)
class ReplySpec:
    """What a method expects in a reply.

    Parameters
    ----------
    extras : tuple[Extra, ...]
        Extra vectors (``pollen.x.<name>``).
    flags : tuple[str, ...]
        Names of boolean flags the reply may carry in ``pollen.flags`` (absent = False).
    update : str (default: "required")
        ``"required"``: a model update must be present; ``"optional"``: a reply may carry none (a
        lazy client that sends only a flag), then ``ClientUpdate.delta`` is ``None``.
    buffers : str (default: "norm")
        ``"norm"``: each floating-point buffer is screened by its L2 norm against the same buffer
        of the other replies (one kind per buffer); integer buffers (counters) never are.
        ``"off"``: buffers get the hard limit only.
    weight : bool (default: False)
        The reply must carry a positive weight (``weighted_by_key``): a method that weighs updates by
        their examples needs it (so does ``aggregation="weighted"``, whatever the spec says).
    """

    extras: tuple[Extra, ...] = ()
    flags: tuple[str, ...] = ()
    update: str = "required"
    buffers: str = "norm"
    weight: bool = False

    def for_round(self, server_round: int) -> ReplySpec:
        """What a final reply of ``server_round`` carries: this spec, every round. (A method whose replies
        change by round, FedLAMB's sync rounds, gives its strategy a spec object of its own with this method.)"""
        return self

    def __post_init__(self) -> None:
        if self.update not in UPDATE_MODES:
            raise ValueError(f"update={self.update!r} is unknown; allowed: {', '.join(UPDATE_MODES)}")
        if self.buffers not in SCREEN_MODES:
            raise ValueError(f"buffers={self.buffers!r} is unknown; allowed: {', '.join(SCREEN_MODES)}")
        names = [extra.name for extra in self.extras]
        if len(set(names)) != len(names):
            raise ValueError(f"extras {names} are not unique")


@dataclass
class ClientUpdate:
    """One client's validated contribution to a round.

    ``delta`` is ``x_local - x_global`` as float32 (``None`` when the method allows a reply without
    an update); ``record_bytes`` the bytes of each record of the reply, by record name;
    ``applied_scale`` the fraction of the update the server applies (below 1 when the outlier screen
    clipped it; the client is told, :mod:`pollen.strategies.engine.ledger`); ``record_norms`` the L2 norm of
    each record the outlier screen judges, by kind (``"extra:v"``, ``"buffer:bn.running_var"``);
    ``update_record`` the name of the record the update came in; ``reply`` the reply's MetricRecords and
    ConfigRecords (what a Flower metric aggregation function is given; the arrays are not kept);
    ``sent_round`` the round the client's message named when an asynchronous step applies it later;
    ``screen_clipped`` whether the outlier screen scaled the update down (its remainder is not owed).
    """

    client_key: str
    node_id: int
    delta: np.ndarray | None
    buffers: dict[str, np.ndarray]
    num_examples: float
    metrics: MetricRecord | None
    extras: dict[str, np.ndarray] = field(default_factory=dict)
    flags: dict[str, bool] = field(default_factory=dict)
    record_bytes: dict[str, int] = field(default_factory=dict)
    norm: float = 0.0
    applied_scale: float = 1.0
    record_norms: dict[str, float] = field(default_factory=dict)
    update_record: str = ""
    reply: RecordDict | None = None
    #: The round the client's message named, when it is not the round applying it (an asynchronous step).
    sent_round: int | None = None
    #: The outlier screen clipped the update: the part it cut is refused for its content, not owed (the ledger).
    screen_clipped: bool = False


def screened_kinds(spec: ReplySpec, layout: ModelLayout) -> list[str]:
    """The record kinds a reply read against ``spec`` may carry for the outlier screen."""
    kinds = [extra.kind for extra in spec.extras if extra.screen == "norm"]
    if spec.buffers == "norm":
        kinds += [BUFFER_KIND + b.name for b in layout.buffers if b.dtype.kind == "f"]
    return kinds


def record_norms(update: ClientUpdate, spec: ReplySpec) -> dict[str, float]:
    """The L2 norm of each record of ``update`` that ``spec`` screens, by kind (float64, finite values in)."""
    norms = {}
    for extra in spec.extras:
        if extra.screen == "norm" and extra.name in update.extras:
            norms[extra.kind] = vector_stats(update.extras[extra.name], float("inf"))[0]
    if spec.buffers == "norm":
        for name, value in update.buffers.items():
            if value.dtype.kind == "f":
                norms[BUFFER_KIND + name] = vector_stats(np.ravel(value), float("inf"))[0]
    return norms


def scale_record(update: ClientUpdate, kind: str, scale: float) -> None:
    """Scale record ``kind`` of ``update`` by ``scale`` (a new array: the reply's may be read-only)."""
    if kind.startswith(EXTRA_KIND):
        name = kind[len(EXTRA_KIND) :]
        update.extras[name] = update.extras[name] * np.float32(scale)
    elif kind.startswith(BUFFER_KIND):
        name = kind[len(BUFFER_KIND) :]
        value = update.buffers[name]
        update.buffers[name] = (value * scale).astype(value.dtype)
    else:
        raise ValueError(f"record kind {kind!r} is unknown; allowed: '{EXTRA_KIND}<name>' or '{BUFFER_KIND}<name>'")


def count_records(reply: Message) -> dict[str, int]:
    """Bytes of each record of a reply as Flower counts them; ``ReplyRejected`` if one cannot be counted."""
    sizes = {}
    for name, record in reply.content.items():
        try:
            sizes[name] = int(record.count_bytes())
        except Exception as err:  # Flower raises on some legal-looking values (e.g. empty strings)
            raise ReplyRejected(f"record '{name}' cannot be measured: {type(err).__name__}: {err}") from None
    return sizes


def read_reply(
    reply: Message,
    *,
    client_key: str,
    layout: ModelLayout,
    params: np.ndarray,
    spec: ReplySpec = ReplySpec(),
    arrayrecord_key: str = protocol.ARRAYS_RECORD,
    weighted_by_key: str = protocol.NUM_EXAMPLES,
    weight_required: bool = False,
    max_abs: float = float("inf"),
    scratch: np.ndarray | None = None,
) -> ClientUpdate:
    """Validate one reply against ``layout`` and ``spec``; raise ``ReplyRejected`` with the reason.

    ``params`` is the global model the reply's full model (if any) is compared with. The update's
    norm is computed in the same pass that checks it is finite and that no coordinate exceeds
    ``max_abs``; the buffers and every extra are held to the same hard limit. ``scratch`` (a float32
    vector of the model's size) is filled with the update (a full-model reply's difference, or a compressed
    payload decoded) instead of allocating one; the returned ``delta`` is then that buffer.
    """
    if reply.has_error():
        raise ClientErrorReply(f"client error: {client_error_text(reply.error.reason)}")
    record_bytes = count_records(reply)
    content = reply.content
    update_record, delta, buffers, squares = _read_update(content, layout, params, spec, arrayrecord_key, scratch)
    norm = 0.0
    if delta is not None:
        if squares is not None and math.isfinite(squares) and math.sqrt(squares) <= max_abs:
            norm = peak = math.sqrt(squares)  # summed while the difference was made (see _difference)
        else:
            norm, peak = vector_stats(delta, max_abs)
        if not np.isfinite(norm):
            raise ReplyRejected("update contains NaN or Inf")
        if peak > max_abs:
            raise ReplyRejected(f"update has a coordinate of magnitude {peak:.3g} > {max_abs:.3g} (hard limit)")
    for name, value in buffers.items():
        _check_magnitude(value, f"buffer '{name}'", max_abs)
        if name.endswith(NONNEGATIVE_BUFFERS) and value.size and value.min() < 0:
            raise ReplyRejected(f"buffer '{name}' holds negative values; a variance must be >= 0")
    extras = {
        extra.name: value
        for extra in spec.extras
        if (value := _read_extra(content, extra, layout, max_abs)) is not None
    }
    flags = _read_flags(content, spec)
    metrics = _first_metrics(content)
    num_examples = _read_weight(metrics, weighted_by_key, weight_required)
    update = ClientUpdate(
        client_key=client_key,
        node_id=reply.metadata.src_node_id,
        delta=delta,
        buffers=buffers,
        num_examples=num_examples,
        metrics=metrics,
        extras=extras,
        flags=flags,
        record_bytes=record_bytes,
        norm=norm,
        update_record=update_record,
        reply=RecordDict({**content.metric_records, **content.config_records}),
    )
    update.record_norms = record_norms(update, spec)
    return update


# ---------------------------------------------------------------------------- parts of a reply
def _array_record(content, name: str) -> ArrayRecord | None:  # noqa: ANN001
    record = content.get(name) if name in content else None
    if record is not None and not isinstance(record, ArrayRecord):
        raise ReplyRejected(f"record '{name}' is a {type(record).__name__}, expected an ArrayRecord")
    return record


def _sole_model_record(content) -> str | None:  # noqa: ANN001
    """The name of the reply's one ArrayRecord outside pollen's own names, if it has exactly one (Flower reads a
    reply's model from its one ArrayRecord whatever its name)."""
    names = [name for name in content.array_records if not name.startswith(protocol.CLIENT_STATE_PREFIX)]
    return names[0] if len(names) == 1 else None


def _read_update(
    content,
    layout: ModelLayout,
    params: np.ndarray,
    spec: ReplySpec,
    arrayrecord_key: str,
    scratch: np.ndarray | None,  # noqa: ANN001
) -> tuple[str, np.ndarray | None, dict[str, np.ndarray], float | None]:
    """The name of the record the update came in, the update, the buffers and, for a full-model reply, the
    update's sum of squares (else None)."""
    squares = None
    compressed = _array_record(content, protocol.UPDATE_RECORD)
    full = _array_record(content, arrayrecord_key)
    if full is None and compressed is None and (sole := _sole_model_record(content)) is not None:
        arrayrecord_key, full = sole, content.array_records[sole]
    if compressed is not None and full is not None:
        raise ReplyRejected(f"reply carries both '{arrayrecord_key}' and '{protocol.UPDATE_RECORD}'")
    if compressed is not None:
        meta = content.get(protocol.UPDATE_META_RECORD) if protocol.UPDATE_META_RECORD in content else None
        if not isinstance(meta, ConfigRecord):
            raise ReplyRejected("compressed update without its meta record")
        payload = records_to_payload(compressed, meta)
        delta = decode_payload(payload, layout.dim, segments=layout.segments, out=scratch)
        buffers = _read_buffers(content, layout)
    elif full is not None:
        arrays = record_to_arrays(full)
        _check_names(arrays, layout.keys, f"'{arrayrecord_key}'")
        for spec_ in layout.trainable:
            _check_shape(arrays[spec_.name], spec_.shape, spec_.name)
            if arrays[spec_.name].dtype.kind != "f":
                raise ReplyRejected(
                    f"array '{spec_.name}' has dtype {arrays[spec_.name].dtype}; allowed: floating point"
                )
        delta, squares = _difference(arrays, layout, params, scratch)
        buffers = _buffers_from(arrays, layout)
    else:
        if spec.update == "required":
            raise ReplyRejected(f"reply carries neither '{arrayrecord_key}' nor '{protocol.UPDATE_RECORD}' arrays")
        return "", None, {}, None
    delta = np.asarray(delta, dtype=np.float32)
    if delta.shape != (layout.dim,):
        raise ReplyRejected(f"decoded update has shape {delta.shape}, the model has ({layout.dim},)")
    return protocol.UPDATE_RECORD if compressed is not None else arrayrecord_key, delta, buffers, squares


_BLOCK = 1 << 16  # elements of a tensor subtracted and squared while in cache


def _difference(
    arrays: dict[str, np.ndarray], layout: ModelLayout, params: np.ndarray, out: np.ndarray | None
) -> tuple[np.ndarray, float]:
    """``flatten(arrays) - params`` and its sum of squares, in one pass per tensor, a block at a time.

    Values are cast to float32 first, as flatten does. The sum of squares is the float64 sum of each
    block's float32 ``dot``, taken while the block is in cache (so the norm needs no second read of the
    update; its last bits may differ from one ``dot`` over the whole vector). A value that is not finite
    after the cast (a float64 1e300) gives a non-finite difference and sum, which :func:`read_reply`
    rejects.
    """
    if out is None:
        out = np.empty(layout.dim, dtype=np.float32)
    squares = 0.0
    with np.errstate(over="ignore", invalid="ignore"):
        for spec, (start, stop) in zip(layout.trainable, layout.segments):
            value = np.reshape(arrays[spec.name], -1)
            for lo in range(0, stop - start, _BLOCK):
                hi = min(stop - start, lo + _BLOCK)
                part = value[lo:hi]
                if part.dtype != np.float32:
                    part = part.astype(np.float32)
                block = out[start + lo : start + hi]
                np.subtract(part, params[start + lo : start + hi], out=block)
                squares += float(np.dot(block, block))
    return out, squares


def _read_buffers(content, layout: ModelLayout) -> dict[str, np.ndarray]:  # noqa: ANN001
    if not layout.buffers:
        return {}
    record = _array_record(content, protocol.BUFFERS_RECORD)
    if record is None:
        raise ReplyRejected("compressed update without the model's buffers")
    arrays = record_to_arrays(record)
    _check_names(arrays, layout.buffer_keys, f"'{protocol.BUFFERS_RECORD}'")
    return _buffers_from(arrays, layout)


def _buffers_from(arrays: dict[str, np.ndarray], layout: ModelLayout) -> dict[str, np.ndarray]:
    """The buffers, cast to the model's dtypes and checked after the cast.

    Any real numeric kind is accepted (Flower's own aggregation turns integer counters into
    floats; a PyTorch client sends them back as integers); a float value must be finite after the
    cast, and an integer buffer must receive finite values inside its integer range.
    """
    out = {}
    for spec in layout.buffers:
        value = arrays[spec.name]
        _check_shape(value, spec.shape, spec.name)
        if value.dtype.kind not in "biuf":
            raise ReplyRejected(f"buffer '{spec.name}' has dtype {value.dtype}; allowed: a real number type")
        with np.errstate(over="ignore", invalid="ignore"):
            if spec.dtype.kind == "f":
                cast = np.asarray(value, dtype=spec.dtype).reshape(spec.shape)
                _check_finite(cast, f"buffer '{spec.name}'")
            else:
                if value.dtype.kind == "f":
                    _check_finite(value, f"buffer '{spec.name}'")
                if spec.dtype.kind in "iu" and value.size:
                    info = np.iinfo(spec.dtype)
                    if float(value.min()) < info.min or float(value.max()) > info.max:
                        raise ReplyRejected(f"buffer '{spec.name}' holds values outside {spec.dtype}")
                cast = (
                    np.asarray(np.rint(value) if value.dtype.kind == "f" else value)
                    .astype(spec.dtype)
                    .reshape(spec.shape)
                )
        out[spec.name] = cast
    return out


def _read_extra(content, extra: Extra, layout: ModelLayout, max_abs: float) -> np.ndarray | None:  # noqa: ANN001
    record = _array_record(content, extra.record_name)
    if record is None:
        if extra.required:
            raise ReplyRejected(f"reply lacks the extra record '{extra.record_name}'")
        return None
    arrays = record_to_arrays(record)
    _check_names(arrays, (protocol.EXTRA_ARRAY,), f"'{extra.record_name}'")
    value = arrays[protocol.EXTRA_ARRAY]
    length = extra.length(layout)
    if value.shape != (length,):
        raise ReplyRejected(f"extra '{extra.name}' has shape {value.shape}, expected ({length},)")
    if value.dtype.kind != "f":
        raise ReplyRejected(f"extra '{extra.name}' has dtype {value.dtype}; allowed: floating point")
    with np.errstate(over="ignore", invalid="ignore"):  # a float32 extra stays a read-only view of the reply's
        vector = value.astype(np.float32, copy=False)  # bytes (alive through the round; no extra is written to)
    _check_finite(vector, f"extra '{extra.name}'")
    _check_magnitude(vector, f"extra '{extra.name}'", max_abs)
    if extra.nonnegative and vector.size and vector.min() < 0:
        raise ReplyRejected(f"extra '{extra.name}' holds negative values; it must be >= 0")
    return vector


def _read_flags(content, spec: ReplySpec) -> dict[str, bool]:  # noqa: ANN001
    if protocol.FLAGS_RECORD not in content:
        return {name: False for name in spec.flags}
    record = content[protocol.FLAGS_RECORD]
    if not isinstance(record, ConfigRecord):
        raise ReplyRejected(f"record '{protocol.FLAGS_RECORD}' is a {type(record).__name__}, expected a ConfigRecord")
    unknown = sorted(set(record.keys()) - set(spec.flags))
    if unknown:
        raise ReplyRejected(f"unknown flags {unknown}; this method knows {list(spec.flags)}")
    flags = {}
    for name in spec.flags:
        value = record.get(name, False)
        if not isinstance(value, bool):
            raise ReplyRejected(f"flag '{name}' is {value!r}, expected true or false")
        flags[name] = value
    return flags


def _first_metrics(content) -> MetricRecord | None:  # noqa: ANN001
    if protocol.METRICS_RECORD in content.metric_records:
        return content.metric_records[protocol.METRICS_RECORD]
    return next(iter(content.metric_records.values()), None)


def _read_weight(metrics: MetricRecord | None, key: str, required: bool) -> float:
    if metrics is None or key not in metrics:
        if required:
            raise ReplyRejected(f"metrics lack '{key}', needed for weighted aggregation")
        return 1.0
    value = metrics[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ReplyRejected(f"'{key}' must be a positive number, got {value!r}")
    weight = float(value)
    if not (math.isfinite(weight) and 0 < weight <= MAX_WEIGHT):
        raise ReplyRejected(f"'{key}' must be a positive number <= {MAX_WEIGHT:g}, got {value!r}")
    return weight


# ---------------------------------------------------------------------------- checks
def _check_names(arrays: dict[str, np.ndarray], expected: tuple[str, ...], where: str) -> None:
    if sorted(arrays) != sorted(expected):
        missing = sorted(set(expected) - set(arrays))
        extra = sorted(set(arrays) - set(expected))
        raise ReplyRejected(
            f"array names in {where} do not match the model (missing {missing[:5]}, unexpected {extra[:5]})"
        )


def _check_shape(value: np.ndarray, shape: tuple[int, ...], name: str) -> None:
    size = int(np.prod(shape, dtype=np.int64))
    # A 0-d tensor may come back as shape (1,) from some converters: same value, accept.
    if tuple(value.shape) != shape and not (value.size == size == 1):
        raise ReplyRejected(f"array '{name}' has shape {tuple(value.shape)}, the model has {shape}")


def _check_magnitude(values: np.ndarray, what: str, max_abs: float) -> None:
    """``ReplyRejected`` when any value's magnitude exceeds ``max_abs`` (the hard limit updates have too).

    A second moment of 1e30 or a gradient entry of 1e20 is finite, but squared or kept in a running max
    it would pin the server's state at a huge value (or overflow float32) for the rest of the run.
    A float array is read as it is (its max and min, exact in any float type: no float64 copy of a
    model-size extra); an integer one through float64, where ``abs`` cannot overflow.
    """
    if values.size == 0 or not math.isfinite(max_abs):
        return
    if values.dtype.kind == "f":
        peak = peak_magnitude(values)
    else:
        peak = float(np.max(np.abs(values.astype(np.float64, copy=False))))
    if peak > max_abs:
        raise ReplyRejected(f"{what} has a value of magnitude {peak:.3g} > {max_abs:.3g} (hard limit)")


def _check_finite(vector: np.ndarray, what: str) -> None:
    if not np.isfinite(vector).all():
        raise ReplyRejected(f"{what} contains NaN or Inf")
