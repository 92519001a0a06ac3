"""How a round's client updates become one vector: the mean and robust aggregators (Flower-free math).

:mod:`pollen.aggregate.robust` holds the aggregators by name (:data:`AGGREGATORS`): the mean (which
the strategies stream, one reply at a time), the coordinate-wise median, the coordinate-wise trimmed
mean and the majority vote of scaled-sign uploads. The server side wires them in
:mod:`pollen.strategies.engine.aggregation`.
"""

from pollen.aggregate.robust import (
    AGGREGATORS,
    DEFAULT_TRIM_FRACTION,
    Aggregator,
    MajorityVote,
    Mean,
    Median,
    TrimmedMean,
    make_aggregator,
)

__all__ = [
    "AGGREGATORS",
    "DEFAULT_TRIM_FRACTION",
    "Aggregator",
    "MajorityVote",
    "Mean",
    "Median",
    "TrimmedMean",
    "make_aggregator",
]
