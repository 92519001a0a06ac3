"""What the server applied of each client's last upload, told back to the client: error feedback stays exact.

An error-fed client keeps ``e_i`` = what it owes the server. It can only know what it owes if it knows
what the server applied: a reply that was rejected, lost, part of a skipped or rolled-back round, or
clipped by the outlier screen was applied in part or not at all. :class:`AppliedLedger` records, when a
server step *commits*, the round and the applied fraction of each applied reply; the next train message
to that client carries both (``pollen.applied-round``, ``pollen.applied-scale``), and the client adds
the part that was not applied back into its residual (:func:`pollen.clientside.feedback.settle`). So
"sum of what the server applied + the client's residual = the sum of the client's true updates" holds
under skips, rollbacks, drop-outs, clipping and resume (the ledger is part of the strategy's state).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from pollen.wire import protocol


class AppliedLedger:
    """Client id -> (round of its last applied upload, the fraction of it applied)."""

    def __init__(self) -> None:
        self.rounds: dict[str, int] = {}
        self.scales: dict[str, float] = {}

    def record(self, server_round: int, applied: Iterable[Any]) -> None:
        """The server step of ``server_round`` committed these updates (``client_key``, ``applied_scale``)."""
        for update in applied:
            self.rounds[update.client_key] = server_round
            self.scales[update.client_key] = float(update.applied_scale)

    def round_of(self, client: str) -> int:
        """The round of ``client``'s last applied upload (0: none)."""
        return self.rounds.get(client, 0)

    def config_for(self, client: str) -> dict[str, Any]:
        """The train-config entries that tell ``client`` what was applied of its last upload."""
        return {
            protocol.CFG_APPLIED_ROUND: self.round_of(client),
            protocol.CFG_APPLIED_SCALE: self.scales.get(client, 1.0),
        }

    def state_dict(self) -> dict[str, Any]:
        return {client: [self.rounds[client], self.scales[client]] for client in sorted(self.rounds)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s form; ``ValueError`` naming the entry when one does not fit."""
        if not isinstance(state, Mapping):
            raise ValueError("state 'ledger' must map client ids to [round, applied fraction]")
        rounds, scales = {}, {}
        for client, entry in state.items():
            try:
                server_round, scale = entry
                server_round, scale = int(server_round), float(scale)
            except (TypeError, ValueError):
                raise ValueError(f"state 'ledger[{client}]' must be [round, applied fraction], got {entry!r}") from None
            if server_round < 1 or not (math.isfinite(scale) and 0.0 < scale <= 1.0):
                raise ValueError(
                    f"state 'ledger[{client}]' = [{server_round}, {scale}]: the round must be >= 1 and the "
                    "applied fraction in (0, 1]"
                )
            rounds[str(client)], scales[str(client)] = server_round, scale
        self.rounds, self.scales = rounds, scales
