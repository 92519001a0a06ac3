"""Every registered method x every record it declares x hostile values: no trace but a counted rejection.

The cases are generated from the method table (:data:`pollen.app.methods.METHODS`) and from what each
strategy declares and sends (:mod:`pollen.testing.hostile_cases`), so a new method is covered without new
test code. Each case runs two rounds of a tiny BatchNorm model with four clients; in round 2 one client's
replies are hostile. It passes when the strategy's whole state (``state_dict()`` flattened, and the global
model) is bit-identical to a run where that client stayed silent and the rejection is counted with a
reason, or, for a reply that means the same as the honest one (a duplicate, an unknown extra record),
bit-identical to the honest run.

Every method and record kind is run; the values are sampled deterministically (every fifth case of a
kind, the first always, and every known failure), so the module stays fast; ``benchmarks/fuzz_replies.py``
runs them all. Known failures are strict xfails naming the bug (:func:`known_failure`): remove the entry
with the fix.
"""

from __future__ import annotations

import pytest

from pollen.testing import hostile
from pollen.testing.hostile_cases import ESCAPES, TIMEOUT_REASON, Case, cases_for, judge, probe, reference

pytestmark = pytest.mark.flower_compat

BASELINES = ("fedavg", "fedadam", "fedyogi", "fedadagrad")
FLOWER_OPT = ("fedadam", "fedyogi", "fedadagrad")


def known_failure(method: str, case: Case) -> str | None:
    """The bug a case runs into today, in words; ``None`` when it must pass."""
    if (
        case.value == "negative"
        and "running_var" in case.target
        and not (method in BASELINES and case.kind == "buffers-codec")
    ):
        return (
            "a negative BatchNorm running_var is accepted and averaged into the global buffers: read_reply checks "
            "buffers for finiteness and the hard limit only, no buffer declares that it is a (non-negative) moment"
        )
    if case.value.startswith("stale-round") and method != "adp-fed":
        return (
            "a previous round's reply is taken as this round's: ReplyCollector.from_asked checks the sender node "
            "and phase but not reply_to_message_id against the messages sent this round"
        )
    if method in BASELINES and case.id == "metrics|metrics/loss|[1.0, nan]":
        return (
            "Flower's baselines: a list-valued metric passes Metered._judge, then Flower's aggregate_metricrecords "
            "raises TypeError and the whole round fails"
        )
    if method in BASELINES and case.id == "envelope|reply|renamed metrics":
        return (
            "Flower's baselines: a MetricRecord under another name passes Metered._judge, then Flower raises "
            "InconsistentMessageReplies and the whole round fails"
        )
    if method in FLOWER_OPT and case.id == "buffers-arrays|arrays/bn.num_batches_tracked|int":
        return (
            "Flower's FedAdam/Yogi/Adagrad: an int32 0-d buffer where the global one is float passes pollen's "
            "reader (dtype cast), then Flower's aggregation raises AggregationError (shape) and the round fails"
        )
    return None


def _sample(method: str) -> list[Case]:
    """Every kind's first case, every fifth one after it, and every known failure."""
    kept, seen = [], {}
    for case in cases_for(method):
        index = seen[case.kind] = seen.get(case.kind, -1) + 1
        if index % 5 == 0 or known_failure(method, case) is not None:
            kept.append(case)
    return kept


def _params() -> list:
    params = []
    for method in hostile.method_names():
        for case in _sample(method):
            reason = known_failure(method, case)
            marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
            params.append(pytest.param(method, case, id=f"{method}:{case.id}", marks=marks))
    return params


@pytest.mark.parametrize(("method", "case"), _params())
def test_a_hostile_reply_leaves_no_trace_but_a_counted_rejection(method: str, case: Case) -> None:
    verdict = judge(method, case)
    assert verdict.outcome not in ESCAPES, f"{method} {case.id}: {verdict.outcome}: {verdict.detail}"


@pytest.mark.parametrize("method", hostile.method_names())
def test_every_record_kind_the_method_declares_is_attacked(method: str) -> None:
    found = probe(method)
    kinds = {case.kind for case in _sample(method)}
    expected = {"update-arrays", "update-codec", "buffers-arrays", "buffers-codec", "flags", "metrics", "envelope"}
    expected |= {f"extra:{extra.name}" for extra in found.spec.extras}
    if found.mid_round:
        expected.add("mid-round")
    assert expected <= kinds, sorted(expected - kinds)
    flags = {case.target.split("/", 1)[-1] for case in cases_for(method) if case.kind == "flags"}
    assert set(found.spec.flags) <= flags


@pytest.mark.parametrize("method", hostile.method_names())
def test_the_round_goes_on_with_the_others_when_one_client_is_silent(method: str) -> None:
    strategy = hostile.run(method, hostile.Attack(None))
    stats = strategy.accounting.rounds[hostile.ATTACK_ROUND]
    assert stats.replies >= 1
    assert [r for r in stats.failure_reasons if TIMEOUT_REASON not in r] == []
    silent, honest = reference(method, 0), reference(method, None)
    assert hostile.differences(silent, honest), "the attacker's reply must matter, or the matrix proves nothing"
    assert "/result/conv.weight" in silent


def test_mid_round_methods_are_found_from_their_behaviour() -> None:
    """HA-Fed gossips inside the round; its baselines without gossip (W = I) have no mid-round replies."""
    assert probe("hafed").mid_round and len(probe("hafed").phases) == 2
    assert not probe("fedamsgrad-stratified").mid_round
    assert not probe("fedams").mid_round
