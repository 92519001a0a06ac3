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

**Records screened by kind.** The same rule and factor judge every other record a method declares as
screened (:class:`~pollen.strategies.replies.Extra` ``screen="norm"``: a second moment ``v_i``, a
gradient; the model's floating-point buffers, one kind per buffer: a BatchNorm ``running_var``),
each against its own kind: the L2 norm of a reply's record against the median norm of the same
record in the accepted replies of the last ``window`` rounds (a history per kind), else against the
same record of the round's other replies. A reply with an outlying record is rejected as a whole
(``rule="reject"``) or that record is scaled down to its bound (``rule="clip"``). Integer buffers
(counters such as ``num_batches_tracked``) are not screened.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping
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
        #: Accepted norms of each screened record kind (``"extra:v"``, ``"buffer:bn.running_var"``), per round.
        self.kinds: dict[str, deque[list[float]]] = {}

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
        norms; each screened record (``record_norms``) likewise against its own kind. An outlier is
        handed to ``on_reject`` with the reason and left out; with ``rule="clip"`` it is scaled down
        to the bound in place instead. Updates without a delta (a flag-only reply) pass the update
        screen. ``updates`` need ``delta``, ``norm`` (and whatever ``on_reject`` reads).
        """
        record_bounds = self.round_record_bounds([getattr(u, "record_norms", {}) for u in updates])
        rejected = set()
        for update, bounds in zip(updates, record_bounds):
            why = self.screen_records(update, bounds)
            if why is not None:
                rejected.add(id(update))
                on_reject(update, why)
        with_delta = [u for u in updates if u.delta is not None]
        bound = self.bound()
        bounds = (
            [bound] * len(with_delta) if bound is not None else self.within_round_bounds([u.norm for u in with_delta])
        )
        for update, limit in zip(with_delta, bounds):
            if id(update) in rejected:
                continue
            verdict, scale = self.judge(update.norm, limit)
            if verdict == "reject":
                rejected.add(id(update))
                on_reject(update, self.reason(update.norm, limit))
            elif verdict == "clip":
                update.delta = update.delta * np.float32(scale)
                update.norm *= scale
                update.applied_scale *= scale
        return [u for u in updates if id(u) not in rejected]

    # ------------------------------------------------------------------ records screened by kind
    def kind_bound(self, kind: str) -> float | None:
        """The largest norm record ``kind`` may have this round, from its history; ``None`` without history.

        A history whose norms are all zero gives no reference (``inf``), as the others' zeros do within a round.
        """
        if self.rule == "off":
            return float("inf")
        rounds = self.kinds.get(kind)
        if not rounds:
            return None
        norms = [n for round_norms in rounds for n in round_norms if n > 0]
        return self.factor * float(np.median(norms)) if norms else float("inf")

    def record_bounds(self, kinds: Iterable[str]) -> dict[str, float] | None:
        """Each kind's history bound; ``None`` when any of them has no history yet (judge within the round)."""
        bounds = {}
        for kind in kinds:
            bound = self.kind_bound(kind)
            if bound is None:
                return None
            bounds[kind] = bound
        return bounds

    def round_record_bounds(self, record_norms: list[Mapping[str, float]]) -> list[dict[str, float]]:
        """Per reply, each of its records' bound: the kind's history bound, else the median of the same
        record of the round's other replies (``factor`` times it)."""
        out: list[dict[str, float]] = [{} for _ in record_norms]
        for kind in sorted({kind for norms in record_norms for kind in norms}):
            holders = [i for i, norms in enumerate(record_norms) if kind in norms]
            bound = self.kind_bound(kind)
            limits = (
                [bound] * len(holders)
                if bound is not None
                else self.within_round_bounds([record_norms[i][kind] for i in holders])
            )
            for i, limit in zip(holders, limits):
                out[i][kind] = limit
        return out

    def screen_records(self, update: Any, bounds: Mapping[str, float]) -> str | None:
        """Judge each screened record of ``update`` against its bound: the reason it is rejected, or ``None``.

        With ``rule="clip"`` an outlying record is scaled down to its bound (a new array; see
        :func:`~pollen.strategies.replies.scale_record`) and its norm updated.
        """
        from pollen.strategies.replies import scale_record  # replies imports this module

        norms = getattr(update, "record_norms", {})
        for kind in sorted(norms):
            norm, limit = norms[kind], bounds.get(kind, float("inf"))
            verdict, scale = self.judge(norm, limit)
            if verdict == "reject":
                return self.record_reason(kind, norm, limit)
            if verdict == "clip":
                scale_record(update, kind, scale)
                norms[kind] = norm * scale
        return None

    def record_reason(self, kind: str, norm: float, bound: float) -> str:
        what = kind.replace(":", " '", 1) + "'"
        return f"{what} has norm {norm:.3g} > {bound:.3g} ({self.factor:g} x its reference norm; outlier screen)"

    def reason(self, norm: float, bound: float) -> str:
        return f"update norm {norm:.3g} exceeds {bound:.3g} ({self.factor:g} x the reference norm; outlier screen)"

    def observe(self, accepted_norms: list[float], record_norms: Iterable[Mapping[str, float]] = ()) -> None:
        """Remember this round's accepted norms, of updates and of each screened record kind (a round or
        kind without any is not remembered). Call it with the replies the server step applied only."""
        if accepted_norms:
            self.history.append([float(n) for n in accepted_norms])
        by_kind: dict[str, list[float]] = {}
        for norms in record_norms:
            for kind, norm in norms.items():
                by_kind.setdefault(kind, []).append(float(norm))
        for kind in sorted(by_kind):
            self.kinds.setdefault(kind, deque(maxlen=self.window)).append(by_kind[kind])

    def state_dict(self) -> dict[str, Any]:
        return {
            "history": [list(r) for r in self.history],
            "kinds": {kind: [list(r) for r in rounds] for kind, rounds in sorted(self.kinds.items())},
        }

    def load_state_dict(self, state: dict[str, Any], where: str = "screen") -> None:
        """Restore the history; nothing changes when it is refused (see :meth:`prepare_load`)."""
        self.prepare_load(state, where)()

    def prepare_load(self, state: Any, where: str = "screen") -> Callable[[], None]:
        """Check a saved history and return what makes it this screen's: at most ``window`` rounds, each a
        list of accepted norms that are 0 (a client that did not move) or in [1e-12, 1e6 x the hard limit]
        (a norm of 1e-30 would make the bound reject every honest update for ``window`` rounds)."""
        from pollen.core import state_fields as fields

        saved = fields.mapping(state, where, keys=("history", "kinds"))
        history = self._checked_rounds(saved["history"], fields.join(where, "history"))
        kinds_where = fields.join(where, "kinds")
        kinds = {
            kind: self._checked_rounds(rounds, fields.join(kinds_where, kind))
            for kind, rounds in fields.mapping(saved["kinds"], kinds_where).items()
        }

        def commit() -> None:
            self.history, self.kinds = history, kinds

        return commit

    def _checked_rounds(self, value: Any, where: str) -> deque[list[float]]:
        """Saved rounds of accepted norms: at most ``window`` rounds of norms 0 or in [1e-12, 1e6 x the limit]."""
        from pollen.core import state_fields as fields

        history: deque[list[float]] = deque(maxlen=self.window)
        for i, norms in enumerate(fields.sequence(value, where, most=self.window)):
            round_where = fields.join(where, i)
            kept = []
            for j, n in enumerate(fields.sequence(norms, round_where, most=MAX_REPLIES_PER_ROUND)):
                norm = fields.finite_number(n, fields.join(round_where, j), low=0.0, high=self.max_abs * 1e6)
                if 0.0 < norm < MIN_NORM:
                    raise fields.StateError(
                        fields.join(round_where, j), f"is {norm!r}; expected 0 (no move) or a norm >= {MIN_NORM:g}"
                    )
                kept.append(norm)
            history.append(kept)
        return history


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
