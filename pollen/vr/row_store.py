"""The arrays that hold a stored-update table's rows, in RAM or in a memory-mapped file.

:class:`RowStore` owns the bytes of a table: the encoded rows (``capacity x row_width``, the storage dtype
of :class:`~pollen.vr.row_codec.RowCodec`), their per-tensor scales and weights, and which client owns which
row. Rows are given out in order of first sight; capacity doubles when full, for both backends. With a
``path`` the data array is a memory-mapped file, so N x d larger than RAM still runs (only the touched rows
are paged in); the file grows sparsely and stays when the store is closed.

The store also keeps each row's CRC-32 (of its encoded bytes, as they lie in the file), computed when
asked (:meth:`RowStore.checksums`) for the rows written since: a checkpoint that re-attaches the file
records them, and resume reads every row of the file against them (:mod:`pollen.vr.table_state`).

This is a part of its own because allocation, growth, the memmap backend and measuring the bytes held are
bookkeeping that does not change a number: the arithmetic of the table (its running sum) stays in
:class:`pollen.vr.table.UpdateTable`, which owns one store.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from pollen.vr.row_codec import EncodedRow, RowCodec


class RowStore:
    """Encoded rows, scales, weights and the key -> row index of one table.

    Parameters
    ----------
    codec : RowCodec
        The row format (width, storage dtype, number of scales).
    path : str, optional
        Memory-mapped file of the data array (created or overwritten); None keeps it in RAM.
    capacity : int
        Rows allocated up front.
    attach : bool, default False
        Reuse the rows of an existing file at ``path`` instead of overwriting it (resume); the capacity is
        then at least the rows the file holds.

    Attributes: ``data``, ``absmax`` (``capacity x n_scales`` float32), ``weights`` (``capacity`` float64),
    ``keys`` (row order) and ``index`` (key -> row). Rows past ``len(keys)`` are zeros (in a re-attached
    file: whatever the file holds there, overwritten whole when a client takes the row).
    """

    def __init__(self, codec: RowCodec, path: str | None, capacity: int, *, attach: bool = False) -> None:
        self.codec = codec
        self.path = path
        cap = capacity
        attach = attach and path is not None and os.path.exists(path)
        if attach:
            cap = max(cap, os.path.getsize(path) // (codec.width * codec.dtype.itemsize))
        self.data = self._allocate(cap, fresh=not attach)
        self.absmax = np.zeros((cap, codec.n_scales), dtype=np.float32)
        self.weights = np.zeros(cap, dtype=np.float64)
        self.index: dict[str, int] = {}
        self.keys: list[str] = []
        self._crc = np.zeros(cap, dtype=np.uint32)
        self._stale: set[int] = set()  # rows written since their CRC-32 was last computed

    @property
    def backend(self) -> str:
        """``"memmap"`` or ``"ram"``."""
        return "ram" if self.path is None else "memmap"

    @property
    def capacity(self) -> int:
        """Rows currently allocated."""
        return int(self.data.shape[0])

    def weight_of(self, key: str) -> float:
        """Weight stored with ``key``'s row (0.0 if it has none)."""
        slot = self.index.get(key)
        return 0.0 if slot is None else float(self.weights[slot])

    def put(self, key: str, row: EncodedRow, weight: float) -> None:
        """Write ``row`` and ``weight`` into ``key``'s row; a new key gets the next row (capacity doubles if full)."""
        slot = self.index.get(key)
        if slot is None:
            if len(self.keys) == self.capacity:
                self.grow(2 * self.capacity)
            slot = len(self.keys)
            self.index[key] = slot
            self.keys.append(key)
        self.data[slot] = row.data
        self.absmax[slot] = row.absmax
        self.weights[slot] = weight
        self._stale.add(slot)

    def write(self, rows: Sequence[int], data: np.ndarray) -> None:
        """Put encoded ``data`` back into ``rows`` (an undo); shapes are the caller's to check."""
        if rows:
            self.data[list(rows)] = data
            self._stale.update(int(r) for r in rows)

    def checksums(self) -> np.ndarray:
        """CRC-32 of each held row's encoded bytes (``len(keys)`` uint32, a copy); rows written since the
        last call are computed now."""
        n = len(self.keys)
        for row in sorted(r for r in self._stale if r < n):
            self._crc[row] = row_crc32(self.data[row])
        self._stale.clear()
        return self._crc[:n].copy()

    def restore(
        self, weights: np.ndarray, absmax: np.ndarray, data: np.ndarray | None, checksums: np.ndarray | None = None
    ) -> None:
        """Make the first ``len(weights)`` rows these (rows past them zero), growing by doubling as needed.

        ``data`` None keeps the encoded rows already in the memory-mapped file; ``checksums`` are then
        their CRC-32s, already checked against the file (else they are computed when next asked). The
        keys are set apart, by :meth:`set_keys`.
        """
        n = len(weights)
        cap = self.capacity
        while cap < n:
            cap *= 2
        if cap != self.capacity:
            self.grow(cap)
        if data is not None:
            for lo in range(0, n, 1024):  # blockwise: data may itself be a memmap
                hi = min(n, lo + 1024)
                self.data[lo:hi] = data[lo:hi]
            self.data[n:] = 0
        self.absmax[:] = 0
        self.absmax[:n] = absmax
        self.weights[:] = 0
        self.weights[:n] = weights
        self._crc[:] = 0
        if data is None and checksums is not None:
            self._crc[:n] = checksums
            self._stale = set()
        else:
            self._stale = set(range(n))

    def set_keys(self, keys: list[str]) -> None:
        """Rows ``0..len(keys)-1`` belong to ``keys``, in order; ``ValueError`` if a key is listed twice."""
        self.keys = keys
        self.index = {k: i for i, k in enumerate(keys)}
        if len(self.index) != len(keys):
            raise ValueError("state has duplicate client keys")

    def grow(self, cap: int) -> None:
        """Reallocate every array to ``cap`` rows, keeping the rows held (a memmap file is extended in place)."""
        old = self.capacity
        if self.path is None:
            data = np.zeros((cap, self.codec.width), dtype=self.codec.dtype)
            data[:old] = self.data
            self.data = data
        else:
            self.data.flush()
            self.data = None  # type: ignore[assignment]  # drop the old map before resizing the file
            self.data = self._allocate(cap, fresh=False)
        absmax = np.zeros((cap, self.codec.n_scales), dtype=np.float32)
        absmax[:old] = self.absmax
        self.absmax = absmax
        weights = np.zeros(cap, dtype=np.float64)
        weights[:old] = self.weights
        self.weights = weights
        crc = np.zeros(cap, dtype=np.uint32)
        crc[:old] = self._crc
        self._crc = crc

    def memory_report(self, running_sum_bytes: int) -> dict[str, Any]:
        """Bytes held right now, measured from the arrays and (memmap) the file on disk, plus ``running_sum_bytes``.

        Keys: ``backend``, ``precision``, ``capacity``, ``known_clients``, ``data_bytes`` (the data array's
        ``nbytes``; for memmap, the file's size on disk), ``data_allocated_bytes`` (memmap only: blocks the
        file system really allocated, since unwritten rows are sparse), ``scale_bytes``, ``weight_bytes``,
        ``running_sum_bytes``, ``row_bytes`` (data + scales of one row, from the arrays), ``fp32_row_bytes``
        (``4 d``), ``used_bytes`` (``row_bytes * known_clients``) and ``total_bytes`` (everything held).
        """
        cap = self.capacity
        if self.path is None:
            data_bytes = int(self.data.nbytes)
            allocated = data_bytes
        else:
            self.data.flush()
            st = os.stat(self.path)
            data_bytes = int(st.st_size)
            allocated = int(st.st_blocks) * 512
        scale_bytes = int(self.absmax.nbytes)
        row_bytes = (data_bytes + scale_bytes) // cap
        total = data_bytes + scale_bytes + int(self.weights.nbytes) + running_sum_bytes
        return {
            "backend": self.backend,
            "precision": self.codec.precision,
            "capacity": cap,
            "known_clients": len(self.keys),
            "data_bytes": data_bytes,
            "data_allocated_bytes": allocated,
            "scale_bytes": scale_bytes,
            "weight_bytes": int(self.weights.nbytes),
            "running_sum_bytes": running_sum_bytes,
            "row_bytes": row_bytes,
            "fp32_row_bytes": 4 * self.codec.dim,
            "used_bytes": row_bytes * len(self.keys),
            "total_bytes": total,
        }

    def flush(self) -> None:
        """Write dirty pages of a memory-mapped store to its file (no-op in RAM)."""
        if self.path is not None:
            self.data.flush()

    def close(self) -> None:
        """Flush and release the memory map (the file stays). The store must not be used afterwards."""
        if self.path is not None and self.data is not None:
            self.data.flush()
        self.data = None  # type: ignore[assignment]

    def _allocate(self, cap: int, *, fresh: bool) -> np.ndarray:
        width, dtype = self.codec.width, self.codec.dtype
        if self.path is None:
            return np.zeros((cap, width), dtype=dtype)
        with open(self.path, "wb" if fresh else "r+b") as f:
            f.truncate(cap * width * dtype.itemsize)  # grows with zeros, sparse on disk
        return np.memmap(self.path, dtype=dtype, mode="r+", shape=(cap, width))


def row_crc32(row: np.ndarray) -> int:
    """CRC-32 (``zlib.crc32``) of one encoded row's bytes, as they lie in the table's file."""
    return zlib.crc32(np.ascontiguousarray(row).view(np.uint8))


__all__ = ["RowStore", "row_crc32"]
