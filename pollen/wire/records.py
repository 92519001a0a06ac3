"""Flower glue shared by strategies and client-side mods: records <-> numpy, payloads.

Everything that converts between Flower's records and pollen's numpy world lives
here once: named arrays to an ``ArrayRecord`` and back, a codec ``Payload`` to the
records that carry it and back, and the byte count of what goes on the wire
(``record.count_bytes()``, never a formula).
"""

from __future__ import annotations

import io
from collections import OrderedDict
from collections.abc import Mapping

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from pollen.compression.payload import Payload, PayloadError
from pollen.wire import protocol


def arrays_to_record(arrays: Mapping[str, np.ndarray]) -> ArrayRecord:
    """Wrap named numpy arrays in an ``ArrayRecord``, keeping their order."""
    return ArrayRecord(OrderedDict((name, numpy_to_array(a)) for name, a in arrays.items()))


#: Array dtype kinds pollen accepts from the wire: bool, signed and unsigned integers, real floats.
#: Complex, datetime/timedelta, strings, objects and structured dtypes are refused.
WIRE_KINDS = "biuf"
_NPY_MAGIC = b"\x93NUMPY"
_MAX_HEADER = 10_000


_HEADER_CACHE: dict[tuple[str, tuple[int, ...]], tuple[bytes, np.dtype, int]] = {}
_HEADER_CACHE_LIMIT = 65_536


def _expected_header(dtype: str, shape: tuple[int, ...]) -> tuple[bytes, np.dtype, int] | None:
    """The exact ``.npy`` v1.0 header numpy writes for a C-ordered array of ``dtype`` and ``shape``.

    Cached per (dtype, shape): a model has a few hundred distinct tensors, so after the first
    reply each array's header is checked with one bytes comparison instead of being parsed.
    """
    key = (dtype, shape)
    cached = _HEADER_CACHE.get(key)
    if cached is None:
        try:
            descr = np.dtype(dtype)
        except TypeError:
            return None
        if descr.hasobject or descr.fields is not None or descr.kind not in WIRE_KINDS:
            return None
        stream = io.BytesIO()
        header = {"descr": np.lib.format.dtype_to_descr(descr), "fortran_order": False, "shape": shape}
        np.lib.format.write_array_header_1_0(stream, header)
        count = 1
        for n in shape:
            count *= n
        cached = (stream.getvalue(), descr, count)
        if len(_HEADER_CACHE) < _HEADER_CACHE_LIMIT:
            _HEADER_CACHE[key] = cached
    return cached


def array_to_numpy(array: Array) -> np.ndarray:
    """The numpy array a Flower ``Array`` carries, read without trusting its header.

    Same result as Flower's ``Array.numpy()`` (which loads the ``.npy`` bytes with ``np.load``), but: the header
    is parsed once and checked (dtype kind in :data:`WIRE_KINDS`, shape non-negative, the byte length
    after the header exactly what the shape and dtype declare) before anything is allocated, and the
    result is a read-only view of the message bytes, not a copy. Raises ``ValueError`` with the reason.
    """
    if array.stype != "numpy.ndarray":
        raise ValueError(f"serialisation type {array.stype!r} is not numpy.ndarray")
    data = array.data
    shape = tuple(array.shape) if isinstance(array.shape, (list, tuple)) else None
    if shape is not None and all(isinstance(n, int) and n >= 0 for n in shape) and isinstance(array.dtype, str):
        fast = _expected_header(array.dtype, shape)
        if fast is not None:
            header, dtype, count = fast
            if data[: len(header)] == header and len(data) - len(header) == count * dtype.itemsize:
                return np.frombuffer(data, dtype=dtype, count=count, offset=len(header)).reshape(shape)
    if not isinstance(data, (bytes, bytearray, memoryview)) or bytes(data[:6]) != _NPY_MAGIC or len(data) < 10:
        raise ValueError("data is not .npy bytes")
    stream = io.BytesIO(data)
    try:
        major, minor = np.lib.format.read_magic(stream)
        if (major, minor) == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(stream, max_header_size=_MAX_HEADER)
        elif (major, minor) in ((2, 0), (3, 0)):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(stream, max_header_size=_MAX_HEADER)
        else:  # np.load (Flower's Array.numpy) knows these three only
            raise ValueError(f"unknown .npy version {major}.{minor}; allowed: 1.0, 2.0, 3.0")
    except (ValueError, SyntaxError, TypeError, OverflowError) as err:
        raise ValueError(f"malformed .npy header ({err})") from None
    if dtype.hasobject or dtype.fields is not None or dtype.subdtype is not None or dtype.kind not in WIRE_KINDS:
        raise ValueError(f"dtype {dtype} is not allowed; allowed: bool, integer or real floating point")
    if any(not isinstance(n, int) or n < 0 for n in shape):
        raise ValueError(f"shape {shape} is not a tuple of non-negative integers")
    count = 1
    for n in shape:
        count *= n
    offset = stream.tell()
    if len(data) - offset != count * dtype.itemsize:
        raise ValueError(
            f"declares shape {shape} of {dtype} ({count * dtype.itemsize} bytes) but carries {len(data) - offset} bytes"
        )
    flat = np.frombuffer(data, dtype=dtype, count=count, offset=offset)
    return flat.reshape(shape, order="F" if fortran else "C")


def numpy_to_array(value: np.ndarray) -> Array:
    """A Flower ``Array`` holding ``value``: the ``.npy`` header and the raw bytes, one copy.

    Equal to ``Array(value)`` (which runs ``np.save`` into a buffer) for C-ordered arrays of the
    wire kinds, without the per-array ``np.save`` overhead.
    """
    value = np.asarray(value)
    expected = _expected_header(value.dtype.str, tuple(value.shape)) if value.dtype.kind in WIRE_KINDS else None
    if expected is None:
        return Array(np.require(value, requirements="C"))
    header = expected[0]
    data = b"".join((header, np.ascontiguousarray(value).data))  # one copy, straight into the bytes
    return Array(dtype=str(value.dtype), shape=tuple(value.shape), stype="numpy.ndarray", data=data)


def record_to_arrays(record: ArrayRecord) -> dict[str, np.ndarray]:
    """Unwrap an ``ArrayRecord`` (read-only views); ``ValueError`` naming an array that cannot be read."""
    out = {}
    for name, array in record.items():
        try:
            out[name] = array_to_numpy(array)
        except Exception as err:  # a malformed array from the wire, whatever numpy says
            raise ValueError(f"array '{name}' cannot be decoded: {err}") from err
    return out


def content_bytes(content: RecordDict) -> int:
    """Bytes of all records in a message content, as Flower counts them."""
    return int(sum(record.count_bytes() for record in content.values()))


def payload_to_records(payload: Payload, granularity: str) -> tuple[ArrayRecord, ConfigRecord]:
    """The records that carry a compressed update."""
    meta = ConfigRecord(
        {
            protocol.META_CODEC: payload.codec,
            protocol.META_DIM: int(payload.dim),
            protocol.META_GRANULARITY: granularity,
        }
    )
    return arrays_to_record(payload.arrays), meta


def records_to_payload(update: ArrayRecord, meta: ConfigRecord) -> Payload:
    """Rebuild a ``Payload`` from its records; ``PayloadError`` when the header is malformed."""
    codec = meta.get(protocol.META_CODEC)
    dim = meta.get(protocol.META_DIM)
    if not isinstance(codec, str):
        raise PayloadError(f"update meta has no codec name (got {codec!r})")
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise PayloadError(f"update meta has no integer dim (got {dim!r})")
    try:
        arrays = record_to_arrays(update)
    except ValueError as err:
        raise PayloadError(str(err)) from err
    return Payload(codec=codec, dim=dim, arrays=arrays)
