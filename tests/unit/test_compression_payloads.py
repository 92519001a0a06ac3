"""Untrusted payloads: every malformed payload is rejected with a PayloadError that says why (DESIGN.md)."""

from __future__ import annotations

import numpy as np
import pytest

from pollen.compression import (
    FP16Codec,
    IdentityCodec,
    Payload,
    PayloadError,
    SignCodec,
    TopKCodec,
    decode_payload,
    make_codec,
)

D = 200  # top-k indices are uint8, so an out-of-range index (200..255) is representable


def x_vec(d: int = D) -> np.ndarray:
    return np.random.default_rng(0).standard_normal(d).astype(np.float32)


def with_arrays(p: Payload, **changes) -> Payload:
    """A copy of ``p`` with arrays replaced (value) or removed (None)."""
    arrays = dict(p.arrays)
    for k, v in changes.items():
        if v is None:
            arrays.pop(k, None)
        else:
            arrays[k] = v
    return Payload(p.codec, p.dim, arrays)


def rejects(p: Payload, match: str, dim: int = D, codec=None, segments=None) -> None:
    """Both the server's decode_payload and the codec's own decode reject ``p`` with ``match``."""
    with pytest.raises(PayloadError, match=match):
        decode_payload(p, dim, segments=segments)
    if codec is not None:
        with pytest.raises(PayloadError, match=match):
            codec.decode(p, dim)


SIGN = SignCodec().encode(x_vec())
TOPK = TopKCodec(1 / 16).encode(x_vec())
NONE = IdentityCodec().encode(x_vec())
FP16 = FP16Codec().encode(x_vec())


# ----------------------------------------------------------------------------------------------------
# Header: type, codec name, dim
# ----------------------------------------------------------------------------------------------------


def test_not_a_payload():
    with pytest.raises(PayloadError, match="expected a Payload"):
        decode_payload({"bits": SIGN.arrays["bits"]}, D)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["gzip", "SIGN", "sign/layer", "", "/tensor", "topk/tensor/x"])
def test_unknown_codec(name):
    rejects(Payload(name, D, dict(SIGN.arrays)), "unknown codec")


def test_codec_mismatch_on_a_codec_instance():
    with pytest.raises(PayloadError, match="payload codec is 'topk', expected 'sign'"):
        SignCodec().decode(TOPK, D)


@pytest.mark.parametrize(
    "p, codec", [(SIGN, SignCodec()), (TOPK, TopKCodec(1 / 16)), (NONE, IdentityCodec()), (FP16, FP16Codec())]
)
def test_wrong_dim(p, codec):
    rejects(p, f"payload dim is {D}, expected {D + 8}", dim=D + 8, codec=codec)
    rejects(Payload(p.codec, -D, dict(p.arrays)), f"payload dim is {-D}, expected {D}", codec=codec)
    rejects(Payload(p.codec, float(D), dict(p.arrays)), "payload dim must be an integer", codec=codec)
    rejects(p, "dim must be positive", dim=0, codec=codec)
    rejects(p, "dim must be positive", dim=-3, codec=codec)


# ----------------------------------------------------------------------------------------------------
# Scaled sign
# ----------------------------------------------------------------------------------------------------


def test_sign_truncated_bits():
    rejects(with_arrays(SIGN, bits=SIGN.arrays["bits"][:-1]), "'bits' has length 24, expected 25", codec=SignCodec())


def test_sign_too_many_bits():
    extra = np.concatenate([SIGN.arrays["bits"], np.zeros(1, np.uint8)])
    rejects(with_arrays(SIGN, bits=extra), "'bits' has length 26, expected 25")


def test_sign_nonzero_padding_bits():
    p = SignCodec().encode(x_vec(13))  # 2 bytes, 3 padding bits
    bits = p.arrays["bits"].copy()
    bits[-1] |= 0b001
    rejects(with_arrays(p, bits=bits), "padding bit", dim=13, codec=SignCodec())


@pytest.mark.parametrize(
    "scale, match", [(np.nan, "'scale' is nan"), (np.inf, "'scale' is inf"), (-1.0, "'scale' is -1.0")]
)
def test_sign_bad_scale_value(scale, match):
    rejects(with_arrays(SIGN, scale=np.array([scale], np.float32)), match, codec=SignCodec())


def test_sign_scale_wrong_length_or_dtype():
    rejects(with_arrays(SIGN, scale=np.ones(2, np.float32)), "'scale' has length 2, expected 1")
    rejects(with_arrays(SIGN, scale=np.zeros(0, np.float32)), "'scale' has length 0, expected 1")
    rejects(with_arrays(SIGN, scale=np.ones(1, np.float64)), "'scale' has dtype float64, expected float32")


def test_sign_bits_wrong_dtype_or_shape():
    rejects(with_arrays(SIGN, bits=SIGN.arrays["bits"].view(np.int8)), "'bits' has dtype int8, expected uint8")
    rejects(with_arrays(SIGN, bits=SIGN.arrays["bits"].reshape(5, 5)), "must be 1-D")
    rejects(with_arrays(SIGN, bits=SIGN.arrays["bits"].tolist()), "must be a numpy array")


def test_sign_missing_or_extra_arrays():
    rejects(with_arrays(SIGN, scale=None), r"missing \['scale'\]", codec=SignCodec())
    rejects(with_arrays(SIGN, extra=np.zeros(1, np.uint8)), r"unexpected \['extra'\]", codec=SignCodec())


# ----------------------------------------------------------------------------------------------------
# Top-k
# ----------------------------------------------------------------------------------------------------


def test_topk_index_out_of_range():
    idx = TOPK.arrays["indices"].copy()
    idx[-1] = D  # 200 fits in uint8 but not in the vector
    rejects(with_arrays(TOPK, indices=idx), "index 200 out of range", codec=TopKCodec(1 / 16))


def test_topk_duplicate_and_unsorted_indices():
    idx = TOPK.arrays["indices"].copy()
    idx[3] = idx[2]
    rejects(with_arrays(TOPK, indices=idx), "duplicate at position 3")
    idx = TOPK.arrays["indices"][::-1].copy()
    rejects(with_arrays(TOPK, indices=idx), "unsorted at position 1")


def test_topk_count_mismatch_and_empty():
    rejects(with_arrays(TOPK, values=TOPK.arrays["values"][:-1]), "12 indices but 11 values")
    rejects(with_arrays(TOPK, indices=TOPK.arrays["indices"][:-1]), "11 indices but 12 values")
    rejects(
        with_arrays(TOPK, indices=np.zeros(0, np.uint8), values=np.zeros(0, np.float32)),
        "empty; expected at least 1",
    )
    rejects(
        Payload("topk", 4, {"indices": np.arange(5, dtype=np.uint8), "values": np.ones(5, np.float32)}),
        "5 entries; expected at most dim = 4",
        dim=4,
    )


def test_topk_wrong_index_dtype():
    rejects(with_arrays(TOPK, indices=TOPK.arrays["indices"].astype(np.uint16)), "dtype uint16, expected uint8")
    rejects(with_arrays(TOPK, indices=TOPK.arrays["indices"].astype(np.int64)), "dtype int64, expected uint8")
    rejects(with_arrays(TOPK, values=TOPK.arrays["values"].astype(np.float64)), "dtype float64, expected float32")


def test_topk_non_finite_values():
    v = TOPK.arrays["values"].copy()
    v[0] = np.nan
    rejects(with_arrays(TOPK, values=v), "'values' holds 1 NaN/Inf")
    v[1] = -np.inf
    rejects(with_arrays(TOPK, values=v), "'values' holds 2 NaN/Inf")


def test_topk_configured_count():
    with pytest.raises(PayloadError, match="expected k = 3"):
        TopKCodec(1 / 64).decode(TOPK, D)


# ----------------------------------------------------------------------------------------------------
# Dense codecs
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("p, dtype, other", [(NONE, "float32", np.float16), (FP16, "float16", np.float32)])
def test_dense_wrong_length_dtype_and_non_finite(p, dtype, other):
    v = p.arrays["values"]
    rejects(with_arrays(p, values=v[:-1]), f"'values' has length {D - 1}, expected {D}")
    rejects(with_arrays(p, values=v.astype(other)), f"expected {dtype}")
    bad = v.copy()
    bad[5] = np.inf
    rejects(with_arrays(p, values=bad), "NaN/Inf")
    rejects(with_arrays(p, values=None), "missing")


# ----------------------------------------------------------------------------------------------------
# Per-tensor
# ----------------------------------------------------------------------------------------------------

SEGS = [(0, 50), (50, 51), (51, 200)]


def test_per_tensor_errors_name_the_segment():
    codec = make_codec("sign", granularity="tensor", segments=SEGS)
    p = codec.encode(x_vec())
    nan_scale = with_arrays(p, **{"1.scale": np.array([np.nan], np.float32)})
    rejects(nan_scale, r"segment 1 \[50:51\].*'scale' is nan", segments=SEGS, codec=codec)
    short_bits = with_arrays(p, **{"2.bits": p.arrays["2.bits"][:-1]})
    rejects(short_bits, r"segment 2 \[51:200\].*'bits' has length", segments=SEGS)
    rejects(with_arrays(p, **{"0.bits": None}), r"missing \['0.bits'\]", segments=SEGS)
    rejects(with_arrays(p, **{"3.bits": np.zeros(1, np.uint8)}), r"unexpected \['3.bits'\]", segments=SEGS)


def test_per_tensor_needs_matching_segments():
    p = make_codec("topk", topk_ratio=0.1, granularity="tensor", segments=SEGS).encode(x_vec())
    rejects(p, "no segments were given")
    rejects(p, "cover 190 entries", segments=[(0, 50), (50, 190)])
    rejects(p, "segments must tile", segments=[(0, 50), (60, 200)])
    rejects(p, r"unexpected \['2.indices', '2.values'\]", segments=[(0, 100), (100, 200)])


def test_whole_model_payload_sent_to_a_per_tensor_decoder():
    codec = make_codec("sign", granularity="tensor", segments=SEGS)
    with pytest.raises(PayloadError, match="payload codec is 'sign', expected 'sign/tensor'"):
        codec.decode(SIGN, D)


# ----------------------------------------------------------------------------------------------------
# Fuzz: a corrupted payload either decodes to a finite float32 vector of the right length or raises
# PayloadError; never another exception, never NaN.
# ----------------------------------------------------------------------------------------------------


def _mutate(p: Payload, rng: np.random.Generator) -> Payload:
    arrays = {k: v.copy() for k, v in p.arrays.items()}
    key = sorted(arrays)[int(rng.integers(len(arrays)))]
    a = arrays[key]
    op = int(rng.integers(8))
    if op == 0:  # random bytes of the same dtype and length (may make NaN/Inf, bad indices, padding)
        arrays[key] = np.frombuffer(rng.bytes(a.nbytes), dtype=a.dtype).copy()
    elif op == 1:
        arrays[key] = a[: int(rng.integers(a.size + 1))]
    elif op == 2:
        arrays[key] = np.concatenate([a, a[:1]])
    elif op == 3:
        arrays[key] = a.astype(
            rng.choice([np.uint8, np.uint16, np.uint32, np.int64, np.float16, np.float32, np.float64])
        )
    elif op == 4:
        del arrays[key]
    elif op == 5:
        arrays["junk"] = np.zeros(2, np.uint8)
    elif op == 6:
        return Payload(p.codec, int(p.dim + rng.integers(-9, 10)), arrays)
    else:  # flip one random bit
        raw = bytearray(a.tobytes())
        if raw:
            i = int(rng.integers(len(raw)))
            raw[i] ^= 1 << int(rng.integers(8))
        arrays[key] = np.frombuffer(bytes(raw), dtype=a.dtype).copy()
    return Payload(p.codec, p.dim, arrays)


@pytest.mark.parametrize("seed", range(4))
def test_fuzzed_payloads_decode_or_raise_payload_error(seed):
    rng = np.random.default_rng(seed)
    segs = [(0, 13), (13, 14), (14, D)]
    codecs = [
        (SignCodec(), None),
        (TopKCodec(1 / 16), None),
        (TopKCodec(0.5), None),
        (IdentityCodec(), None),
        (FP16Codec(), None),
        (make_codec("sign", granularity="tensor", segments=segs), segs),
        (make_codec("topk", topk_ratio=0.2, granularity="tensor", segments=segs), segs),
    ]
    outcomes = {"ok": 0, "rejected": 0}
    for _ in range(300):
        codec, s = codecs[int(rng.integers(len(codecs)))]
        p = _mutate(codec.encode(x_vec()), rng)
        try:
            y = decode_payload(p, D, segments=s)
        except PayloadError:
            outcomes["rejected"] += 1
            continue
        assert y.dtype == np.float32 and y.shape == (D,) and np.isfinite(y).all()
        outcomes["ok"] += 1
    assert outcomes["ok"] > 0 and outcomes["rejected"] > 0
