"""What the server applied of each client's last upload, told back to the client: error feedback stays exact.

An error-fed client keeps ``e_i`` = what it owes the server. It can only know what it owes if it knows
what the server applied: a reply that was rejected, lost, part of a skipped or rolled-back round, or
clipped by the outlier screen was applied in part or not at all. :class:`AppliedLedger` records, when a
server step *commits*, the round and the applied fraction of each applied reply; the next train message
to that client carries both (``pollen.applied-round``, ``pollen.applied-scale``), and the client adds
the part that was not applied back into its residual (:func:`pollen.clientside.feedback.settle`). So
"sum of what the server applied + the client's residual = the sum of the client's true updates" holds
under skips, rollbacks, drop-outs, clipping and resume (the ledger is part of the strategy's state).

An upload the server *refused for its content* (the outlier screen, or a reply that failed validation) is
the exception: owing it would make the client send it again, inside every later upload, and be refused
every round from then on (a client whose local training diverged once, advanced-pytorch with FedCAMS:
the same norm of 3.3e7 refused in 7 of 13 rounds). The ledger records such a refusal (:meth:`refuse`), the
next train message says so (``pollen.refused-round``), and the client drops that upload and its residual
and starts again from ``e = 0``; the invariant then reads "applied + residual = the true updates, less
what the server refused". An upload the screen *clipped* is refused in part: the applied fraction is
recorded as usual and the refused round is the same round, so the client drops the part that was cut
with its residual instead of owing it (owed, the cut part of a diverged client's upload came back in
every later one: FedCAMS in advanced-pytorch, seed 1, fell from 0.547 to 0.271 under the clip rule).

A robust aggregator (median, trimmed mean, majority vote) has no per-client share to report: the
aggregate is not a sum of parts of the uploads. A ledger that tells clients refuses to serve a strategy
with one, before round 1 (:meth:`decide`,
:func:`~pollen.strategies.engine.aggregation.check_feedback`): error feedback stays exact by not being
combined with what cannot be told.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from flwr.app import ConfigRecord, RecordDict

from pollen.core import state_fields as fields
from pollen.wire import protocol


class AppliedLedger:
    """Client id -> (round of its last applied upload, the fraction of it applied).

    Parameters
    ----------
    tell : bool | None (default: None)
        Tell each client, in its next train message, what was applied of its last upload; ``None``: as the
        strategy decides (:meth:`decide`: on for error-fed compressed uploads).
    keep : bool | None (default: None)
        Record committed uploads; ``None``: whenever clients are told (a method may need the record anyway:
        the lazy family's ``ref_mode="consecutive-only"`` asks who took part in the last round).
    """

    def __init__(self, *, tell: bool | None = None, keep: bool | None = None) -> None:
        self.tell, self.keep = tell, keep
        self._asked = (tell, keep)  # the caller's own settings: a strategy decides only what they leave open
        self.rounds: dict[str, int] = {}
        self.scales: dict[str, float] = {}
        #: Client id -> the round of its last upload refused for its content.
        self.refused: dict[str, int] = {}

    def decide(self, error_fed: bool, *, must_keep: bool = False, owner: Any = None) -> None:
        """Settle what the caller left open: tell clients when their uploads are error-fed (the client puts
        whatever was not applied back into its residual, so error feedback loses nothing); keep a record
        whenever they are told, or always when the method needs it (``must_keep``). A strategy may decide
        again (a method that knows more than the base); the caller's own settings always stand.

        A ledger that would tell the clients of ``owner`` (the strategy deciding) when its aggregator has no
        per-client share (a robust one) refuses it with the reason (``ValueError``), and nothing changes."""
        asked_tell, asked_keep = self._asked
        tell = error_fed if asked_tell is None else bool(asked_tell)
        if tell and owner is not None and getattr(owner, "aggregator", None) is not None:
            from pollen.strategies.engine.aggregation import check_feedback

            uploads = getattr(getattr(owner, "uplink", None), "codec", "none")
            check_feedback(owner.aggregator, type(owner).__name__, uploads, forced=asked_tell is not None)
        self.tell = tell
        self.keep = must_keep or (tell if asked_keep is None else bool(asked_keep))

    def told(self, content: RecordDict, shared: RecordDict, configrecord_key: str, client: str) -> RecordDict:
        """``content`` (a node's train message) with the ledger's word on ``client``'s last upload when clients
        are told; a ``content`` that is the round's ``shared`` one is copied first, never changed."""
        if not self.tell:
            return content
        if content is shared:
            content = RecordDict(dict(shared.items()))
        config = ConfigRecord(dict(content.config_records[configrecord_key]))
        config.update(self.config_for(client))
        content[configrecord_key] = config
        return content

    def record(self, server_round: int, applied: Iterable[Any]) -> None:
        """The server step of ``server_round`` committed these updates (``client_key``, ``applied_scale``); an
        update applied later than it was sent (``sent_round``, an asynchronous step) is recorded under the round
        its message named, which is the round the client knows its upload by."""
        for update in applied:
            sent = getattr(update, "sent_round", None)
            round_named = server_round if sent is None else sent
            self.rounds[update.client_key] = round_named
            self.scales[update.client_key] = float(update.applied_scale)
            if getattr(update, "screen_clipped", False):  # the part the screen cut is refused, as a rejection is
                self.refused[update.client_key] = round_named

    def refuse(
        self, server_round: int, clients: Iterable[str], sent_round: Callable[[str, int], int] | None = None
    ) -> None:
        """The uploads of ``clients`` in ``server_round`` were refused for their content (told, then dropped);
        ``sent_round(client, server_round)``: the round a client's message named, when it is another."""
        for client in clients:
            self.refused[client] = server_round if sent_round is None else sent_round(client, server_round)

    def round_of(self, client: str) -> int:
        """The round of ``client``'s last applied upload (0: none)."""
        return self.rounds.get(client, 0)

    def config_for(self, client: str) -> dict[str, Any]:
        """The train-config entries that tell ``client`` what was applied of its last upload."""
        config: dict[str, Any] = {
            protocol.CFG_APPLIED_ROUND: self.round_of(client),
            protocol.CFG_APPLIED_SCALE: self.scales.get(client, 1.0),
        }
        if client in self.refused:
            config[protocol.CFG_REFUSED_ROUND] = self.refused[client]
        return config

    def state_dict(self) -> dict[str, Any]:
        """``{client: [applied round, applied fraction]}``, with the refused round third for a client that has one
        (an applied round of 0 and fraction 1 where nothing of it was applied yet)."""
        out: dict[str, Any] = {}
        for client in sorted(set(self.rounds) | set(self.refused)):
            entry = [self.rounds.get(client, 0), self.scales.get(client, 1.0)]
            out[client] = entry + [self.refused[client]] if client in self.refused else entry
        return out

    def load_state_dict(self, state: Any, *, last_round: int | None = None, where: str = "ledger") -> None:
        """Restore :meth:`state_dict`'s form, all or nothing (:meth:`prepare_load`, then its commit)."""
        self.prepare_load(state, last_round=last_round, where=where)()

    def prepare_load(self, state: Any, *, last_round: int | None = None, where: str = "ledger") -> Callable[[], None]:
        """Check :meth:`state_dict`'s form and return what makes it this ledger's; a
        :class:`~pollen.core.state_fields.StateError` (a ``ValueError``) names the entry that does not fit.

        Each entry is ``[round, fraction]``: a whole round in ``[1, last_round]`` (the checkpoint's round,
        when known) and an applied fraction in ``(0, 1]``; or ``[round, fraction, refused round]``, where the
        round may be 0 (nothing applied yet) and the refused round is in ``[1, last_round]``.
        """
        rounds, scales, refused = {}, {}, {}
        highest = fields.MAX_COUNT if last_round is None else max(int(last_round), 1)
        for client, entry in fields.mapping(state, where).items():
            at = fields.join(where, client)
            values = fields.sequence(entry, at, most=3)
            if len(values) < 2:
                raise fields.StateError(at, f"has {len(values)} items; expected 2 or 3")
            if len(values) == 3:
                refused[client] = fields.whole(values[2], fields.join(at, 2), low=1, high=highest)
            applied = fields.whole(values[0], fields.join(at, 0), low=0 if client in refused else 1, high=highest)
            scale = fields.finite_number(values[1], fields.join(at, 1), low=0.0, high=1.0)
            if scale == 0.0:
                raise fields.StateError(fields.join(at, 1), "is 0; expected an applied fraction in (0, 1]")
            if applied:
                rounds[client], scales[client] = applied, scale

        def commit() -> None:
            self.rounds, self.scales, self.refused = rounds, scales, refused

        return commit
