"""Symmetric per-tensor quantisation: FedAdaVR-Quant's QUANT / DEQUANT (Appendix C, Algorithms 8-9).

Pure numpy, no Flower. The same quantiser serves the FedAdaVR stored-update table (``pollen.vr``) and any
codec that wants FP16 / Int8 / Int4 payloads.

Scheme (spec ``papers/fedadavr.md`` section 3.7), one tensor at a time:

* ``fp32``: stored as is (4 bytes per element).
* ``fp16``: ``cast(W, float16)`` (2 bytes per element). Values beyond the FP16 range are saturated to
  +-65504 instead of becoming +-inf, so a single huge entry cannot poison a sum forever.
* ``int8``: ``alpha = max|W| / 127``; ``code = clip(round(W / alpha), -127, 127)`` (255 levels, -128 unused).
* ``int4``: ``alpha = max|W| / 7``; ``code = clip(round(W / alpha), -7, 7)`` (15 levels). Codes are shifted by
  +8 to 1..15 and packed two per byte, **even index in the high nibble**:
  ``byte[k] = ((code[2k] + 8) << 4) | (code[2k+1] + 8)``. An odd length is padded with one nibble of value 8
  (i.e. a zero), which :func:`dequantize` drops.

Symmetric, zero-point 0, one scale per tensor, deterministic round-half-to-even (``np.rint``), no stochastic
rounding. An all-zero tensor has ``alpha = 1.0`` and decodes to exact zeros.

What the 4 scale bytes hold. For the integer formats the 4 bytes stored next to the codes are the float32
``max|W|`` (``absmax``); ``alpha = absmax / qmax`` is derived from it in float64 when decoding, and decoding
computes ``code * absmax / qmax``. The information content is the same as storing a float32 ``alpha`` (one
float32 per tensor), but it makes the largest-magnitude element come back **exactly**: with a float32
``alpha`` the product ``127 * alpha`` misses ``max|W|`` by one ulp for about 0.5% of tensors (Int8) and 8% of
tensors (Int4), because not every float32 is a float32 multiple of 7 or 127. :attr:`QuantizedTensor.scale`
still reports ``alpha`` (1.0 for an all-zero tensor), as the spec names it.

Stored bytes per tensor of ``n`` elements (:func:`stored_bytes`; the shape tuple is metadata, not counted):
``fp32: 4n``, ``fp16: 2n``, ``int8: n + 4``, ``int4: ceil(n/2) + 4``, i.e. exactly 1/2, 1/4 + 4 B and
1/8 (+ the pad nibble) + 4 B of FP32.

Element-wise error bounds: fp16 relative <= 2**-11 in the normal range; int8 ``|W_hat - W| <= max|W|/254``;
int4 ``|W_hat - W| <= max|W|/14`` (plus float32 output rounding, at most 2**-24 * max|W|).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np

PRECISIONS = ("fp32", "fp16", "int8", "int4")
"""Allowed precisions, from no compression to the most compact."""

QMAX = {"int8": 127, "int4": 7}
"""Largest code magnitude of each integer format (symmetric range ``[-QMAX, QMAX]``)."""

FP16_MAX = 65504.0
"""Largest finite float16; larger magnitudes saturate to it."""

_STORAGE_DTYPE = {
    "fp32": np.dtype(np.float32),
    "fp16": np.dtype(np.float16),
    "int8": np.dtype(np.int8),
    "int4": np.dtype(np.uint8),
}
_SCALE_BYTES = 4  # one float32 per tensor for int8 / int4


def check_precision(precision: str) -> str:
    """Return ``precision`` if it is one of :data:`PRECISIONS`, else raise ``ValueError`` naming the choices."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not supported; allowed: {', '.join(PRECISIONS)}")
    return precision


def storage_dtype(precision: str) -> np.dtype:
    """Numpy dtype of the stored data array (float32, float16, int8 codes, uint8 packed nibbles)."""
    return _STORAGE_DTYPE[check_precision(precision)]


def is_integer(precision: str) -> bool:
    """True for the formats that store a per-tensor scale (``int8``, ``int4``)."""
    return check_precision(precision) in QMAX


def encoded_length(n: int, precision: str) -> int:
    """Number of stored data elements for an ``n``-element tensor (``ceil(n/2)`` bytes for int4, else ``n``)."""
    check_precision(precision)
    return (n + 1) // 2 if precision == "int4" else n


def stored_nbytes(n: int, precision: str) -> int:
    """Bytes needed to store an ``n``-element tensor: data plus 4 scale bytes for int8 / int4."""
    data = encoded_length(n, precision) * storage_dtype(precision).itemsize
    return data + (_SCALE_BYTES if is_integer(precision) else 0)


# ---------------------------------------------------------------------------------------------- int4 nibbles


def pack_int4(values: np.ndarray) -> np.ndarray:
    """Pack signed int4 values in ``[-7, 7]`` two per byte.

    ``byte[k] = ((v[2k] + 8) << 4) | (v[2k+1] + 8)``: even index in the high nibble, codes 1..15. An odd
    length is padded with one nibble 8 (value 0). Returns ``uint8[ceil(n/2)]``.
    """
    v = np.asarray(values).reshape(-1)
    if v.size and (v.min() < -7 or v.max() > 7):
        raise ValueError("int4 values must lie in [-7, 7]")
    u = (v.astype(np.int16) + 8).astype(np.uint8)
    if u.size % 2:
        u = np.concatenate([u, np.array([8], dtype=np.uint8)])
    return (u[0::2] << 4) | u[1::2]


def unpack_int4(packed: np.ndarray, n: int) -> np.ndarray:
    """Inverse of :func:`pack_int4`: the first ``n`` signed values (``int8``), padding dropped."""
    p = np.asarray(packed, dtype=np.uint8).reshape(-1)
    if n > 2 * p.size or n < 2 * p.size - 1:
        raise ValueError(f"{p.size} packed bytes cannot hold exactly {n} int4 values")
    u = np.empty(2 * p.size, dtype=np.int8)
    u[0::2] = p >> 4
    u[1::2] = p & 0x0F
    return u[:n] - np.int8(8)


# ------------------------------------------------------------------------------------- flat encode / decode


CHUNK = 1 << 16
"""Elements processed per step by the encoders / decoders: their float64 work stays in cache and no temporary
grows with the tensor (even, so an int4 chunk never splits a byte)."""


def absmax_of(x: np.ndarray) -> float:
    """float32 ``max|x|`` of a finite float array (two reductions, no ``|x|`` temporary)."""
    if not x.size:
        return 0.0
    return float(np.float32(max(float(x.max()), -float(x.min()))))


def encode_into(x: np.ndarray, precision: str, out: np.ndarray) -> float:
    """Quantise the flat float array ``x`` into the preallocated ``out`` (length :func:`encoded_length`).

    Returns the float32 ``max|x|`` that integer formats need for decoding (0.0 for fp32 / fp16, and for an
    all-zero tensor). ``x`` must be finite. This is the allocation-light primitive behind :func:`quantize`
    and the stored-update table: codes are computed in float64 ``CHUNK`` elements at a time, so they are
    exactly ``clip(rint(x * (qmax / absmax)))`` without a tensor-sized temporary.
    """
    x = np.asarray(x).reshape(-1)
    absmax = absmax_of(x) if precision in QMAX else 0.0
    work = BlockWork(min(CHUNK, x.size))
    for lo in range(0, x.size, CHUNK):
        hi = min(x.size, lo + CHUNK)
        encode_block(x[lo:hi], precision, absmax, out, lo, work)
    return absmax


class BlockWork:
    """Reusable scratch of one block (``CHUNK`` elements at most) for :func:`encode_block`."""

    def __init__(self, size: int) -> None:
        self.codes = np.empty(size, dtype=np.float64)
        self.small = np.empty(size + size % 2, dtype=np.int8)
        self.wide = np.empty(size // 2 + 1, dtype=np.uint16)


_LITTLE = sys.byteorder == "little"


def encode_block(x: np.ndarray, precision: str, absmax: float, out: np.ndarray, lo: int, work: BlockWork) -> None:
    """Quantise ``x``, the elements ``lo:lo + x.size`` of one tensor whose float32 ``max|.|`` is ``absmax``, into
    the tensor's stored ``out`` (``lo`` even for int4; the tensor's last block pads an odd length).

    Element for element what :func:`encode_into` writes: ``clip(rint(x * (qmax / absmax)))`` in float64.
    For a finite float32 ``x`` with ``max|x| = absmax`` the clip is a no-op (``|x * factor| <= qmax (1 +
    2**-53)**2`` rounds to at most ``qmax``), so it is only applied to other input dtypes.
    """
    hi = lo + x.size
    if precision == "fp32":
        out[lo:hi] = x
        return
    if precision == "fp16":
        np.clip(x, -FP16_MAX, FP16_MAX, out=out[lo:hi], casting="unsafe")
        return
    qmax = QMAX[precision]
    first, pairs = lo // 2, x.size // 2
    if absmax == 0.0:
        if precision == "int8":
            out[lo:hi] = 0
        else:  # int4: two zero codes (8, 8) per byte
            out[first : first + (x.size + 1) // 2] = 0x88
        return
    factor = qmax / absmax  # alpha = absmax / qmax in float64: the max element lands exactly on +-qmax
    codes = work.codes[: x.size]
    np.copyto(codes, x)  # exact; a float64 multiply in place is cheaper than a mixed-type one
    np.multiply(codes, factor, out=codes)
    np.rint(codes, out=codes)
    if x.dtype != np.float32:
        np.clip(codes, -qmax, qmax, out=codes)
    if precision == "int8":
        out[lo:hi] = codes
        return
    small = work.small[: x.size]
    np.copyto(small, codes, casting="unsafe")  # exact: integers in [-7, 7]
    nibbles = small.view(np.uint8)
    nibbles += 8  # int4 nibbles 1..15 (-7 wraps to 249, + 8 to 1), even index in the high nibble
    packed = out[first : first + pairs]
    if _LITTLE:  # a pair as one uint16 (low byte = even element): (even << 4) | odd in its low byte
        both = nibbles[: 2 * pairs].view(np.uint16)
        wide = work.wide[:pairs]
        np.left_shift(both, 4, out=wide)
        np.bitwise_or(wide, both >> 8, out=wide)
        np.copyto(packed, wide, casting="unsafe")  # keeps the low byte
    else:
        np.left_shift(nibbles[0 : 2 * pairs : 2], 4, out=packed)
        np.bitwise_or(packed, nibbles[1 : 2 * pairs : 2], out=packed)
    if x.size % 2:  # only the last block of an odd-length tensor: pad with a zero code
        out[first + pairs] = (int(nibbles[-1]) << 4) | 8


def _code_values(precision: str, absmax: float) -> np.ndarray:
    """float32 value of every stored byte: ``lut[b]`` for int8, ``lut[b] = (high, low)`` pair for int4.

    Each value is ``code * absmax / qmax`` in float64, rounded once to float32, exactly as an element-wise
    decode computes it; a decode is then one table look-up per stored byte.
    """
    return code_tables(precision, np.array([absmax], dtype=np.float32))[0]


_HIGH = np.arange(256) >> 4
_LOW = np.arange(256) & 0x0F


def code_tables(precision: str, absmax: np.ndarray) -> np.ndarray:
    """:func:`_code_values` of many tensors at once: ``(T, 256)`` (int8) or ``(T, 256, 2)`` (int4) float32.

    ``absmax`` holds the tensors' float32 ``max|W|``; a tensor with ``absmax == 0`` decodes to exact (+) zeros.
    """
    qmax = QMAX[precision]
    scale = np.asarray(absmax, dtype=np.float32).astype(np.float64).reshape(-1, 1)
    if precision == "int8":
        codes = np.arange(256, dtype=np.uint8).view(np.int8).astype(np.float64)
        table = (codes * scale / qmax).astype(np.float32)
    else:
        nibble = ((np.arange(16, dtype=np.float64) - 8) * scale / qmax).astype(np.float32)
        table = np.stack([nibble[:, _HIGH], nibble[:, _LOW]], axis=-1)
    table[scale[:, 0] == 0.0] = 0.0
    return table


_WIDE = {4: np.dtype(np.uint64), 8: np.dtype(np.complex128)}  # two float32 / two float64 as one item


def lookup(table: np.ndarray, data: np.ndarray, n: int, out: np.ndarray) -> np.ndarray:
    """``out[:n]`` = the values of ``n`` elements stored in ``data`` (uint8 bytes), by a table look-up.

    ``table`` is ``(256,)`` (one value per byte: int8) or ``(256, 2)`` (a high / low nibble pair per byte:
    int4), of ``out``'s dtype (float32, or float64 for a table with a weight folded in). Int4 bytes are
    looked up as one 8- or 16-byte item each, so a byte yields both its values in one copy. The data is
    read in blocks of ``CHUNK`` elements (the look-up casts its indices to intp). Returns ``out[:n]``.
    """
    if table.ndim == 1:
        for lo in range(0, n, CHUNK):
            hi = min(n, lo + CHUNK)
            np.take(table, data[lo:hi], out=out[lo:hi], mode="clip")
        return out[:n]
    wide = _WIDE[table.dtype.itemsize]
    items = table.view(wide).reshape(256)
    pairs = n // 2
    flat = out[: 2 * pairs].view(wide)
    for lo in range(0, pairs, CHUNK // 2):
        hi = min(pairs, lo + CHUNK // 2)
        np.take(items, data[lo:hi], out=flat[lo:hi], mode="clip")
    if n % 2:
        out[n - 1] = table[data[pairs], 0]
    return out[:n]


def decode_into(data: np.ndarray, precision: str, absmax: float, n: int, out: np.ndarray) -> np.ndarray:
    """Dequantise flat stored ``data`` (one tensor of ``n`` elements) into ``out`` (float32, length ``n``)."""
    data = np.asarray(data).reshape(-1)
    if precision in ("fp32", "fp16"):
        out[...] = data
        return out
    expected = encoded_length(n, precision)
    if data.size != expected:
        raise ValueError(f"{data.size} stored {precision} elements cannot hold exactly {n} values")
    if absmax == 0.0:
        out[...] = 0.0
        return out
    lookup(_code_values(precision, absmax), data.view(np.uint8), n, out)
    return out


def decode(data: np.ndarray, precision: str, absmax: float, n: int) -> np.ndarray:
    """Dequantise flat stored ``data`` back to ``float32[n]`` (always a new array)."""
    return decode_into(data, precision, absmax, n, np.empty(n, dtype=np.float32))


# ------------------------------------------------------------------------------------------ tensor objects


@dataclass(frozen=True)
class QuantizedTensor:
    """One quantised tensor.

    Attributes
    ----------
    precision : str
        One of :data:`PRECISIONS`.
    data : np.ndarray
        Flat stored data: float32, float16, int8 codes, or uint8 packed int4 nibbles (``ceil(length/2)``).
    absmax : float
        float32 ``max|W|`` for int8 / int4 (the 4 stored scale bytes); 0.0 for fp formats and zero tensors.
    length : int
        Number of elements of the original tensor.
    shape : tuple of int
        Original shape (metadata; not counted in :func:`stored_bytes`).
    """

    precision: str
    data: np.ndarray
    absmax: float
    length: int
    shape: tuple[int, ...]

    @property
    def scale(self) -> float:
        """Quantisation step ``alpha = max|W| / qmax`` (1.0 for an all-zero tensor; 1.0 for fp formats)."""
        if self.precision not in QMAX or self.absmax == 0.0:
            return 1.0
        return self.absmax / QMAX[self.precision]


def quantize(x: np.ndarray, precision: str) -> QuantizedTensor:
    """Quantise one tensor (any shape) per tensor, symmetric, zero-point 0; raises on NaN / Inf."""
    check_precision(precision)
    arr = np.asarray(x, dtype=np.float32)
    flat = arr.reshape(-1)
    if not np.all(np.isfinite(flat)):
        raise ValueError("cannot quantise a tensor that contains NaN or Inf")
    out = np.empty(encoded_length(flat.size, precision), dtype=storage_dtype(precision))
    absmax = encode_into(flat, precision, out)
    return QuantizedTensor(precision, out, absmax, int(flat.size), tuple(arr.shape))


def dequantize(q: QuantizedTensor) -> np.ndarray:
    """Return the float32 tensor (original shape) that ``q`` represents."""
    return decode(q.data, q.precision, q.absmax, q.length).reshape(q.shape)


def stored_bytes(q: QuantizedTensor) -> int:
    """Bytes actually held for ``q``: ``q.data.nbytes`` plus 4 scale bytes for int8 / int4."""
    return int(q.data.nbytes) + (_SCALE_BYTES if q.precision in QMAX else 0)
