"""The saved state of a stored-update table: what is written, how it is checked, how it is read back.

A table's state is a flat dict of numpy arrays: ``dim``, ``segments``, ``precision``, ``keys`` (str array,
row order), ``weights``, ``absmax``, ``running_sum`` and, unless the rows stay in the table's memory-mapped
file, ``data`` (``known_clients x row_width``). :class:`pollen.vr.table.UpdateTable` keeps its public
``state_dict`` / ``load_state_dict`` / ``check_state`` / ``check_running_sum`` / ``save`` / ``load`` and
delegates here.

This is a part of its own because everything about a state that came from a file (its fields, their
shapes and ranges, the rows file a memmap table re-attaches, a running sum that must match its rows) is
checked in one place, apart from the table's arithmetic; these functions see the table's pieces (its
:class:`~pollen.vr.row_codec.RowCodec`, :class:`~pollen.vr.row_store.RowStore` and running sum), not
the table.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pollen.compression import quant
from pollen.core import state_fields as fields
from pollen.core.files import read_npz, write_npz_atomic
from pollen.vr.row_codec import RowCodec
from pollen.vr.row_store import RowStore

FIELDS = ("dim", "segments", "precision", "keys", "weights", "absmax", "running_sum")
"""The fields every state holds; ``data`` comes on top unless the rows stay in a memory-mapped file."""


@dataclass(frozen=True)
class TableContents:
    """A state's contents, checked against a table's format, ready to be put into the table."""

    keys: list[str]
    weights: np.ndarray
    absmax: np.ndarray
    running_sum: np.ndarray
    data: np.ndarray | None


def state_dict(
    codec: RowCodec, store: RowStore, running_sum: np.ndarray, *, include_data: bool = True
) -> dict[str, np.ndarray]:
    """The state of a table made of ``codec``, ``store`` and ``running_sum`` (copies; ``data`` if asked)."""
    n = len(store.keys)
    state = {
        "dim": np.array(codec.dim, dtype=np.int64),
        "segments": np.array(codec.sizes, dtype=np.int64),
        "precision": np.array(codec.precision),
        "keys": np.array(store.keys, dtype=str),
        "weights": store.weights[:n].copy(),
        "absmax": store.absmax[:n].copy(),
        "running_sum": running_sum.copy(),
    }
    if include_data:
        state["data"] = np.array(store.data[:n])
    return state


def contents(codec: RowCodec, store: RowStore, state: Mapping[str, np.ndarray]) -> TableContents:
    """``state`` read for a table of format ``codec`` whose rows are in ``store``; ``ValueError`` if it does not fit.

    ``dim``, ``segments`` and ``precision`` must match ``codec``. Without ``data`` the rows must already be
    in ``store``'s memory-mapped file (at least as many rows as the state has keys).
    """
    if int(state["dim"]) != codec.dim or tuple(int(s) for s in state["segments"]) != codec.sizes:
        raise ValueError("state was saved for a different dim / segments")
    if str(state["precision"]) != codec.precision:
        raise ValueError(f"state precision {str(state['precision'])!r} != table precision {codec.precision!r}")
    keys = [str(k) for k in np.asarray(state["keys"]).reshape(-1)]
    n = len(keys)
    weights = np.asarray(state["weights"], dtype=np.float64).reshape(n)
    absmax = np.asarray(state["absmax"], dtype=np.float32).reshape(n, codec.n_scales)
    running = np.asarray(state["running_sum"], dtype=np.float64).reshape(codec.dim)
    if "data" in state:
        data = np.asarray(state["data"])
        if data.shape != (n, codec.width) or data.dtype != codec.dtype:
            raise ValueError(
                f"state data has shape {data.shape} / {data.dtype}, expected {(n, codec.width)} / {codec.dtype}"
            )
    elif store.path is None or store.capacity < n:
        raise ValueError("state has no 'data' and this table has no memory-mapped file holding the rows")
    else:
        data = None
    return TableContents(keys, weights, absmax, running, data)


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
    :func:`state_dict` writes (``data`` required or refused when ``need_data`` says so), ``dim``,
    ``segments`` and ``precision`` those expected, ``keys`` distinct non-empty strings, one weight
    (finite, >= 0), one row of scales (finite, >= 0) and one encoded row (finite for fp16 / fp32)
    per key, the running sum ``dim`` finite values. Nothing is allocated from a declared size: every
    shape is compared with ``dim`` and the number of keys the file really holds.
    """
    names = list(FIELDS)
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
        "running_sum": fields.numeric_array(state["running_sum"], at("running_sum"), shape=(dim,), dtype=np.float64),
    }
    if has_data:
        checked["data"] = fields.numeric_array(
            state["data"], at("data"), shape=(count, width), dtype=quant.storage_dtype(precision)
        )
    return checked


def check_running_sum(codec: RowCodec, store: RowStore, running_sum: np.ndarray, exact: np.ndarray, where: str) -> None:
    """``StateError`` unless ``running_sum`` equals ``exact`` (its recomputation from the rows) up to float64 drift.

    The tolerance of each coordinate is ``1e-6 * sum_j w_j |D(y_j)|`` over the rows in ``store``.
    """
    scale = np.zeros(codec.dim, dtype=np.float64)
    buffer = codec.tensor_buffer()
    for row in range(len(store.keys)):
        for a, b, values in codec.decoded_tensors(store.data[row], store.absmax[row], buffer):
            scale[a:b] += np.abs(values) * store.weights[row]
    worst = np.abs(running_sum - exact) - (1e-6 * scale + 1e-30)
    if worst.size and worst.max() > 0:
        index = int(np.argmax(worst))
        raise fields.StateError(
            fields.join(where, "running_sum"),
            f"holds {running_sum[index]!r} at index {index}; expected the weighted sum of the rows ({exact[index]!r})",
        )


def check_rows_file(state: Mapping[str, np.ndarray], path: str | os.PathLike[str] | None) -> None:
    """``ValueError`` unless ``path`` is a file big enough for the rows of ``state`` (which has no ``data``)."""
    if path is None or not os.path.exists(path):
        raise ValueError("state has no 'data': pass path= of the existing memory-mapped file with the rows")
    codec = RowCodec(int(state["dim"]), [int(s) for s in state["segments"]], str(state["precision"]))
    need = len(np.asarray(state["keys"]).reshape(-1)) * codec.width * codec.dtype.itemsize
    if os.path.getsize(path) < need:
        raise ValueError(f"{os.fspath(path)} holds {os.path.getsize(path)} bytes, the state needs {need}")


def save(file: str | os.PathLike[str], state: dict[str, np.ndarray], store: RowStore) -> None:
    """Write ``state`` (without ``data``) plus the rows of ``store`` to ``file``, streaming them (no copy).

    The file is replaced atomically (:func:`pollen.core.files.write_npz_atomic`), at exactly ``file``.
    """
    store.flush()
    state["data"] = store.data[: len(store.keys)]
    write_npz_atomic(file, state)


def read(file: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """The state in a file written by :func:`save`; ``ValueError`` if the file is not such a state.

    Read by :func:`pollen.core.files.read_npz` (no pickle; every array checked against its bytes before it
    is allocated), and ``dim`` checked against the running sum the file really holds, so no table is sized
    from a declared number.
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
    "read",
    "save",
    "state_dict",
]
