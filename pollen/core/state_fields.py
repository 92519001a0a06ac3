"""Checks for the fields of a saved state: one line naming the field and what was expected.

A checkpoint or a client-state file can be handed to pollen by anyone (a run-config points at it), so
every field is checked before anything of the live state changes: its presence, type, dtype, shape
(against the model and the run-config), range and invariants. Each check here returns the value in its
checked form or raises :class:`StateError`, a :class:`~pollen.core.checkpoint.CheckpointError` (so a
``ValueError``) whose message is one line::

    state field 'strategy/optimizer/slots/v' holds -1 at index 3; expected values >= 0 (a second moment)

Fields are named by their path in the saved tree (``/``-joined). Nothing is allocated from a size the
state declares: arrays are checked against the shapes the caller expects (which come from the model or
the run-config, or from arrays whose bytes were already read), and a declared size is compared with one
of those before it is used.

Flower-free: numpy and the standard library only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from numbers import Integral, Real
from typing import Any

import numpy as np

from pollen.core.checkpoint import CheckpointError

__all__ = [
    "MAX_COUNT",
    "StateError",
    "at",
    "bit_generator_state",
    "entry",
    "finite_number",
    "float_vector",
    "join",
    "mapping",
    "numeric_array",
    "one_to_one",
    "pairs",
    "sequence",
    "text",
    "whole",
]

#: The largest whole number a state field may hold (counters, byte totals): int64's range.
MAX_COUNT = 2**63 - 1
_BLOCK = 1 << 16


class StateError(CheckpointError):
    """A saved state field that cannot be used: one line naming the field and what was expected."""

    def __init__(self, where: str, why: str, *, source: str = "") -> None:
        self.field = where
        self.why = " ".join(why.split())
        self.source = source
        prefix = f"{source}: " if source else ""
        super().__init__(f"{prefix}state field {where!r} {self.why}")

    def in_file(self, source: str) -> StateError:
        """The same refusal, naming the file it came from."""
        return type(self)(self.field, self.why, source=source)


def join(where: str, *keys: Any) -> str:
    """The path of ``keys`` (a key, or a key inside a key ...) inside the field at ``where``."""
    for key in keys:
        where = f"{where}/{key}" if where else str(key)
    return where


def _show(value: Any) -> str:
    text_ = repr(value)
    return text_ if len(text_) <= 60 else text_[:57] + "..."


def _kind(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return f"a {value.dtype} array of shape {value.shape}"
    return f"{_show(value)} ({type(value).__name__})"


def at(state: Any, key: str, where: str) -> Any:
    """``state[key]``; the field ``where/key`` must be there (and ``state`` a mapping)."""
    mapping(state, where)
    if key not in state:
        raise StateError(join(where, key), "is missing")
    return state[key]


def entry(state: Mapping[str, Any], key: str, where: str, default: Any) -> Any:
    """``state[key]``, or ``default`` when the field is absent (an optional field)."""
    return state[key] if key in state else default


def mapping(value: Any, where: str, *, keys: Sequence[str] | None = None) -> Mapping[str, Any]:
    """A mapping with ``str`` keys (exactly ``keys`` when given)."""
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise StateError(where, f"is {_kind(value)}; expected a mapping with str keys")
    if keys is not None and set(value) != set(keys):
        missing, extra = sorted(set(keys) - set(value)), sorted(set(value) - set(keys))
        name = join(where, (missing or extra)[0])
        raise StateError(name, "is missing" if missing else f"is not a field of {where or 'the state'}")
    return value


def sequence(value: Any, where: str, *, length: int | None = None, most: int | None = None) -> Sequence[Any]:
    """A list (or tuple) of ``length`` items (at most ``most``)."""
    if not isinstance(value, (list, tuple)):
        raise StateError(where, f"is {_kind(value)}; expected a list")
    if length is not None and len(value) != length:
        raise StateError(where, f"has {len(value)} items; expected {length}")
    if most is not None and len(value) > most:
        raise StateError(where, f"has {len(value)} items; expected at most {most}")
    return value


def pairs(value: Any, where: str) -> list[tuple[str, Any]]:
    """A list of ``[name, value]`` pairs with distinct ``str`` names."""
    out: list[tuple[str, Any]] = []
    for i, item in enumerate(sequence(value, where)):
        sequence(item, join(where, i), length=2)
        text(item[0], join(join(where, i), 0))
        out.append((item[0], item[1]))
    names = [name for name, _ in out]
    if len(set(names)) != len(names):
        raise StateError(where, "names one entry twice; expected distinct names")
    return out


def whole(value: Any, where: str, *, low: int = 0, high: int = MAX_COUNT) -> int:
    """An integer (Python or numpy, not a bool or a float) in ``[low, high]``."""
    if isinstance(value, np.ndarray) and value.shape == ():
        value = value[()]
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, Integral):
        raise StateError(where, f"is {_kind(value)}; expected an integer in [{low}, {high}]")
    if not low <= int(value) <= high:
        raise StateError(where, f"is {int(value)}; expected an integer in [{low}, {high}]")
    return int(value)


def finite_number(value: Any, where: str, *, low: float = -math.inf, high: float = math.inf) -> float:
    """A finite real number (int or float, not a bool) in ``[low, high]``."""
    if isinstance(value, np.ndarray) and value.shape == ():
        value = value[()]
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, Real):
        raise StateError(where, f"is {_kind(value)}; expected a finite number in [{low:g}, {high:g}]")
    number = float(value)
    if not math.isfinite(number) or not low <= number <= high:
        raise StateError(where, f"is {number!r}; expected a finite number in [{low:g}, {high:g}]")
    return number


def text(value: Any, where: str, *, most: int = 4096, allowed: Sequence[str] | None = None) -> str:
    """A ``str`` of at most ``most`` characters (one of ``allowed`` when given)."""
    if not isinstance(value, str):
        raise StateError(where, f"is {_kind(value)}; expected a str")
    if len(value) > most:
        raise StateError(where, f"is a str of {len(value)} characters; expected at most {most}")
    if allowed is not None and value not in allowed:
        raise StateError(where, f"is {_show(value)}; expected one of {', '.join(map(repr, allowed))}")
    return value


def numeric_array(
    value: Any,
    where: str,
    *,
    shape: Sequence[int | None] | None = None,
    dtype: Any = None,
    kinds: str = "biuf",
    low: float | None = None,
    high: float | None = None,
    what: str = "",
) -> np.ndarray:
    """A numpy array of the given dtype (exactly; else of a kind in ``kinds``) and shape (``None``: any
    length), finite when floating, every value in ``[low, high]`` when given. ``what`` says what the
    values are (it ends the message of a range refusal, e.g. ``"(a second moment)"``)."""
    if isinstance(value, np.generic) and not isinstance(value, (np.str_, np.bytes_)):
        value = np.asarray(value)  # a numpy scalar is a 0-d array (a buffer averaged with 0-d ufuncs is one)
    if not isinstance(value, np.ndarray):
        raise StateError(where, f"is {_kind(value)}; expected a numpy array")
    if dtype is not None and value.dtype != np.dtype(dtype):
        raise StateError(where, f"has dtype {value.dtype}; expected {np.dtype(dtype)}")
    if value.dtype.kind not in kinds:
        raise StateError(where, f"has dtype {value.dtype}; expected a numeric dtype")
    if shape is not None and (
        len(shape) != value.ndim or any(w is not None and w != n for w, n in zip(shape, value.shape))
    ):
        want = "(" + ", ".join("N" if w is None else str(w) for w in shape) + ("," if len(shape) == 1 else "") + ")"
        raise StateError(where, f"has shape {value.shape}; expected {want}")
    flat = value.reshape(-1)
    for start in range(0, flat.shape[0], _BLOCK):
        block = flat[start : start + _BLOCK]
        bad = None
        if value.dtype.kind in "fc" and not np.isfinite(block).all():
            bad = int(np.argmin(np.isfinite(block)))
            raise StateError(where, f"holds {block[bad]!r} at index {start + bad}; expected finite values")
        if low is not None and block.size and block.min() < low:
            bad = int(np.argmin(block))
            raise StateError(where, f"holds {block[bad]!r} at index {start + bad}; expected values >= {low:g} {what}")
        if high is not None and block.size and block.max() > high:
            bad = int(np.argmax(block))
            raise StateError(where, f"holds {block[bad]!r} at index {start + bad}; expected values <= {high:g} {what}")
    return value


def float_vector(
    value: Any, where: str, dim: int, *, low: float | None = None, high: float | None = None, what: str = ""
) -> np.ndarray:
    """A finite float32 vector of ``dim`` values (in ``[low, high]`` when given)."""
    return numeric_array(value, where, shape=(dim,), dtype=np.float32, low=low, high=high, what=what)


def one_to_one(value: Any, where: str, *, most: int = 256) -> dict[int, str]:
    """Node id -> client id: str keys that spell integers, non-empty str values, no client id twice."""
    out: dict[int, str] = {}
    holder: dict[str, int] = {}
    for key, client in mapping(value, where).items():
        name = join(where, key)
        try:
            node = int(key, 10)
        except ValueError:
            raise StateError(name, "is keyed by a node id that is not an integer") from None
        client = text(client, name, most=most)
        if not client:
            raise StateError(name, "is an empty client id; expected a non-empty str")
        if client in holder:
            raise StateError(name, f"maps node {node} to client id {client!r}, held by node {holder[client]} too")
        holder[client] = node
        out[node] = client
    return out


#: The bit generators whose state a saved ``numpy.random.Generator`` may hold, and that state's fields.
_BIT_GENERATORS = {"PCG64": ("state", "inc"), "PCG64DXSM": ("state", "inc")}


def bit_generator_state(value: Any, where: str) -> dict[str, Any]:
    """The state of a numpy ``PCG64`` bit generator: its name, 128-bit ``state``/``inc`` (``inc`` odd)
    and the buffered 32-bit half (``has_uint32`` 0 or 1, ``uinteger`` < 2**32)."""
    state = mapping(value, where, keys=("bit_generator", "state", "has_uint32", "uinteger"))
    name = text(state["bit_generator"], join(where, "bit_generator"), allowed=tuple(_BIT_GENERATORS))
    inner = mapping(state["state"], join(where, "state"), keys=_BIT_GENERATORS[name])
    numbers = {key: whole(inner[key], join(join(where, "state"), key), high=2**128 - 1) for key in inner}
    if numbers["inc"] % 2 == 0:
        raise StateError(join(join(where, "state"), "inc"), "is even; expected an odd increment")
    return {
        "bit_generator": name,
        "state": numbers,
        "has_uint32": whole(state["has_uint32"], join(where, "has_uint32"), high=1),
        "uinteger": whole(state["uinteger"], join(where, "uinteger"), high=2**32 - 1),
    }
