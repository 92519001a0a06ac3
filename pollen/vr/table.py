"""The stored-update table of FedAdaVR / FedVARP / MIFA (spec ``papers/fedadavr.md`` section 3.3).

One row per client that has ever replied: the client's latest update ``y_j`` (its model update divided by
the client learning rate), quantised per tensor with :mod:`pollen.compression.quant`. A client that was never seen reads
as zeros and owns no row. The table also keeps, incrementally,

    running_sum = sum_j w_j * D(y_j)        (float64, length d)

over its rows, where ``w_j`` is the weight given when ``y_j`` was stored (the client's number of examples,
or 1.0 for equal weighting) and ``D`` is dequantisation. :meth:`UpdateTable.replace` updates it by the
difference ``w_new * D(y_new) - w_old * D(y_old)``, so a round costs O(M d) for M replies, never O(N d).
The accumulator is float64 (8 d bytes, e.g. 355 kB for LeNet) rather than float32 so thousands of
add / subtract rounds stay equal to a full recomputation to ~1e-12 relative;
:meth:`UpdateTable.recompute_running_sum` does the O(N d) recomputation when you want to check or resync.

Storage is one 2-D array per table (``capacity x row_width``; float32, float16, int8 codes or packed uint8
int4 nibbles, each tensor packed separately so tensors never share a byte) plus a ``capacity x n_tensors``
float32 array of per-tensor ``max|W|`` for int8 / int4. The data array lives in RAM or, with ``path=``, in a
memory-mapped file, so N x d larger than RAM still runs (only the touched rows are paged in). Rows are given
out in order of first sight; capacity doubles when full, for both backends.

The table is made of parts, each in its own module: the row format and its encoding
(:mod:`pollen.vr.row_codec`), the arrays that hold the rows (:mod:`pollen.vr.row_store`) and the saved
state (:mod:`pollen.vr.table_state`). The table itself keeps the running sum and the public API.

This module only stores; it does not decide when to store. FedAdaVR's order within a round is: aggregate
from the *old* table (:func:`pollen.vr.vr_aggregate`, pure), step the server optimiser, then
:meth:`UpdateTable.replace_many` for the clients that replied. A client that was sampled but did not reply
is simply not replaced and keeps its row.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

import pollen.vr.table_state as table_state  # not through the package: its __init__ imports this module
from pollen.core import state_fields as fields
from pollen.vr.row_codec import BlockVisitor, EncodedRow, RowCodec, RowReader, add_scaled, as_update, segment_sizes
from pollen.vr.row_store import RowStore

ClientKey = str | int


def client_key(key: Any) -> str:
    """Normalise a client key: strings as is, integers (partition id, node id) as ``str(int)``."""
    if isinstance(key, str):
        return key
    if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
        return str(int(key))
    raise TypeError(f"client key must be a str or an int, got {type(key).__name__}")


class UpdateTable:
    """Per-client latest updates ``y_j`` with an O(M d) running weighted sum.

    Parameters
    ----------
    dim : int
        Length ``d`` of a flat update vector.
    segments : sequence of int, optional
        Sizes of the tensors that make up the flat vector, in order (they must sum to ``dim``). Each tensor
        gets its own quantisation scale. Default: one tensor of size ``dim``.
    precision : str, default "fp32"
        Storage precision, one of ``pollen.compression.quant.PRECISIONS`` (``fp32 | fp16 | int8 | int4``).
    path : str or os.PathLike, optional
        If given, the data array is a memory-mapped file at this path (created or overwritten; it grows as
        capacity doubles and is left in place by :meth:`close`). Otherwise the table lives in RAM.
    initial_capacity : int, default 16
        Rows allocated up front; doubled whenever a new client arrives and the table is full.
    """

    def __init__(
        self,
        dim: int,
        segments: Sequence[int] | None = None,
        precision: str = "fp32",
        *,
        path: str | os.PathLike[str] | None = None,
        initial_capacity: int = 16,
        _attach: bool = False,
    ) -> None:
        dim, sizes = segment_sizes(dim, segments)
        if int(initial_capacity) < 1:
            raise ValueError(f"initial_capacity={initial_capacity} must be >= 1")
        self._codec = RowCodec(dim, sizes, precision)
        # _attach: reuse the rows of an existing file (resume); see from_state_dict
        path = None if path is None else os.fspath(path)
        self._rows = RowStore(self._codec, path, int(initial_capacity), attach=_attach)
        self._sum = np.zeros(dim, dtype=np.float64)
        self._total_weight = 0.0

    # ------------------------------------------------------------------------------------------ properties

    @property
    def dim(self) -> int:
        """Length of one update vector."""
        return self._codec.dim

    @property
    def segments(self) -> tuple[int, ...]:
        """Tensor sizes (each has its own scale)."""
        return self._codec.sizes

    @property
    def precision(self) -> str:
        """Storage precision."""
        return self._codec.precision

    @property
    def path(self) -> str | None:
        """Memory-mapped file path, or None for the RAM backend."""
        return self._rows.path

    @property
    def backend(self) -> str:
        """``"memmap"`` or ``"ram"``."""
        return self._rows.backend

    @property
    def capacity(self) -> int:
        """Rows currently allocated."""
        return self._rows.capacity

    @property
    def row_width(self) -> int:
        """Elements of one encoded row (the data array's second dimension)."""
        return self._codec.width

    @property
    def storage_dtype(self) -> np.dtype:
        """dtype of the encoded rows (float32, float16, int8 or uint8)."""
        return self._codec.dtype

    @property
    def known_clients(self) -> int:
        """Number of clients with a stored row."""
        return len(self._rows.keys)

    @property
    def total_weight(self) -> float:
        """Sum of the weights stored with the rows (float64)."""
        return self._total_weight

    @property
    def running_sum(self) -> np.ndarray:
        """``sum_j w_j * D(y_j)`` over stored rows (float64, read-only view; zeros when empty)."""
        view = self._sum.view()
        view.flags.writeable = False
        return view

    def keys(self) -> list[str]:
        """Known client keys in row order (order of first sight)."""
        return list(self._rows.keys)

    def __contains__(self, key: object) -> bool:
        try:
            return client_key(key) in self._rows.index
        except TypeError:
            return False

    def __len__(self) -> int:
        return len(self._rows.keys)

    def weight(self, key: ClientKey) -> float:
        """Weight stored with ``key``'s row (0.0 if the client was never seen)."""
        return self._rows.weight_of(client_key(key))

    # ---------------------------------------------------------------------------------------- read / write

    def get(self, key: ClientKey) -> np.ndarray:
        """Dequantised ``y_key`` as a new float32 vector; zeros if the client was never seen."""
        out = np.zeros(self.dim, dtype=np.float32)
        self.decode_into(key, out)
        return out

    def decode_into(self, key: ClientKey, out: np.ndarray) -> bool:
        """Write dequantised ``y_key`` into ``out`` (float32, length ``dim``); False (``out`` untouched) if unseen."""
        row = self._rows.index.get(client_key(key))
        if row is None:
            return False
        self._codec.decode_into(self._rows.data[row], self._rows.absmax[row], out)
        return True

    def encode(self, y: np.ndarray, *, check_finite: bool = True, visit: BlockVisitor | None = None) -> EncodedRow:
        """``y`` validated and quantised per tensor, ready for :meth:`store` (the table is not touched).

        Raises ``ValueError`` on a wrong shape or dtype, or on NaN / Inf unless ``check_finite=False`` (for
        callers that have checked already: a reply's norm is its finiteness check). For fp32 the row is a
        copy of ``y``. ``visit(t, a, lo, hi, block)`` is called with every block of :meth:`blocks` (``block``
        is ``y[a + lo : a + hi]`` as float32) right after it is encoded, while it is still in cache.
        """
        return self._codec.encode(y, check_finite=check_finite, visit=visit)

    def replace(self, key: ClientKey, y: np.ndarray, weight: float = 1.0) -> None:
        """Store ``y`` (quantised per tensor) as ``key``'s latest update and update the running sum.

        ``weight`` is the client's weight in the running sum (its number of examples, or 1.0 for equal
        weighting); use the same convention as in :func:`pollen.vr.vr_aggregate`. A new key gets the next
        row (capacity doubles if needed). Raises ``ValueError`` on a wrong shape, NaN / Inf, or a negative
        or non-finite weight, leaving the table unchanged.
        """
        _check_weight(weight)
        self.store(key, self.encode(y), weight)

    def store(self, key: ClientKey, row: EncodedRow, weight: float = 1.0, *, buffer: np.ndarray | None = None) -> None:
        """Make the encoded ``row`` (from :meth:`encode`) ``key``'s latest update; update the running sum.

        The sum changes by ``weight * D(new) - w_old * D(old)``, each added in float64, one tensor at a
        time; ``buffer`` (from :meth:`tensor_buffer`) holds a decoded tensor, else one is allocated.
        """
        k = client_key(key)
        w = _check_weight(weight)
        self._codec.check_row(row)
        slot = self._rows.index.get(k)
        old_w = self._rows.weight_of(k)
        buffer = self.tensor_buffer() if buffer is None else buffer
        if old_w:  # rows of weight 0 (e.g. the lazy family's bookkeeping) add nothing to the sum
            for a, b, old in self.decoded_tensors(self._rows.data[slot], self._rows.absmax[slot], buffer):
                add_scaled(self._sum[a:b], old, -old_w)
        if w:
            for a, b, new in self.decoded_tensors(row.data, row.absmax, buffer):
                add_scaled(self._sum[a:b], new, w)
        self._put(k, row, w, old_w)

    def store_many(
        self, rows: Sequence[tuple[ClientKey, EncodedRow, float]], *, buffer: np.ndarray | None = None
    ) -> None:
        """:meth:`store` for each ``(key, row, weight)`` in order, the running sum updated block by block.

        The sum's block stays in cache while every row's ``- w_old D(old) + w D(new)`` is added to it, in
        the same order per coordinate as one :meth:`store` after another, so the result is the same to the
        bit (an int4 row is decoded and weighted by one look-up of a float64 table per byte). Rows are
        checked before the sum changes. Repeated keys fall back to one :meth:`store` after another.
        """
        items = [(client_key(k), row, _check_weight(w)) for k, row, w in rows]
        if len({k for k, _, _ in items}) != len(items):
            for k, row, w in items:
                self.store(k, row, w, buffer=buffer)
            return
        for _, row, _ in items:
            self._codec.check_row(row)
        terms = []  # (row data, weighted reader) in the order store() adds them
        for k, row, w in items:
            slot = self._rows.index.get(k)
            old_w = self._rows.weight_of(k)
            if old_w:
                terms.append(self.row_reader(self._rows.data[slot], self._rows.absmax[slot], -old_w))
            if w:
                terms.append(self.row_reader(row.data, row.absmax, w))
        if terms:
            self._codec.add_weighted(self._sum, terms)
        for k, row, w in items:
            self._put(k, row, w, self._rows.weight_of(k))

    def _put(self, key: str, row: EncodedRow, weight: float, old_weight: float) -> None:
        """Write the row (a new key gets the next row) once the running sum has been updated for it."""
        self._rows.put(key, row, weight)
        self._total_weight += weight - old_weight

    def blocks(self) -> Iterator[tuple[int, int, int, int]]:
        """``(tensor, tensor start, lo, hi)`` for every block of at most ``CHUNK`` elements of a row, in order;
        ``lo:hi`` is inside the tensor and ``lo`` is even (an int4 block starts on a byte)."""
        return self._codec.blocks()

    def row_reader(self, data: np.ndarray, absmax: np.ndarray, weight: float | None = None) -> RowReader:
        """A :class:`RowReader` of one encoded row (``weight`` for :meth:`RowReader.weighted`)."""
        return self._codec.reader(data, absmax, weight)

    def tensor_buffer(self) -> np.ndarray:
        """A float32 buffer the size of the largest tensor: what :meth:`decoded_tensors` decodes into."""
        return self._codec.tensor_buffer()

    def row_of(self, key: ClientKey) -> EncodedRow | None:
        """``key``'s stored row (views of the table's arrays; do not keep across writes), None if unseen."""
        slot = self._rows.index.get(client_key(key))
        return None if slot is None else EncodedRow(self._rows.data[slot], self._rows.absmax[slot])

    def decoded_tensors(
        self, data: np.ndarray, absmax: np.ndarray, buffer: np.ndarray
    ) -> Iterator[tuple[int, int, np.ndarray]]:
        """``(start, stop, D(tensor))`` for each tensor of an encoded row, in order.

        For fp32 the values are a view of ``data`` itself; otherwise they are decoded into ``buffer``,
        which the next step overwrites. So a whole row is read with one tensor's worth of memory.
        """
        return self._codec.decoded_tensors(data, absmax, buffer)

    def replace_many(
        self, updates: Mapping[ClientKey, np.ndarray], weights: Mapping[ClientKey, float] | None = None
    ) -> None:
        """:meth:`replace` for every ``key -> y`` in ``updates`` (weights default to 1.0).

        All updates are validated first, so a bad one leaves the whole table unchanged.
        """
        items = [(client_key(k), as_update(v, self.dim)) for k, v in updates.items()]
        wmap = None if weights is None else {client_key(k): float(v) for k, v in weights.items()}
        missing = [k for k, _ in items if wmap is not None and k not in wmap]
        if missing:
            raise KeyError(f"no weight for client(s) {missing}")
        ws = [_check_weight(1.0 if wmap is None else wmap[k]) for k, _ in items]
        buffer = self.tensor_buffer()
        for (k, v), w in zip(items, ws):
            self.store(k, self.encode(v), w, buffer=buffer)

    def row_indices(self, keys: Sequence[ClientKey]) -> list[int]:
        """Row numbers of the keys that already have a row (in the order given)."""
        index = self._rows.index
        return [index[k] for k in map(client_key, keys) if k in index]

    def read_rows(self, rows: Sequence[int]) -> np.ndarray:
        """A copy of the encoded storage of ``rows`` (for an undo log)."""
        if not rows:
            return np.zeros((0, self.row_width), dtype=self.storage_dtype)
        return np.array(self._rows.data[list(rows)])

    def write_rows(self, rows: Sequence[int], data: np.ndarray) -> None:
        """Put encoded rows back (undo); ``data`` must have the table's row width and storage dtype."""
        data = np.asarray(data)
        width, dtype = self.row_width, self.storage_dtype
        if data.shape != (len(rows), width) or data.dtype != dtype:
            raise ValueError(f"rows of shape {data.shape} / {data.dtype} do not fit ({len(rows)}, {width}) / {dtype}")
        self._rows.write(rows, data)

    def recompute_running_sum(self) -> np.ndarray:
        """The O(N d) recomputation of ``sum_j w_j D(y_j)`` from the stored rows (float64; table unchanged)."""
        total = np.zeros(self.dim, dtype=np.float64)
        buffer = self.tensor_buffer()
        rows = self._rows
        for r in range(len(rows.keys)):
            for a, b, values in self.decoded_tensors(rows.data[r], rows.absmax[r], buffer):
                add_scaled(total[a:b], values, float(rows.weights[r]))
        return total

    def resync(self) -> None:
        """Replace the incremental running sum (and total weight) by an exact recomputation."""
        self._sum = self.recompute_running_sum()
        self._total_weight = float(self._rows.weights[: len(self._rows.keys)].sum())

    # ---------------------------------------------------------------------------------------------- memory

    def memory_report(self) -> dict[str, Any]:
        """Bytes the table holds right now, measured from its arrays and (memmap) the file on disk.

        Keys: see :meth:`pollen.vr.row_store.RowStore.memory_report` (``total_bytes`` is everything held).
        """
        return self._rows.memory_report(int(self._sum.nbytes))

    def memory_bytes(self) -> int:
        """Total bytes held (data array or file, scales, weights, running sum); see :meth:`memory_report`."""
        return int(self.memory_report()["total_bytes"])

    # ----------------------------------------------------------------------------------------- persistence

    def state_dict(self, *, include_data: bool = True) -> dict[str, np.ndarray]:
        """Everything needed to rebuild the table, as a flat dict of numpy arrays (copies).

        Keys: ``dim``, ``segments``, ``precision``, ``keys`` (str array, row order), ``weights``, ``absmax``,
        ``running_sum`` and, if ``include_data``, ``data`` (``known_clients x row_width``). For a memory-mapped
        table bigger than RAM use :meth:`save`, which streams the rows instead of copying them, or
        ``include_data=False`` and keep the file at :attr:`path` (then the file is the data: it must not be
        written between this call and the load).
        """
        return table_state.state_dict(self._codec, self._rows, self._sum, include_data=include_data)

    def load_state_dict(self, state: Mapping[str, np.ndarray], *, where: str = "table") -> None:
        """Replace this table's contents by ``state`` (from :meth:`state_dict` or :meth:`save`); all or nothing.

        Every field is checked first, as a resume checks it (:func:`pollen.vr.table_state.check_state` for this
        table's ``dim``, ``segments`` and ``precision``: finite running sum equal to the weighted sum of the rows,
        weights and scales finite and >= 0, shapes and dtypes, one row per key), and a refusal is a
        :class:`~pollen.core.state_fields.StateError` (a ``ValueError``) naming the field under ``where``,
        the table unchanged. Without a ``data`` entry the rows are taken from the memory-mapped file this
        table already uses, each read back against the state's ``row_crc32`` first (see :meth:`state_dict`).
        """
        checked = table_state.check_state(state, where, dim=self.dim, segments=self.segments, precision=self.precision)
        contents = table_state.contents(self._codec, self._rows, checked)
        if contents.data is None:
            table_state.check_rows_file(self.path, self._codec, checked, where)
        self._restore(contents)

    def _restore(self, contents: table_state.TableContents) -> None:
        self._rows.restore(contents.weights, contents.absmax, contents.data, contents.checksums)
        self._sum = np.array(contents.running_sum, dtype=np.float64)
        self._total_weight = float(contents.weights.sum())
        self._rows.set_keys(contents.keys)

    @classmethod
    def from_state_dict(
        cls,
        state: Mapping[str, np.ndarray],
        *,
        path: str | os.PathLike[str] | None = None,
        initial_capacity: int = 16,
        where: str = "table",
        _checked: bool = False,
    ) -> UpdateTable:
        """Build a new table (RAM, or memmap at ``path``) holding ``state``; every field checked first.

        The state is checked for the format it declares, as :meth:`load_state_dict` checks it (a refusal
        names the field under ``where``; nothing is built and no file is touched). If ``state`` has no
        ``data`` (``state_dict(include_data=False)`` of a memmap table), ``path`` must be that table's
        file: its rows are read back against the state's ``row_crc32``, then it is reopened as is, not
        overwritten, and its rows are used (resume after a crash with a table bigger than RAM).
        Otherwise a file at ``path`` is overwritten.
        """
        # _checked: ``state`` is what check_state returned for its format and, without data, its rows
        # were checked against the file (the strategy's resume does both before it commits)
        if not _checked:
            dim, segments, precision = table_state.declared_format(state, where)
            state = table_state.check_state(state, where, dim=dim, segments=segments, precision=precision)
        has_data = "data" in state
        codec = RowCodec(int(state["dim"]), [int(s) for s in state["segments"]], str(state["precision"]))
        if not has_data and not _checked:
            table_state.check_rows_file(path, codec, state, where)
        table = cls(
            codec.dim,
            codec.sizes,
            codec.precision,
            path=path,
            initial_capacity=max(int(initial_capacity), len(state["keys"]), 1),
            _attach=not has_data,
        )
        table._restore(table_state.contents(table._codec, table._rows, state))
        return table

    def save(self, file: str | os.PathLike[str]) -> None:
        """Write the state to an uncompressed ``.npz`` file, streaming the rows (no copy of a memmap table).

        The file is replaced atomically (:func:`pollen.core.files.write_npz_atomic`), at exactly ``file``.
        """
        table_state.save(file, self._codec, self._rows, self._sum)

    @classmethod
    def load(cls, file: str | os.PathLike[str], *, path: str | os.PathLike[str] | None = None) -> UpdateTable:
        """Read a table written by :meth:`save` into RAM, or into a memmap at ``path``.

        The file is checked before a table of its size is built (:func:`pollen.vr.table_state.read`), then
        every field as :meth:`from_state_dict` checks it (a :class:`~pollen.core.state_fields.StateError`
        naming the file and the field); a file that is not such a table raises ``ValueError``.
        """
        try:
            return cls.from_state_dict(table_state.read(file), path=path)
        except fields.StateError as err:
            raise err.in_file(os.fspath(file)) from None

    def flush(self) -> None:
        """Write dirty pages of a memory-mapped table to its file (no-op in RAM)."""
        self._rows.flush()

    def close(self) -> None:
        """Flush and release the memory map (the file stays). The table must not be used afterwards."""
        self._rows.close()


def _check_weight(weight: float) -> float:
    w = float(weight)
    if not np.isfinite(w) or w < 0:
        raise ValueError(f"weight={weight!r} must be finite and >= 0")
    return w


__all__ = ["UpdateTable", "EncodedRow", "RowReader", "add_scaled", "client_key", "ClientKey"]
