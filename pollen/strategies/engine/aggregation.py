"""Robust aggregation as a part any strategy takes: ``FedAMS(aggregator="median")``.

Like :class:`~pollen.strategies.engine.uplink.Uplink`, the aggregator is given to a strategy, not built into
a class: every method whose round aggregate is a mean of decoded updates (FedAMS, FedCAMS, FedOpt,
FedAdaVR's ``novr`` variant, the lazy family's resolved vectors, Fed-LAMB's model average) can swap that
mean for one of :mod:`pollen.aggregate.robust` (coordinate-wise median, trimmed mean, or the majority
vote of scaled-sign uploads). Compressed replies are aggregated as the server decodes them.

A robust aggregator needs every update of the round, so a strategy that has one keeps its updates
(the base's non-streaming path) and hands them to :func:`robust_delta`; the mean keeps streaming.

What does not fit, refused at construction with the reason:

- ``aggregation="weighted"``: robust aggregators give each client one vote;
- majority vote without scaled-sign uploads (the vote is over signs, the scale over the clients' scales);
- a method whose aggregate is not a mean of this round's updates (it declares ``robust_refusal``):
  HA-Fed, FedAdaVR's stored-update table; Flower's own strategies aggregate inside Flower;
- error-fed compressed uploads (:func:`check_feedback`, asked by the strategy's ledger when it decides to
  tell clients what was applied): a robust aggregate has no per-client share, so an error-fed client
  cannot be told what of its upload the server applied (:meth:`~pollen.aggregate.Aggregator.feedback_refusal`).
  The same aggregator with ``error_feedback=False`` fits: signSGD's majority vote is designed without it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pollen.aggregate import AGGREGATORS, Aggregator, make_aggregator
from pollen.core.layout import ModelLayout

__all__ = ["AGGREGATORS", "Aggregator", "check_feedback", "check_fits", "make_aggregator", "robust_delta"]


def check_fits(aggregator: Aggregator, owner: str, *, aggregation: str, refusal: str | None) -> None:
    """``ValueError`` naming why ``aggregator`` cannot aggregate for ``owner`` (a strategy's name)."""
    if aggregator.streams:
        return
    if refusal:
        raise ValueError(f"{owner} cannot use aggregator={aggregator.name!r}: {refusal}; allowed: 'mean'")
    if aggregation != "mean":
        raise ValueError(
            f"aggregator={aggregator.name!r} gives every client one vote, so it does not take "
            f"aggregation={aggregation!r}; allowed: aggregation='mean' with it"
        )


def check_codec(aggregator: Aggregator, owner: str, codec: str) -> None:
    """``ValueError`` when ``aggregator`` needs an upload codec that ``owner``'s clients do not use."""
    if aggregator.codec is not None and codec != aggregator.codec:
        raise ValueError(
            f"{owner}: aggregator={aggregator.name!r} needs scaled-sign uploads (uplink codec "
            f"{aggregator.codec!r}); this strategy's uploads are {codec!r}. Allowed: an uplink with codec "
            f"{aggregator.codec!r}, or another aggregator"
        )


def check_feedback(aggregator: Aggregator, owner: str, uploads: str, *, forced: bool = False) -> None:
    """``ValueError`` when ``owner`` (a strategy's name) would tell the clients of its error-fed ``uploads`` (the
    codec) what ``aggregator`` applied of each upload, which it cannot say; ``forced``: the ledger tells because
    its caller set ``tell=True``."""
    reason = aggregator.feedback_refusal()
    if reason is None:
        return
    if forced:
        what, allowed = f"a ledger set to tell clients (tell=True) about their {uploads!r} uploads", "tell=None and "
    else:
        what, allowed = f"error-fed {uploads!r} uploads", ""
    raise ValueError(
        f"{owner}: aggregator={aggregator.name!r} cannot take {what}: {reason}, so no client can be told what of "
        f"its upload was applied; allowed: {allowed}error_feedback=False (run-config 'error-feedback' = false) "
        "with it, or aggregator='mean'"
    )


def robust_delta(aggregator: Aggregator, deltas: Sequence[np.ndarray], layout: ModelLayout) -> np.ndarray:
    """The round's delta from its kept updates, by ``aggregator``.

    The majority vote takes its scales per tensor: with per-tensor sign scales that is the codec's
    own grouping, and with one scale per model each client's scale is the same in every tensor, so
    the per-tensor median is the median of the clients' model scales (the same result).
    """
    return aggregator.combine(deltas, layout.segments)
