"""The wire format of a compressed vector, and the checks every decoder runs on it.

A :class:`Payload` is what a client uploads in place of a dense float32 update: a codec name, the length
of the vector it stands for, and a few 1-D numpy arrays that are exactly the bytes on the wire. Nothing in
a payload is trusted: a decoder checks every name, dtype and length before it touches the data, and
raises :class:`PayloadError` with one line that says what was wrong and what was expected. The Flower glue
catches that error, logs it and counts the reply as a failure; it never reaches the model.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

__all__ = ["Payload", "PayloadError"]


class PayloadError(ValueError):
    """A payload cannot be decoded; the message names the problem and what was expected."""


@dataclass(frozen=True)
class Payload:
    """A compressed 1-D vector as it travels on the wire.

    Parameters
    ----------
    codec : str
        Name of the codec that produced it, e.g. ``"sign"``, ``"topk"``, ``"fp16"``, ``"none"`` or
        ``"sign/tensor"`` for per-tensor granularity.
    dim : int
        Length of the float32 vector the payload encodes.
    arrays : dict[str, np.ndarray]
        The 1-D numpy arrays that go on the wire, by name (``"bits"``, ``"scale"``, ``"indices"``,
        ``"values"``; per-tensor payloads prefix them with the segment number, ``"0.bits"``).
    """

    codec: str
    dim: int
    arrays: dict[str, np.ndarray]

    @property
    def nbytes(self) -> int:
        """Bytes on the wire: the sum of the arrays' ``nbytes`` (names and metadata not counted)."""
        return int(sum(np.asarray(a).nbytes for a in self.arrays.values()))


# ----------------------------------------------------------------------------------------------------
# Checks shared by the decoders. Each raises PayloadError with a one-line reason.
# ----------------------------------------------------------------------------------------------------


def check_header(payload: object, codec: str, dim: int) -> None:
    """Check that ``payload`` is a :class:`Payload` of codec ``codec`` for a vector of length ``dim``."""
    if not isinstance(payload, Payload):
        raise PayloadError(f"expected a Payload, got {type(payload).__name__}")
    check_dim(dim)
    if payload.codec != codec:
        raise PayloadError(f"payload codec is {payload.codec!r}, expected {codec!r}")
    if isinstance(payload.dim, bool) or not isinstance(payload.dim, (int, np.integer)):
        raise PayloadError(f"payload dim must be an integer, got {payload.dim!r}")
    if payload.dim != dim:
        raise PayloadError(f"payload dim is {payload.dim}, expected {dim} (the model's vector length)")
    if not isinstance(payload.arrays, dict):
        raise PayloadError(f"payload arrays must be a dict, got {type(payload.arrays).__name__}")


def check_dim(dim: object) -> int:
    """Check that ``dim`` is a positive integer; return it as ``int``."""
    if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)):
        raise PayloadError(f"dim must be an integer, got {dim!r}")
    if dim <= 0:
        raise PayloadError(f"dim must be positive, got {dim}")
    return int(dim)


def check_keys(arrays: dict[str, np.ndarray], expected: Iterable[str], codec: str) -> None:
    """Check that ``arrays`` has exactly the names in ``expected``."""
    expected = set(expected)
    got = set(arrays)
    if got != expected:
        missing = sorted(expected - got)
        extra = sorted(got - expected, key=str)
        parts = []
        if missing:
            parts.append(f"missing {missing}")
        if extra:
            parts.append(f"unexpected {extra}")
        raise PayloadError(f"{codec} payload arrays: {', '.join(parts)}; expected exactly {sorted(expected)}")


def check_array(
    arrays: dict[str, np.ndarray],
    key: str,
    dtype: np.dtype | type,
    length: int | None,
    codec: str,
) -> np.ndarray:
    """Return ``arrays[key]`` after checking it is a 1-D numpy array of ``dtype`` and ``length``.

    ``length=None`` accepts any length (the caller checks it).
    """
    a = arrays[key]
    dtype = np.dtype(dtype)
    if not isinstance(a, np.ndarray):
        raise PayloadError(f"{codec} payload {key!r} must be a numpy array, got {type(a).__name__}")
    if a.ndim != 1:
        raise PayloadError(f"{codec} payload {key!r} must be 1-D, got shape {a.shape}")
    if a.dtype != dtype:
        raise PayloadError(f"{codec} payload {key!r} has dtype {a.dtype}, expected {dtype}")
    if length is not None and a.size != length:
        raise PayloadError(f"{codec} payload {key!r} has length {a.size}, expected {length}")
    return a


def check_finite(a: np.ndarray, key: str, codec: str) -> None:
    """Check that a float array holds no NaN or Inf."""
    if not np.isfinite(a).all():
        bad = int(a.size - np.count_nonzero(np.isfinite(a)))
        raise PayloadError(f"{codec} payload {key!r} holds {bad} NaN/Inf value(s); expected finite numbers")
