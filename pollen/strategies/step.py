"""The server step: the optimiser and its state, double-buffered so a failed round changes nothing.

:class:`ServerStep` owns the server optimiser (a :mod:`pollen.optim` transform), its state and the
spare arrays the next step writes into. ``x_new = x + step`` goes into the spare parameter vector and
the optimiser writes its new state into the spare state (the ones discarded a round ago), so neither
the old model nor the old state is written: a round that fails (an exception, non-finite values) goes
back by keeping the old references, and no ``d``-sized memory is allocated after round 1.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pollen.optim import OptState, Transform
from pollen.strategies.screening import all_finite


class ServerStep:
    """A server optimiser with its state, stepped as a transaction.

    Parameters
    ----------
    optimizer : Transform | None
        The optimiser; ``None`` until the strategy builds it from the model's layout.
    """

    def __init__(self, optimizer: Transform | None = None) -> None:
        self.optimizer = optimizer
        self.state: OptState | None = None
        self._spare_state: OptState | None = None
        self._spare_params: np.ndarray | None = None
        self._scratch: np.ndarray | None = None

    def start(self, optimizer: Transform, dim: int) -> None:
        """Use ``optimizer`` from its initial state for a model of ``dim`` trainable values."""
        self.optimizer = optimizer
        self.state = optimizer.init(dim)
        self._spare_state = self._spare_params = None

    def scratch(self, dim: int) -> np.ndarray:
        """A float32 vector of ``dim`` values, kept across rounds (the reader's and the step's buffer)."""
        if self._scratch is None or self._scratch.shape != (dim,):
            self._scratch = np.empty(dim, dtype=np.float32)
        return self._scratch

    def apply(self, params: np.ndarray, delta: np.ndarray) -> np.ndarray:
        """The new parameters ``params + step(delta)``, in the spare vector; the optimiser state advances.

        ``params`` and the state before stay untouched (see :meth:`keep`); what they are replaced by
        becomes the spares after :meth:`commit`. ``FloatingPointError`` (nothing swapped) when the new
        optimiser state holds NaN or Inf.
        """
        out = self.scratch(params.shape[0])
        step, new_state = self.optimizer.update(
            self.state, delta, params, into=self._spare_state, out=None if out is delta else out
        )
        for name, slot in new_state.slots.items():
            if not all_finite(slot):  # an Inf second moment gives a zero step: finite parameters, a frozen model
                raise FloatingPointError(f"the server step produced NaN or Inf in the optimiser's '{name}'")
        new_params = self._spare_params
        if new_params is None or new_params.shape != params.shape or new_params is params:
            new_params = np.empty_like(params)
        np.add(params, step, out=new_params)
        self._spare_state, self.state = self.state, new_state
        self._spare_params = params
        return new_params

    def keep(self, params_before: np.ndarray, state_before: OptState, params_now: np.ndarray) -> None:
        """Go back to the state of before a failed step; what was computed becomes the spares."""
        if params_now is not params_before:
            self._spare_params = params_now
        if self.state is not state_before:
            self._spare_state = self.state
        self.state = state_before

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return self.state.to_dict() if self.state is not None else {}

    def load_state_dict(self, plain: dict[str, Any], optimizer: Transform, dim: int) -> None:
        """Restore what :meth:`state_dict` wrote, for ``optimizer`` and ``dim``; ``ValueError`` if it does not fit."""
        state = OptState.from_dict(plain)
        for name, slot in state.slots.items():
            if slot.shape != (dim,) or not all_finite(slot):
                raise ValueError(f"state optimiser slot '{name}' is not {dim} finite values")
        optimizer.check_state(state, dim)
        self.optimizer = optimizer
        self.state = state
        self._spare_state = self._spare_params = None
