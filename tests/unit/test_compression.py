"""Codecs: round trips, exact wire bytes, paper bit counts and compressor identities (fedcams §3.7, §7.1)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from pollen.compression import (
    CODECS,
    FP16Codec,
    IdentityCodec,
    Payload,
    PayloadError,
    PerTensorCodec,
    SignCodec,
    TopKCodec,
    decode_payload,
    index_dtype,
    make_codec,
    topk_count,
)

DIMS = [1, 2, 7, 8, 9, 63, 64, 65, 200, 1000, 4099]


def rand(d: int, seed: int = 0, kind: str = "normal") -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "normal":
        return rng.standard_normal(d).astype(np.float32)
    if kind == "ties":  # few distinct magnitudes, many zeros: stresses sign(0) and top-k ties
        return rng.integers(-3, 4, size=d).astype(np.float32)
    if kind == "heavy":
        return (rng.standard_cauchy(d) * 1e-3).astype(np.float32)
    raise ValueError(kind)


def all_codecs():
    return [
        IdentityCodec(),
        FP16Codec(),
        SignCodec(),
        TopKCodec(1 / 64),
        TopKCodec(1 / 128),
        TopKCodec(0.3),
        TopKCodec(1.0),
    ]


def sign_reference(x: np.ndarray) -> np.ndarray:
    """Scaled sign in float64 with s(0) = +1: (||x||_1/d) * (+1 if x >= 0 else -1)."""
    x64 = x.astype(np.float64)
    return np.abs(x64).sum() / x.size * np.where(x64 >= 0, 1.0, -1.0)


def topk_reference(x: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest |x|, ties to the lowest index, via a full stable sort (test only)."""
    order = np.lexsort((np.arange(x.size), -np.abs(x.astype(np.float64))))
    return np.sort(order[:k])


# ----------------------------------------------------------------------------------------------------
# Round trips and bytes
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("d", DIMS)
def test_payload_bytes_exact_for_every_codec(d):
    x = rand(d, seed=d)
    for codec in all_codecs():
        p = codec.encode(x)
        assert p.codec == codec.name and p.dim == d
        assert p.nbytes == codec.payload_bytes(d), (codec, d)
        assert p.nbytes == sum(a.nbytes for a in p.arrays.values())
        for a in p.arrays.values():
            assert isinstance(a, np.ndarray) and a.ndim == 1


@pytest.mark.parametrize("d", DIMS)
def test_sign_bytes_are_ceil_d_over_8_plus_4(d):
    p = SignCodec().encode(rand(d))
    assert p.nbytes == math.ceil(d / 8) + 4
    assert p.arrays["bits"].dtype == np.uint8 and p.arrays["bits"].size == math.ceil(d / 8)
    assert p.arrays["scale"].dtype == np.float32 and p.arrays["scale"].size == 1


@pytest.mark.parametrize("d", DIMS)
def test_identity_round_trip_exact_and_not_aliased(d):
    x = rand(d)
    p = IdentityCodec().encode(x)
    x_before = x.copy()
    x[:] = 7.0  # the payload must not alias the caller's vector
    y = IdentityCodec().decode(p, d)
    assert y.dtype == np.float32 and np.array_equal(y, x_before)
    assert p.nbytes == 4 * d


@pytest.mark.parametrize("d", DIMS)
def test_fp16_round_trip_is_the_float16_cast(d):
    x = rand(d, kind="heavy")
    y = FP16Codec().decode(FP16Codec().encode(x), d)
    assert y.dtype == np.float32
    assert np.array_equal(y, x.astype(np.float16).astype(np.float32))
    assert FP16Codec().encode(x).arrays["values"].dtype == np.float16


def test_fp16_overflow_is_an_error_not_inf():
    x = np.array([1.0, 70000.0], dtype=np.float32)
    with pytest.raises(ValueError, match="fp16 overflow"):
        FP16Codec().encode(x)


@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("kind", ["normal", "ties", "heavy"])
def test_sign_round_trip_matches_reference(d, kind):
    x = rand(d, seed=3, kind=kind)
    y = SignCodec().decode(SignCodec().encode(x), d)
    assert y.dtype == np.float32 and y.shape == (d,)
    np.testing.assert_allclose(y, sign_reference(x), rtol=1e-6, atol=0)


@pytest.mark.parametrize("codec", all_codecs()[3:], ids=repr)
@pytest.mark.parametrize("d", DIMS)
def test_topk_round_trip_matches_reference(codec, d):
    for kind in ("normal", "ties"):
        x = rand(d, seed=5, kind=kind)
        k = codec.k(d)
        ref = np.zeros(d, dtype=np.float32)
        idx = topk_reference(x, k)
        ref[idx] = x[idx]
        p = codec.encode(x)
        assert np.array_equal(p.arrays["indices"].astype(np.int64), idx)
        assert np.array_equal(codec.decode(p, d), ref)


def test_float64_input_is_cast_to_float32():
    x = np.linspace(-1, 1, 50)
    for codec in all_codecs():
        y = codec.decode(codec.encode(x), 50)
        assert np.array_equal(y, codec.decode(codec.encode(x.astype(np.float32)), 50))


@pytest.mark.parametrize("codec", all_codecs(), ids=repr)
@pytest.mark.parametrize(
    "bad, match",
    [
        (np.zeros((2, 3), np.float32), "1-D"),
        (np.zeros(0, np.float32), "empty"),
        (np.arange(5), "float"),
        (np.array([1.0, np.nan, 2.0], np.float32), "NaN/Inf"),
        (np.array([1.0, -np.inf, 2.0], np.float32), "NaN/Inf"),
    ],
)
def test_encode_rejects_bad_input(codec, bad, match):
    with pytest.raises(ValueError, match=match):
        codec.encode(bad)


# ----------------------------------------------------------------------------------------------------
# Scaled sign identities (fedcams §3.7, §7.1.1)
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("d", DIMS + [100_003])
@pytest.mark.parametrize("kind", ["normal", "ties", "heavy"])
def test_sign_error_identity(d, kind):
    """||C(x) - x||^2 == ||x||^2 - ||x||_1^2 / d, in float64, zeros included (s(0) = +1)."""
    x = rand(d, seed=11, kind=kind)
    y = SignCodec().decode(SignCodec().encode(x), d).astype(np.float64)
    x64 = x.astype(np.float64)
    lhs = np.sum((y - x64) ** 2)
    rhs = np.sum(x64**2) - np.abs(x64).sum() ** 2 / d
    assert lhs == pytest.approx(rhs, rel=1e-5, abs=1e-6 * np.sum(x64**2))
    assert np.abs(y).sum() == pytest.approx(np.abs(x64).sum(), rel=1e-5)  # ||C(x)||_1 == ||x||_1


@pytest.mark.parametrize("kind", ["normal", "ties", "heavy"])
def test_sign_output_takes_only_plus_minus_scale(kind):
    d = 1001
    x = rand(d, seed=2, kind=kind)
    x[:3] = [0.0, -0.0, 0.0]
    p = SignCodec().encode(x)
    s = p.arrays["scale"][0]
    assert s == pytest.approx(np.abs(x.astype(np.float64)).sum() / d, rel=1e-6)
    y = SignCodec().decode(p, d)
    assert set(np.unique(y).tolist()) <= {float(s), float(-s)}
    assert np.all(y[x > 0] == s) and np.all(y[x < 0] == -s)
    assert np.all(y[x == 0] == s)  # documented choice: zero (either sign) is sent as +scale


def test_sign_zero_vector():
    p = SignCodec().encode(np.zeros(13, np.float32))
    assert p.arrays["scale"][0] == 0
    y = SignCodec().decode(p, 13)
    assert np.array_equal(y, np.zeros(13, np.float32))


def test_sign_bits_layout_is_packbits_big_endian_one_for_nonnegative():
    x = np.array([1, -1, 0, -2, 3, -4, -5, 6, -7], dtype=np.float32)
    p = SignCodec().encode(x)
    assert p.arrays["bits"].tolist() == [0b10101001, 0b00000000]


def test_sign_q_for_gaussian_is_about_0_60():
    """q^2 = 1 - ||x||_1^2/(d ||x||^2) -> 1 - 2/pi for Gaussian x (fedcams §7.1.1)."""
    d = 1_000_000
    x = rand(d, seed=1)
    y = SignCodec().decode(SignCodec().encode(x), d).astype(np.float64)
    q2 = np.sum((y - x) ** 2) / np.sum(x.astype(np.float64) ** 2)
    assert q2 == pytest.approx(1 - 2 / np.pi, abs=2e-3)


# ----------------------------------------------------------------------------------------------------
# Top-k
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ratio, d, k",
    [(1 / 64, 10, 1), (1 / 64, 64, 1), (1 / 64, 128, 2), (1 / 64, 11_173_962, 174_593), (0.29, 100, 28), (1.0, 7, 7)],
)
def test_topk_count(ratio, d, k):
    assert topk_count(ratio, d) == k
    assert TopKCodec(ratio).k(d) == k


@pytest.mark.parametrize("seed", range(20))
def test_topk_keeps_exactly_the_k_largest_with_lowest_index_ties(seed):
    rng = np.random.default_rng(seed)
    d = int(rng.integers(1, 3000))
    ratio = float(rng.choice([1 / 256, 1 / 64, 0.1, 0.5, 0.99]))
    kind = ["normal", "ties", "heavy"][seed % 3]
    x = rand(d, seed=seed, kind=kind)
    codec = TopKCodec(ratio)
    k = codec.k(d)
    p = codec.encode(x)
    idx = p.arrays["indices"].astype(np.int64)
    assert idx.size == k and np.all(np.diff(idx) > 0)
    assert np.array_equal(idx, topk_reference(x, k))
    a = np.abs(x)
    kept = np.zeros(d, bool)
    kept[idx] = True
    if k < d:
        assert a[kept].min() >= a[~kept].max()  # nothing dropped is larger than anything kept
    y = codec.decode(p, d)
    assert np.count_nonzero(y) <= k
    assert np.array_equal(y[kept], x[kept]) and np.all(y[~kept] == 0)


def test_topk_ties_lowest_index_wins():
    x = np.array([1, -2, 2, 0, -2, 2, 1], dtype=np.float32)
    p = TopKCodec(3 / 7).encode(x)  # k = 3; |x| = 2 at 1, 2, 4, 5
    assert p.arrays["indices"].tolist() == [1, 2, 4]
    assert p.arrays["values"].tolist() == [-2, 2, -2]
    p = TopKCodec(0.5).encode(np.ones(10, np.float32))
    assert p.arrays["indices"].tolist() == [0, 1, 2, 3, 4]


def test_topk_is_deterministic_under_repeats():
    x = rand(50_000, seed=9, kind="ties")
    a = TopKCodec(1 / 64).encode(x)
    b = TopKCodec(1 / 64).encode(x.copy())
    assert all(np.array_equal(a.arrays[k], b.arrays[k]) for k in a.arrays)


@pytest.mark.parametrize("ratio", [1 / 256, 1 / 128, 1 / 64, 0.25, 1.0])
@pytest.mark.parametrize("kind", ["normal", "ties", "heavy"])
def test_topk_error_bound(ratio, kind):
    """||C(x) - x||^2 <= (1 - k/d) ||x||^2 (fedcams §3.7)."""
    for d in (1, 5, 100, 4099, 70_000):
        x = rand(d, seed=d, kind=kind).astype(np.float64)  # float32 values, float64 arithmetic
        codec = TopKCodec(ratio)
        y = codec.decode(codec.encode(x), d).astype(np.float64)
        k = codec.k(d)
        assert np.sum((y - x) ** 2) <= (1 - k / d) * np.sum(x**2) * (1 + 1e-6) + 1e-30


@pytest.mark.parametrize(
    "d, dtype",
    [
        (1, np.uint8),
        (200, np.uint8),
        (256, np.uint8),
        (257, np.uint16),
        (65_536, np.uint16),
        (65_537, np.uint32),
        (70_000, np.uint32),
        (5_000_000, np.uint32),
        (2**32, np.uint32),
        (2**32 + 1, np.uint64),
    ],
)
def test_index_dtype_is_narrowest(d, dtype):
    assert index_dtype(d) == np.dtype(dtype)


@pytest.mark.parametrize("d, dtype", [(200, np.uint8), (70_000, np.uint32), (5_000_000, np.uint32)])
def test_topk_payload_uses_narrowest_index_dtype(d, dtype):
    x = rand(d, seed=1)
    codec = TopKCodec(1 / 64)
    p = codec.encode(x)
    assert p.arrays["indices"].dtype == np.dtype(dtype)
    assert p.arrays["values"].dtype == np.float32
    assert p.nbytes == codec.k(d) * (np.dtype(dtype).itemsize + 4) == codec.payload_bytes(d)
    assert np.array_equal(decode_payload(p, d)[p.arrays["indices"]], x[p.arrays["indices"]])


@pytest.mark.parametrize("ratio", [0, -0.5, 1.5, float("nan"), float("inf"), True, "0.1", None])
def test_topk_ratio_validated(ratio):
    if ratio is None:  # None is allowed: a decode-only codec; it cannot encode
        with pytest.raises(ValueError, match="decode-only"):
            TopKCodec(None).encode(rand(10))
        return
    with pytest.raises(ValueError, match="ratio"):
        TopKCodec(ratio)


# ----------------------------------------------------------------------------------------------------
# Paper bit counts (fedcams §3.7, §7.1.2, Table 2)
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("d", DIMS + [11_173_962])
def test_theoretical_bits(d):
    assert IdentityCodec().theoretical_bits(d) == 32 * d
    assert FP16Codec().theoretical_bits(d) == 16 * d
    assert SignCodec().theoretical_bits(d) == d + 32
    for r in (1 / 64, 1 / 128, 1 / 256):
        assert TopKCodec(r).theoretical_bits(d) == 64 * max(math.floor(r * d), 1)


def test_table2_bit_counts():
    """Every Table 2 entry from the codecs' bit counts: d = 11,173,962, T = 500, one client link."""
    d, T = 11_173_962, 500
    dense = IdentityCodec().theoretical_bits(d)
    assert f"{dense * 2 * T:.2e}" == "3.58e+11"
    expect = {  # codec: (one-way = compressed up + dense down, two-way = compressed both ways)
        SignCodec(): ("1.84e+11", "1.12e+10"),
        TopKCodec(1 / 64): ("1.84e+11", "1.12e+10"),
        TopKCodec(1 / 128): ("1.82e+11", "5.59e+09"),
        TopKCodec(1 / 256): ("1.80e+11", "2.79e+09"),
    }
    for codec, (one_way, two_way) in expect.items():
        up = codec.theoretical_bits(d)
        assert f"{(up + dense) * T:.2e}" == one_way, codec
        assert f"{up * 2 * T:.2e}" == two_way, codec


def test_sign_and_topk_64_cost_about_the_same():
    d = 11_173_962
    assert abs(SignCodec().theoretical_bits(d) - TopKCodec(1 / 64).theoretical_bits(d)) < 100


# ----------------------------------------------------------------------------------------------------
# Granularity
# ----------------------------------------------------------------------------------------------------

SEGMENTS = [(0, 5), (5, 64), (64, 65), (65, 300)]


def test_per_tensor_sign_is_sign_of_each_segment():
    x = rand(300, seed=4)
    x[65:] *= 100.0
    codec = make_codec("sign", granularity="tensor", segments=SEGMENTS)
    assert isinstance(codec, PerTensorCodec) and codec.name == "sign/tensor"
    p = codec.encode(x)
    assert p.codec == "sign/tensor"
    assert sorted(p.arrays) == sorted(f"{i}.{k}" for i in range(4) for k in ("bits", "scale"))
    y = codec.decode(p, 300)
    for start, stop in SEGMENTS:
        np.testing.assert_allclose(y[start:stop], sign_reference(x[start:stop]), rtol=1e-6)
    assert p.nbytes == codec.payload_bytes(300) == sum(math.ceil((b - a) / 8) + 4 for a, b in SEGMENTS)
    assert codec.theoretical_bits(300) == 300 + 32 * len(SEGMENTS)
    # per tensor is a more accurate compressor here than one scale for the whole model
    whole = make_codec("sign").decode(make_codec("sign").encode(x), 300)
    assert np.sum((y - x) ** 2) < np.sum((whole - x) ** 2)


def test_per_tensor_topk_is_topk_of_each_segment():
    x = rand(300, seed=6, kind="ties")
    mixed = [slice(0, 5), slice(5, 64), (64, 65), (65, 300)]  # slices and pairs both accepted
    codec = make_codec("topk", topk_ratio=0.1, granularity="tensor", segments=mixed)
    assert codec.name == "topk/tensor"
    p = codec.encode(x)
    y = codec.decode(p, 300)
    for i, (start, stop) in enumerate(SEGMENTS):
        k = topk_count(0.1, stop - start)
        assert p.arrays[f"{i}.indices"].size == k
        ref = np.zeros(stop - start, np.float32)
        idx = topk_reference(x[start:stop], k)
        ref[idx] = x[start:stop][idx]
        assert np.array_equal(y[start:stop], ref)
    assert p.nbytes == codec.payload_bytes(300)
    assert codec.theoretical_bits(300) == sum(64 * topk_count(0.1, b - a) for a, b in SEGMENTS)
    assert np.array_equal(decode_payload(p, 300, segments=SEGMENTS), y)


def test_per_tensor_encode_checks_length():
    codec = make_codec("sign", granularity="tensor", segments=SEGMENTS)
    with pytest.raises(ValueError, match="segments"):
        codec.encode(rand(299))
    with pytest.raises(ValueError, match="segments"):
        codec.payload_bytes(301)


def test_elementwise_codecs_are_the_same_at_both_granularities():
    for name, cls in (("none", IdentityCodec), ("fp16", FP16Codec)):
        assert type(make_codec(name, granularity="tensor", segments=SEGMENTS)) is cls


def test_model_granularity_is_default_and_ignores_segments():
    assert type(make_codec("sign")) is SignCodec
    assert type(make_codec("sign", segments=SEGMENTS)) is SignCodec
    assert make_codec("topk", topk_ratio=1 / 128).ratio == 1 / 128


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(name="gzip"), "unknown codec"),
        (dict(name="sign", granularity="layer"), "unknown granularity"),
        (dict(name="sign", granularity="tensor"), "needs segments"),
        (dict(name="sign", granularity="tensor", segments=[]), "non-empty"),
        (dict(name="sign", granularity="tensor", segments=[(1, 5)]), "starts at 1"),
        (dict(name="sign", granularity="tensor", segments=[(0, 5), (6, 9)]), "starts at 6"),
        (dict(name="sign", granularity="tensor", segments=[(0, 5), (4, 9)]), "starts at 4"),
        (dict(name="sign", granularity="tensor", segments=[(0, 5), (5, 5)]), "empty"),
        (dict(name="sign", granularity="tensor", segments=[(0, 5.0)]), "integers"),
        (dict(name="sign", granularity="tensor", segments=[slice(0, 4, 2)]), "step"),
        (dict(name="fp16", granularity="tensor", segments=[(0, 3), (2, 5)]), "starts at 2"),
        (dict(name="topk", topk_ratio=2.0), "ratio"),
    ],
)
def test_make_codec_rejects_bad_settings(kwargs, match):
    name = kwargs.pop("name")
    with pytest.raises(ValueError, match=match):
        make_codec(name, **kwargs)


def test_codecs_tuple_and_names():
    assert CODECS == ("none", "sign", "topk", "fp16")
    for name in CODECS:
        assert make_codec(name).name == name


# ----------------------------------------------------------------------------------------------------
# decode_payload: the server's entry point
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("codec", all_codecs(), ids=repr)
def test_decode_payload_dispatches_on_codec_name(codec):
    x = rand(1000, seed=8)
    p = codec.encode(x)
    assert np.array_equal(decode_payload(p, 1000), codec.decode(p, 1000))


def test_decode_payload_reads_topk_count_from_payload():
    x = rand(1000, seed=8)
    p = TopKCodec(1 / 32).encode(x)  # k = 31
    assert np.count_nonzero(decode_payload(p, 1000)) == 31
    with pytest.raises(PayloadError, match="expected k = 15"):
        TopKCodec(1 / 64).decode(p, 1000)  # a configured decoder insists on its own k


def test_payload_is_frozen_and_counts_bytes():
    p = Payload("none", 3, {"values": np.zeros(3, np.float32)})
    assert p.nbytes == 12
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.dim = 4  # type: ignore[misc]
