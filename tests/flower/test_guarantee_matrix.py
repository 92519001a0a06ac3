"""Every registered method x every record it declares x hostile values: no trace but a counted rejection.

The cases are generated from the method table (:data:`pollen.app.methods.METHODS`) and from what each
strategy declares and sends (:mod:`pollen.testing.hostile_cases`), so a new method is covered without new
test code. Each case runs two rounds of a tiny BatchNorm model with four clients; in round 2 one client's
replies are hostile. It passes when the strategy's whole state (``state_dict()`` flattened, and the global
model) is bit-identical to a run where that client stayed silent and the rejection is counted with a
reason, or, for a reply that means the same as the honest one (a duplicate, an unknown extra record),
bit-identical to the honest run.

Every method and record kind is run; the values are sampled deterministically (every fifth case of a
kind, the first always), so the module stays fast; ``benchmarks/fuzz_replies.py`` runs them all.
"""

from __future__ import annotations

import pytest

from pollen.testing import hostile
from pollen.testing.hostile_cases import ESCAPES, TIMEOUT_REASON, Case, cases_for, judge, probe, reference

pytestmark = pytest.mark.flower_compat


def _sample(method: str, every: int = 5) -> list[Case]:
    """Every kind's first case and every ``every``-th one after it (the benchmark runs them all); the envelope's
    cases all (records renamed, missing, duplicated: few per method, and a renamed record once escaped)."""
    kept, seen = [], {}
    for case in cases_for(method):
        index = seen[case.kind] = seen.get(case.kind, -1) + 1
        if index % every == 0 or case.kind == "envelope":
            kept.append(case)
    return kept


def _params() -> list:
    params = []
    for method in hostile.method_names():
        for case in _sample(method):
            params.append(pytest.param(method, case, id=f"{method}:{case.id}"))
    return params


@pytest.mark.parametrize(("method", "case"), _params())
def test_a_hostile_reply_leaves_no_trace_but_a_counted_rejection(method: str, case: Case) -> None:
    verdict = judge(method, case)
    assert verdict.outcome not in ESCAPES, f"{method} {case.id}: {verdict.outcome}: {verdict.detail}"


def _async_params() -> list:
    """The asynchronous driver's share: every method that runs on it, every kind, every tenth value."""
    return [
        pytest.param(method, case, id=f"{method}:{case.id}")
        for method in hostile.async_method_names()
        for case in _sample(method, every=10)
    ]


@pytest.mark.parametrize(("method", "case"), _async_params())
def test_on_the_async_driver_a_hostile_reply_leaves_no_trace_but_a_counted_rejection(method: str, case: Case) -> None:
    """The same oracle with each step the synchronous round (``hostile.ASYNC_CONFIG``): replies meet the
    driver's binding to their job first, a silent client's job is dropped after its timeout."""
    verdict = judge(method, case, "async")
    assert verdict.outcome not in ESCAPES, f"{method} {case.id}: {verdict.outcome}: {verdict.detail}"


def test_the_async_matrix_covers_the_adaptive_methods_and_not_the_lock_step_ones() -> None:
    names = set(hostile.async_method_names())
    assert {"fedams", "fedcams", "fedopt", "fedadavr"} <= names, names
    assert not names & {"hafed", "fed-lamb", "fednlaa", "fedbnlaca", "fedavg"}, names


def test_on_the_async_driver_a_silent_client_leaves_the_step_to_the_others() -> None:
    strategy = hostile.run("fedcams", hostile.Attack(None), driver="async")
    stats = strategy.accounting.rounds[hostile.ATTACK_ROUND]
    assert stats.replies == len(hostile.NODES) - 1 and stats.failures == 1, stats.failure_reasons
    assert hostile.differences(reference("fedcams", 0, "async"), reference("fedcams", None, "async"))
    assert not hostile.differences(reference("fedcams", None, "async"), reference("fedcams", None))


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
