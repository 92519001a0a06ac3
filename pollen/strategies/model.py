"""The global model a strategy holds: one flat float32 vector of trainable values plus the buffers.

:class:`GlobalModel` adopts the ``ArrayRecord`` Flower hands a strategy each round, keeps the
trainable parameters as one contiguous ``np.float32`` vector (what the server optimiser steps) and
the non-trainable buffers apart (averaged, never fed to an optimiser), and turns them back into an
``ArrayRecord`` in the original key order. It writes and reads its own part of a checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from flwr.app import ArrayRecord

from pollen.core.layout import ModelLayout
from pollen.strategies.screening import all_finite
from pollen.wire.records import arrays_to_record, record_to_arrays


class GlobalModel:
    """Layout, flat parameters, buffers and key order of the global model.

    Parameters
    ----------
    buffer_keys : Iterable[str] | None
        Names of non-trainable arrays; ``None`` infers them (integer dtypes and PyTorch
        normalisation statistics).
    """

    def __init__(self, buffer_keys: Iterable[str] | None = None) -> None:
        self.buffer_keys = None if buffer_keys is None else tuple(buffer_keys)
        self.layout: ModelLayout | None = None
        self.params: np.ndarray | None = None
        self.buffers: dict[str, np.ndarray] = {}
        self.key_order: tuple[str, ...] = ()
        self._returned: ArrayRecord | None = None

    def adopt(self, arrays: ArrayRecord) -> bool:
        """Take the global model from ``arrays``; ``True`` when this made the layout known.

        When ``arrays`` is the record this model returned last (:meth:`to_record` after
        :meth:`returned`), the parameters already hold it and nothing is decoded again.
        """
        if arrays is self._returned and self.params is not None:
            return False
        named = record_to_arrays(arrays)
        self.key_order = tuple(named)
        first = self.layout is None
        if first:
            self.layout = ModelLayout.from_arrays(named, self.buffer_keys)
        self.layout.check_arrays(named, self.layout.trainable + self.layout.buffers)
        self.params = self.layout.flatten(named)
        self.buffers = {spec.name: np.array(named[spec.name]) for spec in self.layout.buffers}
        return first

    def to_record(self) -> ArrayRecord:
        """The current model as an ``ArrayRecord`` in the original key order."""
        assert self.layout is not None and self.params is not None
        named: dict[str, np.ndarray] = dict(self.buffers)
        for spec, (start, stop) in zip(self.layout.trainable, self.layout.segments):
            view = self.params[start:stop].reshape(spec.shape)  # a view: the record copies once
            named[spec.name] = view if view.dtype == spec.dtype else view.astype(spec.dtype)
        return self.record_of(named)

    def record_of(self, named: Mapping[str, np.ndarray]) -> ArrayRecord:
        """An ``ArrayRecord`` of ``named`` arrays (a whole model) in the model's key order."""
        return arrays_to_record({key: named[key] for key in self.key_order})

    def returned(self, record: ArrayRecord) -> ArrayRecord:
        """Remember ``record`` as the one handed back to Flower (adopted again without decoding)."""
        self._returned = record
        return record

    @property
    def last_returned(self) -> ArrayRecord | None:
        """The record handed back to Flower last (``None`` before the first step or after a load)."""
        return self._returned

    def average_buffers(self, buffers: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float]) -> None:
        """Set each buffer to the weighted mean of the clients' (integers rounded to the nearest)."""
        if not self.buffers or not buffers:
            return
        for name, old in self.buffers.items():
            mean = np.zeros(old.shape, dtype=np.float64)
            for weight, client in zip(weights, buffers):
                mean += weight * client[name]
            self.buffers[name] = (np.rint(mean) if np.issubdtype(old.dtype, np.integer) else mean).astype(old.dtype)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Layout, parameters and buffers (empty before the model is known)."""
        if self.layout is None:
            return {}
        specs = self.layout.trainable + self.layout.buffers
        return {
            "key_order": list(self.key_order),
            "buffer_keys": list(self.layout.buffer_keys),
            "shapes": {spec.name: list(spec.shape) for spec in specs},
            "dtypes": {spec.name: spec.dtype.str for spec in specs},
            "params": self.params.copy(),
            "buffers": {k: v.copy() for k, v in self.buffers.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` wrote; ``ValueError`` when it does not describe a usable model."""
        self._returned = None
        if "params" not in state:
            return
        named = {
            name: np.zeros(state["shapes"][name], dtype=np.dtype(state["dtypes"][name])) for name in state["key_order"]
        }
        layout = ModelLayout.from_arrays(named, state["buffer_keys"])
        params = np.asarray(state["params"])
        if params.shape != (layout.dim,) or params.dtype != np.float32 or not all_finite(params):
            raise ValueError(
                f"state params must be {layout.dim} finite float32 values, got {params.shape} {params.dtype}"
            )
        buffers = {k: np.array(v) for k, v in state["buffers"].items()}
        if sorted(buffers) != sorted(layout.buffer_keys) or any(
            buffers[spec.name].shape != spec.shape for spec in layout.buffers
        ):
            raise ValueError("state buffers do not match the model's buffers")
        self.layout = layout
        self.key_order = tuple(state["key_order"])
        self.params = np.array(params)
        self.buffers = buffers
