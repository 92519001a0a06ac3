"""The NLA / AA rules and the increment-reading downlink as pure functions
(spec ``papers/fedbaca.md`` §4, §5.3, §10.3)."""

from __future__ import annotations

import numpy as np
import pytest

from pollen.compression import make_codec
from pollen.lazy import apply_downlink, checksum, downlink_step, judge, replay, uplink_residual


def vec(seed: int, d: int = 50) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(d).astype(np.float32)


def test_first_participation_never_triggers():
    for ref in (None, np.zeros(50, dtype=np.float32)):
        for rule in ("nla", "aa"):
            verdict = judge(vec(1), ref, rule, tau=1e9)
            assert verdict.kind == "send" and verdict.transmit and np.isnan(verdict.rel)
            np.testing.assert_array_equal(verdict.used, vec(1))


@pytest.mark.parametrize("rule", ["nla", "aa"])
def test_trigger_iff_the_change_is_within_tau_of_the_reference(rule):
    ref = vec(2)
    for scale in (0.1, 0.3, 0.6, 1.0, 1.5):
        cand = (ref + scale * vec(3)).astype(np.float32)
        rel = np.linalg.norm((cand - ref).astype(np.float64)) / np.linalg.norm(
            ref.astype(np.float64)
        )  # the change in float32, as sent
        for tau in (0.0, 0.2, 0.5, 1.0, 2.0):
            verdict = judge(cand, ref, rule, tau)
            assert (verdict.kind != "send") == (rel <= tau)
            assert verdict.rel == pytest.approx(rel, rel=1e-12)
            if verdict.kind == "skip":
                np.testing.assert_array_equal(verdict.used, ref)
                assert verdict.new_ref is ref and not verdict.transmit
            elif verdict.kind == "aa":
                np.testing.assert_array_equal(verdict.used, (ref + cand).astype(np.float32))
                np.testing.assert_array_equal(verdict.new_ref, cand)
            else:
                np.testing.assert_array_equal(verdict.used, cand)


def test_skip_rate_grows_with_tau():
    refs = [vec(10 + i) for i in range(200)]
    cands = [
        (r + np.random.default_rng(i).uniform(0.1, 2.0) * vec(500 + i)).astype(np.float32) for i, r in enumerate(refs)
    ]
    rates = [
        np.mean([judge(c, r, "nla", tau).kind == "skip" for c, r in zip(cands, refs)])
        for tau in (0, 0.25, 0.5, 1.0, 1.5, 3.0)
    ]
    assert rates == sorted(rates) and rates[0] == 0 and rates[-1] == 1


def test_rule_none_always_sends():
    ref = vec(4)
    assert judge(ref, ref, "none", 10.0).kind == "send"


def test_replay_mirrors_judge_and_rejects_what_cannot_be_applied():
    ref, cand = vec(5), vec(6)
    for kind, received in (("skip", None), ("aa", cand), ("send", cand)):
        used, new_ref = replay(kind, received, ref)
        expected = {"skip": ref, "aa": (ref + cand).astype(np.float32), "send": cand}[kind]
        np.testing.assert_array_equal(used, expected)
    with pytest.raises(ValueError, match="skip flag together with a vector"):
        replay("skip", cand, ref)
    with pytest.raises(ValueError, match="no stored copy to reuse"):
        replay("skip", None, None)
    with pytest.raises(ValueError, match="no stored copy to add"):
        replay("aa", cand, None)
    with pytest.raises(ValueError, match="without its vector"):
        replay("send", None, ref)


def test_uplink_residual_applied_and_compressed():
    delta, e, used, cand = vec(7), vec(8), vec(9), vec(10)
    np.testing.assert_array_equal(uplink_residual(delta, e, used, cand, "applied"), (delta + e) - used)
    np.testing.assert_array_equal(uplink_residual(delta, e, used, cand, "compressed"), (delta + e) - cand)
    np.testing.assert_array_equal(uplink_residual(delta, None, used, cand, "applied"), delta - used)


def test_checksum_tells_copies_apart():
    a = vec(11)
    b = a.copy()
    b[17] = np.nextafter(b[17], np.float32(np.inf))
    assert checksum(a) == checksum(a.copy()) and checksum(a) != checksum(b) and len(checksum(a)) == 16


@pytest.mark.parametrize("rule", ["none", "nla", "aa"])
def test_increment_reading_applied_increments_sum_to_the_mirror(rule):
    """Sum of applied increments = x_i - theta_1; the client's apply_downlink gives the server's mirror."""
    codec = make_codec("topk", topk_ratio=0.125)
    theta = vec(20)
    x, c_prev, applied = theta.copy(), None, np.zeros(50, dtype=np.float64)
    client_x, client_c = x.copy(), None
    for t in range(1, 30):
        theta = (theta + 0.05 * vec(100 + t)).astype(np.float32)
        step, payload = downlink_step(theta, x, c_prev, None, codec, rule=rule, tau=1.3, mode="increment")
        assert (payload is None) == (step.kind == "skip")
        received = None if payload is None else codec.decode(payload, 50)
        client_x, client_c = apply_downlink(step.kind, received, client_x, client_c, step.apply)
        applied += step.new_x.astype(np.float64) - x
        x, c_prev = step.new_x, step.new_c_prev
        assert checksum(client_x) == checksum(x)
    np.testing.assert_allclose(applied, x.astype(np.float64) - vec(20), atol=1e-5)
    assert np.linalg.norm(theta - x) < np.linalg.norm(theta - vec(20))


def test_identity_downlink_without_rules_tracks_theta():
    codec = make_codec("none")
    theta, x = vec(30), vec(31)
    step, _ = downlink_step(theta, x, None, None, codec, rule="none", tau=0.0)
    np.testing.assert_allclose(step.new_x, theta, atol=1e-6)


def test_increment_reading_is_x_plus_the_compressed_gap():
    """No rule firing: the new mirror is exactly x + C(theta - x), written out by hand with the codec."""
    codec = make_codec("topk", topk_ratio=0.125)
    theta, x = vec(40), vec(41)
    step, payload = downlink_step(theta, x, None, None, codec, rule="nla", tau=0.0)
    gap = (theta - x).astype(np.float32)
    order = np.argsort(-np.abs(gap), kind="stable")[: max(1, int(0.125 * 50))]
    sparse = np.zeros(50, dtype=np.float32)
    sparse[order] = gap[order]
    np.testing.assert_array_equal(codec.decode(payload, 50), sparse)
    np.testing.assert_array_equal(step.new_x, (x + sparse).astype(np.float32))
    np.testing.assert_array_equal(step.new_c_prev, sparse)
    # AA when it fires: the client adds the stored increment and the new one; the stored one becomes the new
    fired, _ = downlink_step(theta, x, sparse, None, codec, rule="aa", tau=10.0)
    assert fired.kind == "aa"
    np.testing.assert_array_equal(fired.new_x, (x + (sparse + sparse)).astype(np.float32))
