"""Outlier screening of client updates before they reach an adaptive server's state.

Adaptive methods remember: AMSGrad's running max keeps one poisoned second moment for ever, a
stored-update table keeps a poisoned row until that client returns. One client sending a finite but
huge update (a coordinate of 1e20, a scaled-sign scale of 1e20) would freeze the model. The rule,
on by default:

- **hard limit**: every coordinate of an update must satisfy ``|delta_j| <= max_abs`` (default 1e15,
  so that its square stays far inside float32 in any second moment);
- **norm screen**: an update whose L2 norm exceeds its bound is rejected (``rule="reject"``, pollen's app's
  ``outlier-rule`` default) or scaled down to it and applied (``rule="clip"``, the constructor's default: a
  Flower project's honest client whose local training diverged still counts; the part of an error-fed upload
  that was cut is refused, not owed, :mod:`~pollen.strategies.engine.ledger`). The bound is the larger of two
  references, each times ``factor`` (default 10): the median norm of the updates accepted in the last
  ``window`` rounds (default 5), and the median norm of the *other* updates of the same round. An honest
  update that grew with its round (training speeds up, a client's data differ) passes on its round's evidence;
  an outlier must exceed both. Without a history (the first round) the round's reference alone; a lone update
  (nothing to compare with) the history's alone. ``rule="off"`` keeps only the hard limit.

  An update's reference norm is never below ``MODEL_NORM_FLOOR`` (1%) of the global model's norm: near
  convergence most clients barely move (quickstart-pytorch's round 18: three clients at a train loss of
  0.000 moved about 0.03), and one still learning (loss 0.098, a move of 2.14 on a model of norm 40) is
  not an outlier of a median of almost nothing.

  Why both: judged against its history only, an honest round whose updates grow 7x from one round to
  the next (Flower's quickstart-pytorch between rounds 2 and 3: norm 51.3 against a history bound of
  7.56) was thrown away whole when its replies were streamed. A streamed round therefore holds every
  reply beyond its history bound to the end of the round and judges it then, as a round that kept its
  replies does (:class:`StreamedRound`).

The history holds accepted norms only, so a rejected reply leaves no trace in later rounds either.
It is part of the strategy's saved state (resume stays exact).

**Records screened by kind.** The same rule and factor judge every other record a method declares as
screened (:class:`~pollen.strategies.engine.replies.Extra` ``screen="norm"``: a second moment ``v_i``, a
gradient; the model's floating-point buffers, one kind per buffer: a BatchNorm ``running_var``),
each against its own kind: the L2 norm of a reply's record against the median norm of the same
record in the accepted replies of the last ``window`` rounds (a history per kind), else against the
same record of the round's other replies. A reply with an outlying record is rejected as a whole
(``rule="reject"``) or that record is scaled down to its bound (``rule="clip"``). Integer buffers
(counters such as ``num_batches_tracked``) are not screened. A variance (a BatchNorm ``running_var``) is
judged on its scale, with ``factor`` squared (:meth:`UpdateScreen.factor_of`).

**A stale history gives way (liveness).** The history describes the step size of the rounds before;
when the honest step size changes regime (Mime's bias-free server ``v`` makes every honest round-2
update ~30x round 1's; a BatchNorm ``running_var`` that grows), every reply of a round would exceed
the history bound, nothing would be accepted, the history would never adapt and the run would stall.
So: when **more than half** of a round's screened updates (those with a delta) exceed the history
bound, the history no longer describes the round; the round is judged within itself (each update
against ``factor`` x the median of the *other* updates' norms, as the first round is) and the stale
history is dropped, so what this round's step accepts replaces it. Each record kind likewise: when
more than half of the replies that hold it exceed the kind's history bound, that kind is judged within
the round and its history dropped. A round that streams its replies (each judged against the history
bound as it arrives and dropped when rejected) cannot be judged again: when more than half of its
updates (or of a kind's holders) exceeded the bound, the stale history is dropped at the end of the
round, so the next round is judged within itself (it keeps its replies, as the first round does).
The decision is :func:`history_is_stale`, the one every path calls.

This keeps the security property: a minority of outliers never outvotes the history (the honest
majority passes its bound) and is rejected as before; only a majority can make a round judge itself,
and a majority can always pass its own round anyway (within the round, the median is theirs). A
round needs at least :data:`MIN_TO_OUTVOTE` (2) judged updates to outvote its history: a lone reply
that exceeds it is rejected and leaves the history as it was, since with nothing to compare it with
a within-round judgement would accept anything below the hard limit. A run that samples one client
per round therefore stays on its history until a round with two replies comes.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

RULES = ("reject", "clip", "off")
DEFAULT_MAX_ABS = 1e15
#: The smallest reference norm of an update, as a fraction of the global model's norm: near convergence
#: most clients barely move, and a client still learning must not be "10x" a median of almost nothing.
MODEL_NORM_FLOOR = 0.01
#: The fewest judged norms with which a round can outvote its history (a lone reply never does).
MIN_TO_OUTVOTE = 2

_log = logging.getLogger("flwr")  # Flower's logger, which the strategies log through


def _checked_bounds(bounds: Mapping[str, tuple[float, float]] | None) -> dict[str, tuple[float, float]]:
    """``metric_bounds`` as a dict of ``name -> (low, high)``; ``ValueError`` naming what is wrong."""
    out: dict[str, tuple[float, float]] = {}
    for name, pair in (bounds or {}).items():
        ok = isinstance(name, str) and isinstance(pair, (tuple, list)) and len(pair) == 2
        low, high = (pair[0], pair[1]) if ok else (None, None)
        numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) and not np.isnan(v) for v in (low, high))
        if not (ok and numbers and low <= high):
            raise ValueError(
                f"metric_bounds[{name!r}] = {pair!r} is invalid; allowed: a (low, high) pair of numbers with low <= "
                "high (inf for no bound), by metric name"
            )
        out[name] = (float(low), float(high))
    return out


def history_is_stale(exceeding: int, judged: int) -> bool:
    """Whether a round's norms outvote the history they were judged against: at least
    :data:`MIN_TO_OUTVOTE` judged and more than half of them exceeding its bound (the one rule)."""
    return judged >= MIN_TO_OUTVOTE and 2 * exceeding > judged


class UpdateScreen:
    """Norm-based outlier screen with a short history of accepted norms.

    Parameters
    ----------
    rule : str (default: "clip")
        ``"clip"``, ``"reject"`` or ``"off"`` (see the module docstring). pollen's app passes its
        ``outlier-rule`` (default ``"reject"``).
    factor : float (default: 10.0)
        How many times the reference norm an update may reach, > 1.
    window : int (default: 5)
        Rounds of accepted norms that make the reference, >= 1.
    max_abs : float (default: 1e15)
        Largest absolute value of any coordinate, > 0.
    metric_bounds : Mapping[str, tuple[float, float]] | None (default: None)
        The range of each evaluation metric that has one, by name (``{"accuracy": (0.0, 1.0)}``): a reply whose
        metric lies outside is skipped with the reason before anything is averaged. A metric's range is the
        project's to know (an accuracy may be a fraction or a percentage); without a declared range a metric is
        only held to be finite and within 1e12 in magnitude.
    """

    def __init__(
        self,
        *,
        rule: str = "clip",
        factor: float = 10.0,
        window: int = 5,
        max_abs: float = DEFAULT_MAX_ABS,
        metric_bounds: Mapping[str, tuple[float, float]] | None = None,
    ) -> None:
        if rule not in RULES:
            raise ValueError(f"outlier rule {rule!r} is unknown; allowed: {', '.join(RULES)}")
        if not (isinstance(factor, (int, float)) and factor > 1):
            raise ValueError(f"outlier factor={factor!r} is out of range; allowed: a number > 1")
        if not (isinstance(window, int) and window >= 1):
            raise ValueError(f"outlier window={window!r} is out of range; allowed: an integer >= 1")
        if not (isinstance(max_abs, (int, float)) and max_abs > 0):
            raise ValueError(f"max_abs={max_abs!r} is out of range; allowed: a number > 0")
        self.metric_bounds = _checked_bounds(metric_bounds)
        self.rule = rule
        self.factor = float(factor)
        self.window = window
        self.max_abs = float(max_abs)
        self.history: deque[list[float]] = deque(maxlen=window)
        #: ``||x||`` of the round's global model (:meth:`set_model_norm`): the reference norm of an update is
        #: never below ``MODEL_NORM_FLOOR`` of it. 0 (no floor) until a strategy sets it.
        self.model_norm = 0.0
        #: Accepted norms of each screened record kind (``"extra:v"``, ``"buffer:bn.running_var"``), per round.
        self.kinds: dict[str, deque[list[float]]] = {}
        #: Updates clipped to their bound and applied in committed rounds, in this process (not saved: the log
        #: line of each round is the record).
        self.clipped = 0

    def set_model_norm(self, norm: float) -> None:
        """The round's ``||x||``: an update's reference norm is at least ``MODEL_NORM_FLOOR`` of it."""
        self.model_norm = float(norm) if np.isfinite(norm) and norm > 0 else 0.0

    def reference(self, median: float) -> float:
        """An update's reference norm: ``median``, floored at ``MODEL_NORM_FLOOR x ||x||``."""
        return max(median, MODEL_NORM_FLOOR * self.model_norm)

    def bound(self) -> float | None:
        """The largest norm an update may have this round, from history; ``None`` without history."""
        if self.rule == "off":
            return float("inf")
        norms = [n for round_norms in self.history for n in round_norms if n > 0]
        if not norms:
            return None
        return self.factor * self.reference(float(np.median(norms)))

    def within_round_bounds(self, norms: list[float]) -> list[float]:
        """Each update's bound from the median of the *other* updates' norms (a round without history)."""
        if self.rule == "off" or len(norms) < 2:
            return [float("inf")] * len(norms)
        out = []
        for i in range(len(norms)):
            others = [n for j, n in enumerate(norms) if j != i and n > 0]
            out.append(self.factor * self.reference(float(np.median(others))) if others else float("inf"))
        return out

    def update_bounds(self, norms: list[float], where: str = "this round") -> list[float]:
        """Each update's bound in a round that judges its updates together (``norms``: those with a delta).

        The larger of the history's bound and the update's bound within the round (``factor`` x the median
        of the *other* updates' norms, :meth:`spared_bounds`): an honest update that grew with its round
        passes, an outlier among its round is judged against both. Without a history, the bound within the
        round; a lone update (no other to compare with), the history's. A history that more than half of
        ``norms`` exceed (:func:`history_is_stale`) is dropped (logged, ``where`` naming the round), so what
        the round's step accepts replaces it (:meth:`observe`).
        """
        bound = self.bound()
        if bound is not None and self._outvoted("updates", norms, bound, where):
            self.history.clear()
            bound = None
        return self.spared_bounds(bound, norms)

    def spared_bounds(self, history_bound: float | None, norms: list[float], what: str = "update") -> list[float]:
        """Each norm's bound: ``max(history_bound, factor x median of the others' positive norms)``; the
        history's alone where there are no others, the round's alone without a history, ``inf`` with neither.
        The norms of updates (``what="update"``; else a record kind) have their reference floored at
        ``MODEL_NORM_FLOOR x ||x||``; a variance kind is judged with :meth:`factor_of`."""
        if self.rule == "off":
            return [float("inf")] * len(norms)
        what_updates = what == "update"  # StreamedRound.UPDATES
        factor = self.factor_of(what)
        out = []
        for i in range(len(norms)):
            others = [n for j, n in enumerate(norms) if j != i and n > 0 and np.isfinite(n)]
            median = float(np.median(others)) if others else None
            within = None if median is None else factor * (self.reference(median) if what_updates else median)
            if history_bound is None:
                out.append(float("inf") if within is None else within)
            else:
                out.append(history_bound if within is None else max(history_bound, within))
        return out

    def _outvoted(self, what: str, norms: list[float], bound: float, where: str) -> bool:
        """Whether ``norms`` outvote their history ``bound`` (:func:`history_is_stale`); logs it when they do."""
        exceeding = sum(self.judge(n, bound)[0] != "accept" for n in norms)
        if not history_is_stale(exceeding, len(norms)):
            return False
        _log.warning(
            "%s: %d of %d %s exceed the history bound %.3g; the history is stale, judging them within the round",
            where,
            exceeding,
            len(norms),
            what,
            bound,
        )
        return True

    def count_clipped(self, server_round: int, applied: list[Any]) -> None:
        """Count and log the updates of a committed round that the screen clipped (applied in part)."""
        clipped = [u for u in applied if getattr(u, "screen_clipped", False)]
        if clipped:
            self.clipped += len(clipped)
            names = ", ".join(f"{u.client_key} x{u.applied_scale:.3g}" for u in clipped[:5])
            _log.info(
                "round %d: outlier screen clipped %d update(s) to the bound: %s", server_round, len(clipped), names
            )

    def judge(self, norm: float, bound: float) -> tuple[str, float]:
        """``("accept", 1.0)``, ``("clip", scale)`` or ``("reject", 0.0)`` for one update."""
        if not np.isfinite(norm):
            return "reject", 0.0
        if norm <= bound:
            return "accept", 1.0
        if self.rule == "clip":
            return "clip", bound / norm
        return "reject", 0.0

    def filter(
        self,
        updates: list[Any],
        on_reject: Callable[[Any, str], None],
        where: str = "this round",
        *,
        clip: bool = True,
        reorder: bool = True,
        norm_of: Callable[[Any], float | None] | None = None,
        reference: float | None | str = "history",
        rescale: Callable[[Any, float], None] | None = None,
    ) -> list[Any]:
        """The updates that pass the screen, for a round that kept every update (``where``: the round, as logged):
        the one round-level screening call of every strategy that keeps its replies (pollen's, Flower's baselines,
        HA-Fed's gossip steps).

        Each update's bound is the larger of the history's and the round's (:meth:`update_bounds`); each
        screened record (``record_norms``) likewise against its own kind (:meth:`round_record_bounds`).
        The kept updates come back in the order a streamed round sums them: those within their history
        bounds first, then those beyond (:class:`StreamedRound`), or as given with ``reorder=False``. An outlier
        is handed to ``on_reject`` with the reason and left out; with ``rule="clip"`` it is scaled down to the
        bound in place instead, unless ``clip=False`` (an aggregation that cannot take a scaled reply: it is
        rejected). Updates without a delta (a flag-only reply) pass the update screen. ``updates`` need
        ``delta``, ``norm`` (and whatever ``on_reject`` reads).

        A caller that judges something other than the update's own norm names it: ``norm_of(update)`` is the
        number judged (``None``: not judged, and not part of anyone's reference; HA-Fed's gossip step judges a
        client's move since the model it was sent, and an idle client's move is ``None``), and ``reference`` the
        bound that stands in for the history's (``None``: none; HA-Fed's: ``factor`` x the median of the moves
        accepted earlier in the round). With a caller's reference the screen's own history is neither consulted
        nor dropped. A judged number that is not the update's norm is scaled by the caller's ``rescale(update,
        scale)``, which must bring that number down by ``scale`` (HA-Fed's pulls the reply's model back towards
        the one it was sent); without one, beyond its bound the update is rejected whatever the rule.
        """
        beyond = self._beyond_history(updates) if reorder else set()
        record_bounds = self.round_record_bounds([getattr(u, "record_norms", {}) for u in updates], where)
        rejected = set()
        for update, bounds in zip(updates, record_bounds):
            why = self.screen_records(update, bounds, clip=clip)
            if why is not None:
                rejected.add(id(update))
                on_reject(update, why)
        rescale = _scale_in_place if norm_of is None else rescale
        norm_of = norm_of or (lambda update: update.norm if update.delta is not None else None)
        judged = [(u, norm) for u in updates if (norm := norm_of(u)) is not None]
        norms = [norm for _, norm in judged]
        bounds = self.update_bounds(norms, where) if reference == "history" else self.spared_bounds(reference, norms)
        for (update, norm), limit in zip(judged, bounds):
            if id(update) in rejected:
                continue
            verdict, scale = self.judge(norm, limit)
            if verdict == "reject" or (verdict == "clip" and not (clip and rescale)):
                rejected.add(id(update))
                on_reject(update, self.reason(norm, limit))
            elif verdict == "clip":
                rescale(update, scale)
        kept = [u for u in updates if id(u) not in rejected]
        return [u for u in kept if id(u) not in beyond] + [u for u in kept if id(u) in beyond]

    def _beyond_history(self, updates: list[Any]) -> set[int]:
        """The ids of the updates with a finite norm (of the update or a screened record) above its history
        bound at the start of the round: a streamed round holds exactly these to its end
        (:class:`StreamedRound`), so :meth:`filter` puts the ones it keeps last, in the same order."""
        bound = self.bound()
        out = set()
        for update in updates:
            norms = dict(getattr(update, "record_norms", {}))
            limits = {kind: self.kind_bound(kind) for kind in norms}
            if update.delta is not None:
                norms[StreamedRound.UPDATES], limits[StreamedRound.UPDATES] = update.norm, bound
            if any(
                limits[what] is not None and np.isfinite(norm) and norm > limits[what] for what, norm in norms.items()
            ):
                out.add(id(update))
        return out

    # ------------------------------------------------------------------ records screened by kind
    def streaming(self, kinds: Iterable[str]) -> StreamedRound | None:
        """The judge of a round that streams its replies, when the updates and every screened kind ``kinds`` have
        a history to be judged by; ``None``: the round keeps its replies and is screened by :meth:`filter`."""
        bound = self.bound()
        record_bounds = self.record_bounds(kinds) if bound is not None else None
        if bound is None or record_bounds is None:
            return None
        return StreamedRound(self, bound, record_bounds)

    def factor_of(self, kind: str) -> float:
        """How many times its reference norm a record of ``kind`` may reach: ``factor``, squared for a
        variance (a BatchNorm ``running_var`` buffer). A variance is the square of a scale, so a client
        whose activations are 10x the others' has a ``running_var`` 100x theirs: judged on the scale, as
        every other record is. Measured: in Mime's run (docs/results/dropin.md) an honest client's
        ``running_var`` at 10.6x the others' median was refused with ``factor`` itself."""
        return self.factor**2 if _is_variance(kind) else self.factor

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
        return self.factor_of(kind) * float(np.median(norms)) if norms else float("inf")

    def record_bounds(self, kinds: Iterable[str]) -> dict[str, float] | None:
        """Each kind's history bound; ``None`` when any of them has no history yet (judge within the round)."""
        bounds = {}
        for kind in kinds:
            bound = self.kind_bound(kind)
            if bound is None:
                return None
            bounds[kind] = bound
        return bounds

    def round_record_bounds(
        self, record_norms: list[Mapping[str, float]], where: str = "this round"
    ) -> list[dict[str, float]]:
        """Per reply, each of its records' bound, as :meth:`update_bounds` judges updates: the larger of the
        kind's history bound and ``factor`` x the median of the same record of the round's other replies
        (the round's alone without a history, or with a stale one: more than half of the kind's holders
        exceed it, which drops it)."""
        out: list[dict[str, float]] = [{} for _ in record_norms]
        for kind in sorted({kind for norms in record_norms for kind in norms}):
            holders = [i for i, norms in enumerate(record_norms) if kind in norms]
            bound = self.kind_bound(kind)
            if bound is not None and self._outvoted(
                _of_kind(kind), [record_norms[i][kind] for i in holders], bound, where
            ):
                del self.kinds[kind]
                bound = None
            limits = self.spared_bounds(bound, [record_norms[i][kind] for i in holders], kind)
            for i, limit in zip(holders, limits):
                out[i][kind] = limit
        return out

    def screen_records(self, update: Any, bounds: Mapping[str, float], *, clip: bool = True) -> str | None:
        """Judge each screened record of ``update`` against its bound: the reason it is rejected, or ``None``.

        With ``rule="clip"`` an outlying record is scaled down to its bound (a new array; see
        :func:`~pollen.strategies.engine.replies.scale_record`) and its norm updated; ``clip=False``
        rejects it instead.
        """
        from pollen.strategies.engine.replies import scale_record  # replies imports this module

        norms = getattr(update, "record_norms", {})
        for kind in sorted(norms):
            norm, limit = norms[kind], bounds.get(kind, float("inf"))
            verdict, scale = self.judge(norm, limit)
            if verdict == "reject" or (verdict == "clip" and not clip):
                return self.record_reason(kind, norm, limit)
            if verdict == "clip":
                scale_record(update, kind, scale)
                norms[kind] = norm * scale
        return None

    def record_reason(self, kind: str, norm: float, bound: float) -> str:
        what = kind.replace(":", " '", 1) + "'"
        return (
            f"{what} has norm {norm:.3g} > {bound:.3g} ({self.factor_of(kind):g} x its reference norm; outlier screen)"
        )

    def reason(self, norm: float, bound: float) -> str:
        return f"update norm {norm:.3g} exceeds {bound:.3g} ({self.factor:g} x the reference norm; outlier screen)"

    def drop_stale(self, streamed: StreamedRound, where: str = "this round") -> None:
        """At the end of a streamed round: drop each history (of updates, of a record kind) that more than
        half of the round's norms judged against it exceeded (:func:`history_is_stale`), so that the next
        round is judged within itself. Call it after :meth:`observe`: the history goes as a whole."""
        for what in sorted(streamed.judged):
            exceeding, judged = streamed.exceeding.get(what, 0), streamed.judged[what]
            if not history_is_stale(exceeding, judged):
                continue
            if what == StreamedRound.UPDATES:
                self.history.clear()
            else:
                self.kinds.pop(what, None)
            _log.warning(
                "%s: %d of %d %s exceeded the history bound; the history is stale and dropped, "
                "the next round is judged within itself",
                where,
                exceeding,
                judged,
                "updates" if what == StreamedRound.UPDATES else _of_kind(what),
            )

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


class StreamedRound:
    """A streamed round's screen, one reply at a time, with the round's own judgement at its end.

    Each reply is judged against the history bounds as it is read. One within them goes straight to
    the round's sink. One that exceeds a bound (its update, or a screened record, by a finite norm) is
    *held*: its delta is copied out of the reader's reused buffer and it waits for the end of the
    round, where :meth:`settle` judges it as the kept path does (:meth:`UpdateScreen.spared_bounds`:
    the larger of the history's bound and ``factor`` x the median of the round's other norms) and
    hands it to the sink or rejects it. So an honest round whose updates all grew is accepted whole,
    and the history never decides alone while the round says otherwise. Held replies reach the sink
    after the others, in the round's fixed order; the kept path sums in the same order
    (:meth:`UpdateScreen.filter`), so both give the same bits.

    It also counts, per what (``UPDATES``, or a record kind), how many norms were judged against the
    history and how many exceeded it: :meth:`UpdateScreen.drop_stale` decides from that at the end.
    """

    UPDATES = "update"

    def __init__(self, screen: UpdateScreen, bound: float, record_bounds: Mapping[str, float]) -> None:
        self.screen = screen
        self.bound = bound
        self.record_bounds = dict(record_bounds)
        self.judged: dict[str, int] = {}
        self.exceeding: dict[str, int] = {}
        #: Every counted update, with its norms by what (taken when counted: the sink drops the delta).
        self.members: list[tuple[Any, dict[str, float]]] = []
        self.held: list[Any] = []

    def count(self, update: Any) -> None:
        """Count ``update``'s norm (when it has a delta) and each of its screened records' norms against
        their bounds, before any of them is judged (a reply its record rejects still counts)."""
        norms = dict(getattr(update, "record_norms", {}))
        if update.delta is not None:
            norms[self.UPDATES] = float(update.norm)
        for what, norm in norms.items():
            bound = self.bound if what == self.UPDATES else self.record_bounds.get(what, float("inf"))
            self.judged[what] = self.judged.get(what, 0) + 1
            if self.screen.judge(norm, bound)[0] != "accept":
                self.exceeding[what] = self.exceeding.get(what, 0) + 1
        self.members.append((update, norms))

    def hold_if_beyond_history(self, update: Any) -> bool:
        """Hold ``update`` for :meth:`settle` when a finite norm of it exceeds its history bound (its delta
        copied out of the reader's buffer); ``False`` when it is within every bound (or not finite: the
        sink rejects that at once)."""
        norms = self.members[-1][1] if self.members and self.members[-1][0] is update else {}
        beyond = False
        for what, norm in norms.items():
            if not np.isfinite(norm):
                return False
            bound = self.bound if what == self.UPDATES else self.record_bounds.get(what, float("inf"))
            beyond = beyond or norm > bound
        if beyond and self.screen.rule != "off":
            if update.delta is not None:
                update.delta = update.delta.copy()
            self.held.append(update)
            return True
        return False

    def settle(self, on_reject: Callable[[Any, str], None], admit: Callable[[Any], None]) -> set[int]:
        """Judge each held update within its round (:meth:`UpdateScreen.spared_bounds` against the norms of
        every counted update), then ``admit`` it (clipped first under ``rule="clip"``) or hand it to
        ``on_reject`` with the reason; the ids of the rejected ones."""
        from pollen.strategies.engine.replies import scale_record  # replies imports this module

        rejected: set[int] = set()
        for update in self.held:
            why = None
            own = next(norms for member, norms in self.members if member is update)
            for what in sorted(own, key=lambda w: (w == self.UPDATES, w)):  # records first, as the kept path
                others = [norms[what] for member, norms in self.members if member is not update and what in norms]
                history = self.bound if what == self.UPDATES else self.record_bounds.get(what)
                limit = self.screen.spared_bounds(history, [own[what], *others], what)[0]
                verdict, scale = self.screen.judge(own[what], limit)
                if verdict == "reject":
                    why = (
                        self.screen.reason(own[what], limit)
                        if what == self.UPDATES
                        else self.screen.record_reason(what, own[what], limit)
                    )
                    break
                if verdict == "clip" and what == self.UPDATES:
                    update.delta *= np.float32(scale)
                    update.norm *= scale
                    update.applied_scale *= scale
                    update.screen_clipped = True
                elif verdict == "clip":
                    scale_record(update, what, scale)
                    update.record_norms[what] = own[what] * scale
            if why is None:
                admit(update)
            else:
                rejected.add(id(update))
                on_reject(update, why)
        return rejected


def _is_variance(kind: str) -> bool:
    """Whether record ``kind`` holds a variance (a BatchNorm ``running_var``), judged on its square root's scale."""
    return kind.startswith("buffer:") and kind.rsplit(".", 1)[-1] == "running_var"


def _of_kind(kind: str) -> str:
    """``"extra:v"`` -> ``"holders of extra 'v'"``, as the log names a kind."""
    return "holders of " + kind.replace(":", " '", 1) + "'"


#: The smallest accepted norm a saved history may hold: float32 round-off of a real update is far above it.
MIN_NORM = 1e-12
#: The most norms one saved round may hold.
MAX_REPLIES_PER_ROUND = 1_000_000


_BLOCK = 1 << 16


def peak_magnitude(values: np.ndarray) -> float:
    """``max |x|`` of a non-empty float array from its max and min (exact in any float type, no copy of
    ``abs``); NaN when any value is NaN."""
    return max(float(values.max()), -float(values.min()))


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
    peak = peak_magnitude(vector)
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


def _scale_in_place(update: Any, scale: float) -> None:
    """The clip of an update judged by its own norm: scaled down to the bound, the scale on its record."""
    update.delta = update.delta * np.float32(scale)
    update.norm *= scale
    update.applied_scale *= scale
    update.screen_clipped = True
