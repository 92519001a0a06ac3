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

from collections.abc import Iterable
from typing import Any

from pollen.core import state_fields as fields
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

    def load_state_dict(self, state: Any, *, last_round: int | None = None, where: str = "ledger") -> None:
        """Restore :meth:`state_dict`'s form, all or nothing; a :class:`~pollen.core.state_fields.StateError`
        (a ``ValueError``) names the entry that does not fit.

        Each entry is ``[round, fraction]``: a whole round in ``[1, last_round]`` (the checkpoint's round,
        when known) and an applied fraction in ``(0, 1]``.
        """
        rounds, scales = {}, {}
        highest = fields.MAX_COUNT if last_round is None else max(int(last_round), 1)
        for client, entry in fields.mapping(state, where).items():
            at = fields.join(where, client)
            server_round, scale = fields.sequence(entry, at, length=2)
            rounds[client] = fields.whole(server_round, fields.join(at, 0), low=1, high=highest)
            scales[client] = fields.finite_number(scale, fields.join(at, 1), low=0.0, high=1.0)
            if scales[client] == 0.0:
                raise fields.StateError(fields.join(at, 1), "is 0; expected an applied fraction in (0, 1]")
        self.rounds, self.scales = rounds, scales
