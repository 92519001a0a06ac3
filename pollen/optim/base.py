"""The shape of the server optimisers: an explicit state, a transform, the shared kernels and checks.

Shaped like optax (``optax/_src/base.py``, ``transform.py``): a :class:`Transform` has
``state = tx.init(d)`` and ``step, new_state = tx.update(state, delta, params)``. The state passed in
is **never modified**: rolling a step back is keeping the old reference. Transforms compose with
:func:`~pollen.optim.transforms.chain`; the named optimisers are one chain each
(:mod:`pollen.optim.aliases`).

Sign convention (used by every transform in :mod:`pollen.optim`)
----------------------------------------------------------------
``delta`` is the aggregated client update ``Delta = x_local - x_global``: it points
*downhill*. ``update`` returns the *step* the server **adds**: ``x_new = x + step``.
Papers that write the step as ``w - eta * m_hat / (...)`` with a gradient-like
``G = -Delta`` (FedAdaVR, Appendix B) describe the same update: every moment is
linear (``m``) or quadratic (``v``) in its input, so flipping the sign of the input
flips the sign of the step and nothing else.

All vectors are flat, contiguous ``np.float32`` arrays of one length ``d``.

Memory: no fresh ``d``-sized allocation per round
-------------------------------------------------
``d`` can be 11M floats; a new state every round would page-fault ``len(slots) * 45 MB`` of fresh memory
each round. ``update(..., into=spare)`` writes the new state into the arrays of a *spare* state (the
state a caller discarded a round ago, or :func:`spare_like`), so the caller double-buffers::

    step, new = tx.update(state, delta, params, into=spare)
    spare, state = state, new          # commit
    # or, to roll back:  spare = new   (state is untouched)

Every kernel runs block by block (``block_size`` elements) so the few vectors a block touches stay in
cache between the numpy calls; every element sees exactly the same operations, so the numbers do not
depend on the block size.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from numbers import Integral, Real
from typing import Any, ClassVar, NamedTuple

import numpy as np

__all__ = [
    "OptState",
    "Transform",
    "adaptive_step",
    "divide_into_denominator",
    "spare_like",
]


class _Slots(Mapping):
    """A read-only mapping ``name -> array`` (the mapping cannot change; see :class:`OptState`)."""

    __slots__ = ("_d",)

    def __init__(self, d: Mapping[str, np.ndarray]) -> None:
        self._d = dict(d)

    def __getitem__(self, key: str) -> np.ndarray:
        return self._d[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)

    def __repr__(self) -> str:
        return repr(self._d)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Slots, (self._d,))


@dataclass(frozen=True, eq=False)
class OptState:
    """Everything a server optimiser carries from one round to the next (immutable for the caller).

    Attributes
    ----------
    step : int
        Number of updates taken so far (0 after ``init``). The bias-correction
        exponent of round ``t`` is this counter *after* the increment, i.e. ``t``
        counts from 1.
    slots : Mapping[str, np.ndarray]
        Named flat ``float32`` vectors of one length, e.g. ``"m"``, ``"v"``, ``"v_hat"``; a
        read-only mapping. States made by ``init``, ``update`` and ``from_dict`` hold read-only
        arrays: ``update`` never writes into the state it is given, and neither should anyone else.
        Only a state handed to ``update(..., into=...)`` as a spare has its arrays overwritten.
    """

    step: int = 0
    slots: Mapping[str, np.ndarray] = field(default_factory=dict)

    def __post_init__(self) -> None:
        step = self.step
        if isinstance(step, bool) or not isinstance(step, Integral) or step < 0:
            raise ValueError(f"optimizer state 'step'={step!r} is invalid; allowed: an integer >= 0")
        if not isinstance(self.slots, Mapping):
            raise ValueError("optimizer state 'slots' must be a dict of name -> 1-D array")
        for name, a in self.slots.items():
            if not isinstance(a, np.ndarray) or a.ndim != 1 or a.dtype != np.float32:
                shape, dtype = getattr(a, "shape", None), getattr(a, "dtype", type(a).__name__)
                raise ValueError(
                    f"optimizer state slot {name!r} has shape {shape} and dtype {dtype}; allowed: a 1-D float32 array"
                )
        lengths = {a.shape[0] for a in self.slots.values()}
        if len(lengths) > 1:
            raise ValueError(f"optimizer state slots have different lengths {sorted(lengths)}")
        object.__setattr__(self, "step", int(step))
        object.__setattr__(self, "slots", _Slots({str(k): v for k, v in self.slots.items()}))

    @property
    def dim(self) -> int | None:
        """The length of the slots (``None`` for a state without slots)."""
        return next(iter(self.slots.values())).shape[0] if self.slots else None

    def to_dict(self) -> dict[str, Any]:
        """Return ``{"step": int, "slots": {name: float32 copy}}`` (a snapshot; the checkpoint format)."""
        return {
            "step": int(self.step),
            "slots": {name: np.array(arr, dtype=np.float32, copy=True) for name, arr in self.slots.items()},
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> OptState:
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
            slots[str(name)] = _read_only(np.array(a, dtype=np.float32, copy=True))
        return cls(step=int(step), slots=slots)


def spare_like(state: OptState) -> OptState:
    """A state with the same slots, shapes and step as ``state`` and arbitrary contents: a first spare
    for ``update(..., into=...)``. Its arrays are fresh (the first round writing them page-faults them in)."""
    return OptState(step=state.step, slots={k: np.empty_like(v) for k, v in state.slots.items()})


def _read_only(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


class _Stage(NamedTuple):
    """One transform of a (flattened, fused) chain and the scalar it multiplies its output by."""

    transform: Transform
    factor: float


class Transform(abc.ABC):
    """A server optimiser or one piece of one: ``state = init(d)``, ``step, new_state = update(state, delta)``.

    ``delta`` is the aggregated client update ``x_local - x_global`` (points downhill);
    the returned ``step`` is what the server adds: ``x_new = x + step``. ``update`` returns a
    new state and leaves the one it is given untouched.

    A piece sets ``name``, lists its slots in ``slot_names``, keeps its checked settings in
    ``_hyper``, optionally overrides :meth:`_initial_slots` and :meth:`_check_dim`, and implements
    either :meth:`_block` (element-wise math on one block of coordinates, ``elementwise = True``) or
    :meth:`_whole` (a pass over the whole vector after the blocks, ``elementwise = False``: LAMB's
    trust ratio). :class:`~pollen.optim.transforms.Chain` runs several pieces, each on the output of
    the one before.
    """

    name: str = "transform"
    #: names of the flat float32 vectors this piece keeps in the state
    slot_names: tuple[str, ...] = ()
    #: whether ``update`` needs the current parameters ``params`` (the trust ratio does)
    needs_params: bool = False
    #: elements per block of the blocked evaluation (see ``update``); results do not depend on it
    block_size: int = 1 << 16  # 256 KiB of float32 per vector
    #: True: :meth:`_block` on each block; False: :meth:`_whole` once, after the blocks before it
    elementwise: ClassVar[bool] = True
    #: the kernel reads its input after writing ``out``: a chain hands it a copy when the input is ``out``
    reads_input_late: ClassVar[bool] = False
    #: a following ``scale(c)`` can be folded into this piece's own last multiply (see ``chain``)
    folds_scale: ClassVar[bool] = False
    _hyper: dict[str, Any] = {}

    # -- public API ---------------------------------------------------------------------
    def init(self, dim: int) -> OptState:
        """Return the state before round 1: step 0 and the slots at their initial values."""
        if isinstance(dim, bool) or not isinstance(dim, Integral) or dim < 1:
            raise ValueError(f"{self.name}: dim={dim!r} is invalid; allowed: an integer >= 1")
        self._check_dim(int(dim))
        slots = self._initial_slots(int(dim))
        return OptState(step=0, slots={k: _read_only(slots[k]) for k in self.slot_names})

    def update(
        self,
        state: OptState,
        delta: np.ndarray,
        params: np.ndarray | None = None,
        *,
        into: OptState | None = None,
        out: np.ndarray | None = None,
    ) -> tuple[np.ndarray, OptState]:
        """Take one server step; ``state`` is not modified.

        Parameters
        ----------
        state : OptState
            The state from ``init`` or the previous ``update``; read only.
        delta : np.ndarray
            Aggregated client update ``x_local - x_global`` (downhill), flat ``float32``.
        params : np.ndarray, optional
            Current global parameters ``x`` (flat ``float32``); only the trust ratio (LAMB) needs them.
        into : OptState, optional
            A *spare* state with the same slots and length (the state discarded a round ago, or
            :func:`spare_like`): its arrays are overwritten and become the returned state's, so no
            ``d``-sized memory is allocated. It must not share memory with ``state``, ``delta``,
            ``params`` or ``out``. Without it the new state's arrays are freshly allocated.
        out : np.ndarray, optional
            A float32 vector of the same length to write the step into (no allocation); it must
            not share memory with ``delta``, ``params`` or a state (it is scratch while the step is computed).

        Returns
        -------
        tuple[np.ndarray, OptState]
            The step (``out`` or a new ``float32`` vector; the server sets ``x_new = x + step``) and
            the new state (``step`` counter advanced by one).

        Notes
        -----
        The element-wise math runs block by block (``block_size`` elements at a time) so
        that the few vectors one block touches stay in cache between the numpy calls;
        every element sees exactly the same operations, so the numbers do not depend on
        the block size.
        """
        if not isinstance(state, OptState):
            raise ValueError(
                f"{self.name}: state is a {type(state).__name__}; allowed: an OptState from init() or update()"
            )
        self.check_state(state)
        delta = self._as_vector("delta", delta, state.dim)
        n = delta.shape[0]
        if params is not None:
            params = self._as_vector("params", params, n)
        elif self.needs_params:
            raise ValueError(f"{self.name}: update() needs params (the current global parameters)")
        self._check_dim(n)
        if out is None:
            out = np.empty_like(delta)
        elif not isinstance(out, np.ndarray) or out.shape != delta.shape or out.dtype != np.float32:
            raise ValueError(
                f"{self.name}: out has shape {getattr(out, 'shape', None)} / {getattr(out, 'dtype', None)}, "
                f"expected {delta.shape} / float32"
            )
        elif not out.flags.writeable:
            raise ValueError(f"{self.name}: out is read-only")
        others = {"delta": delta, "params": params, **{f"state slot {k!r}": v for k, v in state.slots.items()}}
        for what, x in others.items():
            if x is not None and np.may_share_memory(out, x):
                raise ValueError(f"{self.name}: out shares memory with {what}; allowed: a separate float32 vector")
        new_slots = self._new_slots(state, into, n, {"out": out, **others})
        t = state.step + 1
        self._run(t, state.slots, new_slots, delta, params, out)
        return out, OptState(step=t, slots={k: _read_only(v) for k, v in new_slots.items()})

    def check_state(self, state: OptState, dim: int | None = None) -> None:
        """Raise ValueError unless ``state`` has exactly this transform's slots (of length ``dim`` if given)."""
        have, want = set(state.slots), set(self.slot_names)
        if have != want:
            missing, extra = sorted(want - have), sorted(have - want)
            raise ValueError(
                f"{self.name}: state has slots {sorted(have)}, expected {sorted(want)} "
                f"(missing {missing}, unexpected {extra}); was it made by another optimiser?"
            )
        if dim is not None and state.dim is not None and state.dim != dim:
            raise ValueError(f"{self.name}: state slots have length {state.dim}; allowed: {dim}")

    def hyperparameters(self) -> dict[str, float | int | str | bool]:
        """The checked settings, for logging and ``summary()`` (scalars only)."""
        return {k: v for k, v in self._hyper.items() if isinstance(v, (bool, int, float, str))}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.hyperparameters().items())
        return f"{self.name}({args})"

    # -- for pieces ---------------------------------------------------------------------
    def _initial_slots(self, dim: int) -> dict[str, np.ndarray]:
        """The slots before round 1 (default: zeros)."""
        return {name: np.zeros(dim, dtype=np.float32) for name in self.slot_names}

    def _check_dim(self, dim: int) -> None:
        """Hook: reject a dimension the piece cannot serve (the trust ratio's segments)."""

    def _stages(self) -> tuple[_Stage, ...]:
        """This transform as a list of pieces for the runner (a chain flattens and fuses its pieces)."""
        return (_Stage(self, 1.0),)

    def _block(
        self,
        t: int,
        old: Mapping[str, np.ndarray],
        new: Mapping[str, np.ndarray],
        u: np.ndarray,
        params: np.ndarray | None,
        out: np.ndarray,
        factor: float,
        scratch: np.ndarray,
    ) -> None:
        """Round ``t`` (from 1) on one block: compute ``new`` slots from ``old`` ones, write the step into ``out``.

        All arguments are views of the same block of coordinates. ``old`` is read only; every element
        of every ``new`` slot must be written (it may hold anything before). ``u`` is the input (the
        client update, or the previous piece's output, then ``u is out`` unless ``reads_input_late``);
        ``out`` may be used as scratch before the step is written into it, ``scratch`` is one more
        block-sized buffer. The step is multiplied by ``factor`` (a folded ``scale``; 1.0 if none).
        """
        raise NotImplementedError(f"{self.name} has no element-wise kernel")

    def _whole(
        self,
        t: int,
        old: Mapping[str, np.ndarray],
        new: Mapping[str, np.ndarray],
        u: np.ndarray,
        params: np.ndarray | None,
        out: np.ndarray,
        factor: float,
    ) -> None:
        """Round ``t`` on the whole vector (``elementwise = False``); the arguments are as in :meth:`_block`."""
        raise NotImplementedError(f"{self.name} has no whole-vector kernel")

    # -- the runner ---------------------------------------------------------------------
    def _run(
        self,
        t: int,
        old: Mapping[str, np.ndarray],
        new: Mapping[str, np.ndarray],
        delta: np.ndarray,
        params: np.ndarray | None,
        out: np.ndarray,
    ) -> None:
        """Run the stages: runs of element-wise pieces block by block, the others over the whole vector.

        The first piece reads ``delta``; every later piece reads the output of the one before (``out``).
        """
        stages = self._stages()
        if not stages:  # chain(): the identity
            np.copyto(out, delta)
            return
        n, b = delta.shape[0], self.block_size
        scratch = np.empty(min(b, n), dtype=np.float32)
        spare_input: np.ndarray | None = None
        first, i = True, 0
        while i < len(stages):
            if not stages[i].transform.elementwise:
                tr, factor = stages[i]
                tr._whole(t, _pick(old, tr), _pick(new, tr), delta if first else out, params, out, factor)
                first, i = False, i + 1
                continue
            j = i
            while j < len(stages) and stages[j].transform.elementwise:
                j += 1
            group = stages[i:j]
            for lo in range(0, n, b):
                hi = min(lo + b, n)
                o = out[lo:hi]
                p = None if params is None else params[lo:hi]
                u = delta[lo:hi] if first else o
                for tr, factor in group:
                    if u is o and tr.reads_input_late:
                        if spare_input is None:
                            spare_input = np.empty(min(b, n), dtype=np.float32)
                        u = spare_input[: hi - lo]
                        np.copyto(u, o)
                    tr._block(
                        t,
                        {k: old[k][lo:hi] for k in tr.slot_names},
                        {k: new[k][lo:hi] for k in tr.slot_names},
                        u,
                        p,
                        o,
                        factor,
                        scratch[: hi - lo],
                    )
                    u = o
            first, i = False, j

    # -- helpers ------------------------------------------------------------------------
    def _new_slots(
        self, state: OptState, into: OptState | None, n: int, others: Mapping[str, np.ndarray | None]
    ) -> dict[str, np.ndarray]:
        """The arrays the new state is written into: the spare's (checked, made writable) or fresh ones."""
        if into is None:
            return {k: np.empty(n, dtype=np.float32) for k in self.slot_names}
        if not isinstance(into, OptState):
            raise ValueError(f"{self.name}: into is a {type(into).__name__}; allowed: a spare OptState or None")
        if into is state:
            raise ValueError(f"{self.name}: into is the state itself; allowed: a spare state (see spare_like)")
        self.check_state(into, n)
        slots: dict[str, np.ndarray] = {}
        for k in self.slot_names:
            a = into.slots[k]
            for what, x in others.items():
                if x is not None and np.may_share_memory(a, x):
                    raise ValueError(
                        f"{self.name}: into slot {k!r} shares memory with {what}; allowed: a spare state whose "
                        "arrays nothing else uses (the state discarded a round ago, or spare_like(state))"
                    )
            if not a.flags.writeable:
                try:
                    a.flags.writeable = True
                except ValueError:
                    raise ValueError(f"{self.name}: into slot {k!r} is read-only and cannot be written") from None
            slots[k] = a
        return slots

    def _as_vector(self, what: str, x: np.ndarray, dim: int | None) -> np.ndarray:
        x = np.asarray(x, dtype=np.float32)
        if x.ndim != 1 or (dim is not None and x.shape[0] != dim) or x.shape[0] == 0:
            allowed = f"({dim},)" if dim is not None else "(d,) with d >= 1"
            raise ValueError(f"{self.name}: {what} has shape {x.shape}; allowed: {allowed} flat float32")
        return x


def _pick(slots: Mapping[str, np.ndarray], tr: Transform) -> dict[str, np.ndarray]:
    return {k: slots[k] for k in tr.slot_names}


def adaptive_step(
    m: np.ndarray,
    second: np.ndarray,
    out: np.ndarray,
    *,
    eta: float,
    eps: float,
    t: int,
    beta_1: float,
    beta_2: float,
    bias_correction: bool,
    denominator_positive: bool = False,
) -> np.ndarray:
    """Write ``eta * m_hat / (sqrt(second_hat) + eps)`` into ``out`` (ε outside the sqrt).

    Without bias correction this is ``eta * m / (sqrt(second) + eps)`` (Reddi et al.,
    FedCAMS eq. 3.4). With it, ``m_hat = m / (1 - beta_1**t)`` and
    ``second_hat = second / (1 - beta_2**t)`` (FedAdaVR App. B), computed in the
    FedCAMS code's form ``(eta / (1 - beta_1**t)) * m / (sqrt(second) / sqrt(1 - beta_2**t) + eps)``,
    which is the same expression. ``out`` may not alias ``m``; it may alias ``second``.

    ``eta`` is the step size the transform was told to fold in (a following ``scale(eta)``; 1.0 when
    none): it joins the bias-correction factor in one float64 scalar and one multiply, as before.

    A coordinate whose denominator is exactly 0 (only possible with ``eps == 0``,
    e.g. an all-zero history) gets step 0 instead of ``0/0 = nan``; the search for such
    zeros is skipped when the caller knows ``second > 0`` (``denominator_positive=True``).
    """
    np.sqrt(second, out=out)
    if bias_correction:
        out /= math.sqrt(1.0 - beta_2**t)
    if eps != 0.0:  # skipping `+ 0.0` is exact
        out += eps
    divide_into_denominator(m, out, may_be_zero=eps == 0.0 and not denominator_positive)
    scale = eta / (1.0 - beta_1**t) if bias_correction else eta
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


# -- hyper-parameter checks (used by every piece) -------------------------------------------


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
