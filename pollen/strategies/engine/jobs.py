"""What a server step of an asynchronous run knows about each reply it aggregates: the job behind it.

A synchronous round reads every reply against the model of now. A buffered asynchronous step holds replies
that started from older models: :class:`StepJobs` tells the reader, for each replying node, the model its
job started from (so a full-model reply is differenced against that model, not the current one), the round
its message named (what the ledger records, so an error-fed client settles the right upload), and how the
driver's rule scales the update (a staleness weight; FedAsync's reference to the current model). The
strategy consults it only while the driver has set it (``AdaptiveStrategy.jobs``); it is ``None`` in a
synchronous round.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from pollen.strategies.engine.screening import vector_stats


@dataclass
class StepJobs:
    """The jobs whose replies one asynchronous step aggregates, by node.

    ``bases[node]`` is the flat model the node's job started from; ``weights[node]`` the factor its update
    is scaled by (``1.0``: none); ``sent_rounds[client]`` the round the job's message named; with
    ``reference="current"`` the update becomes ``x_local - x_now`` (FedAsync), else ``x_local - x_start``.
    ``taus[node]`` is the reply's staleness and ``lr_scale_of(tau_max)`` the rule's factor on the step's
    learning rate, taken over the replies that reach the server step (:meth:`lr_scale`: after the screen).
    """

    bases: Mapping[int, np.ndarray]
    weights: Mapping[int, float] = field(default_factory=dict)
    sent_rounds: Mapping[str, int] = field(default_factory=dict)
    reference: str = "dispatch"
    taus: Mapping[int, int] = field(default_factory=dict)
    lr_scale_of: Callable[[int], float] | None = None
    #: What the server step used: the staleness of the updates it applied and its learning-rate factor.
    applied_taus: list[int] | None = None
    lr_scale_used: float = 1.0

    def lr_scale(self, nodes: list[int]) -> float:
        """The step's learning-rate factor for the updates of ``nodes`` (the ones the screen kept); noted."""
        self.applied_taus = [self.taus[node] for node in nodes if node in self.taus]
        if self.lr_scale_of is not None and self.applied_taus:
            self.lr_scale_used = float(self.lr_scale_of(max(self.applied_taus)))
        return self.lr_scale_used

    def base(self, node: int, current: np.ndarray) -> np.ndarray:
        """The model ``node``'s reply is read against (``current`` for a node the step has no job of)."""
        return self.bases.get(node, current)

    def sent_round(self, client: str, default: int) -> int:
        """The round ``client``'s message named (``default``: the step's own)."""
        return self.sent_rounds.get(client, default)

    def adjust(self, update: object, current: np.ndarray) -> None:
        """Move ``update`` to the rule's reference and weight, in place (its norm follows)."""
        delta = getattr(update, "delta", None)
        node = update.node_id  # type: ignore[attr-defined]
        update.sent_round = self.sent_rounds.get(update.client_key)  # type: ignore[attr-defined]
        if delta is None:
            return
        if not delta.flags.writeable:
            delta = update.delta = np.array(delta, dtype=np.float32)  # type: ignore[attr-defined]
        moved = False
        if self.reference == "current" and node in self.bases and self.bases[node] is not current:
            np.add(delta, self.bases[node], out=delta)
            np.subtract(delta, current, out=delta)
            moved = True
        weight = float(self.weights.get(node, 1.0))
        if weight != 1.0:
            np.multiply(delta, np.float32(weight), out=delta)
        if moved:
            update.norm = vector_stats(delta, float("inf"))[0]  # type: ignore[attr-defined]
        elif weight != 1.0:
            update.norm *= weight  # type: ignore[attr-defined]
