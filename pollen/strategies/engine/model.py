"""The global model a strategy holds: one flat float32 vector of trainable values plus the buffers.

:class:`GlobalModel` adopts the ``ArrayRecord`` Flower hands a strategy each round, keeps the
trainable parameters as one contiguous ``np.float32`` vector (what the server optimiser steps) and
the non-trainable buffers apart (averaged, never fed to an optimiser), and turns them back into an
``ArrayRecord`` in the original key order. It writes and reads its own part of a checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from flwr.app import ArrayRecord

from pollen.core import state_fields as fields
from pollen.core.layout import ModelLayout, TensorSpec
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
        first = self.layout is None
        layout = ModelLayout.from_arrays(named, self.buffer_keys) if first else self.layout
        layout.check_arrays(named, layout.trainable + layout.buffers)  # a refused record changes nothing
        self.layout, self.key_order = layout, tuple(named)
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

    def load_state_dict(self, state: Mapping[str, Any], where: str = "") -> None:
        """Restore what :meth:`state_dict` wrote; :class:`~pollen.core.state_fields.StateError` (a
        ``ValueError``) when it does not describe a usable model, and then nothing changes."""
        self.prepare_load(state, where)()

    def take(self, other: GlobalModel) -> None:
        """Hold what ``other`` holds (a model loaded into a fresh object, checked, then made this one's)."""
        vars(self).update(vars(other))

    def prepare_load(self, state: Mapping[str, Any], where: str = "") -> Callable[[], None]:
        """Check the model part of ``state`` (names, shapes, dtypes, finite values; no array is allocated
        from a declared shape: the declared sizes are checked against the arrays that were read) and
        return what makes it this model's."""
        if "params" not in state:
            return self._forget
        layout, key_order = saved_layout(state, where)
        params = fields.float_vector(state["params"], fields.join(where, "params"), layout.dim)
        saved = fields.mapping(
            fields.at(state, "buffers", where), fields.join(where, "buffers"), keys=layout.buffer_keys
        )
        buffers = {
            spec.name: fields.numeric_array(
                saved[spec.name],
                fields.join(fields.join(where, "buffers"), spec.name),
                shape=spec.shape,
                dtype=spec.dtype,
            )
            for spec in layout.buffers
        }

        def commit() -> None:
            self._returned = None
            self.layout = layout
            self.key_order = key_order
            self.params = np.array(params)
            self.buffers = {name: np.array(value) for name, value in buffers.items()}

        return commit

    def _forget(self) -> None:
        self._returned = None


#: dtypes a saved model's arrays may have (what a PyTorch or numpy model holds).
MODEL_DTYPE_KINDS = "biuf"
#: The most arrays and dimensions a saved model may declare (far above any real model's).
MAX_TENSORS, MAX_NDIM = 100_000, 32


def saved_layout(state: Mapping[str, Any], where: str = "") -> tuple[ModelLayout, tuple[str, ...]]:
    """The layout and key order a saved model declares, checked without allocating anything.

    ``key_order`` lists distinct names, ``buffer_keys`` some of them, ``shapes`` and ``dtypes`` one entry
    per name (whole dimensions, numeric dtypes; trainable tensors floating point). The sizes are only
    multiplied here; the caller checks the total against the parameter vector whose bytes were read.
    """
    names = [
        fields.text(name, fields.join(fields.join(where, "key_order"), i))
        for i, name in enumerate(
            fields.sequence(fields.at(state, "key_order", where), fields.join(where, "key_order"), most=MAX_TENSORS)
        )
    ]
    if len(set(names)) != len(names):
        raise fields.StateError(fields.join(where, "key_order"), "names one array twice; expected distinct names")
    buffer_where = fields.join(where, "buffer_keys")
    buffer_keys = [
        fields.text(name, fields.join(buffer_where, i))
        for i, name in enumerate(
            fields.sequence(fields.at(state, "buffer_keys", where), buffer_where, most=MAX_TENSORS)
        )
    ]
    if not set(buffer_keys) <= set(names) or len(set(buffer_keys)) != len(buffer_keys):
        raise fields.StateError(
            buffer_where, "names arrays twice or outside 'key_order'; expected distinct model arrays"
        )
    shapes = fields.mapping(fields.at(state, "shapes", where), fields.join(where, "shapes"), keys=names)
    dtypes = fields.mapping(fields.at(state, "dtypes", where), fields.join(where, "dtypes"), keys=names)
    trainable, buffers = [], []
    for name in names:
        shape_where = fields.join(fields.join(where, "shapes"), name)
        shape = tuple(
            fields.whole(n, fields.join(shape_where, i), high=2**62)
            for i, n in enumerate(fields.sequence(shapes[name], shape_where, most=MAX_NDIM))
        )
        dtype = saved_dtype(dtypes[name], fields.join(fields.join(where, "dtypes"), name))
        is_buffer = name in buffer_keys
        if not is_buffer and dtype.kind != "f":
            raise fields.StateError(
                fields.join(fields.join(where, "dtypes"), name), f"is {dtype}; expected a floating dtype (trainable)"
            )
        (buffers if is_buffer else trainable).append(TensorSpec(name, shape, dtype))
    return ModelLayout(tuple(trainable), tuple(buffers)), tuple(names)


def saved_dtype(value: Any, where: str) -> np.dtype:
    """A numeric numpy dtype spelled as ``dtype.str`` (``'<f4'``, ``'<i8'``, ``'|b1'``...)."""
    spelled = fields.text(value, where, most=8)
    try:
        dtype = np.dtype(spelled)
    except (TypeError, ValueError):
        raise fields.StateError(where, f"is {spelled!r}; expected a numeric dtype such as '<f4'") from None
    if dtype.kind not in MODEL_DTYPE_KINDS or dtype.str != spelled:
        raise fields.StateError(where, f"is {spelled!r}; expected a numeric dtype such as '<f4'")
    return dtype
