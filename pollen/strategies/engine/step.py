"""The server step: the optimiser and its state, double-buffered so a failed round changes nothing.

:class:`ServerStep` owns the server optimiser (a :mod:`pollen.optim` transform), its state and the
spare arrays the next step writes into. ``x_new = x + step`` goes into the spare parameter vector and
the optimiser writes its new state into the spare state (the ones discarded a round ago), so neither
the old model nor the old state is written: a round that fails (an exception, non-finite values) goes
back by keeping the old references, and no ``d``-sized memory is allocated after round 1.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from pollen.core import state_fields as fields
from pollen.optim import OptState, Transform
from pollen.strategies.engine.screening import DEFAULT_MAX_ABS, all_finite


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
        #: A factor on the next steps' learning rate, set by a driver for one step (FADAS's delay-adaptive rate).
        self.lr_scale = 1.0

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
        if self.lr_scale != 1.0:  # every optimiser's step is linear in its learning rate
            step = np.multiply(step, np.float32(self.lr_scale), dtype=np.float32)
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

    def load_state_dict(
        self, plain: dict[str, Any], optimizer: Transform, dim: int, *, max_moment: float = DEFAULT_MAX_ABS
    ) -> None:
        """Restore what :meth:`state_dict` wrote, for ``optimizer`` and ``dim``; ``ValueError`` if it does not fit."""
        self.prepare_load(plain, optimizer, dim, max_moment=max_moment)()

    def prepare_load(
        self,
        plain: Any,
        optimizer: Transform,
        dim: int,
        *,
        max_moment: float = DEFAULT_MAX_ABS,
        where: str = "optimizer",
        max_step: int = fields.MAX_COUNT,
    ) -> Callable[[], None]:
        """Check a saved optimiser state against ``optimizer`` and ``dim``; return what makes it this step's.

        Exactly the optimiser's slots, each ``dim`` finite float32 values; the second moments
        (:data:`SECOND_MOMENTS`: ``v``, ``v_hat``, ``z``) in ``[0, max_moment]`` and the first moment ``m``
        in ``[-max_moment, max_moment]`` (an average of updates, each within the hard limit), other slots
        within 1e6 times it; ``max_moment`` is the updates' hard limit:
        a legitimate moment is many orders below it, and a larger one would pin an AMSGrad maximum or
        scale every step down for the rest of the run); the step counter in ``[0, max_step]``.
        """
        fields.mapping(plain, where, keys=("step", "slots"))
        step = fields.whole(plain["step"], fields.join(where, "step"), high=max_step)
        slots_where = fields.join(where, "slots")
        saved = fields.mapping(plain["slots"], slots_where, keys=optimizer.slot_names)
        slots = {}
        for name in optimizer.slot_names:
            moment = name in SECOND_MOMENTS
            bound = max_moment if moment or name == "m" else max_moment * 1e6  # m: an average of bounded updates
            slots[name] = fields.float_vector(
                saved[name],
                fields.join(slots_where, name),
                dim,
                low=0.0 if moment else -bound,
                high=bound,
                what="(a second moment)" if moment else "(a first moment: within the updates' hard limit)",
            )
        state = OptState.from_dict({"step": step, "slots": slots})
        optimizer.check_state(state, dim)

        def commit() -> None:
            self.optimizer = optimizer
            self.state = state
            self._spare_state = self._spare_params = None

        return commit


#: Optimiser slots that hold second moments (sums or averages of squares): never negative.
SECOND_MOMENTS = frozenset({"v", "v_hat", "z"})
