"""The contract of :class:`~pollen.strategies.engine.ledger.AppliedLedger`: what a client is told was applied.

When a server step commits, ``record(round, updates)`` notes for each applied update its client, the round
and the fraction of it that was applied (below 1 when the outlier screen clipped it); ``refuse(round,
clients)`` notes uploads refused for their content. ``config_for(client)`` is what the next train message
tells that client: ``pollen.applied-round`` (0: nothing yet), ``pollen.applied-scale`` (1.0 by default) and,
for a client with a refusal, ``pollen.refused-round``. The ledger is part of a checkpoint: ``state_dict`` is
``{client: [round, fraction]}`` (with the refused round third) and ``load_state_dict`` restores it all or
nothing, a ``StateError`` naming the entry that does not fit.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from pollen.core.state_fields import StateError
from pollen.strategies.engine.ledger import AppliedLedger
from pollen.wire import protocol

pytestmark = pytest.mark.flower_compat


@dataclass
class Applied:
    """The two fields the ledger reads of an applied ClientUpdate."""

    client_key: str
    applied_scale: float = 1.0
    screen_clipped: bool = False


def test_a_client_never_applied_is_told_round_0_and_a_whole_scale() -> None:
    assert AppliedLedger().config_for("c1") == {protocol.CFG_APPLIED_ROUND: 0, protocol.CFG_APPLIED_SCALE: 1.0}


def test_record_tells_each_applied_client_its_round_and_fraction() -> None:
    ledger = AppliedLedger()
    ledger.record(3, [Applied("c1"), Applied("c2", 0.25)])
    assert ledger.config_for("c1") == {protocol.CFG_APPLIED_ROUND: 3, protocol.CFG_APPLIED_SCALE: 1.0}
    assert ledger.config_for("c2") == {protocol.CFG_APPLIED_ROUND: 3, protocol.CFG_APPLIED_SCALE: 0.25}
    assert ledger.round_of("c2") == 3 and ledger.round_of("c3") == 0


def test_a_later_commit_replaces_the_clients_entry_and_leaves_the_others() -> None:
    ledger = AppliedLedger()
    ledger.record(3, [Applied("c1", 0.5), Applied("c2", 0.25)])
    ledger.record(5, [Applied("c2")])
    assert ledger.config_for("c1")[protocol.CFG_APPLIED_ROUND] == 3
    assert ledger.config_for("c2") == {protocol.CFG_APPLIED_ROUND: 5, protocol.CFG_APPLIED_SCALE: 1.0}


def test_an_update_the_screen_clipped_is_applied_in_part_and_its_cut_part_refused() -> None:
    """The client keeps what was applied on the server's books and drops the rest with its residual (owed, the
    cut part of a diverged client's upload would come back inside every later upload)."""
    ledger = AppliedLedger()
    ledger.record(4, [Applied("c1", 0.25, screen_clipped=True), Applied("c2", 0.25)])
    assert ledger.config_for("c1") == {
        protocol.CFG_APPLIED_ROUND: 4,
        protocol.CFG_APPLIED_SCALE: 0.25,
        protocol.CFG_REFUSED_ROUND: 4,
    }
    assert protocol.CFG_REFUSED_ROUND not in ledger.config_for("c2"), "clipped by central DP: the remainder is owed"
    restored = AppliedLedger()
    restored.load_state_dict(ledger.state_dict(), last_round=4)
    assert restored.config_for("c1") == ledger.config_for("c1")


def test_refuse_tells_the_client_the_refused_round_beside_what_was_applied() -> None:
    ledger = AppliedLedger()
    ledger.record(2, [Applied("c1", 0.5)])
    ledger.refuse(4, ["c1", "c3"])
    assert ledger.config_for("c1") == {
        protocol.CFG_APPLIED_ROUND: 2,
        protocol.CFG_APPLIED_SCALE: 0.5,
        protocol.CFG_REFUSED_ROUND: 4,
    }
    assert ledger.config_for("c3") == {
        protocol.CFG_APPLIED_ROUND: 0,
        protocol.CFG_APPLIED_SCALE: 1.0,
        protocol.CFG_REFUSED_ROUND: 4,
    }
    assert protocol.CFG_REFUSED_ROUND not in AppliedLedger().config_for("c1")


# ---------------------------------------------------------------------------- state
def filled() -> AppliedLedger:
    ledger = AppliedLedger()
    ledger.record(3, [Applied("c2", 0.5), Applied("c1")])
    ledger.refuse(4, ["c1", "c9"])
    return ledger


def test_state_dict_lists_each_client_with_its_round_fraction_and_refusal() -> None:
    assert filled().state_dict() == {"c1": [3, 1.0, 4], "c2": [3, 0.5], "c9": [0, 1.0, 4]}
    assert AppliedLedger().state_dict() == {}


def test_state_round_trip_tells_every_client_the_same() -> None:
    ledger = filled()
    again = AppliedLedger()
    again.load_state_dict(ledger.state_dict(), last_round=4)
    for client in ("c1", "c2", "c9", "never"):
        assert again.config_for(client) == ledger.config_for(client), client
    assert again.state_dict() == ledger.state_dict()


@pytest.mark.parametrize(
    ("state", "field", "expected"),
    [
        ({"c1": [5, 1.0]}, "ledger/c1/0", "is 5; expected an integer in \\[1, 4\\]"),
        ({"c1": [0, 1.0]}, "ledger/c1/0", "is 0; expected an integer in \\[1, 4\\]"),
        ({"c1": [2, 0.0]}, "ledger/c1/1", "is 0; expected an applied fraction in \\(0, 1\\]"),
        ({"c1": [2, 1.5]}, "ledger/c1/1", r"is 1.5; expected a finite number in \[0, 1\]"),
        ({"c1": [2, float("nan")]}, "ledger/c1/1", "expected a finite number"),
        ({"c1": [0, 1.0, 9]}, "ledger/c1/2", "is 9; expected an integer in \\[1, 4\\]"),
        ({"c1": [1]}, "ledger/c1", "has 1 items; expected 2 or 3"),
        ({"c1": [1, 1.0, 1, 1]}, "ledger/c1", "has 4 items; expected at most 3"),
        ({"c1": "3"}, "ledger/c1", "expected a list"),
        ([["c1", 3, 1.0]], "ledger", "expected a mapping with str keys"),
    ],
    ids=[
        "after-the-checkpoint",
        "applied-0-without-refusal",
        "fraction-0",
        "fraction-above-1",
        "nan-fraction",
        "refused-later",
        "one-item",
        "four-items",
        "not-a-list",
        "not-a-mapping",
    ],
)
def test_a_bad_saved_ledger_is_refused_naming_the_entry_and_nothing_changes(state, field, expected) -> None:  # noqa: ANN001
    ledger = filled()
    before = ledger.state_dict()
    good_and_bad = {"c0": [1, 1.0], **state} if isinstance(state, dict) else state  # a good entry is not kept
    with pytest.raises(StateError, match=expected) as refused:
        ledger.load_state_dict(good_and_bad, last_round=4)
    assert refused.value.field == field
    assert ledger.state_dict() == before
    assert ledger.config_for("c0") == {protocol.CFG_APPLIED_ROUND: 0, protocol.CFG_APPLIED_SCALE: 1.0}
