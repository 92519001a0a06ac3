"""Decoding a payload into a reused buffer (``decode_payload(..., out=)``): the same bits as a new vector.

The server decodes every compressed reply into one reused float32 vector instead of a new d-size array a
reply (issue 41: at ResNet-18 size the new array and its page faults were about 6 ms of a sign reply's 9);
the scaled sign is decoded by a look-up of each byte's eight values. Both must give exactly the vector the
wire format defines.
"""

from __future__ import annotations

import numpy as np
import pytest

from pollen.compression import decode_payload, make_codec
from pollen.compression.codecs import PerTensorCodec, SignCodec


def bits_of(values: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(values).view(np.uint32)


def sign_reference(bits: np.ndarray, scale: np.float32, dim: int) -> np.ndarray:
    """The scaled sign as its docstring defines it: ``+scale`` where the bit is 1, ``-scale`` where it is 0."""
    signs = np.unpackbits(bits, count=dim).astype(np.float32) * np.float32(2) - np.float32(1)
    return signs * scale


@pytest.mark.parametrize("dim", [1, 7, 8, 9, 2048, 8 * 70_000 + 5])  # the last spans several look-up blocks
@pytest.mark.parametrize("scale", [0.0, 1.5e-3, 3.0e38])
def test_every_byte_of_a_sign_payload_decodes_to_its_eight_signs(dim: int, scale: float) -> None:
    rng = np.random.default_rng(dim)
    bits = np.packbits(rng.integers(0, 2, dim).astype(bool))
    if dim >= 2048:
        bits[:256] = np.arange(256, dtype=np.uint8)  # every byte value at least once
    payload = SignCodec().encode(np.ones(dim, np.float32))  # a valid header; arrays replaced below
    payload.arrays["bits"], payload.arrays["scale"] = bits, np.array([scale], np.float32)
    expected = sign_reference(bits, np.float32(scale), dim)
    fresh = decode_payload(payload, dim)
    into = np.full(dim, np.nan, np.float32)
    assert decode_payload(payload, dim, out=into) is into
    assert np.array_equal(bits_of(fresh), bits_of(expected))  # signed zeros included when the scale is 0
    assert np.array_equal(bits_of(into), bits_of(expected))


@pytest.mark.parametrize("name", ["none", "fp16", "sign", "topk"])
def test_each_codec_decodes_into_a_dirty_buffer_exactly_as_into_a_new_one(name: str) -> None:
    rng = np.random.default_rng(3)
    dim = 1000
    x = rng.standard_normal(dim).astype(np.float32)
    codec = make_codec(name, **({"topk_ratio": 0.05} if name == "topk" else {}))
    payload = codec.encode(x)
    out = rng.standard_normal(dim).astype(np.float32)  # a previous reply's values
    assert decode_payload(payload, dim, out=out) is out
    assert np.array_equal(bits_of(out), bits_of(decode_payload(payload, dim)))


@pytest.mark.parametrize("inner", ["sign", "topk"])
def test_a_per_tensor_payload_decodes_each_tensor_in_place(inner: str) -> None:
    segments = [(0, 13), (13, 300), (300, 301), (301, 1000)]
    x = np.random.default_rng(4).standard_normal(1000).astype(np.float32)
    codec = PerTensorCodec(make_codec(inner, **({"topk_ratio": 0.1} if inner == "topk" else {})), segments)
    payload = codec.encode(x)
    out = np.full(1000, 7.0, np.float32)
    decode_payload(payload, 1000, segments=segments, out=out)
    for start, stop in segments:
        part = make_codec(inner, **({"topk_ratio": 0.1} if inner == "topk" else {})).encode(x[start:stop])
        assert np.array_equal(bits_of(out[start:stop]), bits_of(decode_payload(part, stop - start)))


@pytest.mark.parametrize(
    "out",
    [np.empty(999, np.float32), np.empty(1000, np.float64), np.empty(2000, np.float32)[::2]],
    ids=["short", "float64", "strided"],
)
def test_a_buffer_of_the_wrong_shape_or_kind_is_refused_with_what_is_allowed(out: np.ndarray) -> None:
    payload = SignCodec().encode(np.ones(1000, np.float32))
    with pytest.raises(ValueError, match="contiguous float32 vector of length 1000"):
        decode_payload(payload, 1000, out=out)
