"""How a round's screened updates become one delta: a part a method replaces (FedAdaVR's table).

The engine asks the strategy's ``round_aggregate`` for a *sink* when a round streams its replies (each screened
update goes into it as it is read, none is kept) and for the *delta* of the kept updates otherwise (round 1,
or a robust aggregator). The default, :class:`MeanAggregate`, is the (weighted) mean of the deltas, the same
arithmetic both ways; FedAdaVR's is its variance-reduced table aggregate
(:class:`pollen.strategies.fedadavr.TableAggregate`). An aggregate holds no state of its own: it reads the
strategy it serves (its layout, screen, aggregation, aggregator), so one object may serve any number.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pollen.strategies.engine.aggregation import robust_delta
from pollen.strategies.engine.replies import ClientUpdate
from pollen.strategies.engine.sinks import RunningMean, ScreenedSink, mean_of


class MeanAggregate:
    """The papers' simple average of the round's deltas (``aggregation="weighted"``: by the replies' weights),
    or the strategy's robust aggregator's delta when it does not stream."""

    def sink(self, strategy: Any, server_round: int, bound: float) -> ScreenedSink:
        """What takes each screened update of a streamed round: the running mean of the deltas."""
        return RunningMean(strategy.layout.dim, strategy.screen, bound, weighted=strategy.aggregation == "weighted")

    def delta(self, strategy: Any, server_round: int, updates: list[ClientUpdate]) -> np.ndarray:
        """The round's delta from kept updates: the mean, as the streaming path computes it, or the robust one."""
        if not strategy.aggregator.streams:
            return robust_delta(strategy.aggregator, [u.delta for u in updates if u.delta is not None], strategy.layout)
        return mean_of(updates, strategy.layout.dim, strategy.screen, weighted=strategy.aggregation == "weighted")
