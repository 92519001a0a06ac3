"""Aggregation sinks: where each screened update of a round goes, and the round's mean.

A streamed round hands every update to a :class:`ScreenedSink` as soon as the reply is read (the
reader reuses one buffer, so no per-reply vector is kept); :class:`RunningMean` is the default sink,
FedAdaVR's stored-update table has its own. :func:`mean_of` is the same arithmetic for a round that
kept its updates, so both paths give the same bits.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
from flwr.app import MetricRecord

from pollen.strategies.engine.replies import ClientUpdate, ReplyRejected
from pollen.strategies.engine.screening import StreamedRound, UpdateScreen

#: How client updates are combined: the papers' plain mean, or weighted by ``num-examples``.
AGGREGATIONS = ("mean", "weighted")


class ScreenedSink:
    """Takes each update of a streamed round as it is read: screens it against the history bound,
    hands it to :meth:`take`, then drops its vector (the reader reuses one buffer). ``mean()`` is
    the round's aggregated delta."""

    def __init__(self, screen: UpdateScreen, bound: float) -> None:
        self.screen = screen
        self.bound = bound

    def __call__(self, update: ClientUpdate) -> None:
        """Screen ``update`` (``ReplyRejected`` if it is an outlier), take it, drop its vector."""
        if update.delta is None:
            return
        verdict, scale = self.screen.judge(update.norm, self.bound)
        if verdict == "reject":
            raise ReplyRejected(self.screen.reason(update.norm, self.bound))
        if verdict == "clip":
            update.delta *= np.float32(scale)
            update.norm *= scale
            update.applied_scale *= scale
            update.screen_clipped = True
        self.admit(update)

    def admit(self, update: ClientUpdate) -> None:
        """Take an update already judged (a held one, :meth:`StreamedRound.settle`), then drop its vector."""
        self.take(update)
        update.delta = None

    def take(self, update: ClientUpdate) -> None:
        raise NotImplementedError

    def mean(self) -> np.ndarray:
        raise NotImplementedError


def records_first(
    screen: UpdateScreen,
    bounds: Mapping[str, float],
    sink: Callable[[ClientUpdate], None],
    streamed: StreamedRound | None = None,
) -> Callable[[ClientUpdate], None]:
    """``sink`` behind the screen of each update's other records (extras, buffers) against ``bounds``,
    their kinds' history bounds: an outlying record rejects the reply (``ReplyRejected``) before
    ``sink`` sees any of it. With ``streamed``, each update's norms are first counted there, and an
    update beyond a history bound is held for the round's own judgement at its end
    (:meth:`StreamedRound.settle`) instead of being rejected."""

    def take(update: ClientUpdate) -> None:
        if streamed is not None:
            streamed.count(update)
            if streamed.hold_if_beyond_history(update):
                return
        why = screen.screen_records(update, bounds)
        if why is not None:
            raise ReplyRejected(why)
        sink(update)

    return take


class RunningMean(ScreenedSink):
    """The round's (weighted) mean of deltas, summed as replies are read; screens each one first.

    ``sum_i float32(w_i) * delta_i`` with raw weights (1 for the mean, ``num-examples`` when
    weighted), then one multiplication by ``1 / sum w``: a rejected reply never touched the sum,
    so the result equals a round where that client stayed silent, bit for bit.
    """

    def __init__(self, dim: int, screen: UpdateScreen, bound: float, *, weighted: bool) -> None:
        super().__init__(screen, bound)
        self.total = np.zeros(dim, dtype=np.float32)
        self.weight = 0.0
        self.weighted = weighted

    def take(self, update: ClientUpdate) -> None:
        self.add(update.delta, update.num_examples)

    def add(self, delta: np.ndarray, num_examples: float) -> None:
        weight = num_examples if self.weighted else 1.0
        if weight == 1.0:
            self.total += delta
        else:
            self.total += np.float32(weight) * delta
        self.weight += weight

    def mean(self) -> np.ndarray:
        self.total *= np.float32(1.0 / self.weight)
        return self.total


def mean_of(updates: Sequence[ClientUpdate], dim: int, screen: UpdateScreen, *, weighted: bool) -> np.ndarray:
    """The (weighted) mean of the updates' deltas, computed as :class:`RunningMean` does."""
    running = RunningMean(dim, screen, float("inf"), weighted=weighted)
    for update in updates:
        if update.delta is not None:
            running.add(update.delta, update.num_examples)
    return running.mean()


def weights_of(updates: Sequence[ClientUpdate], *, weighted: bool) -> np.ndarray:
    """Weight of each update: ``1/M`` (papers) or ``n_i / sum n`` (weighted)."""
    if not weighted:
        return np.full(len(updates), 1.0 / len(updates))
    raw = np.array([u.num_examples for u in updates], dtype=np.float64)
    return raw / raw.sum()


def aggregate_metrics(records: list[MetricRecord], weights: list[float]) -> MetricRecord | None:
    """Weighted average of each numeric metric present in every record.

    Lists are skipped; a non-finite value (a client reporting NaN) is left out of that metric's
    average instead of dropping the metric for everyone.
    """
    if not records:
        return None
    common = set.intersection(*(set(record.keys()) for record in records))
    out = MetricRecord()
    for key in sorted(common):
        pairs = [
            (w, float(record[key]))
            for w, record in zip(weights, records)
            if isinstance(record[key], (int, float)) and not isinstance(record[key], bool) and np.isfinite(record[key])
        ]
        total = float(sum(w for w, _ in pairs))
        if pairs and total > 0:
            value = float(sum(w * v for w, v in pairs) / total)
            if np.isfinite(value):
                out[key] = value
    return out
