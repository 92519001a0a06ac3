"""Codecs for client updates: identity, float16, scaled sign and top-k (fedcams §3.7).

A codec turns a flat float32 vector into a :class:`~pollen.compression.payload.Payload` of real wire
bytes and back::

    payload = codec.encode(x)          # x: 1-D float32, length d
    y = codec.decode(payload, d)       # float32, length d; y == C(x)

``decode`` trusts nothing in the payload: codec name, length, array names, dtypes, sizes, index range and
order, and finiteness are all checked, and any problem raises
:class:`~pollen.compression.payload.PayloadError` with a one-line reason. :func:`decode_payload` does the
same for a payload of any known codec, dispatching on ``payload.codec`` (what a server needs to decode
whatever a client sent).

Byte counts come in two kinds. ``payload_bytes(d)`` is exactly ``encode(x).nbytes`` for a length-``d``
vector (what goes on the wire). ``theoretical_bits(d)`` is the paper's count (fedcams §3.7): none ``32d``,
sign ``d + 32``, top-k ``64k``, fp16 ``16d``.

Granularity
-----------
By default a codec sees the whole model as one vector: scaled sign uses one scale ``||x||_1 / d`` for all
layers and top-k picks the ``k`` largest magnitudes across all layers. That is what the authors' code does
(fedcams §8.C.12), it is the compressor the paper's bit counts and Table 2 describe, and it is the cheapest
on the wire. :class:`PerTensorCodec` applies a codec to each tensor separately (one scale or one top-k per
tensor), a different and usually more accurate compressor; it is opt-in.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

import numpy as np

from .payload import (
    Payload,
    PayloadError,
    check_array,
    check_finite,
    check_header,
    check_keys,
)

__all__ = [
    "CODECS",
    "Codec",
    "FP16Codec",
    "IdentityCodec",
    "PerTensorCodec",
    "SignCodec",
    "TopKCodec",
    "decode_payload",
    "index_dtype",
    "normalize_segments",
    "topk_count",
]

CODECS: tuple[str, ...] = ("none", "sign", "topk", "fp16")

_FP16_MAX = float(np.finfo(np.float16).max)

#: Row ``b``: the 8 signs byte ``b`` of ``np.packbits`` stands for (big bit order), as float32 -1 / +1.
_SIGN_PATTERNS = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1).astype(np.float32) * 2 - 1
_SIGN_BLOCK = 1 << 16  # bytes of a sign payload decoded per look-up


def _as_vector(x: np.ndarray, *, copy: bool = False) -> np.ndarray:
    """Return ``x`` as a non-empty 1-D float32 array (cast from another float dtype if needed)."""
    v = np.asarray(x)
    if v.ndim != 1:
        raise ValueError(f"expected a 1-D vector, got shape {v.shape}")
    if v.size == 0:
        raise ValueError("cannot encode an empty vector (length 0)")
    if not np.issubdtype(v.dtype, np.floating):
        raise ValueError(f"expected a float vector, got dtype {v.dtype}")
    return np.array(v, dtype=np.float32, copy=True) if copy else v.astype(np.float32, copy=False)


def _dim(dim: int) -> int:
    """Check that a vector length given by the caller is a positive integer (``ValueError`` if not)."""
    if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)) or dim <= 0:
        raise ValueError(f"dim must be a positive integer, got {dim!r}")
    return int(dim)


def _output(out: np.ndarray | None, dim: int) -> np.ndarray:
    """``out`` checked as a decode's destination (contiguous float32 of length ``dim``), or a new one."""
    if out is None:
        return np.empty(dim, dtype=np.float32)
    if out.dtype != np.float32 or out.shape != (dim,) or not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(
            f"out must be a writeable contiguous float32 vector of length {dim}; got {out.dtype} {out.shape}"
        )
    return out


def _non_finite_input(v: np.ndarray) -> ValueError:
    bad = int(v.size - np.count_nonzero(np.isfinite(v)))
    return ValueError(f"cannot compress a vector with {bad} NaN/Inf entries")


class Codec(ABC):
    """A compressor ``C`` with an exact wire format.

    Subclasses set ``name`` and ``keys`` (the array names of their payload) and implement ``encode``,
    ``_decode_arrays``, ``payload_bytes`` and ``theoretical_bits``. ``decode`` checks the payload header
    (type, codec name, dim) and then calls ``_decode_arrays``, which checks the arrays.
    """

    name: ClassVar[str]
    keys: ClassVar[tuple[str, ...]]

    @abstractmethod
    def encode(self, x: np.ndarray) -> Payload:
        """Compress a 1-D float vector (cast to float32). Raises ``ValueError`` on empty or non-finite input."""

    def decode(self, payload: Payload, dim: int, out: np.ndarray | None = None) -> np.ndarray:
        """Return ``C(x)`` as a float32 vector of length ``dim``; raise ``PayloadError`` if invalid.

        The vector is new, or ``out`` (a contiguous float32 vector of length ``dim``: a reader's reused buffer,
        whose contents are undefined after a ``PayloadError``).
        """
        check_header(payload, self.name, dim)
        return self._decode_arrays(payload.arrays, int(dim), _output(out, int(dim)))

    @abstractmethod
    def _decode_arrays(self, arrays: dict[str, np.ndarray], dim: int, out: np.ndarray) -> np.ndarray:
        """Check ``arrays`` (names, dtypes, lengths, values) and decode them into ``out``; return ``out``."""

    @abstractmethod
    def payload_bytes(self, dim: int) -> int:
        """Exact number of bytes ``encode`` produces for a vector of length ``dim``."""

    @abstractmethod
    def theoretical_bits(self, dim: int) -> int:
        """The paper's bit count for one message of length ``dim`` (fedcams §3.7)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class IdentityCodec(Codec):
    """No compression: the float32 vector itself. ``C(x) = x``, so error feedback stays exactly zero."""

    name = "none"
    keys = ("values",)

    def encode(self, x: np.ndarray) -> Payload:
        v = _as_vector(x, copy=True)  # the payload must not alias the caller's vector
        if not np.isfinite(v).all():
            raise _non_finite_input(v)
        return Payload(self.name, v.size, {"values": v})

    def _decode_arrays(self, arrays: dict[str, np.ndarray], dim: int, out: np.ndarray) -> np.ndarray:
        check_keys(arrays, self.keys, self.name)
        values = check_array(arrays, "values", np.float32, dim, self.name)
        check_finite(values, "values", self.name)
        np.copyto(out, values)
        return out

    def payload_bytes(self, dim: int) -> int:
        return 4 * _dim(dim)

    def theoretical_bits(self, dim: int) -> int:
        return 32 * _dim(dim)


class FP16Codec(Codec):
    """Cast to IEEE float16 (round to nearest). Entries beyond float16's range (65504) are an error."""

    name = "fp16"
    keys = ("values",)

    def encode(self, x: np.ndarray) -> Payload:
        v = _as_vector(x)
        with np.errstate(over="ignore"):  # overflow is reported below, as a ValueError
            values = v.astype(np.float16)
        if not np.isfinite(values).all():
            if not np.isfinite(v).all():
                raise _non_finite_input(v)
            raise ValueError(
                f"fp16 overflow: max |x| = {float(np.abs(v).max()):.6g} exceeds float16's range ({_FP16_MAX:g})"
            )
        return Payload(self.name, v.size, {"values": values})

    def _decode_arrays(self, arrays: dict[str, np.ndarray], dim: int, out: np.ndarray) -> np.ndarray:
        check_keys(arrays, self.keys, self.name)
        values = check_array(arrays, "values", np.float16, dim, self.name)
        check_finite(values, "values", self.name)
        np.copyto(out, values)  # exact: every float16 is a float32
        return out

    def payload_bytes(self, dim: int) -> int:
        return 2 * _dim(dim)

    def theoretical_bits(self, dim: int) -> int:
        return 16 * _dim(dim)


class SignCodec(Codec):
    """Scaled sign (Karimireddy et al. 2019): ``C(x) = (||x||_1 / d) * s(x)`` with ``s(x) in {-1, +1}^d``.

    Wire format: ``"bits"``, ``ceil(d/8)`` bytes of ``np.packbits`` (big bit order, zero padding), bit 1
    meaning ``x_i >= 0``; ``"scale"``, one float32 ``||x||_1 / d``. Exactly ``ceil(d/8) + 4`` bytes.

    Zero entries: one bit cannot say "zero", so ``x_i == 0`` (either sign of zero) is sent as ``+scale``.
    The authors' code uses ``torch.sign(0) = 0``, which would need a third symbol. With ``s(0) = +1`` the
    decoded vector takes only the values ``+-||x||_1/d``, ``||C(x)||_1 = ||x||_1`` and the paper's identity
    ``||C(x) - x||^2 = ||x||^2 - ||x||_1^2 / d`` hold exactly for every ``x``, zeros included (with
    ``torch.sign`` they hold only when ``x`` has no zeros). Error feedback carries the ``-scale`` a zero
    entry receives into the next round. The all-zero vector has scale 0 and decodes to zeros.
    """

    name = "sign"
    keys = ("bits", "scale")

    def encode(self, x: np.ndarray) -> Payload:
        v = _as_vector(x)
        l1 = float(np.abs(v).sum())  # numpy's pairwise float32 summation
        if not math.isfinite(l1):
            if not np.isfinite(v).all():
                raise _non_finite_input(v)
            raise ValueError("||x||_1 overflows float32; cannot compute the sign scale")
        scale = np.array([l1 / v.size], dtype=np.float32)
        bits = np.packbits(v >= 0)
        return Payload(self.name, v.size, {"bits": bits, "scale": scale})

    def _decode_arrays(self, arrays: dict[str, np.ndarray], dim: int, out: np.ndarray) -> np.ndarray:
        check_keys(arrays, self.keys, self.name)
        bits = check_array(arrays, "bits", np.uint8, -(-dim // 8), self.name)
        scale = check_array(arrays, "scale", np.float32, 1, self.name)
        s = scale[0]
        if not np.isfinite(s) or s < 0:
            raise PayloadError(f"sign payload 'scale' is {s}; expected a finite number >= 0")
        pad = 8 * bits.size - dim
        if pad and int(bits[-1]) & ((1 << pad) - 1):
            raise PayloadError(f"sign payload 'bits': the {pad} padding bit(s) after entry {dim} must be zero")
        table = _SIGN_PATTERNS * s  # the 8 values of each byte: exactly +-s (+-0 for s = 0)
        full = dim // 8
        rows = out[: 8 * full].reshape(full, 8)
        for lo in range(0, full, _SIGN_BLOCK):  # take casts its indices to intp: a block at a time
            hi = min(full, lo + _SIGN_BLOCK)
            np.take(table, bits[lo:hi], axis=0, out=rows[lo:hi], mode="clip")  # "clip": out unbuffered
        if dim % 8:
            out[8 * full :] = table[bits[full], : dim % 8]
        return out

    def payload_bytes(self, dim: int) -> int:
        return -(-_dim(dim) // 8) + 4

    def theoretical_bits(self, dim: int) -> int:
        return _dim(dim) + 32


def topk_count(ratio: float, dim: int) -> int:
    """``k = max(floor(ratio * dim), 1)``, as the authors' code (fedcams §8.C.13)."""
    return max(int(math.floor(ratio * dim)), 1)


def index_dtype(dim: int) -> np.dtype:
    """Narrowest unsigned integer dtype that holds every index ``0 .. dim - 1``."""
    top = _dim(dim) - 1
    for dt in (np.uint8, np.uint16, np.uint32, np.uint64):
        if top <= np.iinfo(dt).max:
            return np.dtype(dt)
    raise ValueError(f"dim {dim} too large for a uint64 index")


def _topk_indices(a: np.ndarray, k: int) -> np.ndarray:
    """Ascending indices of the ``k`` largest entries of ``a`` (finite, >= 0); ties: lowest index wins.

    One ``np.argpartition`` (linear time, no full sort), then only the entries equal to the k-th largest
    value are resolved by position.
    """
    d = a.size
    if k >= d:
        return np.arange(d)
    top = np.argpartition(a, d - k)[d - k :]  # k entries, all >= the threshold; all > it are in here
    threshold = a[top[0]]  # argpartition puts the k-th largest at position d - k
    above = top[a[top] > threshold]
    ties = np.flatnonzero(a == threshold)[: k - above.size]  # flatnonzero is ascending
    idx = np.concatenate([above, ties])
    idx.sort()
    return idx


class TopKCodec(Codec):
    """Top-k sparsification (Stich et al. 2018): keep the ``k = max(floor(ratio*d), 1)`` largest magnitudes.

    Wire format: ``"indices"``, ``k`` positions, strictly ascending, in the narrowest unsigned integer dtype
    that holds ``d - 1`` (see :func:`index_dtype`); ``"values"``, the ``k`` float32 entries of ``x`` there.

    Ties: among entries whose magnitude equals the k-th largest magnitude, the lowest indices are kept, so
    the output depends only on ``x`` (``torch.topk`` in the authors' code leaves the order unspecified).

    ``ratio=None`` makes a decode-only codec that accepts any ``1 <= k <= d`` (used by
    :func:`decode_payload`, which reads ``k`` from the payload); with a ratio, ``decode`` also requires
    ``k`` to be the count this ratio gives.
    """

    name = "topk"
    keys = ("indices", "values")

    def __init__(self, ratio: float | None = 1 / 64) -> None:
        if ratio is not None:
            if isinstance(ratio, bool) or not isinstance(ratio, (int, float, np.floating, np.integer)):
                raise ValueError(f"topk ratio must be a number in (0, 1], got {ratio!r}")
            if not (0 < ratio <= 1):
                raise ValueError(f"topk ratio must be in (0, 1], got {ratio!r}")
            ratio = float(ratio)
        self.ratio = ratio

    def __repr__(self) -> str:
        return f"TopKCodec(ratio={self.ratio!r})"

    def k(self, dim: int) -> int:
        """Number of kept entries for a vector of length ``dim``."""
        if self.ratio is None:
            raise ValueError("this TopKCodec has no ratio (decode-only); build it with TopKCodec(ratio)")
        return topk_count(self.ratio, _dim(dim))

    def encode(self, x: np.ndarray) -> Payload:
        v = _as_vector(x)
        d = v.size
        k = self.k(d)
        a = np.abs(v)
        if not np.isfinite(a.max()):
            raise _non_finite_input(v)
        idx = _topk_indices(a, k)
        return Payload(self.name, d, {"indices": idx.astype(index_dtype(d)), "values": v[idx]})

    def _decode_arrays(self, arrays: dict[str, np.ndarray], dim: int, out: np.ndarray) -> np.ndarray:
        check_keys(arrays, self.keys, self.name)
        idx = check_array(arrays, "indices", index_dtype(dim), None, self.name)
        values = check_array(arrays, "values", np.float32, None, self.name)
        n = idx.size
        if values.size != n:
            raise PayloadError(f"topk payload has {n} indices but {values.size} values; expected equal counts")
        if n == 0:
            raise PayloadError("topk payload is empty; expected at least 1 entry")
        if n > dim:
            raise PayloadError(f"topk payload has {n} entries; expected at most dim = {dim}")
        if self.ratio is not None and n != (k := topk_count(self.ratio, dim)):
            raise PayloadError(f"topk payload has {n} entries; expected k = {k} for ratio {self.ratio:g}, dim {dim}")
        top = int(idx.max())
        if top >= dim:
            raise PayloadError(f"topk payload index {top} out of range; expected indices < dim = {dim}")
        ok = idx[1:] > idx[:-1]
        if not ok.all():
            j = int(np.argmin(ok))
            what = "duplicate" if idx[j] == idx[j + 1] else "unsorted"
            raise PayloadError(
                f"topk payload indices are {what} at position {j + 1} ({idx[j]} then {idx[j + 1]}); "
                "expected strictly ascending"
            )
        check_finite(values, "values", self.name)
        out.fill(0.0)
        out[idx] = values
        return out

    def payload_bytes(self, dim: int) -> int:
        return self.k(dim) * (index_dtype(dim).itemsize + 4)

    def theoretical_bits(self, dim: int) -> int:
        return 64 * self.k(dim)  # 32-bit value + 32-bit index, as the paper counts


def normalize_segments(segments: Sequence[tuple[int, int] | slice]) -> tuple[tuple[int, int], ...]:
    """Check and return ``segments`` as ``((start, stop), ...)``.

    Segments are ``(start, stop)`` pairs or ``slice`` objects, in order, non-empty and contiguous from 0:
    they must tile ``[0, dim)`` with the last ``stop`` equal to the vector length. Raises ``ValueError``.
    """
    if segments is None or isinstance(segments, (str, bytes)) or len(segments) == 0:
        raise ValueError(f"segments must be a non-empty list of (start, stop) pairs, got {segments!r}")
    out: list[tuple[int, int]] = []
    expected_start = 0
    for i, seg in enumerate(segments):
        if isinstance(seg, slice):
            if seg.step not in (None, 1):
                raise ValueError(f"segment {i} {seg!r}: step must be 1")
            pair = (seg.start if seg.start is not None else expected_start, seg.stop)
        else:
            try:
                pair = tuple(seg)
            except TypeError:
                raise ValueError(f"segment {i} {seg!r}: expected a (start, stop) pair") from None
        if len(pair) != 2 or not all(isinstance(b, (int, np.integer)) and not isinstance(b, bool) for b in pair):
            raise ValueError(f"segment {i} {seg!r}: expected a (start, stop) pair of integers")
        start, stop = int(pair[0]), int(pair[1])
        if start != expected_start:
            raise ValueError(
                f"segment {i} starts at {start}; expected {expected_start} (segments must tile [0, dim) in order)"
            )
        if stop <= start:
            raise ValueError(f"segment {i} ({start}, {stop}) is empty; expected stop > start")
        out.append((start, stop))
        expected_start = stop
    return tuple(out)


class PerTensorCodec(Codec):
    """Apply ``inner`` to each segment (tensor) of the vector separately.

    Each segment gets its own sign scale or its own top-k (``k = max(floor(ratio * len), 1)`` per segment).
    Arrays are namespaced by segment number: ``"0.bits"``, ``"0.scale"``, ``"1.bits"``, ... The codec name
    is ``inner.name + "/tensor"``, e.g. ``"sign/tensor"``. Whole-model is the default granularity; see the
    module docstring for why.
    """

    keys = ()  # per-instance; see _expected_keys

    def __init__(self, inner: Codec, segments: Sequence[tuple[int, int] | slice]) -> None:
        if isinstance(inner, PerTensorCodec):
            raise ValueError("PerTensorCodec cannot wrap another PerTensorCodec")
        self.inner = inner
        self.segments = normalize_segments(segments)
        self.dim = self.segments[-1][1]

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"{self.inner.name}/tensor"

    def __repr__(self) -> str:
        return f"PerTensorCodec({self.inner!r}, {len(self.segments)} segments, dim={self.dim})"

    def _check_dim(self, dim: int, err: type[Exception]) -> None:
        if dim != self.dim:
            raise err(f"vector length {dim} does not match the segments, which cover {self.dim} entries")

    def encode(self, x: np.ndarray) -> Payload:
        v = _as_vector(x)
        self._check_dim(v.size, ValueError)
        arrays: dict[str, np.ndarray] = {}
        for i, (start, stop) in enumerate(self.segments):
            part = self.inner.encode(v[start:stop])
            for key, a in part.arrays.items():
                arrays[f"{i}.{key}"] = a
        return Payload(self.name, v.size, arrays)

    def _decode_arrays(self, arrays: dict[str, np.ndarray], dim: int, out: np.ndarray) -> np.ndarray:
        self._check_dim(dim, PayloadError)
        expected = [f"{i}.{key}" for i in range(len(self.segments)) for key in self.inner.keys]
        check_keys(arrays, expected, self.name)
        for i, (start, stop) in enumerate(self.segments):
            sub = {key: arrays[f"{i}.{key}"] for key in self.inner.keys}
            try:
                self.inner._decode_arrays(sub, stop - start, out[start:stop])
            except PayloadError as e:
                raise PayloadError(f"{self.name} segment {i} [{start}:{stop}]: {e}") from e
        return out

    def payload_bytes(self, dim: int) -> int:
        self._check_dim(_dim(dim), ValueError)
        return sum(self.inner.payload_bytes(stop - start) for start, stop in self.segments)

    def theoretical_bits(self, dim: int) -> int:
        self._check_dim(_dim(dim), ValueError)
        return sum(self.inner.theoretical_bits(stop - start) for start, stop in self.segments)


_DECODERS: dict[str, Codec] = {
    "none": IdentityCodec(),
    "sign": SignCodec(),
    "topk": TopKCodec(ratio=None),
    "fp16": FP16Codec(),
}


def decode_payload(
    payload: Payload,
    dim: int,
    segments: Sequence[tuple[int, int] | slice] | None = None,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Decode a payload of any known codec, dispatching on ``payload.codec``; raise ``PayloadError``.

    For top-k the number of entries is read from the payload (any ``1 <= k <= dim``), not assumed from a
    ratio. A per-tensor payload (``"<codec>/tensor"``) needs the ``segments`` it was encoded with. ``out``: see
    :meth:`Codec.decode`.
    """
    if not isinstance(payload, Payload):
        raise PayloadError(f"expected a Payload, got {type(payload).__name__}")
    codec = payload.codec
    if not isinstance(codec, str):
        raise PayloadError(f"payload codec must be a string, got {codec!r}")
    base, sep, granularity = codec.partition("/")
    if base not in _DECODERS or (sep and granularity != "tensor"):
        known = list(CODECS) + [f"{c}/tensor" for c in CODECS]
        raise PayloadError(f"unknown codec {codec!r}; expected one of {known}")
    decoder = _DECODERS[base]
    if sep:
        if segments is None:
            raise PayloadError(f"payload codec {codec!r} is per-tensor, but no segments were given to decode it")
        try:
            decoder = PerTensorCodec(decoder, segments)
        except ValueError as e:
            raise PayloadError(f"cannot decode {codec!r}: {e}") from e
    return decoder.decode(payload, dim, out)
