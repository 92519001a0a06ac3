"""FedAdaVR-Quant quantiser (spec papers/fedadavr.md section 3.7 and check 6.A.1)."""

import numpy as np
import pytest

from pollen.compression import quant
from pollen.compression.quant import PRECISIONS, dequantize, pack_int4, quantize, stored_bytes, unpack_int4

SHAPES = [(6, 1, 5, 5), (120, 256), (7,), (84,), (1,), (3, 3)]
LENET = [150, 6, 2400, 16, 30720, 120, 10080, 84, 840, 10]  # niid_bench CNNMnist, d = 44,426


def _tensor(shape, seed, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_round_trip_keeps_shape_and_dtype(shape, precision):
    x = _tensor(shape, 0)
    q = quantize(x, precision)
    y = dequantize(q)
    assert y.shape == x.shape and y.dtype == np.float32
    assert q.length == x.size and q.shape == x.shape


@pytest.mark.parametrize("shape", SHAPES)
def test_fp32_is_exact(shape):
    x = _tensor(shape, 1)
    np.testing.assert_array_equal(dequantize(quantize(x, "fp32")), x)


@pytest.mark.parametrize("shape", SHAPES)
def test_fp16_relative_error_bound(shape):
    rng = np.random.default_rng(2)
    # normal fp16 range: magnitudes in [1e-4, 1e4]
    x = (rng.choice([-1, 1], size=shape) * 10.0 ** rng.uniform(-4, 4, size=shape)).astype(np.float32)
    y = dequantize(quantize(x, "fp16"))
    assert np.max(np.abs(y - x) / np.abs(x)) <= 2.0**-11


@pytest.mark.parametrize("precision,denominator", [("int8", 254), ("int4", 14)])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("scale", [1e-6, 1.0, 1e3])
def test_integer_error_bound(precision, denominator, shape, scale):
    for seed in range(5):
        x = _tensor(shape, seed, scale)
        y = dequantize(quantize(x, precision))
        m = np.max(np.abs(x))
        # alpha/2 = max|W|/(2 qmax), plus float32 rounding of the output (<= 2**-24 max|W|)
        assert np.max(np.abs(y - x)) <= m / denominator * (1 + 1e-4)


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_largest_magnitude_element_is_exact(precision):
    # A float32 alpha = max/qmax would miss by one ulp for ~0.5% (int8) / ~8% (int4) of these tensors.
    rng = np.random.default_rng(3)
    for seed in range(3000):
        n = int(rng.integers(1, 40))
        x = _tensor((n,), seed, float(10.0 ** rng.uniform(-8, 4)))
        i = int(np.argmax(np.abs(x)))
        y = dequantize(quantize(x, precision))
        assert y[i] == x[i], (seed, x[i], y[i])


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("n", [1, 7, 8, 150])
def test_all_zero_tensor(precision, n):
    q = quantize(np.zeros(n, dtype=np.float32), precision)
    assert q.scale == 1.0
    y = dequantize(q)
    np.testing.assert_array_equal(y, np.zeros(n, dtype=np.float32))
    if precision == "int4":
        assert np.all(q.data == 0x88)  # every nibble is the zero code 8, the pad too


def test_int_codes_range_and_scale():
    x = _tensor((1000,), 4)
    m = float(np.max(np.abs(x)))
    q8 = quantize(x, "int8")
    assert q8.data.dtype == np.int8 and q8.data.min() >= -127 and q8.data.max() <= 127
    assert abs(q8.data).max() == 127 and q8.scale == pytest.approx(m / 127, rel=1e-12)
    q4 = quantize(x, "int4")
    codes = unpack_int4(q4.data, x.size)
    assert codes.min() >= -7 and codes.max() <= 7 and abs(codes).max() == 7
    assert q4.scale == pytest.approx(m / 7, rel=1e-12)
    nibbles = np.concatenate([q4.data >> 4, q4.data & 0x0F])
    assert nibbles.min() >= 1 and nibbles.max() <= 15


def test_int4_packing_order_by_hand():
    # values -7, 7, 0, 1, -1 -> codes 1, 15, 8, 9, 7 (+ pad 8): even index in the HIGH nibble
    packed = pack_int4(np.array([-7, 7, 0, 1, -1]))
    assert packed.dtype == np.uint8
    assert packed.tolist() == [0x1F, 0x89, 0x78]
    np.testing.assert_array_equal(unpack_int4(packed, 5), [-7, 7, 0, 1, -1])


def test_int4_quantize_by_hand_half_to_even():
    # alpha = 1/7: W/alpha = 7, -7, 3.5, 0, 1.75 -> rint (half-to-even) 7, -7, 4, 0, 2 -> codes 15, 1, 12, 8, 10
    q = quantize(np.array([1.0, -1.0, 0.5, 0.0, 0.25], dtype=np.float32), "int4")
    assert q.data.tolist() == [0xF1, 0xC8, 0xA8]
    assert q.absmax == 1.0
    np.testing.assert_allclose(dequantize(q), np.array([7, -7, 4, 0, 2]) / 7, rtol=1e-7)


def test_int8_by_hand():
    q = quantize(np.array([-2.0, 1.0, 0.0079, 2.0], dtype=np.float32), "int8")
    # alpha = 2/127: codes rint(-127), rint(63.5)=64 (half-to-even), rint(0.5017)=1, 127
    assert q.data.tolist() == [-127, 64, 1, 127]


@pytest.mark.parametrize("n", [1, 2, 7, 8, 150, 30720, 30721])
def test_stored_bytes_exact(n):
    x = _tensor((n,), 5)
    fp32 = 4 * n
    assert stored_bytes(quantize(x, "fp32")) == fp32
    assert stored_bytes(quantize(x, "fp16")) * 2 == fp32  # exactly 1/2
    assert stored_bytes(quantize(x, "int8")) == fp32 / 4 + 4  # exactly 1/4 + 4 B
    assert stored_bytes(quantize(x, "int4")) == (n + 1) // 2 + 4  # 1/8 (+ pad nibble) + 4 B
    if n % 2 == 0:
        assert stored_bytes(quantize(x, "int4")) == fp32 / 8 + 4
    for p in PRECISIONS:
        assert quant.stored_nbytes(n, p) == stored_bytes(quantize(x, p))


def test_stored_bytes_ratios_from_spec():
    # 150-element conv kernel: 0.2567 / 0.1317; 30k FC: 0.2500 / 0.1250; LeNet whole model: 25.02% / 12.52%
    def ratio(sizes, p):
        return sum(stored_bytes(quantize(np.ones(n, np.float32), p)) for n in sizes) / (4 * sum(sizes))

    assert round(ratio([150], "int8"), 4) == 0.2567 and round(ratio([150], "int4"), 4) == 0.1317
    assert round(ratio([30720], "int8"), 4) == 0.2500 and round(ratio([30720], "int4"), 4) == 0.1250
    assert round(100 * ratio(LENET, "int8"), 2) == 25.02 and round(100 * ratio(LENET, "int4"), 2) == 12.52


@pytest.mark.parametrize("n", [1, 2, 3, 8, 9, 101])
def test_pack_unpack_round_trip_odd_lengths(n):
    v = np.random.default_rng(n).integers(-7, 8, size=n)
    p = pack_int4(v)
    assert p.size == (n + 1) // 2
    if n % 2:
        assert p[-1] & 0x0F == 8  # pad nibble = value 0
    np.testing.assert_array_equal(unpack_int4(p, n), v)


def test_pack_rejects_out_of_range_and_unpack_rejects_wrong_length():
    with pytest.raises(ValueError):
        pack_int4(np.array([8]))
    with pytest.raises(ValueError):
        unpack_int4(np.zeros(2, np.uint8), 5)


def test_fp16_saturates_instead_of_inf():
    y = dequantize(quantize(np.array([1e6, -1e6, 1.0], np.float32), "fp16"))
    assert y.tolist() == [65504.0, -65504.0, 1.0]


def test_rejects_nan_and_unknown_precision():
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize(np.array([1.0, np.nan], np.float32), "int8")
    with pytest.raises(ValueError, match="allowed: fp32, fp16, int8, int4"):
        quantize(np.ones(3, np.float32), "int2")


def test_float64_input_is_accepted():
    x = np.linspace(-1, 1, 11)
    y = dequantize(quantize(x, "int8"))
    assert y.dtype == np.float32 and np.max(np.abs(y - x)) <= 1 / 254 * (1 + 1e-4)


def _reference_codes(x: np.ndarray, precision: str) -> tuple[np.ndarray, float]:
    """The element-wise definition, whole tensor at once: clip(rint(x * qmax / absmax)) in float64."""
    qmax = {"int8": 127, "int4": 7}[precision]
    absmax = float(np.float32(np.max(np.abs(x)))) if x.size else 0.0
    if absmax == 0.0:
        return np.zeros(x.size, np.int8), 0.0
    return np.clip(np.rint(x.astype(np.float64) * (qmax / absmax)), -qmax, qmax).astype(np.int8), absmax


@pytest.mark.parametrize("precision", ["int8", "int4"])
@pytest.mark.parametrize("n", [1, 2, 5, 65_535, 65_536, 65_537, 131_075])
def test_chunked_encoder_and_table_decoder_equal_the_elementwise_definition(precision, n):
    """Encoding a chunk at a time and decoding by look-up table give exactly the element-wise formulas,
    across chunk borders and for odd lengths (int4's pad nibble)."""
    from pollen.compression import quant

    rng = np.random.default_rng(n)
    x = (rng.standard_normal(n) * 10.0 ** rng.uniform(-4, 4)).astype(np.float32)
    q = quantize(x, precision)
    codes, absmax = _reference_codes(x, precision)
    assert q.absmax == absmax
    stored = unpack_int4(q.data, n) if precision == "int4" else q.data
    np.testing.assert_array_equal(stored, codes)
    qmax = {"int8": 127, "int4": 7}[precision]
    want = (codes.astype(np.float64) * absmax / qmax).astype(np.float32)
    np.testing.assert_array_equal(dequantize(q).view(np.uint32), want.view(np.uint32))
    with pytest.raises(ValueError, match="cannot hold"):
        quant.decode(np.concatenate([q.data, q.data[:1]]), precision, q.absmax, n)
