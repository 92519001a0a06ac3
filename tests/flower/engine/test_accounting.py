"""The contract of :class:`~pollen.strategies.engine.accounting.Accounting` and the :class:`RoundStats` it keeps.

``Accounting.round(r)`` is round ``r``'s :class:`RoundStats` (made on first use, the same object after).
A round reports what was asked and what came back: failures with their reasons (one line each, at most
:data:`MAX_REASON_LENGTH` characters), bytes each way by record name (every message sent is counted, a
mid-round phase under ``<phase>/<record>``), the compression ratio (dense FP32 bytes over update bytes)
and the gradient evaluations the replies claim (a claim that is not a finite whole number in [0, 1e9] counts
as nothing). ``cumulative`` sums a field over rounds. ``to_dict`` / ``from_dict`` save and restore every
field; ``from_dict`` checks each one and refuses a bad one with a ``StateError`` naming it.
"""

from __future__ import annotations

import math
from dataclasses import asdict

import pytest
from flwr.app import MetricRecord

from pollen.core.state_fields import StateError
from pollen.strategies.engine.accounting import (
    GRAD_EVALS,
    MAX_GRAD_EVALS,
    MAX_REASON_LENGTH,
    Accounting,
    RoundStats,
    grad_evals_of,
)

pytestmark = pytest.mark.flower_compat


def test_a_round_is_made_on_first_use_and_kept() -> None:
    accounting = Accounting()
    stats = accounting.round(3)
    assert stats == RoundStats(server_round=3)
    assert (stats.failures, stats.uplink_bytes, stats.downlink_bytes, stats.messages_sent) == (0, 0, 0, 0)
    assert accounting.round(3) is stats
    assert list(accounting.rounds) == [3]


def test_fail_counts_a_failure_and_keeps_its_reason_short() -> None:
    stats = RoundStats(1)
    stats.fail("c1: no reply before the timeout (train)")
    stats.fail("c2: " + "x" * 1000)
    assert stats.failures == 2
    assert stats.failure_reasons[0] == "c1: no reply before the timeout (train)"
    assert len(stats.failure_reasons[1]) == MAX_REASON_LENGTH == 200
    assert stats.failure_reasons[1].startswith("c2: xxx")


def test_uplink_and_downlink_are_counted_by_record_name_with_the_phase_prefix() -> None:
    stats = RoundStats(1)
    stats.add_uplink({"arrays": 100, "metrics": 10})
    stats.add_uplink({"arrays": 100, "metrics": 12})
    stats.add_uplink({"arrays": 50}, prefix="relay/")
    stats.add_downlink({"arrays": 80, "config": 5})
    stats.add_downlink({"arrays": 80, "config": 5}, prefix="relay/")
    assert stats.uplink_records == {"arrays": 200, "metrics": 22, "relay/arrays": 50}
    assert stats.uplink_bytes == 272
    assert stats.downlink_records == {"arrays": 80, "config": 5, "relay/arrays": 80, "relay/config": 5}
    assert stats.downlink_bytes == 170
    assert stats.messages_sent == 2  # one per add_downlink: a message sent; replies are not messages sent


def test_the_compression_ratio_is_dense_bytes_over_update_bytes() -> None:
    stats = RoundStats(1, uplink_fp32_bytes=4000, uplink_update_bytes=125)
    assert stats.compression_ratio == 32.0
    assert RoundStats(1).compression_ratio == 1.0  # nothing came back


def test_grad_evals_sum_what_the_replies_claim() -> None:
    stats = RoundStats(1)
    stats.count_grad_evals([MetricRecord({GRAD_EVALS: 12}), MetricRecord({"num-steps": 5}), {}, None])
    assert stats.grad_evals == 17


@pytest.mark.parametrize(
    "claim",
    [-1, MAX_GRAD_EVALS + 1, math.nan, math.inf, True, "7", [3]],
    ids=["negative", "above-1e9", "nan", "inf", "bool", "str", "list"],
)
def test_a_claim_of_grad_evals_that_cannot_be_believed_counts_as_nothing(claim: object) -> None:
    assert grad_evals_of({GRAD_EVALS: claim}) == 0


def test_grad_evals_prefer_grad_evals_to_num_steps_and_floor_fractions() -> None:
    assert grad_evals_of({GRAD_EVALS: 3, "num-steps": 100}) == 3
    assert grad_evals_of({GRAD_EVALS: 2.9}) == 2
    assert grad_evals_of({GRAD_EVALS: MAX_GRAD_EVALS}) == MAX_GRAD_EVALS


def test_cumulative_sums_a_field_over_the_rounds_up_to_one() -> None:
    accounting = Accounting()
    for server_round, sent in ((1, 10), (2, 20), (4, 40)):
        accounting.round(server_round).downlink_bytes = sent
    assert accounting.cumulative("downlink_bytes") == 70
    assert accounting.cumulative("downlink_bytes", up_to=2) == 30
    assert accounting.cumulative("downlink_bytes", up_to=0) == 0


# ---------------------------------------------------------------------------- state
def busy() -> Accounting:
    accounting = Accounting()
    stats = accounting.round(2)
    stats.sampled, stats.replies, stats.train_seconds = 3, 2, 0.5
    stats.fail("c3: no reply before the timeout (train)")
    stats.add_uplink({"arrays": 100})
    stats.add_downlink({"arrays": 80})
    stats.method = {"lazy_events": {"skip": 2}, "relayed_bytes": 7, "lazy_rel": {"up": [0.5, 0.25]}}
    stats.train_metrics = {"loss": 0.75}
    accounting.round(1).grad_evals = 4
    return accounting


def test_to_dict_is_keyed_by_round_in_order_with_every_field() -> None:
    saved = busy().to_dict()
    assert list(saved) == ["1", "2"]
    assert saved["2"] == asdict(busy().round(2))


def test_state_round_trip_restores_every_field_of_every_round() -> None:
    accounting = busy()
    again = Accounting.from_dict(accounting.to_dict(), last_round=2)
    assert again.rounds == accounting.rounds
    assert again.round(2).compression_ratio == accounting.round(2).compression_ratio


def round_two(**change: object) -> dict:
    saved = busy().to_dict()
    saved["2"].update(change)
    return saved


def with_round_key(key: str) -> dict:
    saved = busy().to_dict()
    saved[key] = saved.pop("2")
    return saved


@pytest.mark.parametrize(
    ("saved", "field", "expected"),
    [
        (with_round_key("two"), "accounting/two", "is keyed by a round that is not a whole number"),
        (busy().to_dict(), "accounting/2", r"expected an integer in \[0, 1\]"),  # last_round=1 below
        (round_two(server_round=5), "accounting/2/server_round", "is not 2"),
        (round_two(failures=-1), "accounting/2/failures", "is -1; expected an integer"),
        (round_two(train_seconds=math.nan), "accounting/2/train_seconds", "expected a finite number"),
        (round_two(failure_reasons=["x" * 201]), "accounting/2/failure_reasons/0", "expected at most 200"),
        (round_two(method={"relayed_bytes": math.inf}), "accounting/2/method/relayed_bytes", "finite"),
        (round_two(uplink_records={"arrays": 1.5}), "accounting/2/uplink_records/arrays", "expected an integer"),
        (
            {"2": {k: v for k, v in round_two()["2"].items() if k != "grad_evals"}},
            "accounting/2/grad_evals",
            "is missing",
        ),
        (round_two(stolen=1), "accounting/2/stolen", "is not a field of accounting/2"),
        ([], "accounting", "expected a mapping"),
    ],
    ids=[
        "word-key",
        "after-checkpoint",
        "other-round",
        "negative-count",
        "nan-seconds",
        "long-reason",
        "inf-method",
        "fractional-bytes",
        "missing-field",
        "unknown-field",
        "not-a-mapping",
    ],
)
def test_a_bad_saved_accounting_is_refused_naming_the_field(saved, field, expected) -> None:  # noqa: ANN001
    last_round = 1 if field == "accounting/2" else None
    with pytest.raises(StateError, match=expected) as refused:
        Accounting.from_dict(saved, last_round=last_round)
    assert refused.value.field == field


def test_a_round_key_of_digit_like_characters_is_refused_naming_the_field() -> None:
    with pytest.raises(StateError) as refused:
        Accounting.from_dict(with_round_key("²"))
    assert refused.value.field == "accounting/²"
