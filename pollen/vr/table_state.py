"""The saved state of a stored-update table: what is written, how it is checked, how it is read back.

A table's state is a flat dict of numpy arrays: ``dim``, ``segments``, ``precision``, ``keys`` (str array,
row order), ``weights``, ``absmax``, ``running_sum`` and either ``data`` (``known_clients x row_width``) or,
when the rows stay in the table's memory-mapped file, ``row_crc32`` (``known_clients`` uint32: the CRC-32
of each row's bytes in the file, so every byte of the rows a load reads back is checked against the state;
:func:`check_rows_file`). :class:`pollen.vr.table.UpdateTable` keeps its public ``state_dict`` /
``load_state_dict`` / ``check_state`` / ``check_running_sum`` / ``save`` / ``load`` and delegates here.

Why CRC-32: a load reads every row of the file (tables of 100 clients x 11M values are 0.55 GB in int4 and
4.4 GB in fp32), and ``zlib.crc32`` is the fastest whole-buffer check the standard library has (3-4 GB/s a
core here, against about 1.8 for sha256 and 0.9 for blake2b; it releases the GIL, so rows are checked on
several threads while others are read). It refuses every change of up to 32 consecutive bits (so any one
changed byte) and misses a random change once in 2**32. It is not a cryptographic binding: like the
checkpoint's own digest file beside it, it tells a changed file from the one written, not a file someone
crafted on purpose.

This is a part of its own because everything about a state that came from a file (its fields, their
shapes and ranges, the rows file a memmap table re-attaches, a running sum that must match its rows) is
checked in one place, apart from the table's arithmetic; these functions see the table's pieces (its
:class:`~pollen.vr.row_codec.RowCodec`, :class:`~pollen.vr.row_store.RowStore` and running sum), not
the table.
"""

from __future__ import annotations

import os
import threading
import zlib
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from pollen.compression import quant
from pollen.core import state_fields as fields
from pollen.core.files import read_npz, write_npz_atomic
from pollen.vr.row_codec import RowCodec, add_scaled
from pollen.vr.row_store import RowStore, row_crc32

FIELDS = ("dim", "segments", "precision", "keys", "weights", "absmax", "running_sum")
"""The fields every state holds; then ``data``, or ``row_crc32`` when the rows stay in a memory-mapped file."""
#: Bytes of a row read (and checksummed) per call while checking a rows file.
_READ_BLOCK = 4 << 20
#: Threads that check the rows of a file at most (each reads and checksums whole rows).
_MAX_THREADS = 8


@dataclass(frozen=True)
class TableContents:
    """A checked state's contents, ready to be put into a table (``data`` None: the rows are in its file)."""

    keys: list[str]
    weights: np.ndarray
    absmax: np.ndarray
    running_sum: np.ndarray
    data: np.ndarray | None
    checksums: np.ndarray | None


def _fields(codec: RowCodec, store: RowStore, running_sum: np.ndarray) -> dict[str, np.ndarray]:
    n = len(store.keys)
    return {
        "dim": np.array(codec.dim, dtype=np.int64),
        "segments": np.array(codec.sizes, dtype=np.int64),
        "precision": np.array(codec.precision),
        "keys": np.array(store.keys, dtype=str),
        "weights": store.weights[:n].copy(),
        "absmax": store.absmax[:n].copy(),
        "running_sum": running_sum.copy(),
    }


def state_dict(
    codec: RowCodec, store: RowStore, running_sum: np.ndarray, *, include_data: bool = True
) -> dict[str, np.ndarray]:
    """The state of a table made of ``codec``, ``store`` and ``running_sum`` (copies).

    ``include_data``: the rows themselves (``data``); otherwise their CRC-32s (``row_crc32``), for a
    memory-mapped table whose file is kept and re-attached (rows written since the last call are
    checksummed now).
    """
    state = _fields(codec, store, running_sum)
    if include_data:
        state["data"] = np.array(store.data[: len(store.keys)])
    else:
        state["row_crc32"] = store.checksums()
    return state


def contents(codec: RowCodec, store: RowStore, checked: Mapping[str, np.ndarray]) -> TableContents:
    """A state checked by :func:`check_state` for ``codec``'s format, read for a table whose rows are in ``store``.

    Without ``data`` the rows must already be in ``store``'s memory-mapped file (at least as many rows as
    the state has keys; their bytes are :func:`check_rows_file`'s to check), else ``ValueError``.
    """
    keys = [str(k) for k in checked["keys"]]
    data = checked.get("data")
    if data is None and (store.path is None or store.capacity < len(keys)):
        raise ValueError("state has no 'data' and this table has no memory-mapped file holding the rows")
    return TableContents(
        keys, checked["weights"], checked["absmax"], checked["running_sum"], data, checked.get("row_crc32")
    )


def declared_format(state: Any, where: str) -> tuple[int, tuple[int, ...], str]:
    """``(dim, segments, precision)`` a state declares, checked as a table format (``StateError`` naming the field).

    Only the format: :func:`check_state` then checks every field against it (``dim`` against the running
    sum the state really holds, so no table is sized from a declared number).
    """
    fields.mapping(state, where)
    at = lambda key: fields.join(where, key)  # noqa: E731
    dim = fields.whole(fields.at(state, "dim", where), at("dim"), low=1)
    sizes = fields.numeric_array(fields.at(state, "segments", where), at("segments"), shape=(None,), dtype=np.int64)
    segments = tuple(int(n) for n in sizes)
    if any(n < 0 for n in segments) or sum(segments) != dim:
        raise fields.StateError(at("segments"), f"are not tensor sizes summing to dim={dim}")
    precision = fields.at(state, "precision", where)
    if not isinstance(precision, np.ndarray) or precision.shape != () or precision.dtype.kind != "U":
        raise fields.StateError(at("precision"), f"is {precision!r}; expected one of {', '.join(quant.PRECISIONS)}")
    name = fields.text(str(precision), at("precision"), allowed=quant.PRECISIONS)
    return dim, segments, name


def check_state(
    state: Any,
    where: str,
    *,
    dim: int,
    segments: Sequence[int],
    precision: str,
    need_data: bool | None = None,
) -> dict[str, np.ndarray]:
    """``state`` (from :func:`state_dict`) checked for a table of ``dim``, ``segments`` and ``precision``.

    Raises :class:`~pollen.core.state_fields.StateError` naming the field: exactly the fields
    :func:`state_dict` writes (``data`` required or refused when ``need_data`` says so; ``row_crc32``
    without it), ``dim``, ``segments`` and ``precision`` those expected, ``keys`` distinct non-empty
    strings, one weight (finite, >= 0), one row of scales (finite, >= 0), one CRC-32 (uint32) or one
    encoded row (finite for fp16 / fp32) per key, the running sum ``dim`` finite values and, with the
    rows, equal to their weighted sum (:func:`check_running_sum`). Nothing is allocated from a declared
    size: every shape is compared with ``dim`` and the number of keys the file really holds. The rows
    of a state without ``data`` are in a file: :func:`check_rows_file` checks them.
    """
    names = list(FIELDS)
    has_data = isinstance(state, Mapping) and "data" in state if need_data is None else need_data
    fields.mapping(state, where, keys=names + (["data"] if has_data else ["row_crc32"]))
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
        "running_sum": fields.numeric_array(state["running_sum"], at("running_sum"), shape=(dim,), dtype=np.float64),
    }
    if has_data:
        checked["data"] = fields.numeric_array(
            state["data"], at("data"), shape=(count, width), dtype=quant.storage_dtype(precision)
        )
        codec = RowCodec(dim, segments, precision)
        check_running_sum(codec, checked["data"], checked["absmax"], checked["weights"], checked["running_sum"], where)
    else:
        checked["row_crc32"] = fields.numeric_array(
            state["row_crc32"], at("row_crc32"), shape=(count,), dtype=np.uint32
        )
    return checked


def check_running_sum(
    codec: RowCodec, data: np.ndarray, absmax: np.ndarray, weights: np.ndarray, running_sum: np.ndarray, where: str
) -> None:
    """``StateError`` unless ``running_sum`` equals the weighted sum of the rows up to float64 drift.

    The rows are ``data`` (one encoded row per weight) with their scales ``absmax``; the sum is computed
    as :meth:`pollen.vr.table.UpdateTable.recompute_running_sum` does, one row at a time (rows of weight 0
    add nothing and are not read). The tolerance of each coordinate is ``1e-6 * sum_j w_j |D(y_j)|``.
    """
    exact = np.zeros(codec.dim, dtype=np.float64)
    scale = np.zeros(codec.dim, dtype=np.float64)
    buffer = codec.tensor_buffer()
    for row, weight in enumerate(weights):
        w = float(weight)
        if not w:
            continue
        for a, b, values in codec.decoded_tensors(data[row], absmax[row], buffer):
            add_scaled(exact[a:b], values, w)
            scale[a:b] += np.abs(values) * w
    worst = np.abs(running_sum - exact) - (1e-6 * scale + 1e-30)
    if worst.size and worst.max() > 0:
        index = int(np.argmax(worst))
        raise fields.StateError(
            fields.join(where, "running_sum"),
            f"holds {running_sum[index]!r} at index {index}; expected the weighted sum of the rows ({exact[index]!r})",
        )


def check_rows_file(
    path: str | os.PathLike[str] | None,
    codec: RowCodec,
    checked: Mapping[str, np.ndarray],
    where: str,
    *,
    overlay: Mapping[int, np.ndarray] | None = None,
    overlay_name: str = "",
) -> None:
    """Refuse unless the file at ``path`` holds the rows of ``checked`` (a state without ``data``) byte for byte.

    The file must exist and hold at least one row of ``codec`` per key (``ValueError``), and row ``i``
    (``codec.width`` values of ``codec.dtype`` at byte ``i * row bytes``) must have the CRC-32
    ``checked["row_crc32"][i]``, else a :class:`~pollen.core.state_fields.StateError` naming the field
    ``row_crc32``, the file, the row, its client and the checksum expected (the first row that differs).
    ``overlay`` maps rows to encoded rows that replace the file's there (an undo log about to be written
    back, named ``overlay_name``); those rows are checked instead of the file's. Every row is read once,
    on up to 8 threads; nothing is written.
    """
    if path is None or not os.path.exists(path):
        raise ValueError("state has no 'data': pass path= of the existing memory-mapped file with the rows")
    keys = [str(k) for k in checked["keys"]]
    expected = checked["row_crc32"]
    row_bytes = codec.width * codec.dtype.itemsize
    need = len(keys) * row_bytes
    if os.path.getsize(path) < need:
        raise ValueError(f"{os.fspath(path)} holds {os.path.getsize(path)} bytes, the state needs {need}")
    overlay = overlay or {}
    found = _file_checksums(os.fspath(path), [r for r in range(len(keys)) if r not in overlay], row_bytes)
    for row, key in enumerate(keys):
        crc, source = (row_crc32(overlay[row]), overlay_name) if row in overlay else (next(found), os.fspath(path))
        if crc != int(expected[row]):
            found.close()
            raise fields.StateError(
                fields.join(where, "row_crc32"),
                f"does not match {'the undo log ' if row in overlay else 'table file '}{source}: its row {row} "
                f"(client {key!r}) has CRC-32 {crc:#010x}; expected {int(expected[row]):#010x}, "
                "the checksum recorded when the state was saved (the file changed since)",
            )


def _file_checksums(path: str, rows: Sequence[int], row_bytes: int):  # noqa: ANN202 - a generator
    """CRC-32 of each of ``rows`` of the file (``row_bytes`` each), in order, read on a few threads."""
    if not rows:
        return
    local = threading.local()
    handles: list[Any] = []
    lock = threading.Lock()

    def checksum(row: int) -> int:
        handle = getattr(local, "handle", None)
        if handle is None:
            handle = local.handle = open(path, "rb", buffering=0)  # noqa: SIM115 - closed below
            local.buffer = memoryview(bytearray(min(_READ_BLOCK, row_bytes)))
            with lock:
                handles.append(handle)
        buffer, crc, left = local.buffer, 0, row_bytes
        handle.seek(row * row_bytes)
        while left:
            got = handle.readinto(buffer[: min(len(buffer), left)])
            if not got:
                raise ValueError(f"{path} ended inside row {row}")
            crc = zlib.crc32(buffer[:got], crc)
            left -= got
        return crc

    pool = ThreadPoolExecutor(max_workers=max(1, min(_MAX_THREADS, os.cpu_count() or 1, len(rows))))
    try:
        yield from pool.map(checksum, rows)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        for handle in handles:
            handle.close()


def save(file: str | os.PathLike[str], codec: RowCodec, store: RowStore, running_sum: np.ndarray) -> None:
    """Write the state of a table (with ``data``: the rows of ``store``) to ``file``, streaming the rows (no copy).

    The file is replaced atomically (:func:`pollen.core.files.write_npz_atomic`), at exactly ``file``.
    """
    store.flush()
    state = _fields(codec, store, running_sum)
    state["data"] = store.data[: len(store.keys)]
    write_npz_atomic(file, state)


def read(file: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """The state in a file written by :func:`save`; ``ValueError`` if the file is not such a state.

    Read by :func:`pollen.core.files.read_npz` (no pickle; every array checked against its bytes before it
    is allocated), and ``dim`` checked against the running sum the file really holds, so no table is sized
    from a declared number. Its fields are checked when it is loaded (:func:`check_state`).
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
    return state


__all__ = [
    "FIELDS",
    "TableContents",
    "check_rows_file",
    "check_running_sum",
    "check_state",
    "contents",
    "declared_format",
    "read",
    "save",
    "state_dict",
]
