"""Save and load a checkpoint tree to one file, atomically and without pickle.

A *checkpoint tree* is what a round loop needs to resume: nested dicts (``str`` keys) and lists holding
``None``, ``bool``, ``int`` (any size: a PCG64 bit-generator state holds 128-bit integers), ``float``
(``nan`` and ``inf`` included), ``str``, numpy scalars and numpy arrays. :func:`save_checkpoint` writes it,
:func:`load_checkpoint` reads it back, :func:`describe_difference` says in one line why a run-config saved in
a checkpoint does not match the current one.

Why this shape:

- **Atomic write.** The file is written to a temporary file in the same directory, flushed, ``fsync``-ed and
  then renamed onto the final path with :func:`os.replace` (:func:`pollen.core.files.write_npz_atomic`). A
  crash (or ``SIGKILL``) while writing leaves the previous checkpoint at ``path`` untouched and usable; a
  reader never sees a half-written file.
- **No pickle.** A run-config can point at a checkpoint file, so the file is untrusted input: nothing in it
  is ever unpickled, arrays of ``object`` dtype are refused when saving and when loading, and every size the
  file declares is checked against the bytes that are really there before anything is allocated
  (:func:`numpy.load` on a zip member allocates from the declared shape first; the members are read by
  :func:`pollen.core.files.read_npz`, which checks each header against its bytes first).

File format (``"pollen-checkpoint/1"``): one uncompressed ``.npz`` written by :func:`numpy.savez`. Every array
of the tree is a member named ``a0``, ``a1``, ... ; the member ``__meta__`` is a 1-D ``uint8`` array holding
UTF-8 JSON ``{"format": "pollen-checkpoint/1", "tree": ...}`` in which the values JSON has no exact form for
are tagged objects with exactly one key:

=====================================  =====================================================================
``{"__array__": "a3"}``                numpy array stored in member ``a3``
``{"__scalar__": "a3"}``               numpy scalar (``np.float32(1.5)``...), stored as the 0-d array ``a3``
``{"__int__": "-0x1f..."}``            ``int`` outside the int64 range, as a hex string (exact, no digit limit)
``{"__float__": "nan"}``               ``nan``, ``inf`` or ``-inf`` (the JSON stays strict)
``{"__dict__": [["k", v], ...]}``      a dict of the tree that has a key spelled like one of these tags
=====================================  =====================================================================

What comes back (documented differences): tuples come back as lists; ``dict`` subclasses / mappings as plain
``dict`` (key order kept); ``int`` / ``float`` / ``str`` subclasses as the plain type; numpy scalars as numpy
scalars of the same dtype; arrays with the same dtype (byte order included), shape and bytes, C- or
Fortran-ordered as saved (a non-contiguous view comes back C-contiguous) and writable. Allowed array dtypes:
bool, integer, floating, complex and fixed-width ``str`` / ``bytes`` (``np.array(["a"])``); ``object``,
structured, void, datetime and zero-width dtypes are refused with :class:`CheckpointError`.

This module only needs numpy and the standard library (no Flower, no torch).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from pollen.core.files import (
    NPZ_KINDS_TEXT,
    NpzError,
    npz_dtype_problem,
    read_npz,
    write_npz_atomic,
)

__all__ = ["FORMAT", "CheckpointError", "describe_difference", "load_checkpoint", "save_checkpoint"]

#: Format string written into every checkpoint; :func:`load_checkpoint` refuses any other.
FORMAT = "pollen-checkpoint/1"

_META = "__meta__"
_ARRAY, _SCALAR, _INT, _FLOAT, _DICT = "__array__", "__scalar__", "__int__", "__float__", "__dict__"
_TAGS = frozenset({_ARRAY, _SCALAR, _INT, _FLOAT, _DICT})
_ARRAY_NAME = re.compile(r"a[0-9]{1,9}")
_HEX_INT = re.compile(r"-?0x[0-9a-f]+")
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


class CheckpointError(ValueError):
    """A checkpoint file that cannot be used; message is one line saying why."""


# --------------------------------------------------------------------------------------------- save


def save_checkpoint(
    path: str | os.PathLike[str], tree: Mapping[str, Any], *, before_replace: Callable[[str], None] | None = None
) -> int:
    """Write ``tree`` to ``path`` atomically; return bytes written.

    Parameters
    ----------
    path
        Destination file (conventionally ending in ``.npz``). Missing parent directories are created. An
        existing file is replaced only once the new one is completely on disk.
    tree
        Mapping with ``str`` keys; values as described in the module docstring.
    before_replace
        Called with the sha256 (hex) of the new file once it is complete, before it replaces ``path``
        (see :func:`pollen.core.files.write_npz_atomic`): a caller records the digest of what it wrote.

    Returns
    -------
    int
        Size of the written file in bytes.

    Raises
    ------
    CheckpointError
        If the tree holds something that cannot be stored (names the place in the tree, e.g.
        ``'strategy/optimizer/m'``). Raised before any file or directory is touched.
    OSError
        If writing fails; the temporary file is removed and the previous file at ``path`` is untouched.
    """
    meta, arrays = _encode_tree(tree)
    return write_npz_atomic(path, {_META: np.frombuffer(meta, dtype=np.uint8), **arrays}, before_replace=before_replace)


def _encode_tree(tree: Mapping[str, Any]) -> tuple[bytes, dict[str, np.ndarray]]:
    """Validate ``tree`` and split it into the JSON meta (bytes) and the arrays to store, by member name."""
    if not isinstance(tree, Mapping):
        raise CheckpointError(f"checkpoint tree must be a mapping with str keys, got {type(tree).__name__}")
    arrays: dict[str, np.ndarray] = {}
    encoded = _encode(tree, "", arrays)
    meta = json.dumps({"format": FORMAT, "tree": encoded}, ensure_ascii=True, allow_nan=False)
    return meta.encode("ascii"), arrays


def _encode(value: Any, where: str, arrays: dict[str, np.ndarray]) -> Any:
    """Return the JSON form of ``value`` (at tree path ``where``), adding its arrays to ``arrays``."""
    if value is None or type(value) in (bool, str):
        return value
    if isinstance(value, (np.ndarray, np.generic)):
        return _encode_numpy(value, where, arrays)
    if isinstance(value, str):
        return str(value)
    if isinstance(value, int):
        return _encode_int(int(value))
    if isinstance(value, float):
        return _encode_float(float(value))
    if isinstance(value, Mapping):
        return _encode_mapping(value, where, arrays)
    if isinstance(value, (list, tuple)):
        return [_encode(item, _join(where, str(i)), arrays) for i, item in enumerate(value)]
    raise CheckpointError(
        f"checkpoint value at {_show(where)} has type {type(value).__name__}; allowed: dict, list, tuple, "
        "None, bool, int, float, str, numpy scalars and arrays"
    )


def _encode_int(value: int) -> int | dict[str, str]:
    return value if _INT64_MIN <= value <= _INT64_MAX else {_INT: hex(value)}


def _encode_float(value: float) -> float | dict[str, str]:
    if math.isfinite(value):
        return value
    return {_FLOAT: "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}


def _encode_mapping(value: Mapping[Any, Any], where: str, arrays: dict[str, np.ndarray]) -> Any:
    items = []
    for key, item in value.items():
        if not isinstance(key, str):
            raise CheckpointError(
                f"checkpoint dict at {_show(where)} has key {key!r} of type {type(key).__name__}; "
                "allowed: str keys only"
            )
        items.append((str(key), _encode(item, _join(where, key), arrays)))
    if any(key in _TAGS for key, _ in items):
        return {_DICT: [[key, item] for key, item in items]}
    return dict(items)


def _encode_numpy(value: np.ndarray | np.generic, where: str, arrays: dict[str, np.ndarray]) -> dict[str, str]:
    if isinstance(value, np.ma.MaskedArray):
        raise CheckpointError(f"checkpoint value at {_show(where)} is a masked array; allowed: plain arrays")
    array = np.asarray(value)
    reason = npz_dtype_problem(array.dtype)
    if reason is not None:
        raise CheckpointError(f"checkpoint value at {_show(where)} has {reason}; allowed: {NPZ_KINDS_TEXT}")
    name = f"a{len(arrays)}"
    arrays[name] = array
    return {_SCALAR if isinstance(value, np.generic) else _ARRAY: name}


def _join(where: str, key: str) -> str:
    return f"{where}/{key}" if where else key


def _show(where: str) -> str:
    return repr(where) if where else "the top level"


# --------------------------------------------------------------------------------------------- load


def load_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read back what :func:`save_checkpoint` wrote.

    Parameters
    ----------
    path
        A file written by :func:`save_checkpoint`.

    Returns
    -------
    dict
        The tree: equal values, numpy arrays with the same dtype, shape and bytes (see the module docstring
        for what changes type: tuples come back as lists).

    Raises
    ------
    CheckpointError
        If the file is not a usable checkpoint (not a zip, truncated, damaged, no or bad ``__meta__``, unknown
        format, a reference to a missing array, a refused dtype...). One line that names the file.
    OSError
        If the file cannot be opened (missing, a directory, no permission).
    """
    name = os.fspath(path)
    try:
        members = read_npz(name)
    except NpzError as exc:
        raise _bad(name, exc.why) from exc
    if _META not in members:
        raise _bad(name, f"has no {_META} member (not a pollen checkpoint)")
    tree = _Reader(members, name).decode(_parse_meta(members[_META], name), "")
    if not isinstance(tree, dict):
        raise _bad(name, f"holds a {type(tree).__name__} at the top level, not a dict")
    return tree


def _bad(name: str, why: str) -> CheckpointError:
    return CheckpointError(" ".join(f"checkpoint {name} {why}".split()))


def _parse_meta(meta: np.ndarray, name: str) -> dict[str, Any]:
    """Decode and check ``__meta__``; return the encoded tree."""
    if meta.dtype != np.uint8 or meta.ndim != 1:
        raise _bad(name, f"has a {_META} of dtype {meta.dtype} and shape {meta.shape}; expected 1-D uint8")
    try:
        doc = json.loads(meta.tobytes().decode("utf-8"), parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as exc:
        raise _bad(name, f"has a {_META} that is not valid JSON ({exc})") from exc
    if not isinstance(doc, dict) or "format" not in doc:
        raise _bad(name, f"has a {_META} without a format field (not a pollen checkpoint)")
    if doc["format"] != FORMAT:
        raise _bad(name, f"has format {doc['format']!r}; this pollen reads {FORMAT!r}")
    tree = doc.get("tree")
    if not isinstance(tree, dict):
        raise _bad(name, f"has a {_META} whose tree is not a JSON object")
    return tree


def _refuse_constant(token: str) -> Any:
    raise ValueError(f"non-standard JSON constant {token}")


class _Reader:
    """Turns the parsed meta of one checkpoint back into the tree, taking arrays from its checked members."""

    def __init__(self, members: Mapping[str, np.ndarray], name: str) -> None:
        self.members = members
        self.name = name
        self.used: set[str] = set()

    def bad(self, why: str) -> CheckpointError:
        return _bad(self.name, why)

    def member(self, key: str, where: str) -> np.ndarray:
        """The array stored in member ``key`` (referenced at ``where``)."""
        array = self.members.get(key)
        if array is None or key == _META:
            raise self.bad(f"has no array {key!r} (referenced at {where})")
        if key in self.used:  # a file pollen wrote never refers to one array twice: no aliasing either way
            return array.copy()
        self.used.add(key)
        return array

    def decode(self, value: Any, where: str) -> Any:
        """Invert :func:`_encode` on the parsed JSON at tree path ``where``."""
        if isinstance(value, list):
            return [self.decode(item, _join(where, str(i))) for i, item in enumerate(value)]
        if not isinstance(value, dict):
            return value
        if not _TAGS.intersection(value):
            return {key: self.decode(item, _join(where, key)) for key, item in value.items()}
        if len(value) != 1:
            raise self.bad(f"has a malformed tagged value at {_show(where)} (keys {sorted(value)})")
        tag, payload = next(iter(value.items()))
        return self.decode_tagged(tag, payload, where)

    def decode_tagged(self, tag: str, payload: Any, where: str) -> Any:
        if tag in (_ARRAY, _SCALAR):
            if not isinstance(payload, str) or not _ARRAY_NAME.fullmatch(payload):
                raise self.bad(f"refers to array {payload!r} at {_show(where)}; expected a name like 'a0'")
            array = self.member(payload, _show(where))
            if tag == _ARRAY:
                return array
            if array.ndim != 0:
                raise self.bad(f"stores the scalar at {_show(where)} with shape {array.shape}")
            return array[()]
        if tag == _INT and isinstance(payload, str) and _HEX_INT.fullmatch(payload):
            return int(payload, 16)
        if tag == _FLOAT and isinstance(payload, str) and payload in _NONFINITE:
            return _NONFINITE[payload]
        if tag == _DICT and isinstance(payload, list) and all(_is_pair(p) for p in payload):
            return {key: self.decode(item, _join(where, key)) for key, item in payload}
        raise self.bad(f"has a malformed {tag} value at {_show(where)}")


def _is_pair(item: Any) -> bool:
    return isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)


# --------------------------------------------------------------------------------------- run-config


def describe_difference(
    saved: Mapping[str, Any], current: Mapping[str, Any], *, ignore: Iterable[str] = ()
) -> str | None:
    """Say how two flat run-configs differ, in one line, or return None when they agree.

    Parameters
    ----------
    saved
        The run-config stored in the checkpoint (key -> scalar).
    current
        The run-config of the run that wants to resume.
    ignore
        Keys that may differ (e.g. ``num-server-rounds`` when extending a run).

    Returns
    -------
    str or None
        None when both agree on every key not in ``ignore``; otherwise one line about the first differing key
        in sorted order: ``run-config 'server-lr' was 0.1 in the checkpoint and is 0.2 now``, ``run-config 'x'
        is missing from the checkpoint`` (only in ``current``) or ``run-config 'x' is not set now`` (only in
        ``saved``). Values compare exactly (``0.1`` and ``0.1000001`` differ); ``True`` and ``1`` differ, ``1``
        and ``1.0`` agree, two NaNs agree.
    """
    skip = set(ignore)
    for key in sorted((set(saved) | set(current)) - skip):
        if key not in saved:
            return f"run-config {key!r} is missing from the checkpoint"
        if key not in current:
            return f"run-config {key!r} is not set now"
        if not _same(saved[key], current[key]):
            return f"run-config {key!r} was {saved[key]!r} in the checkpoint and is {current[key]!r} now"
    return None


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (bool, np.bool_)) != isinstance(b, (bool, np.bool_)):
        return False
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    try:
        return bool(a == b)
    except (TypeError, ValueError):
        return False
