"""Robust aggregation of a round's client updates: coordinate-wise median, trimmed mean, majority vote.

The mean lets one client move the aggregate anywhere: an update scaled by ``-3`` passes a norm screen
of 10x the median and still pulls every coordinate. The aggregators here bound what a minority can do
(Yin et al. 2018 for the median and trimmed mean; Bernstein et al. 2019 for signSGD's majority vote):

- :class:`Median`: per coordinate, the middle value of the M updates (the mean of the two middle
  values when M is even);
- :class:`TrimmedMean`: per coordinate, drop the ``floor(beta M)`` smallest and the ``floor(beta M)``
  largest values and average the rest (``0 <= beta < 0.5``; ``beta = 0`` is the mean);
- :class:`MajorityVote`: for scaled-sign uploads ``s_i * sign(x_i)``, the sign of the sum of the
  clients' signs times the *median* of the clients' scales (per tensor when the codec's scale is per
  tensor). A coordinate whose vote ties gets 0 (no move). The median scale, not the mean, so that a
  minority that sends a huge scale cannot blow the step up: the scale an attacker can reach is
  bounded by the honest clients' scales as long as they are the majority.

Every robust aggregator treats each client as one vote (no ``num-examples`` weights: a client's own
count is itself a lever for an attacker).

**No per-client share, so no error feedback.** An error-fed client keeps what the server did not apply of
its upload (:mod:`pollen.strategies.engine.ledger`); under the mean each upload is applied in full, with
weight ``1/M``. A robust aggregate has no such share (:meth:`Aggregator.feedback_refusal` says why for
each), so the strategies refuse it with error-fed uploads: the median's coordinate is one or two clients'
values and the rest count for nothing; the trimmed mean's share differs per coordinate (0 where a value
is cut, ``1/(M - 2 floor(beta M))`` where it is kept); the vote applies the median scale times the majority
sign, a function of every upload together. Owing back what was not applied would not help either: it
would go out again inside the client's next upload, further from the others'.

**Deterministic.** Each works on the values of a coordinate sorted (or counted), so the result is
bit-identical whatever order the updates come in (``-0.0`` and ``0.0`` sort as equal, and the result is
normalised to ``+0.0``).

**Memory.** The updates are M vectors of d float32 values (the strategy keeps them for the round);
the aggregators read them in column blocks of about :data:`BLOCK_BYTES` of temporaries, so the extra
memory is one float32 result of d values plus a bounded block, not another M x d copy.

:class:`Mean` names the plain mean; the strategies stream it (``RunningMean``) instead of keeping the
updates, and its :meth:`Mean.combine` is the reference the tests and benchmarks compare against.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

import numpy as np

#: The aggregators by run-config name (``aggregator``).
AGGREGATORS: tuple[str, ...] = ("mean", "median", "trimmed-mean", "majority-vote")
#: The trimmed mean's fraction cut from each side when none is given.
DEFAULT_TRIM_FRACTION = 0.1
#: Bytes of temporaries one column block may take (its float64 work copy of M x B values).
BLOCK_BYTES = 32 * 2**20

Segments = Sequence[tuple[int, int]]


def _check_rows(rows: Sequence[np.ndarray]) -> int:
    """The common length of ``rows``; ``ValueError`` when there are none or their shapes differ."""
    if len(rows) == 0:
        raise ValueError("an aggregate needs at least one update; got none")
    dim = rows[0].shape
    for i, row in enumerate(rows):
        if row.ndim != 1 or row.shape != dim:
            raise ValueError(f"update {i} has shape {row.shape}; allowed: the shape of the others, {dim}, 1-D")
    return int(dim[0])


def _blocks(dim: int, count: int):
    """``(lo, hi)`` column blocks whose M x B float64 work copy stays under :data:`BLOCK_BYTES`."""
    width = max(1, BLOCK_BYTES // (8 * count))
    for lo in range(0, dim, width):
        yield lo, min(dim, lo + width)


def _sorted_block(rows: Sequence[np.ndarray], lo: int, hi: int, work: np.ndarray) -> np.ndarray:
    """Columns ``lo:hi`` of every row, as float64, each column sorted (ascending) in place in ``work``."""
    block = work[:, : hi - lo]
    for i, row in enumerate(rows):
        block[i] = row[lo:hi]
    block.sort(axis=0)
    return block


class Aggregator(ABC):
    """How the round's updates become one delta.

    Attributes
    ----------
    name : str
        The run-config name (:data:`AGGREGATORS`).
    streams : bool
        True for the mean only: it needs no update kept (the strategies sum replies as they are read).
    codec : str | None
        The upload codec the aggregator needs (majority vote: ``"sign"``), or ``None`` for any.
    """

    name: ClassVar[str]
    streams: ClassVar[bool] = False
    codec: ClassVar[str | None] = None

    @abstractmethod
    def combine(self, rows: Sequence[np.ndarray], segments: Segments | None = None) -> np.ndarray:
        """One float32 vector from M float32 vectors of the same length (``segments``: the scale groups
        of scaled-sign uploads; only :class:`MajorityVote` uses them)."""

    def feedback_refusal(self) -> str | None:
        """Why no client can be told what its upload contributed to this aggregate, so error-fed uploads
        do not fit; ``None`` when every upload is applied in full, with weight ``1/M`` (the mean). An
        aggregator that does not say is taken to have no per-client share unless it streams the mean."""
        if self.streams:
            return None
        return f"aggregator {self.name!r} does not say what one client's upload contributes to it"

    def describe(self) -> str:
        """One line for a strategy's ``summary()``."""
        return self.name

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and repr(other) == repr(self)

    def __hash__(self) -> int:
        return hash(repr(self))


class Mean(Aggregator):
    """The plain mean ``(1/M) sum_i x_i`` (the strategies stream it; this is the reference)."""

    name = "mean"
    streams = True

    def combine(self, rows: Sequence[np.ndarray], segments: Segments | None = None) -> np.ndarray:
        dim = _check_rows(rows)
        total = np.zeros(dim, dtype=np.float64)
        for row in rows:
            total += row
        return (total / len(rows)).astype(np.float32)

    def describe(self) -> str:
        return "mean (streamed)"


class Median(Aggregator):
    """Coordinate-wise median: the middle value, or the mean of the two middle values for an even M."""

    name = "median"

    def combine(self, rows: Sequence[np.ndarray], segments: Segments | None = None) -> np.ndarray:
        dim, count = _check_rows(rows), len(rows)
        out = np.empty(dim, dtype=np.float32)
        work = np.empty((count, min(dim, max(1, BLOCK_BYTES // (8 * count)))), dtype=np.float64)
        half = count // 2
        for lo, hi in _blocks(dim, count):
            block = _sorted_block(rows, lo, hi, work)
            if count % 2:
                out[lo:hi] = block[half]
            else:
                out[lo:hi] = (block[half - 1] + block[half]) * 0.5
        out += np.float32(0.0)  # -0.0 -> +0.0: the same bits whichever zero sorted first
        return out

    def feedback_refusal(self) -> str | None:
        return (
            "a coordinate-wise median has no per-client share (each coordinate is one client's value, or the "
            "mean of two, and the other uploads count for nothing there)"
        )

    def describe(self) -> str:
        return "coordinate-wise median (one vote per client)"


class TrimmedMean(Aggregator):
    """Coordinate-wise trimmed mean: cut ``floor(beta M)`` values from each side, average the rest.

    Parameters
    ----------
    beta : float (default: 0.1)
        Fraction trimmed from each side, in [0, 0.5); 0 is the mean. With M updates it tolerates up
        to ``floor(beta M)`` bad ones on either side.
    """

    name = "trimmed-mean"

    def __init__(self, beta: float = DEFAULT_TRIM_FRACTION) -> None:
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0.0 <= beta < 0.5:
            raise ValueError(f"trim fraction beta={beta!r} is out of range; allowed: a number in [0, 0.5)")
        self.beta = float(beta)

    def trimmed(self, count: int) -> int:
        """How many values are cut from each side of ``count``."""
        return int(np.floor(self.beta * count))

    def combine(self, rows: Sequence[np.ndarray], segments: Segments | None = None) -> np.ndarray:
        dim, count = _check_rows(rows), len(rows)
        cut = self.trimmed(count)
        out = np.empty(dim, dtype=np.float32)
        work = np.empty((count, min(dim, max(1, BLOCK_BYTES // (8 * count)))), dtype=np.float64)
        for lo, hi in _blocks(dim, count):
            block = _sorted_block(rows, lo, hi, work)
            kept = block[cut : count - cut]
            out[lo:hi] = kept.sum(axis=0) / (count - 2 * cut)
        out += np.float32(0.0)
        return out

    def feedback_refusal(self) -> str | None:
        if self.beta == 0.0:
            return None  # the mean
        return (
            "a trimmed mean's per-client share differs per coordinate (0 where a value is cut, "
            "1/(M - 2 floor(beta M)) where it is kept), which one applied fraction per client cannot tell"
        )

    def describe(self) -> str:
        return f"coordinate-wise trimmed mean (beta={self.beta:g} cut from each side, one vote per client)"

    def __repr__(self) -> str:
        return f"TrimmedMean(beta={self.beta!r})"


class MajorityVote(Aggregator):
    """signSGD with majority vote for scaled-sign uploads: ``median_i(s_i) * sign(sum_i sign(x_i))``.

    ``s_i`` is a client's scale (its mean absolute value, which for a scaled-sign upload is exactly
    the scale it sent), taken per segment when ``segments`` is given (the codec's per-tensor scales)
    and over the whole vector otherwise. A tied vote gives 0 on that coordinate.
    """

    name = "majority-vote"
    codec = "sign"

    def combine(self, rows: Sequence[np.ndarray], segments: Segments | None = None) -> np.ndarray:
        dim = _check_rows(rows)
        groups = list(segments) if segments else [(0, dim)]
        if groups[0][0] != 0 or groups[-1][1] != dim or any(a[1] != b[0] for a, b in zip(groups, groups[1:])):
            raise ValueError(f"segments {groups[:3]}... do not tile the {dim} values; allowed: consecutive (lo, hi)")
        votes = np.zeros(dim, dtype=np.int32)
        for row in rows:
            votes += row > 0
            votes -= row < 0
        out = np.sign(votes).astype(np.float32)
        for lo, hi in groups:
            scales = np.sort([np.abs(row[lo:hi], dtype=np.float64).mean() if hi > lo else 0.0 for row in rows])
            half = len(scales) // 2
            scale = scales[half] if len(scales) % 2 else (scales[half - 1] + scales[half]) * 0.5
            out[lo:hi] *= np.float32(scale)
        out += np.float32(0.0)
        return out

    def feedback_refusal(self) -> str | None:
        return (
            "a majority vote applies the median scale times the majority sign, of which no client's upload is a "
            "share (signSGD's majority vote, Bernstein et al. 2019, is designed without error feedback)"
        )

    def describe(self) -> str:
        return "majority vote of signs x median scale (signSGD, one vote per client)"


def make_aggregator(value: str | Aggregator, trim_fraction: float | None = None) -> Aggregator:
    """An :class:`Aggregator` from its name (:data:`AGGREGATORS`) or an instance.

    ``trim_fraction`` sets the trimmed mean's beta (default :data:`DEFAULT_TRIM_FRACTION`); it is
    refused with another aggregator named, so a setting never silently does nothing.
    """
    if isinstance(value, Aggregator):
        if trim_fraction is not None:
            raise ValueError("trim_fraction is given together with an aggregator instance; set it on the instance")
        return value
    if value not in AGGREGATORS:
        raise ValueError(f"aggregator={value!r} is unknown; allowed: {', '.join(AGGREGATORS)} or an Aggregator")
    if value == "trimmed-mean":
        return TrimmedMean(DEFAULT_TRIM_FRACTION if trim_fraction is None else trim_fraction)
    if trim_fraction is not None:
        raise ValueError(f"trim_fraction={trim_fraction!r} is set but aggregator={value!r}; allowed: trimmed-mean")
    return {"mean": Mean, "median": Median, "majority-vote": MajorityVote}[value]()
