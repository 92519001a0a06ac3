"""A round's train and evaluation metrics: the user's aggregation function as Flower calls it, or the mean.

Flower's ``FedAvg`` hands ``train_metrics_aggr_fn`` / ``evaluate_metrics_aggr_fn`` the replies' RecordDicts
and the weight's metric name; without one, each metric every reply reports is averaged with the replies'
weights. One rule for every strategy: what a reply may count as (its weight, its metrics) was read and checked
by the :class:`~pollen.strategies.engine.collector.ReplyCollector` before it reaches these functions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from flwr.app import MetricRecord, RecordDict

from pollen.strategies.engine.replies import ClientUpdate
from pollen.strategies.engine.sinks import aggregate_metrics

#: Flower's metric aggregation function (``FedAvg``'s ``train_metrics_aggr_fn`` / ``evaluate_metrics_aggr_fn``):
#: the replies' RecordDicts and the weight's metric name in, the round's MetricRecord out.
MetricsAggregationFn = Callable[[list[RecordDict], str], MetricRecord]


def train_metrics(
    applied: Sequence[ClientUpdate], fn: MetricsAggregationFn | None, weighted_by_key: str
) -> MetricRecord | None:
    """The round's train metrics from the replies whose updates it applied (their contents for ``fn``)."""
    if fn is not None:
        contents = [u.reply for u in applied if u.reply is not None]
        return checked("train_metrics_aggr_fn", fn(contents, weighted_by_key)) if contents else None
    reported = [u for u in applied if u.metrics is not None]
    return aggregate_metrics([u.metrics for u in reported], [u.num_examples for u in reported])


def evaluate_metrics(
    usable: Sequence[tuple[RecordDict, MetricRecord, float]], fn: MetricsAggregationFn | None, weighted_by_key: str
) -> MetricRecord | None:
    """The round's evaluation metrics from the usable replies' ``(content, metrics, weight)``."""
    if fn is not None:
        contents = [content for content, _, _ in usable]
        return checked("evaluate_metrics_aggr_fn", fn(contents, weighted_by_key)) if contents else None
    return aggregate_metrics([record for _, record, _ in usable], [weight for _, _, weight in usable])


def checked(name: str, value: Any) -> MetricRecord | None:
    """What a user's metric aggregation function returned, if it is what a round reports (Flower's type)."""
    if value is not None and not isinstance(value, MetricRecord):
        raise TypeError(f"{name} returned a {type(value).__name__}; allowed: a flwr.app.MetricRecord or None")
    return value
