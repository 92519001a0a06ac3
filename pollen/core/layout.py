"""Model layout: how a dict of named arrays maps to one flat float32 vector and back.

Server optimisers and codecs work on one contiguous ``np.float32`` vector of the
*trainable* parameters. Tensors that are not trained (BatchNorm running statistics,
integer counters) are kept apart as "buffers": averaged or copied, never fed to an
adaptive optimiser or a compressor. This module is Flower-free so that the server
strategies and the client-side mods flatten in exactly the same way.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

# PyTorch names the non-trainable state of normalisation layers with these suffixes.
BUFFER_NAME_SUFFIXES = ("running_mean", "running_var", "num_batches_tracked")


def segments_from_sizes(sizes: Iterable[int]) -> list[tuple[int, int]]:
    """Turn tensor sizes (element counts, in flattening order) into ``(start, stop)`` slices."""
    segments, start = [], 0
    for n in sizes:
        n = int(n)
        segments.append((start, start + n))
        start += n
    return segments


def looks_like_buffer(name: str, array: np.ndarray) -> bool:
    """Guess whether an array is non-trainable state (used when nobody says)."""
    if not np.issubdtype(array.dtype, np.floating):
        return True
    return name.split(".")[-1] in BUFFER_NAME_SUFFIXES


@dataclass(frozen=True)
class TensorSpec:
    """Name, shape and dtype of one array of the model."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


@dataclass(frozen=True)
class ModelLayout:
    """The ordered trainable tensors (flattened) and the buffers (kept apart)."""

    trainable: tuple[TensorSpec, ...]
    buffers: tuple[TensorSpec, ...]

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, np.ndarray], buffer_keys: Iterable[str] | None = None) -> ModelLayout:
        """Build the layout of ``arrays``, in their order.

        ``buffer_keys`` names the non-trainable arrays explicitly; when it is ``None``
        they are inferred: non-float dtypes and PyTorch's normalisation statistics.
        """
        explicit = None if buffer_keys is None else set(buffer_keys)
        if explicit is not None and not explicit <= set(arrays):
            unknown = sorted(explicit - set(arrays))
            raise ValueError(f"buffer keys {unknown} are not arrays of the model")
        trainable, buffers = [], []
        for name, array in arrays.items():
            array = np.asarray(array)
            spec = TensorSpec(name, tuple(array.shape), array.dtype)
            is_buffer = looks_like_buffer(name, array) if explicit is None else name in explicit
            (buffers if is_buffer else trainable).append(spec)
        return cls(tuple(trainable), tuple(buffers))

    @functools.cached_property
    def dim(self) -> int:
        """Number of trainable scalars (the paper's d)."""
        return sum(spec.size for spec in self.trainable)

    @property
    def buffer_keys(self) -> tuple[str, ...]:
        return tuple(spec.name for spec in self.buffers)

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(spec.name for spec in self.trainable) + self.buffer_keys

    @property
    def segments(self) -> tuple[tuple[int, int], ...]:
        """(start, stop) of each trainable tensor inside the flat vector."""
        return self._segments

    @functools.cached_property
    def _segments(self) -> tuple[tuple[int, int], ...]:
        return tuple(segments_from_sizes(spec.size for spec in self.trainable))

    def flatten(self, arrays: Mapping[str, np.ndarray], out: np.ndarray | None = None) -> np.ndarray:
        """Concatenate the trainable arrays into one float32 vector (into ``out`` when given)."""
        if out is None:
            out = np.empty(self.dim, dtype=np.float32)
        with np.errstate(over="ignore", invalid="ignore"):  # a float64 1e300 becomes Inf; callers check
            for spec, (start, stop) in zip(self.trainable, self._segments):
                out[start:stop] = np.reshape(arrays[spec.name], -1)
        return out

    def difference(self, arrays: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray]) -> np.ndarray:
        """``flatten(arrays) - flatten(reference)`` tensor by tensor, in float32, without the two copies."""
        out = np.empty(self.dim, dtype=np.float32)
        for spec, (start, stop) in zip(self.trainable, self._segments):
            a = np.reshape(arrays[spec.name], -1)
            b = np.reshape(reference[spec.name], -1)
            np.subtract(a.astype(np.float32, copy=False), b.astype(np.float32, copy=False), out=out[start:stop])
        return out

    def unflatten(self, vector: np.ndarray) -> dict[str, np.ndarray]:
        """Split a flat vector back into named arrays with their original dtypes."""
        if vector.shape != (self.dim,):
            raise ValueError(f"expected a vector of length {self.dim}, got {vector.shape}")
        return {
            spec.name: vector[start:stop].reshape(spec.shape).astype(spec.dtype, copy=True)
            for spec, (start, stop) in zip(self.trainable, self.segments)
        }

    def check_arrays(self, arrays: Mapping[str, np.ndarray], specs: Iterable[TensorSpec]) -> None:
        """Raise ``ValueError`` naming the first array whose name, shape or values do not fit."""
        specs = tuple(specs)
        expected = [spec.name for spec in specs]
        if sorted(arrays) != sorted(expected):
            missing = sorted(set(expected) - set(arrays))
            extra = sorted(set(arrays) - set(expected))
            raise ValueError(f"array names do not match the model (missing {missing}, unexpected {extra})")
        for spec in specs:
            array = np.asarray(arrays[spec.name])
            # A 0-d tensor may come back as shape (1,) from some converters: same value, accept.
            if tuple(array.shape) != spec.shape and not (array.size == spec.size == 1):
                raise ValueError(f"array '{spec.name}' has shape {tuple(array.shape)}, the model has {spec.shape}")
            if not (np.issubdtype(array.dtype, np.number) or array.dtype == np.bool_):
                raise ValueError(f"array '{spec.name}' has non-numeric dtype {array.dtype}")
            if np.issubdtype(array.dtype, np.floating) and not np.all(np.isfinite(array)):
                raise ValueError(f"array '{spec.name}' contains NaN or Inf")
