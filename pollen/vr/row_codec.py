"""The storage format of one row of the stored-update table, and how a row is encoded and read back.

A flat update vector of length ``d`` is cut into tensors (the model's segments) and each tensor is
quantised on its own with :mod:`pollen.compression.quant`: its own ``max|W|`` scale for int8 / int4, its
own bytes (an int4 tensor is packed separately, so tensors never share a byte). :class:`RowCodec` holds
that layout and does the encoding and decoding block by block (at most ``quant.CHUNK`` elements at a
time, so a row is read with one tensor's worth of memory); :class:`RowReader` reads one encoded row
through per-byte look-up tables, optionally weighted, for the streamed sums.

This is a part of its own because the format knows nothing of clients, weights or the running sum: the
table (:class:`pollen.vr.table.UpdateTable`), its saved state (:mod:`pollen.vr.table_state`) and the
streamed round (:mod:`pollen.vr.aggregate`) all read rows the same way through it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pollen.compression import quant

BlockVisitor = Callable[[int, int, int, int, np.ndarray], None]


@dataclass(frozen=True)
class EncodedRow:
    """One update in the table's storage format: ``data`` (row width, storage dtype) and per-tensor ``absmax``."""

    data: np.ndarray
    absmax: np.ndarray


def segment_sizes(dim: int, segments: Sequence[int] | None) -> tuple[int, tuple[int, ...]]:
    """``(dim, tensor sizes)`` checked: ``dim >= 1``, sizes non-negative and summing to ``dim`` (default one tensor)."""
    dim = int(dim)
    if dim < 1:
        raise ValueError(f"dim={dim} must be >= 1")
    sizes = (dim,) if segments is None else tuple(int(s) for s in segments)
    if any(s < 0 for s in sizes) or sum(sizes) != dim:
        raise ValueError(f"segments must be non-negative sizes summing to dim={dim}, got sum {sum(sizes)}")
    return dim, sizes


class RowCodec:
    """Layout of an encoded row (tensor sizes, element and column offsets, width, dtype) and its codec.

    Parameters
    ----------
    dim : int
        Length ``d`` of a flat update vector.
    segments : sequence of int, optional
        Sizes of the tensors that make up the flat vector, in order (they must sum to ``dim``). Default: one
        tensor of size ``dim``.
    precision : str, default "fp32"
        One of ``pollen.compression.quant.PRECISIONS`` (``fp32 | fp16 | int8 | int4``).

    Attributes: ``dim``, ``sizes``, ``precision``, ``starts`` (element offset of each tensor, plus ``dim``),
    ``cols`` (column offset of each tensor in a row, plus the width), ``width`` (elements of one encoded
    row), ``dtype`` (storage dtype) and ``n_scales`` (per-tensor scales of a row: 0 for fp32 / fp16).
    """

    def __init__(self, dim: int, segments: Sequence[int] | None = None, precision: str = "fp32") -> None:
        dim, sizes = segment_sizes(dim, segments)
        self.precision = quant.check_precision(precision)
        self.dim = dim
        self.sizes = sizes
        self.starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        widths = [quant.encoded_length(s, precision) for s in sizes]
        self.cols = np.concatenate([[0], np.cumsum(widths)]).astype(np.int64)
        self.width = int(self.cols[-1])
        self.dtype = quant.storage_dtype(precision)
        self.n_scales = len(sizes) if quant.is_integer(precision) else 0

    def blocks(self) -> Iterator[tuple[int, int, int, int]]:
        """``(tensor, tensor start, lo, hi)`` for every block of at most ``CHUNK`` elements of a row, in order;
        ``lo:hi`` is inside the tensor and ``lo`` is even (an int4 block starts on a byte)."""
        for t, size in enumerate(self.sizes):
            a = int(self.starts[t])
            for lo in range(0, size, quant.CHUNK):
                yield t, a, lo, min(size, lo + quant.CHUNK)

    def tensor_buffer(self) -> np.ndarray:
        """A float32 buffer the size of the largest tensor: what :meth:`decoded_tensors` decodes into."""
        return np.empty(max(self.sizes), dtype=np.float32)

    def check_row(self, row: EncodedRow) -> None:
        """``ValueError`` unless ``row`` has this format's width, storage dtype and number of scales."""
        if row.data.shape != (self.width,) or row.data.dtype != self.dtype or row.absmax.shape != (self.n_scales,):
            raise ValueError(
                f"an encoded row must be ({self.width},) {self.dtype}; got {row.data.shape} {row.data.dtype}"
            )

    def encode(self, y: np.ndarray, *, check_finite: bool = True, visit: BlockVisitor | None = None) -> EncodedRow:
        """``y`` validated (:func:`as_update`) and quantised per tensor into a new :class:`EncodedRow`."""
        vec = as_update(y, self.dim, check_finite=check_finite)
        data = np.empty(self.width, dtype=self.dtype)
        absmax = np.zeros(self.n_scales, dtype=np.float32)
        self.encode_into(vec, data, absmax, visit)
        return EncodedRow(data, absmax)

    def encode_into(
        self, vec: np.ndarray, row: np.ndarray, absmax: np.ndarray, visit: BlockVisitor | None = None
    ) -> None:
        """Encode ``vec`` block by block (what :func:`quant.encode_into` writes for each tensor).

        ``visit(t, a, lo, hi, block)`` is called with every block right after it is encoded, while it is
        still in cache.
        """
        work = quant.BlockWork(min(quant.CHUNK, self.dim))
        scale = 0.0
        for t, a, lo, hi in self.blocks():
            if lo == 0 and self.n_scales:
                scale = _absmax(vec[a : a + self.sizes[t]])
                absmax[t] = scale
            c = int(self.cols[t])
            out = row[c : int(self.cols[t + 1])]
            block = vec[a + lo : a + hi]
            quant.encode_block(block, self.precision, scale, out, lo, work)
            if visit is not None:
                visit(t, a, lo, hi, block)

    def decoded_tensors(
        self, data: np.ndarray, absmax: np.ndarray, buffer: np.ndarray
    ) -> Iterator[tuple[int, int, np.ndarray]]:
        """``(start, stop, D(tensor))`` for each tensor of an encoded row, in order.

        For fp32 the values are a view of ``data`` itself; otherwise they are decoded into ``buffer``,
        which the next step overwrites. So a whole row is read with one tensor's worth of memory.
        """
        for t, size in enumerate(self.sizes):
            a, b = int(self.starts[t]), int(self.starts[t + 1])
            c, e = int(self.cols[t]), int(self.cols[t + 1])
            if self.precision == "fp32":
                yield a, b, data[c:e]
                continue
            out = buffer[:size]
            if self.precision == "fp16":
                out[...] = data[c:e]
            else:
                quant.decode_into(data[c:e], self.precision, float(absmax[t]), size, out)
            yield a, b, out

    def decode_into(self, data: np.ndarray, absmax: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """The whole row dequantised into ``out`` (float32, length ``dim``; allocated if None)."""
        if out is None:
            out = np.empty(self.dim, dtype=np.float32)
        for a, b, values in self.decoded_tensors(data, absmax, self.tensor_buffer()):
            out[a:b] = values
        return out

    def add_weighted(self, total: np.ndarray, readers: Sequence[RowReader]) -> None:
        """``total += float64(D(row)) * weight`` for every reader's row, block by block (float64, length ``dim``).

        Each block of ``total`` stays in cache while every row is added to it, in the order of ``readers``;
        per coordinate that is the order of adding one whole row after another, so the sum is the same to the
        bit.
        """
        work = np.empty(min(quant.CHUNK, self.dim), dtype=np.float64)
        spare = np.empty(min(quant.CHUNK, self.dim), dtype=np.float32)
        for t, a, lo, hi in self.blocks():
            block = total[a + lo : a + hi]
            for reader in readers:
                block += reader.weighted(t, lo, hi, work, spare)

    def reader(self, data: np.ndarray, absmax: np.ndarray, weight: float | None = None) -> RowReader:
        """A :class:`RowReader` of one encoded row (``weight`` for :meth:`RowReader.weighted`)."""
        return RowReader(self, data, absmax, weight)


class RowReader:
    """Blocks of one encoded row, dequantised: ``D(row)`` as float32, or ``float64(D(row)) * weight``.

    Both are exactly what :meth:`RowCodec.decoded_tensors` and :func:`add_scaled` compute element by
    element; an int4 or int8 row is read through per-tensor tables of its 256 byte values, built once
    for the row (with the weight folded in for :meth:`weighted`: the product of a float32 value and the
    weight is one float64 rounding either way).
    """

    def __init__(self, codec: RowCodec, data: np.ndarray, absmax: np.ndarray, weight: float | None) -> None:
        self.precision = codec.precision
        self.data = data
        self.starts = codec.cols
        self.sizes = codec.sizes
        self.weight = weight
        self.values32 = None
        self.values64 = None
        if quant.is_integer(self.precision):
            self.values32 = quant.code_tables(self.precision, absmax)
            if weight is not None:
                self.values64 = self.values32.astype(np.float64) * weight
            if self.precision == "int8":
                self.data = data.view(np.uint8)

    def _stored(self, t: int, lo: int, hi: int) -> np.ndarray:
        c = int(self.starts[t])
        if self.precision == "int4":
            return self.data[c + lo // 2 : c + (hi + 1) // 2]
        return self.data[c + lo : c + hi]

    def values(self, t: int, lo: int, hi: int, out: np.ndarray) -> np.ndarray:
        """float32 ``D`` of elements ``lo:hi`` of tensor ``t`` (into ``out``, or a view of an fp32 row)."""
        stored = self._stored(t, lo, hi)
        if self.precision == "fp32":
            return stored
        out = out[: hi - lo]
        if self.precision == "fp16":
            np.copyto(out, stored)
            return out
        return quant.lookup(self.values32[t], stored, hi - lo, out)

    def weighted(self, t: int, lo: int, hi: int, out: np.ndarray, spare: np.ndarray) -> np.ndarray:
        """``float64(D) * weight`` of elements ``lo:hi`` of tensor ``t``, into ``out`` (float64)."""
        stored = self._stored(t, lo, hi)
        out = out[: hi - lo]
        if self.values64 is not None:
            return quant.lookup(self.values64[t], stored, hi - lo, out)
        values = self.values(t, lo, hi, spare)
        return np.multiply(values, self.weight, out=out, dtype=np.float64)


def add_scaled(total: np.ndarray, x: np.ndarray, weight: float = 1.0) -> None:
    """``total += weight * float64(x)`` in place, a chunk at a time (no d-size float64 temporary).

    Each element is computed exactly as the whole-array expression would (the float32 -> float64 cast is
    exact and the product is one float64 rounding), so sums built this way match it bit for bit.
    """
    if weight == 0.0:
        return
    work = np.empty(min(quant.CHUNK, total.size), dtype=np.float64)
    for lo in range(0, total.size, quant.CHUNK):
        hi = min(total.size, lo + quant.CHUNK)
        if weight == 1.0:
            np.add(total[lo:hi], x[lo:hi], out=total[lo:hi])
            continue
        part = work[: hi - lo]
        np.multiply(x[lo:hi], weight, out=part, dtype=np.float64)
        total[lo:hi] += part


def as_update(y: Any, dim: int, *, check_finite: bool = True) -> np.ndarray:
    """``y`` as a float32 vector of length ``dim``; ``ValueError`` on another shape, a non-float dtype or NaN / Inf.

    Finiteness is checked after the cast to float32 (a float64 1e300 is finite, its float32 is not);
    ``check_finite=False`` skips it for callers that have checked already.
    """
    vec = np.asarray(y)
    if vec.ndim != 1 or vec.shape[0] != dim:
        raise ValueError(f"update has shape {vec.shape}, expected ({dim},)")
    if not np.issubdtype(vec.dtype, np.floating):
        raise ValueError(f"update has dtype {vec.dtype}, expected a float array")
    vec = vec.astype(np.float32, copy=False)
    if check_finite and not np.all(np.isfinite(vec)):
        raise ValueError("update contains NaN or Inf")
    return vec


def _absmax(x: np.ndarray) -> float:
    """:func:`quant.absmax_of` with the tensor read once: both extremes of each block while it is in cache."""
    if x.size <= quant.CHUNK:
        return quant.absmax_of(x)
    count = -(-x.size // quant.CHUNK)
    highs, lows = np.empty(count, dtype=x.dtype), np.empty(count, dtype=x.dtype)
    for i in range(count):
        block = x[i * quant.CHUNK : (i + 1) * quant.CHUNK]
        highs[i], lows[i] = block.max(), block.min()
    return float(np.float32(max(float(highs.max()), -float(lows.min()))))


__all__ = ["BlockVisitor", "EncodedRow", "RowCodec", "RowReader", "add_scaled", "as_update", "segment_sizes"]
