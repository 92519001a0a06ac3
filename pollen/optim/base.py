"""Shared pieces of the server optimisers: state, the abstract optimiser, checks.

Sign convention (used by every optimiser in :mod:`pollen.optim`)
---------------------------------------------------------------
``delta`` is the aggregated client update ``Delta = x_local - x_global``: it points
*downhill*. ``update`` returns the *step* the server **adds**: ``x_new = x + step``.
Papers that write the step as ``w - eta * m_hat / (...)`` with a gradient-like
``G = -Delta`` (FedAdaVR, Appendix B) describe the same update: every moment is
linear (``m``) or quadratic (``v``) in its input, so flipping the sign of the input
flips the sign of the step and nothing else.

All vectors are flat, contiguous ``np.float32`` arrays of one length ``d``.
"""

from __future__ import annotations

import abc
import inspect
import math
from dataclasses import dataclass, field
from numbers import Integral, Real
from typing import Any, ClassVar

import numpy as np

__all__ = ["OptimizerState", "ServerOptimizer", "adaptive_step", "divide_into_denominator"]


@dataclass
class OptimizerState:
    """Everything a server optimiser carries from one round to the next.

    Attributes
    ----------
    step : int
        Number of updates taken so far (0 after ``init``). The bias-correction
        exponent of round ``t`` is this counter *after* the increment, i.e. ``t``
        counts from 1.
    slots : dict[str, np.ndarray]
        Named flat ``float32`` vectors, e.g. ``"m"``, ``"v"``, ``"v_hat"``.
        ``update`` may overwrite them in place; take ``to_dict()`` for a snapshot.
    """

    step: int = 0
    slots: dict[str, np.ndarray] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Return ``{"step": int, "slots": {name: float32 copy}}`` (a snapshot)."""
        return {
            "step": int(self.step),
            "slots": {name: np.array(arr, dtype=np.float32, copy=True) for name, arr in self.slots.items()},
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "OptimizerState":
        """Rebuild a state written by :meth:`to_dict`; the arrays are copied, values kept bit for bit."""
        if not isinstance(d, dict) or "step" not in d or "slots" not in d:
            raise ValueError("optimizer state must be a dict with keys 'step' and 'slots'")
        step = d["step"]
        if isinstance(step, bool) or not isinstance(step, Integral) or step < 0:
            raise ValueError(f"optimizer state 'step'={step!r} is invalid; allowed: an integer >= 0")
        slots_in = d["slots"]
        if not isinstance(slots_in, dict):
            raise ValueError("optimizer state 'slots' must be a dict of name -> 1-D array")
        slots: dict[str, np.ndarray] = {}
        for name, arr in slots_in.items():
            a = np.asarray(arr)
            if a.ndim != 1 or a.dtype != np.float32:
                raise ValueError(
                    f"optimizer state slot {name!r} has shape {a.shape} and dtype {a.dtype}; "
                    "allowed: a 1-D float32 array"
                )
            slots[str(name)] = np.array(a, dtype=np.float32, copy=True)
        lengths = {a.shape[0] for a in slots.values()}
        if len(lengths) > 1:
            raise ValueError(f"optimizer state slots have different lengths {sorted(lengths)}")
        return cls(step=int(step), slots=slots)


class ServerOptimizer(abc.ABC):
    """A server optimiser: ``state = init(d)``, then ``state, step = update(state, delta)``.

    ``delta`` is the aggregated client update ``x_local - x_global`` (points downhill);
    the returned ``step`` is what the server adds: ``x_new = x + step``. ``update``
    overwrites ``state.slots`` in place and returns the same state object.

    Subclasses set ``name``, list their slots in ``slot_names`` (instance or class
    attribute), optionally override :meth:`_initial_slots`, and implement
    :meth:`_step` (element-wise math on one block of coordinates).
    """

    name: ClassVar[str]
    #: whether ``update`` needs the current parameters ``params`` (LAMB does)
    needs_params: ClassVar[bool] = False
    #: elements per block of the blocked evaluation (see ``update``); results do not depend on it
    block_size: int = 1 << 16  # 256 KiB of float32 per vector
    slot_names: tuple[str, ...] = ()

    # -- public API ---------------------------------------------------------------------
    def init(self, dim: int) -> OptimizerState:
        """Return the state before round 1: step 0 and the slots at their initial values."""
        if isinstance(dim, bool) or not isinstance(dim, Integral) or dim < 1:
            raise ValueError(f"{self.name}: dim={dim!r} is invalid; allowed: an integer >= 1")
        self._check_dim(int(dim))
        return OptimizerState(step=0, slots=self._initial_slots(int(dim)))

    def update(
        self,
        state: OptimizerState,
        delta: np.ndarray,
        params: np.ndarray | None = None,
        out: np.ndarray | None = None,
    ) -> tuple[OptimizerState, np.ndarray]:
        """Take one server step.

        Parameters
        ----------
        state : OptimizerState
            The state from ``init`` or the previous ``update``; its slots are
            overwritten in place.
        delta : np.ndarray
            Aggregated client update ``x_local - x_global`` (downhill), flat ``float32``.
        params : np.ndarray, optional
            Current global parameters ``x`` (flat ``float32``); only LAMB needs them.
        out : np.ndarray, optional
            A float32 vector of the same length to write the step into (no allocation); it must
            not be ``delta`` or ``params`` (it is used as scratch while the step is computed).

        Returns
        -------
        tuple[OptimizerState, np.ndarray]
            The (same, advanced) state and a new ``float32`` vector ``step``; the server
            sets ``x_new = x + step``.

        Notes
        -----
        The element-wise math runs block by block (``block_size`` elements at a time) so
        that the few vectors one block touches stay in cache between the numpy calls;
        every element sees exactly the same operations, so the numbers do not depend on
        the block size.
        """
        delta = self._as_vector("delta", delta, state)
        if params is not None:
            params = self._as_vector("params", params, state)
        elif self.needs_params:
            raise ValueError(f"{self.name}: update() needs params (the current global parameters)")
        self._check_dim(delta.shape[0])
        state.step += 1
        t = state.step
        if out is None:
            out = np.empty_like(delta)
        elif out.shape != delta.shape or out.dtype != np.float32:
            raise ValueError(f"{self.name}: out has shape {out.shape} / {out.dtype}, expected {delta.shape} / float32")
        n, b = delta.shape[0], self.block_size
        for lo in range(0, n, b):
            hi = min(lo + b, n)
            self._step(
                t,
                {k: v[lo:hi] for k, v in state.slots.items()},
                delta[lo:hi],
                None if params is None else params[lo:hi],
                out[lo:hi],
            )
        self._finish(state, delta, params, out)
        return state, out

    def hyperparameters(self) -> dict[str, float | int | str | bool]:
        """The settings of this optimiser, for logging and ``summary()``.

        Every scalar keyword of the constructor, read back from the attribute of the same name.
        """
        names = inspect.signature(type(self).__init__).parameters
        values = {name: getattr(self, name, None) for name in names if name != "self"}
        return {k: v for k, v in values.items() if isinstance(v, (bool, int, float, str))}

    # -- for subclasses -----------------------------------------------------------------
    def _set_moment_settings(self, eta: Any, beta1: Any, beta2: Any, eps: Any, bias_correction: Any) -> None:
        """Check and keep the settings the Adam family shares (Adam, Yogi, AdaBelief, LAMB)."""
        self.eta = check_eta(self.name, eta)
        self.beta1 = check_beta(self.name, "beta1", beta1)
        self.beta2 = check_beta(self.name, "beta2", beta2)
        self.eps = check_eps(self.name, eps)
        self.bias_correction = check_bool(self.name, "bias_correction", bias_correction)

    def _initial_slots(self, dim: int) -> dict[str, np.ndarray]:
        return {name: np.zeros(dim, dtype=np.float32) for name in self.slot_names}

    def _check_dim(self, dim: int) -> None:
        """Hook: reject a dimension the optimiser cannot serve (LAMB segments)."""

    @abc.abstractmethod
    def _step(
        self,
        t: int,
        slots: dict[str, np.ndarray],
        delta: np.ndarray,
        params: np.ndarray | None,
        out: np.ndarray,
    ) -> None:
        """Round ``t`` (from 1) on one block: advance ``slots`` in place, write the step into ``out``.

        All arguments are views of the same block of coordinates; ``out`` may be used
        as scratch before the step is written into it.
        """

    def _finish(
        self, state: OptimizerState, delta: np.ndarray, params: np.ndarray | None, out: np.ndarray
    ) -> None:
        """Hook: a whole-vector pass after the blocks (LAMB's trust ratios)."""

    def _scratch(self, n: int) -> np.ndarray:
        """A reusable float32 buffer of ``n <= block_size`` elements (not state, not thread-safe)."""
        buf = getattr(self, "_scratch_buf", None)
        if buf is None or buf.shape[0] < n:
            buf = self._scratch_buf = np.empty(max(n, self.block_size), dtype=np.float32)
        return buf[:n]

    # -- helpers ------------------------------------------------------------------------
    def _as_vector(self, what: str, x: np.ndarray, state: OptimizerState) -> np.ndarray:
        x = np.asarray(x, dtype=np.float32)
        missing = [n for n in self.slot_names if n not in state.slots]
        if missing:
            raise ValueError(
                f"{self.name}: state has slots {sorted(state.slots)}, missing {missing}; "
                f"was it made by another optimiser?"
            )
        dim = next(iter(state.slots.values())).shape[0] if state.slots else None
        if x.ndim != 1 or (dim is not None and x.shape[0] != dim) or x.shape[0] == 0:
            allowed = f"({dim},)" if dim is not None else "(d,) with d >= 1"
            raise ValueError(f"{self.name}: {what} has shape {x.shape}; allowed: {allowed} flat float32")
        return x

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.hyperparameters().items())
        return f"{type(self).__name__}({args})"


def adaptive_step(
    m: np.ndarray,
    second: np.ndarray,
    out: np.ndarray,
    *,
    eta: float,
    eps: float,
    t: int,
    beta1: float,
    beta2: float,
    bias_correction: bool,
    denominator_positive: bool = False,
) -> np.ndarray:
    """Write ``eta * m_hat / (sqrt(second_hat) + eps)`` into ``out`` (ε outside the sqrt).

    Without bias correction this is ``eta * m / (sqrt(second) + eps)`` (Reddi et al.,
    FedCAMS eq. 3.4). With it, ``m_hat = m / (1 - beta1**t)`` and
    ``second_hat = second / (1 - beta2**t)`` (FedAdaVR App. B), computed in the
    FedCAMS code's form ``(eta / (1 - beta1**t)) * m / (sqrt(second) / sqrt(1 - beta2**t) + eps)``,
    which is the same expression. ``out`` may not alias ``m``; it may alias ``second``.

    A coordinate whose denominator is exactly 0 (only possible with ``eps == 0``,
    e.g. an all-zero history) gets step 0 instead of ``0/0 = nan``; the search for such
    zeros is skipped when the caller knows ``second > 0`` (``denominator_positive=True``).
    """
    np.sqrt(second, out=out)
    if bias_correction:
        out /= math.sqrt(1.0 - beta2**t)
    if eps != 0.0:  # skipping `+ 0.0` is exact
        out += eps
    divide_into_denominator(m, out, may_be_zero=eps == 0.0 and not denominator_positive)
    scale = eta / (1.0 - beta1**t) if bias_correction else eta
    if scale != 1.0:  # skipping a multiply by 1 is exact
        out *= scale
    return out


def divide_into_denominator(num: np.ndarray, den: np.ndarray, *, may_be_zero: bool) -> np.ndarray:
    """``den[:] = num / den`` in place; where ``den == 0`` the result is 0 (not nan/inf).

    Pass ``may_be_zero=False`` when every denominator is known to be positive (ε > 0):
    then no extra pass is spent looking for zeros.
    """
    if may_be_zero and not den.all():
        # where den == 0 the kept value of `den` is den itself, i.e. 0.
        return np.divide(num, den, out=den, where=den != 0)
    return np.divide(num, den, out=den)


# -- hyper-parameter checks (used by every constructor) -------------------------------------


def check_real(
    opt: str,
    key: str,
    value: Any,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
) -> float:
    """Return ``float(value)`` or raise ValueError naming the optimiser, key, value and range."""
    lo = "" if low is None else f"{low:g} {'<' if low_open else '<='} "
    hi = "" if high is None else f" {'<' if high_open else '<='} {high:g}"
    allowed = f"{lo}{key}{hi}" if (lo or hi) else "a finite real number"
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ValueError(f"{opt}: {key}={value!r} is not a number; allowed: {allowed}")
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"{opt}: {key}={value!r} is not finite; allowed: {allowed}")
    if low is not None and (v < low or (low_open and v == low)):
        raise ValueError(f"{opt}: {key}={value!r} is out of range; allowed: {allowed}")
    if high is not None and (v > high or (high_open and v == high)):
        raise ValueError(f"{opt}: {key}={value!r} is out of range; allowed: {allowed}")
    return v


def check_eta(opt: str, value: Any, key: str = "eta") -> float:
    return check_real(opt, key, value, low=0.0, low_open=True)


def check_beta(opt: str, key: str, value: Any) -> float:
    return check_real(opt, key, value, low=0.0, high=1.0, high_open=True)


def check_eps(opt: str, value: Any, key: str = "eps") -> float:
    return check_real(opt, key, value, low=0.0)


def check_bool(opt: str, key: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{opt}: {key}={value!r} is not a bool; allowed: true or false")
    return bool(value)


def check_choice(opt: str, key: str, value: Any, allowed: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"{opt}: {key}={value!r} is not allowed; allowed: {', '.join(map(repr, allowed))}")
    return value
