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

This module only stores; it does not decide when to store. FedAdaVR's order within a round is: aggregate
from the *old* table (:func:`pollen.vr.vr_aggregate`, pure), step the server optimiser, then
:meth:`UpdateTable.replace_many` for the clients that replied. A client that was sampled but did not reply
is simply not replaced and keeps its row.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pollen.compression import quant
from pollen.core.files import read_npz, write_npz_atomic

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
        dim = int(dim)
        if dim < 1:
            raise ValueError(f"dim={dim} must be >= 1")
        sizes = (dim,) if segments is None else tuple(int(s) for s in segments)
        if any(s < 0 for s in sizes) or sum(sizes) != dim:
            raise ValueError(f"segments must be non-negative sizes summing to dim={dim}, got sum {sum(sizes)}")
        if int(initial_capacity) < 1:
            raise ValueError(f"initial_capacity={initial_capacity} must be >= 1")
        self._precision = quant.check_precision(precision)
        self._dim = dim
        self._sizes = sizes
        self._starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        widths = [quant.encoded_length(s, precision) for s in sizes]
        self._cols = np.concatenate([[0], np.cumsum(widths)]).astype(np.int64)
        self._width = int(self._cols[-1])
        self._dtype = quant.storage_dtype(precision)
        self._n_scales = len(sizes) if quant.is_integer(precision) else 0
        self._path = None if path is None else os.fspath(path)

        cap = int(initial_capacity)
        attach = _attach and self._path is not None and os.path.exists(self._path)
        if attach:  # reuse the rows of an existing file (resume); see from_state_dict
            cap = max(cap, os.path.getsize(self._path) // (self._width * self._dtype.itemsize))
        self._data = self._allocate(cap, fresh=not attach)
        self._absmax = np.zeros((cap, self._n_scales), dtype=np.float32)
        self._weights = np.zeros(cap, dtype=np.float64)
        self._sum = np.zeros(dim, dtype=np.float64)
        self._total_weight = 0.0
        self._index: dict[str, int] = {}
        self._keys: list[str] = []

    # ------------------------------------------------------------------------------------------ properties

    @property
    def dim(self) -> int:
        """Length of one update vector."""
        return self._dim

    @property
    def segments(self) -> tuple[int, ...]:
        """Tensor sizes (each has its own scale)."""
        return self._sizes

    @property
    def precision(self) -> str:
        """Storage precision."""
        return self._precision

    @property
    def path(self) -> str | None:
        """Memory-mapped file path, or None for the RAM backend."""
        return self._path

    @property
    def backend(self) -> str:
        """``"memmap"`` or ``"ram"``."""
        return "ram" if self._path is None else "memmap"

    @property
    def capacity(self) -> int:
        """Rows currently allocated."""
        return int(self._data.shape[0])

    @property
    def row_width(self) -> int:
        """Elements of one encoded row (the data array's second dimension)."""
        return self._width

    @property
    def storage_dtype(self) -> np.dtype:
        """dtype of the encoded rows (float32, float16, int8 or uint8)."""
        return self._dtype

    @property
    def known_clients(self) -> int:
        """Number of clients with a stored row."""
        return len(self._keys)

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
        return list(self._keys)

    def __contains__(self, key: object) -> bool:
        try:
            return client_key(key) in self._index
        except TypeError:
            return False

    def __len__(self) -> int:
        return len(self._keys)

    def weight(self, key: ClientKey) -> float:
        """Weight stored with ``key``'s row (0.0 if the client was never seen)."""
        row = self._index.get(client_key(key))
        return 0.0 if row is None else float(self._weights[row])

    # ---------------------------------------------------------------------------------------- read / write

    def get(self, key: ClientKey) -> np.ndarray:
        """Dequantised ``y_key`` as a new float32 vector; zeros if the client was never seen."""
        out = np.zeros(self._dim, dtype=np.float32)
        self.decode_into(key, out)
        return out

    def decode_into(self, key: ClientKey, out: np.ndarray) -> bool:
        """Write dequantised ``y_key`` into ``out`` (float32, length ``dim``); False (``out`` untouched) if unseen."""
        row = self._index.get(client_key(key))
        if row is None:
            return False
        self._decode_row(self._data[row], self._absmax[row], out)
        return True

    def encode(
        self,
        y: np.ndarray,
        *,
        check_finite: bool = True,
        visit: Callable[[int, int, int, int, np.ndarray], None] | None = None,
    ) -> EncodedRow:
        """``y`` validated and quantised per tensor, ready for :meth:`store` (the table is not touched).

        Raises ``ValueError`` on a wrong shape or dtype, or on NaN / Inf unless ``check_finite=False`` (for
        callers that have checked already: a reply's norm is its finiteness check). For fp32 the row is a
        copy of ``y``. ``visit(t, a, lo, hi, block)`` is called with every block of :meth:`blocks` (``block``
        is ``y[a + lo : a + hi]`` as float32) right after it is encoded, while it is still in cache.
        """
        vec = _as_update(y, self._dim, check_finite=check_finite)
        data = np.empty(self._width, dtype=self._dtype)
        absmax = np.zeros(self._n_scales, dtype=np.float32)
        self._encode_row(vec, data, absmax, visit)
        return EncodedRow(data, absmax)

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
        self._check_row(row)
        slot = self._index.get(k)
        old_w = 0.0 if slot is None else float(self._weights[slot])
        buffer = self.tensor_buffer() if buffer is None else buffer
        if old_w:  # rows of weight 0 (e.g. the lazy family's bookkeeping) add nothing to the sum
            for a, b, old in self.decoded_tensors(self._data[slot], self._absmax[slot], buffer):
                add_scaled(self._sum[a:b], old, -old_w)
        if w:
            for a, b, new in self.decoded_tensors(row.data, row.absmax, buffer):
                add_scaled(self._sum[a:b], new, w)
        if slot is None:
            if len(self._keys) == self.capacity:
                self._grow(2 * self.capacity)
            slot = len(self._keys)
            self._index[k] = slot
            self._keys.append(k)
        self._total_weight += w - old_w
        self._data[slot] = row.data
        self._absmax[slot] = row.absmax
        self._weights[slot] = w

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
            self._check_row(row)
        terms = []  # (row data, weighted reader) in the order store() adds them
        for k, row, w in items:
            slot = self._index.get(k)
            old_w = 0.0 if slot is None else float(self._weights[slot])
            if old_w:
                terms.append(self.row_reader(self._data[slot], self._absmax[slot], -old_w))
            if w:
                terms.append(self.row_reader(row.data, row.absmax, w))
        if terms:
            work = np.empty(min(quant.CHUNK, self._dim), dtype=np.float64)
            spare = np.empty(min(quant.CHUNK, self._dim), dtype=np.float32)
            for t, a, lo, hi in self.blocks():
                total = self._sum[a + lo : a + hi]
                for reader in terms:
                    total += reader.weighted(t, lo, hi, work, spare)
        for k, row, w in items:
            slot = self._index.get(k)
            old_w = 0.0 if slot is None else float(self._weights[slot])
            if slot is None:
                if len(self._keys) == self.capacity:
                    self._grow(2 * self.capacity)
                slot = len(self._keys)
                self._index[k] = slot
                self._keys.append(k)
            self._total_weight += w - old_w
            self._data[slot] = row.data
            self._absmax[slot] = row.absmax
            self._weights[slot] = w

    def blocks(self) -> Iterator[tuple[int, int, int, int]]:
        """``(tensor, tensor start, lo, hi)`` for every block of at most ``CHUNK`` elements of a row, in order;
        ``lo:hi`` is inside the tensor and ``lo`` is even (an int4 block starts on a byte)."""
        for t, size in enumerate(self._sizes):
            a = int(self._starts[t])
            for lo in range(0, size, quant.CHUNK):
                yield t, a, lo, min(size, lo + quant.CHUNK)

    def row_reader(self, data: np.ndarray, absmax: np.ndarray, weight: float | None = None) -> RowReader:
        """A :class:`RowReader` of one encoded row (``weight`` for :meth:`RowReader.weighted`)."""
        return RowReader(self, data, absmax, weight)

    def _check_row(self, row: EncodedRow) -> None:
        if row.data.shape != (self._width,) or row.data.dtype != self._dtype or row.absmax.shape != (self._n_scales,):
            raise ValueError(
                f"an encoded row must be ({self._width},) {self._dtype}; got {row.data.shape} {row.data.dtype}"
            )

    def tensor_buffer(self) -> np.ndarray:
        """A float32 buffer the size of the largest tensor: what :meth:`decoded_tensors` decodes into."""
        return np.empty(max(self._sizes), dtype=np.float32)

    def row_of(self, key: ClientKey) -> EncodedRow | None:
        """``key``'s stored row (views of the table's arrays; do not keep across writes), None if unseen."""
        slot = self._index.get(client_key(key))
        return None if slot is None else EncodedRow(self._data[slot], self._absmax[slot])

    def decoded_tensors(
        self, data: np.ndarray, absmax: np.ndarray, buffer: np.ndarray
    ) -> Iterator[tuple[int, int, np.ndarray]]:
        """``(start, stop, D(tensor))`` for each tensor of an encoded row, in order.

        For fp32 the values are a view of ``data`` itself; otherwise they are decoded into ``buffer``,
        which the next step overwrites. So a whole row is read with one tensor's worth of memory.
        """
        for t, size in enumerate(self._sizes):
            a, b = int(self._starts[t]), int(self._starts[t + 1])
            c, e = int(self._cols[t]), int(self._cols[t + 1])
            if self._precision == "fp32":
                yield a, b, data[c:e]
                continue
            out = buffer[:size]
            if self._precision == "fp16":
                out[...] = data[c:e]
            else:
                quant.decode_into(data[c:e], self._precision, float(absmax[t]), size, out)
            yield a, b, out

    def replace_many(
        self, updates: Mapping[ClientKey, np.ndarray], weights: Mapping[ClientKey, float] | None = None
    ) -> None:
        """:meth:`replace` for every ``key -> y`` in ``updates`` (weights default to 1.0).

        All updates are validated first, so a bad one leaves the whole table unchanged.
        """
        items = [(client_key(k), _as_update(v, self._dim)) for k, v in updates.items()]
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
        return [self._index[k] for k in map(client_key, keys) if k in self._index]

    def read_rows(self, rows: Sequence[int]) -> np.ndarray:
        """A copy of the encoded storage of ``rows`` (for an undo log)."""
        return np.array(self._data[list(rows)]) if rows else np.zeros((0, self._width), dtype=self._dtype)

    def write_rows(self, rows: Sequence[int], data: np.ndarray) -> None:
        """Put encoded rows back (undo); ``data`` must have the table's row width and storage dtype."""
        data = np.asarray(data)
        if data.shape != (len(rows), self._width) or data.dtype != self._dtype:
            raise ValueError(
                f"rows of shape {data.shape} / {data.dtype} do not fit ({len(rows)}, {self._width}) / {self._dtype}"
            )
        if rows:
            self._data[list(rows)] = data

    def recompute_running_sum(self) -> np.ndarray:
        """The O(N d) recomputation of ``sum_j w_j D(y_j)`` from the stored rows (float64; table unchanged)."""
        total = np.zeros(self._dim, dtype=np.float64)
        buffer = self.tensor_buffer()
        for r in range(len(self._keys)):
            for a, b, values in self.decoded_tensors(self._data[r], self._absmax[r], buffer):
                add_scaled(total[a:b], values, float(self._weights[r]))
        return total

    def resync(self) -> None:
        """Replace the incremental running sum (and total weight) by an exact recomputation."""
        self._sum = self.recompute_running_sum()
        self._total_weight = float(self._weights[: len(self._keys)].sum())

    # ---------------------------------------------------------------------------------------------- memory

    def memory_report(self) -> dict[str, Any]:
        """Bytes the table holds right now, measured from its arrays and (memmap) the file on disk.

        Keys: ``backend``, ``precision``, ``capacity``, ``known_clients``, ``data_bytes`` (the data array's
        ``nbytes``; for memmap, the file's size on disk), ``data_allocated_bytes`` (memmap only: blocks the
        file system really allocated, since unwritten rows are sparse), ``scale_bytes``, ``weight_bytes``,
        ``running_sum_bytes``, ``row_bytes`` (data + scales of one row, from the arrays), ``fp32_row_bytes``
        (``4 d``), ``used_bytes`` (``row_bytes * known_clients``) and ``total_bytes`` (everything held).
        """
        cap = self.capacity
        if self._path is None:
            data_bytes = int(self._data.nbytes)
            allocated = data_bytes
        else:
            self._data.flush()
            st = os.stat(self._path)
            data_bytes = int(st.st_size)
            allocated = int(st.st_blocks) * 512
        scale_bytes = int(self._absmax.nbytes)
        row_bytes = (data_bytes + scale_bytes) // cap
        total = data_bytes + scale_bytes + int(self._weights.nbytes) + int(self._sum.nbytes)
        return {
            "backend": self.backend,
            "precision": self._precision,
            "capacity": cap,
            "known_clients": self.known_clients,
            "data_bytes": data_bytes,
            "data_allocated_bytes": allocated,
            "scale_bytes": scale_bytes,
            "weight_bytes": int(self._weights.nbytes),
            "running_sum_bytes": int(self._sum.nbytes),
            "row_bytes": row_bytes,
            "fp32_row_bytes": 4 * self._dim,
            "used_bytes": row_bytes * self.known_clients,
            "total_bytes": total,
        }

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
        n = len(self._keys)
        state = {
            "dim": np.array(self._dim, dtype=np.int64),
            "segments": np.array(self._sizes, dtype=np.int64),
            "precision": np.array(self._precision),
            "keys": np.array(self._keys, dtype=str),
            "weights": self._weights[:n].copy(),
            "absmax": self._absmax[:n].copy(),
            "running_sum": self._sum.copy(),
        }
        if include_data:
            state["data"] = np.array(self._data[:n])
        return state

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        """Replace this table's contents by ``state`` (from :meth:`state_dict` or :meth:`save`).

        ``dim``, ``segments`` and ``precision`` must match. Without a ``data`` entry the rows are taken from the
        memory-mapped file this table already uses (see :meth:`state_dict`).
        """
        if int(state["dim"]) != self._dim or tuple(int(s) for s in state["segments"]) != self._sizes:
            raise ValueError("state was saved for a different dim / segments")
        if str(state["precision"]) != self._precision:
            raise ValueError(f"state precision {str(state['precision'])!r} != table precision {self._precision!r}")
        keys = [str(k) for k in np.asarray(state["keys"]).reshape(-1)]
        n = len(keys)
        weights = np.asarray(state["weights"], dtype=np.float64).reshape(n)
        absmax = np.asarray(state["absmax"], dtype=np.float32).reshape(n, self._n_scales)
        running = np.asarray(state["running_sum"], dtype=np.float64).reshape(self._dim)
        if "data" in state:
            data = np.asarray(state["data"])
            if data.shape != (n, self._width) or data.dtype != self._dtype:
                raise ValueError(
                    f"state data has shape {data.shape} / {data.dtype}, expected {(n, self._width)} / {self._dtype}"
                )
        elif self._path is None or self.capacity < n:
            raise ValueError("state has no 'data' and this table has no memory-mapped file holding the rows")
        else:
            data = None
        cap = self.capacity
        while cap < n:
            cap *= 2
        if cap != self.capacity:
            self._grow(cap)
        if data is not None:
            for lo in range(0, n, 1024):  # blockwise: data may itself be a memmap
                hi = min(n, lo + 1024)
                self._data[lo:hi] = data[lo:hi]
            self._data[n:] = 0
        self._absmax[:] = 0
        self._absmax[:n] = absmax
        self._weights[:] = 0
        self._weights[:n] = weights
        self._sum = running.copy()
        self._total_weight = float(weights.sum())
        self._keys = keys
        self._index = {k: i for i, k in enumerate(keys)}
        if len(self._index) != n:
            raise ValueError("state has duplicate client keys")

    @classmethod
    def check_state(
        cls,
        state: Any,
        where: str,
        *,
        dim: int,
        segments: Sequence[int],
        precision: str,
        need_data: bool | None = None,
    ) -> dict[str, np.ndarray]:
        """``state`` (from :meth:`state_dict`) checked for a table of ``dim``, ``segments`` and ``precision``.

        Raises :class:`~pollen.core.state_fields.StateError` naming the field: exactly the fields
        :meth:`state_dict` writes (``data`` required or refused when ``need_data`` says so), ``dim``,
        ``segments`` and ``precision`` those expected, ``keys`` distinct non-empty strings, one weight
        (finite, >= 0), one row of scales (finite, >= 0) and one encoded row (finite for fp16 / fp32)
        per key, the running sum ``dim`` finite values. Nothing is allocated from a declared size: every
        shape is compared with ``dim`` and the number of keys the file really holds.
        """
        from pollen.core import state_fields as fields

        names = ["dim", "segments", "precision", "keys", "weights", "absmax", "running_sum"]
        has_data = isinstance(state, Mapping) and "data" in state if need_data is None else need_data
        fields.mapping(state, where, keys=names + (["data"] if has_data else []))
        at = lambda key: fields.join(where, key)  # noqa: E731
        if fields.whole(state["dim"], at("dim")) != dim:
            raise fields.StateError(at("dim"), f"is {int(state['dim'])}; expected {dim} (the model's)")
        saved_segments = fields.numeric_array(state["segments"], at("segments"), shape=(None,), dtype=np.int64)
        if tuple(int(n) for n in saved_segments) != tuple(int(n) for n in segments):
            raise fields.StateError(at("segments"), "differs from the model's tensor sizes")
        if (
            not isinstance(state["precision"], np.ndarray)
            or state["precision"].shape != ()
            or str(state["precision"]) != precision
            or state["precision"].dtype.kind != "U"
        ):
            raise fields.StateError(at("precision"), f"is {state['precision']!r}; expected {precision!r}")
        keys = state["keys"]
        if not isinstance(keys, np.ndarray) or keys.ndim != 1 or (keys.dtype.kind != "U" and keys.size):
            raise fields.StateError(at("keys"), f"is {type(keys).__name__}; expected a 1-D str array")
        count = len(keys)
        listed = [str(k) for k in keys]
        if len(set(listed)) != count or any(not k for k in listed):
            raise fields.StateError(at("keys"), "names a client twice or holds an empty key; expected distinct ids")
        width = sum(quant.encoded_length(int(n), precision) for n in segments)
        scales = len(segments) if quant.is_integer(precision) else 0
        checked = {
            "dim": np.array(dim, dtype=np.int64),
            "segments": np.array(segments, dtype=np.int64),
            "precision": np.array(precision),
            "keys": np.array(listed, dtype=str),
            "weights": fields.numeric_array(
                state["weights"], at("weights"), shape=(count,), dtype=np.float64, low=0.0, what="(a weight)"
            ),
            "absmax": fields.numeric_array(
                state["absmax"], at("absmax"), shape=(count, scales), dtype=np.float32, low=0.0, what="(a scale)"
            ),
            "running_sum": fields.numeric_array(
                state["running_sum"], at("running_sum"), shape=(dim,), dtype=np.float64
            ),
        }
        if has_data:
            checked["data"] = fields.numeric_array(
                state["data"], at("data"), shape=(count, width), dtype=quant.storage_dtype(precision)
            )
        return checked

    def check_running_sum(self, where: str) -> None:
        """``StateError`` unless the running sum equals a recomputation from the rows (up to float64 drift)."""
        from pollen.core import state_fields as fields

        exact = self.recompute_running_sum()
        scale = np.zeros(self._dim, dtype=np.float64)
        buffer = self.tensor_buffer()
        for row in range(len(self._keys)):
            for a, b, values in self.decoded_tensors(self._data[row], self._absmax[row], buffer):
                scale[a:b] += np.abs(values) * self._weights[row]
        worst = np.abs(self._sum - exact) - (1e-6 * scale + 1e-30)
        if worst.size and worst.max() > 0:
            index = int(np.argmax(worst))
            raise fields.StateError(
                fields.join(where, "running_sum"),
                f"holds {self._sum[index]!r} at index {index}; "
                f"expected the weighted sum of the rows ({exact[index]!r})",
            )

    @classmethod
    def from_state_dict(
        cls,
        state: Mapping[str, np.ndarray],
        *,
        path: str | os.PathLike[str] | None = None,
        initial_capacity: int = 16,
    ) -> UpdateTable:
        """Build a new table (RAM, or memmap at ``path``) holding ``state``.

        If ``state`` has no ``data`` (``state_dict(include_data=False)`` of a memmap table), ``path`` must be
        that table's file: it is reopened as is, not overwritten, and its rows are used (resume after a
        crash with a table bigger than RAM). Otherwise a file at ``path`` is overwritten.
        """
        has_data = "data" in state
        if not has_data:
            if path is None or not os.path.exists(path):
                raise ValueError("state has no 'data': pass path= of the existing memory-mapped file with the rows")
            probe = cls(int(state["dim"]), [int(s) for s in state["segments"]], str(state["precision"]))
            need = len(np.asarray(state["keys"]).reshape(-1)) * probe._width * probe._dtype.itemsize
            if os.path.getsize(path) < need:
                raise ValueError(f"{os.fspath(path)} holds {os.path.getsize(path)} bytes, the state needs {need}")
        table = cls(
            int(state["dim"]),
            [int(s) for s in state["segments"]],
            str(state["precision"]),
            path=path,
            initial_capacity=max(int(initial_capacity), len(np.asarray(state["keys"]).reshape(-1)), 1),
            _attach=not has_data,
        )
        table.load_state_dict(state)
        return table

    def save(self, file: str | os.PathLike[str]) -> None:
        """Write the state to an uncompressed ``.npz`` file, streaming the rows (no copy of a memmap table).

        The file is replaced atomically (:func:`pollen.core.files.write_npz_atomic`), at exactly ``file``.
        """
        state: dict[str, np.ndarray] = self.state_dict(include_data=False)
        if self._path is not None:
            self._data.flush()
        state["data"] = self._data[: len(self._keys)]
        write_npz_atomic(file, state)

    @classmethod
    def load(cls, file: str | os.PathLike[str], *, path: str | os.PathLike[str] | None = None) -> UpdateTable:
        """Read a table written by :meth:`save` into RAM, or into a memmap at ``path``.

        The file is read by :func:`pollen.core.files.read_npz` (no pickle; every array checked against its
        bytes before it is allocated), and the table's ``dim`` against the running sum the file really
        holds before a table of that size is built. A file that is not such a table raises ``ValueError``.
        """
        n = None
        spec = {
            "dim": ((), np.int64),
            "segments": ((n,), np.int64),
            "precision": ((), None),
            "keys": ((n,), None),
            "weights": ((n,), np.float64),
            "absmax": ((n, n), np.float32),
            "running_sum": ((n,), np.float64),
            "data": ((n, n), None),
        }
        state = read_npz(file, expected=spec)
        name = os.fspath(file)
        for key in ("precision", "keys"):
            if state[key].dtype.kind != "U":
                raise ValueError(f"{name}: {key!r} is {state[key].dtype}, expected a str array")
        dim, count = int(state["dim"]), len(state["keys"])
        if state["running_sum"].shape != (dim,) or len(state["data"]) != count or len(state["weights"]) != count:
            raise ValueError(
                f"{name}: dim {dim} and {count} keys do not match the running sum {state['running_sum'].shape}, "
                f"the weights {state['weights'].shape} and the rows {state['data'].shape} it holds"
            )
        return cls.from_state_dict(state, path=path)

    def flush(self) -> None:
        """Write dirty pages of a memory-mapped table to its file (no-op in RAM)."""
        if self._path is not None:
            self._data.flush()

    def close(self) -> None:
        """Flush and release the memory map (the file stays). The table must not be used afterwards."""
        if self._path is not None and self._data is not None:
            self._data.flush()
        self._data = None  # type: ignore[assignment]

    # ----------------------------------------------------------------------------------------------- inner

    def _allocate(self, cap: int, *, fresh: bool) -> np.ndarray:
        if self._path is None:
            return np.zeros((cap, self._width), dtype=self._dtype)
        nbytes = cap * self._width * self._dtype.itemsize
        with open(self._path, "wb" if fresh else "r+b") as f:
            f.truncate(nbytes)  # grows with zeros, sparse on disk
        return np.memmap(self._path, dtype=self._dtype, mode="r+", shape=(cap, self._width))

    def _grow(self, cap: int) -> None:
        old = self.capacity
        if self._path is None:
            data = np.zeros((cap, self._width), dtype=self._dtype)
            data[:old] = self._data
            self._data = data
        else:
            self._data.flush()
            self._data = None  # type: ignore[assignment]  # drop the old map before resizing the file
            self._data = self._allocate(cap, fresh=False)
        absmax = np.zeros((cap, self._n_scales), dtype=np.float32)
        absmax[:old] = self._absmax
        self._absmax = absmax
        weights = np.zeros(cap, dtype=np.float64)
        weights[:old] = self._weights
        self._weights = weights

    def _encode_row(
        self,
        vec: np.ndarray,
        row: np.ndarray,
        absmax: np.ndarray,
        visit: Callable[[int, int, int, int, np.ndarray], None] | None = None,
    ) -> None:
        """Encode ``vec`` block by block (what :func:`quant.encode_into` writes for each tensor)."""
        work = quant.BlockWork(min(quant.CHUNK, self._dim))
        scale = 0.0
        for t, a, lo, hi in self.blocks():
            if lo == 0 and self._n_scales:
                scale = _absmax(vec[a : a + self._sizes[t]])
                absmax[t] = scale
            c = int(self._cols[t])
            out = row[c : int(self._cols[t + 1])]
            block = vec[a + lo : a + hi]
            quant.encode_block(block, self._precision, scale, out, lo, work)
            if visit is not None:
                visit(t, a, lo, hi, block)

    def _decode_row(self, row: np.ndarray, absmax: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        if out is None:
            out = np.empty(self._dim, dtype=np.float32)
        for a, b, values in self.decoded_tensors(row, absmax, self.tensor_buffer()):
            out[a:b] = values
        return out


class RowReader:
    """Blocks of one encoded row, dequantised: ``D(row)`` as float32, or ``float64(D(row)) * weight``.

    Both are exactly what :meth:`UpdateTable.decoded_tensors` and :func:`add_scaled` compute element by
    element; an int4 or int8 row is read through per-tensor tables of its 256 byte values, built once
    for the row (with the weight folded in for :meth:`weighted`: the product of a float32 value and the
    weight is one float64 rounding either way).
    """

    def __init__(self, table: UpdateTable, data: np.ndarray, absmax: np.ndarray, weight: float | None) -> None:
        self.precision = table.precision
        self.data = data
        self.starts = table._cols
        self.sizes = table.segments
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


@dataclass(frozen=True)
class EncodedRow:
    """One update in the table's storage format: ``data`` (row width, storage dtype) and per-tensor ``absmax``."""

    data: np.ndarray
    absmax: np.ndarray


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


def _check_weight(weight: float) -> float:
    w = float(weight)
    if not np.isfinite(w) or w < 0:
        raise ValueError(f"weight={weight!r} must be finite and >= 0")
    return w


def _as_update(y: Any, dim: int, *, check_finite: bool = True) -> np.ndarray:
    vec = np.asarray(y)
    if vec.ndim != 1 or vec.shape[0] != dim:
        raise ValueError(f"update has shape {vec.shape}, expected ({dim},)")
    if not np.issubdtype(vec.dtype, np.floating):
        raise ValueError(f"update has dtype {vec.dtype}, expected a float array")
    vec = vec.astype(np.float32, copy=False)
    if check_finite and not np.all(np.isfinite(vec)):
        raise ValueError("update contains NaN or Inf")
    return vec


__all__ = ["UpdateTable", "EncodedRow", "RowReader", "add_scaled", "client_key", "ClientKey"]
