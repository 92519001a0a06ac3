"""Error feedback invariants (fedcams §3.6, §4.6 Lemma C.3, §7.1.3, §7.1.5)."""

from __future__ import annotations

import numpy as np
import pytest

from pollen.compression import (
    ErrorFeedback,
    IdentityCodec,
    SignCodec,
    TopKCodec,
    compress_with_feedback,
    decode_payload,
    make_codec,
)

D = 1000
SEGS = [(0, 100), (100, 101), (101, 600), (600, D)]


def codecs():
    return [
        SignCodec(),
        TopKCodec(1 / 64),
        TopKCodec(1 / 8),
        make_codec("fp16"),
        IdentityCodec(),
        make_codec("sign", granularity="tensor", segments=SEGS),
        make_codec("topk", topk_ratio=1 / 32, granularity="tensor", segments=SEGS),
    ]


def client_delta(rng: np.random.Generator, drift: np.ndarray) -> np.ndarray:
    """A local update: a shared drift (as in training) plus client noise of varying size."""
    return (drift + rng.standard_normal(D) * rng.uniform(0.1, 2.0)).astype(np.float32) * 1e-2


def decode(codec, payload):
    return decode_payload(payload, D, segments=SEGS if payload.codec.endswith("/tensor") else None)


@pytest.mark.parametrize("codec", codecs(), ids=lambda c: c.name + repr(getattr(c, "ratio", "")))
def test_telescoping_sum_single_client(codec):
    """sum_t decoded(C(p_t)) + e_{T+1} == sum_t Delta_t (fedcams §3.6, per client)."""
    rng = np.random.default_rng(0)
    drift = rng.standard_normal(D)
    ef = ErrorFeedback()
    sent = np.zeros(D)
    true = np.zeros(D)
    for _ in range(300):
        delta = client_delta(rng, drift)
        payload, ef = compress_with_feedback(codec, delta, ef)
        assert ef.residual.dtype == np.float32 and ef.residual.shape == (D,)
        sent += decode(codec, payload)
        true += delta
    err = np.linalg.norm(sent + ef.residual - true) / np.linalg.norm(true)
    assert err < 1e-6, err


def test_partial_participation_stale_residuals_and_invariants():
    """m clients, n sampled per round: non-sampled residuals are bit-identical (the same array, untouched),
    each client telescopes, and the mean update obeys (B.24): hat_Delta_t - Delta_t = e'_t - e'_{t+1}
    with e'_t = (1/n) sum_{i=1..m} e^i_t."""
    m, n, T = 8, 3, 200
    rng = np.random.default_rng(1)
    codec = SignCodec()
    drift = rng.standard_normal(D)
    state = {i: ErrorFeedback() for i in range(m)}
    sent = np.zeros((m, D))
    true = np.zeros((m, D))
    sampled_count = np.zeros(m, int)

    def e_prime() -> np.ndarray:
        return sum((s.residual.astype(np.float64) for s in state.values() if s.residual is not None), np.zeros(D)) / n

    for _ in range(T):
        sampled = rng.choice(m, size=n, replace=False)
        before = {i: (state[i], None if state[i].residual is None else state[i].residual.tobytes()) for i in range(m)}
        e_before = e_prime()
        hat, raw = np.zeros(D), np.zeros(D)
        for i in sampled:
            delta = client_delta(rng, drift)
            old = state[i].residual.copy() if state[i].residual is not None else None
            payload, new = compress_with_feedback(codec, delta, state[i])
            if old is not None:  # the caller's state is not mutated
                assert state[i].residual.tobytes() == old.tobytes()
            state[i] = new
            y = decode(codec, payload)
            hat += y / n
            raw += delta.astype(np.float64) / n
            sent[i] += y
            true[i] += delta
            sampled_count[i] += 1
        for i in set(range(m)) - set(sampled.tolist()):
            obj, raw_bytes = before[i]
            assert state[i] is obj
            assert (state[i].residual is None and raw_bytes is None) or state[i].residual.tobytes() == raw_bytes
        lhs = hat - raw
        rhs = e_before - e_prime()
        assert np.linalg.norm(lhs - rhs) <= 1e-5 * np.linalg.norm(lhs) + 1e-9
    assert sampled_count.min() > 0
    for i in range(m):
        err = np.linalg.norm(sent[i] + state[i].residual - true[i]) / np.linalg.norm(true[i])
        assert err < 1e-6, (i, err)


def test_identity_codec_keeps_residual_exactly_zero():
    """C = identity: e == 0 and the decoded update is Delta bit for bit (FedCAMS == FedAMS)."""
    rng = np.random.default_rng(2)
    ef = ErrorFeedback()
    for _ in range(50):
        delta = rng.standard_normal(D).astype(np.float32)
        payload, ef = compress_with_feedback(IdentityCodec(), delta, ef)
        assert np.all(ef.residual == 0)
        assert np.array_equal(decode_payload(payload, D), delta)


def test_disabled_feedback_is_plain_compression():
    rng = np.random.default_rng(3)
    delta = rng.standard_normal(D).astype(np.float32)
    for ef in (ErrorFeedback(enabled=False), ErrorFeedback(residual=np.ones(D, np.float32), enabled=False)):
        payload, out = compress_with_feedback(SignCodec(), delta, ef)
        assert out is ef
        assert ef.residual is None or np.all(ef.residual == 1)
        ref = SignCodec().encode(delta)
        assert all(np.array_equal(payload.arrays[k], ref.arrays[k]) for k in ref.arrays)


def test_first_round_sends_c_of_delta_and_residual_is_the_error():
    delta = np.random.default_rng(4).standard_normal(D).astype(np.float32)
    payload, ef = compress_with_feedback(SignCodec(), delta, ErrorFeedback())
    y = SignCodec().decode(payload, D)
    assert np.array_equal(y, SignCodec().decode(SignCodec().encode(delta), D))
    assert np.array_equal(ef.residual, delta - y)
    # second round compresses delta + e
    delta2 = np.random.default_rng(5).standard_normal(D).astype(np.float32)
    payload2, ef2 = compress_with_feedback(SignCodec(), delta2, ef)
    p = delta2 + ef.residual
    assert np.array_equal(SignCodec().decode(payload2, D), SignCodec().decode(SignCodec().encode(p), D))


def _sign_run(deltas):
    ef = ErrorFeedback()
    norms, qs = [], []
    for delta in deltas:
        p = delta + (ef.residual if ef.residual is not None else 0)
        payload, ef = compress_with_feedback(SignCodec(), delta, ef)
        qs.append(np.linalg.norm(ef.residual) / np.linalg.norm(p))  # ||C(p) - p|| / ||p||
        norms.append(np.linalg.norm(ef.residual))
    return np.array(norms), max(qs)


@pytest.mark.parametrize("pattern", ["gaussian", "constant", "sparse", "growing-then-flat"])
def test_sign_residual_bounded_lemma_c3(pattern):
    """||e_t|| <= 2q/(1-q^2) max_s ||Delta_s|| (Lemma C.3, fedcams §7.1.5) and e does not grow with t."""
    rng = np.random.default_rng(6)
    T = 1500
    base = rng.standard_normal(D).astype(np.float32)
    if pattern == "gaussian":
        deltas = [rng.standard_normal(D).astype(np.float32) for _ in range(T)]
    elif pattern == "constant":  # the same direction every round: a naive accumulator would grow linearly
        deltas = [base] * T
    elif pattern == "sparse":  # a few large coordinates, sign's bad case (q close to 1)
        deltas = []
        for _ in range(T):
            v = np.zeros(D, np.float32)
            v[rng.choice(D, 20, replace=False)] = rng.standard_normal(20)
            deltas.append(v)
    else:
        deltas = [base * min(t / 100, 1.0) for t in range(1, T + 1)]
    norms, q = _sign_run(deltas)
    assert q < 1
    bound = 2 * q / (1 - q**2) * max(np.linalg.norm(d) for d in deltas)
    assert norms.max() <= bound * (1 + 1e-5)
    # no linear growth: the late residuals are no larger than the earlier ones
    assert norms[-T // 4 :].max() <= 1.5 * norms[T // 4 : T // 2].max()


def test_topk_residual_does_not_grow_linearly():
    rng = np.random.default_rng(7)
    T = 1500
    ef = ErrorFeedback()
    norms = []
    for _ in range(T):
        payload, ef = compress_with_feedback(TopKCodec(1 / 64), rng.standard_normal(D).astype(np.float32), ef)
        norms.append(np.linalg.norm(ef.residual))
    norms = np.array(norms)
    assert norms[-T // 4 :].max() <= 1.5 * norms[T // 4 : T // 2].max()


def test_bad_inputs_leave_state_untouched():
    ef = ErrorFeedback(residual=np.full(D, 0.5, np.float32))
    bad = np.ones(D, np.float32)
    bad[3] = np.nan
    with pytest.raises(ValueError, match="NaN/Inf"):
        compress_with_feedback(SignCodec(), bad, ef)
    assert np.all(ef.residual == 0.5)
    with pytest.raises(ValueError, match="residual has shape"):
        compress_with_feedback(SignCodec(), np.ones(D + 1, np.float32), ef)
    with pytest.raises(ValueError, match="1-D"):
        compress_with_feedback(SignCodec(), np.ones((2, D), np.float32), ef)


def test_float64_inputs_give_float32_residual():
    delta = np.random.default_rng(8).standard_normal(D)
    _, ef = compress_with_feedback(SignCodec(), delta, ErrorFeedback(residual=np.zeros(D)))
    assert ef.residual.dtype == np.float32
