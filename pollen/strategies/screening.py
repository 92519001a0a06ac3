"""Outlier screening of client updates before they reach an adaptive server's state.

Adaptive methods remember: AMSGrad's running max keeps one poisoned second moment for ever, a
stored-update table keeps a poisoned row until that client returns. One client sending a finite but
huge update (a coordinate of 1e20, a scaled-sign scale of 1e20) would freeze the model. The rule,
on by default:

- **hard limit**: every coordinate of an update must satisfy ``|delta_j| <= max_abs`` (default 1e15,
  so that its square stays far inside float32 in any second moment);
- **norm screen**: an update whose L2 norm exceeds ``factor`` (default 10) times a reference norm is
  rejected (``rule="reject"``) or scaled down to that bound (``rule="clip"``). The reference is the
  median norm of the updates accepted in the last ``window`` rounds (default 5); in a round without
  that history (the first), it is the median of the *other* replies of the same round (so with two
  replies, each is compared with the other). ``rule="off"`` keeps only the hard limit.

The history holds accepted norms only, so a rejected reply leaves no trace in later rounds either.
It is part of the strategy's saved state (resume stays exact).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

RULES = ("reject", "clip", "off")
DEFAULT_MAX_ABS = 1e15


class UpdateScreen:
    """Norm-based outlier screen with a short history of accepted norms.

    Parameters
    ----------
    rule : str (default: "reject")
        ``"reject"``, ``"clip"`` or ``"off"`` (see the module docstring).
    factor : float (default: 10.0)
        How many times the reference norm an update may reach, > 1.
    window : int (default: 5)
        Rounds of accepted norms that make the reference, >= 1.
    max_abs : float (default: 1e15)
        Largest absolute value of any coordinate, > 0.
    """

    def __init__(
        self, *, rule: str = "reject", factor: float = 10.0, window: int = 5, max_abs: float = DEFAULT_MAX_ABS
    ) -> None:
        if rule not in RULES:
            raise ValueError(f"outlier rule {rule!r} is unknown; allowed: {', '.join(RULES)}")
        if not (isinstance(factor, (int, float)) and factor > 1):
            raise ValueError(f"outlier factor={factor!r} is out of range; allowed: a number > 1")
        if not (isinstance(window, int) and window >= 1):
            raise ValueError(f"outlier window={window!r} is out of range; allowed: an integer >= 1")
        if not (isinstance(max_abs, (int, float)) and max_abs > 0):
            raise ValueError(f"max_abs={max_abs!r} is out of range; allowed: a number > 0")
        self.rule = rule
        self.factor = float(factor)
        self.window = window
        self.max_abs = float(max_abs)
        self.history: deque[list[float]] = deque(maxlen=window)

    def bound(self) -> float | None:
        """The largest norm an update may have this round, from history; ``None`` without history."""
        if self.rule == "off":
            return float("inf")
        norms = [n for round_norms in self.history for n in round_norms if n > 0]
        if not norms:
            return None
        return self.factor * float(np.median(norms))

    def within_round_bounds(self, norms: list[float]) -> list[float]:
        """Each update's bound from the median of the *other* updates' norms (a round without history)."""
        if self.rule == "off" or len(norms) < 2:
            return [float("inf")] * len(norms)
        out = []
        for i in range(len(norms)):
            others = [n for j, n in enumerate(norms) if j != i and n > 0]
            out.append(self.factor * float(np.median(others)) if others else float("inf"))
        return out

    def judge(self, norm: float, bound: float) -> tuple[str, float]:
        """``("accept", 1.0)``, ``("clip", scale)`` or ``("reject", 0.0)`` for one update."""
        if not np.isfinite(norm):
            return "reject", 0.0
        if norm <= bound:
            return "accept", 1.0
        if self.rule == "clip":
            return "clip", bound / norm
        return "reject", 0.0

    def filter(self, updates: list[Any], on_reject: Callable[[Any, str], None]) -> list[Any]:
        """The updates that pass the screen, for a round that kept every update.

        The bound is the history's, else each update is judged against the median of the others'
        norms. An outlier is handed to ``on_reject`` with the reason and left out; with
        ``rule="clip"`` it is scaled down to the bound in place instead. Updates without a delta
        (a flag-only reply) pass. ``updates`` need ``delta``, ``norm`` (and whatever ``on_reject``
        reads).
        """
        with_delta = [u for u in updates if u.delta is not None]
        bound = self.bound()
        bounds = (
            [bound] * len(with_delta) if bound is not None else self.within_round_bounds([u.norm for u in with_delta])
        )
        rejected = set()
        for update, limit in zip(with_delta, bounds):
            verdict, scale = self.judge(update.norm, limit)
            if verdict == "reject":
                rejected.add(id(update))
                on_reject(update, self.reason(update.norm, limit))
            elif verdict == "clip":
                update.delta = update.delta * np.float32(scale)
                update.norm *= scale
        return [u for u in updates if id(u) not in rejected]

    def reason(self, norm: float, bound: float) -> str:
        return f"update norm {norm:.3g} exceeds {bound:.3g} ({self.factor:g} x the reference norm; outlier screen)"

    def observe(self, accepted_norms: list[float]) -> None:
        """Remember this round's accepted norms (a round without any is not remembered)."""
        if accepted_norms:
            self.history.append([float(n) for n in accepted_norms])

    def state_dict(self) -> dict[str, Any]:
        return {"history": [list(r) for r in self.history]}

    def load_state_dict(self, state: dict[str, Any], where: str = "screen") -> None:
        """Restore the history; nothing changes when it is refused (see :meth:`prepare_load`)."""
        self.prepare_load(state, where)()

    def prepare_load(self, state: Any, where: str = "screen") -> Callable[[], None]:
        """Check a saved history and return what makes it this screen's: at most ``window`` rounds, each a
        list of accepted norms that are 0 (a client that did not move) or in [1e-12, 1e6 x the hard limit]
        (a norm of 1e-30 would make the bound reject every honest update for ``window`` rounds)."""
        from pollen.core import state_fields as fields

        saved = fields.mapping(state, where, keys=("history",))
        history_where = fields.join(where, "history")
        rounds = fields.sequence(saved["history"], history_where, most=self.window)
        history = deque(maxlen=self.window)
        for i, norms in enumerate(rounds):
            round_where = fields.join(history_where, i)
            kept = []
            for j, n in enumerate(fields.sequence(norms, round_where, most=MAX_REPLIES_PER_ROUND)):
                norm = fields.finite_number(n, fields.join(round_where, j), low=0.0, high=self.max_abs * 1e6)
                if 0.0 < norm < MIN_NORM:
                    raise fields.StateError(
                        fields.join(round_where, j), f"is {norm!r}; expected 0 (no move) or a norm >= {MIN_NORM:g}"
                    )
                kept.append(norm)
            history.append(kept)

        def commit() -> None:
            self.history = history

        return commit


#: The smallest accepted norm a saved history may hold: float32 round-off of a real update is far above it.
MIN_NORM = 1e-12
#: The most norms one saved round may hold.
MAX_REPLIES_PER_ROUND = 1_000_000


_BLOCK = 1 << 16


def vector_stats(vector: np.ndarray, max_abs: float = DEFAULT_MAX_ABS) -> tuple[float, float]:
    """``(L2 norm, a bound on max |x|)`` of a float vector; the norm is NaN when any value is NaN or Inf.

    The common case is one read of the vector (BLAS ``dot`` in float32): a finite sum of squares
    means every value is finite and no larger than the norm, so when the norm is within ``max_abs``
    the norm itself bounds the peak. Only otherwise (a huge or non-finite update, or a float32 sum
    that overflowed) are the exact peak and a float64 norm computed. Nothing vector-sized is
    allocated, so this pass is also the reply's finiteness check.
    """
    if vector.size == 0:
        return 0.0, 0.0
    if vector.dtype == np.float32:
        with np.errstate(over="ignore", invalid="ignore"):
            squares = float(np.dot(vector, vector))
        if np.isfinite(squares) and np.sqrt(squares) <= max_abs:
            norm = float(np.sqrt(squares))
            return norm, norm
    high, low = float(vector.max()), float(vector.min())
    peak = max(abs(high), abs(low))
    if not np.isfinite(peak):
        return float("nan"), float("inf")
    total = 0.0
    for start in range(0, vector.shape[0], _BLOCK):
        block = vector[start : start + _BLOCK].astype(np.float64)
        total += float(np.dot(block, block))
    return float(np.sqrt(total)), peak


def all_finite(vector: np.ndarray) -> bool:
    """Whether a float vector holds no NaN or Inf, checked in blocks (no vector-sized temporary)."""
    for start in range(0, vector.shape[0], _BLOCK):
        if not np.isfinite(vector[start : start + _BLOCK]).all():
            return False
    return True
