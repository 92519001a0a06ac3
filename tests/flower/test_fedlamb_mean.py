"""The server's mean of the uploaded second moments (Fed-LAMB) or gradients (Mime), formed a block at a time.

``mean_float64`` replaced ``np.mean(np.stack(stats), axis=0, dtype=np.float64)``: the saved ``v_hat`` of every
run depends on its bits, so it must equal NumPy's mean exactly, for any count of uploads, any length (blocks
and their remainders) and values across float32's range.
"""

from __future__ import annotations

import numpy as np
import pytest

from pollen.strategies.fedlamb import _MEAN_BLOCK, _as_float32, mean_float64

pytestmark = pytest.mark.flower_compat


@pytest.mark.parametrize("count", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("dim", [1, 7, _MEAN_BLOCK, _MEAN_BLOCK + 1, 3 * _MEAN_BLOCK - 5])
def test_equals_numpys_mean_of_the_stack_bit_for_bit(count: int, dim: int) -> None:
    rng = np.random.default_rng(count * 100_003 + dim)
    stats = [(rng.standard_normal(dim) * 10.0 ** rng.integers(-30, 30, dim)).astype(np.float32) for _ in range(count)]
    expected = np.mean(np.stack(stats), axis=0, dtype=np.float64)
    got = mean_float64(stats)
    assert got.dtype == np.float64
    assert got.tobytes() == expected.tobytes()


@pytest.mark.parametrize("count", [1, 2, 3])
def test_signed_zeros_and_subnormals_come_out_as_numpys(count: int) -> None:
    values = np.array([-0.0, 0.0, -0.0, 1e-45, -1e-45, 1.0], dtype=np.float32)
    stats = [values.copy() for _ in range(count)]
    stats[0][1] = -0.0  # a column of -0.0 with one +0.0 elsewhere
    expected = np.mean(np.stack(stats), axis=0, dtype=np.float64)
    got = mean_float64(stats)
    assert got.tobytes() == expected.tobytes()
    assert np.signbit(got[0]) == np.signbit(expected[0])  # every upload -0.0: NumPy's sum starts at +0.0


def test_float32_extremes_do_not_overflow_the_float64_sum() -> None:
    big = np.full(5, 3.4e38, dtype=np.float32)
    assert np.all(mean_float64([big, big, big]) == np.float64(np.float32(3.4e38)))


def test_as_float32_refuses_values_outside_float32_and_nan() -> None:
    assert _as_float32(np.array([1.0, -2.0]), "x").dtype == np.float32
    for bad in (np.array([1.0, -1e39]), np.array([1e39, 0.0]), np.array([0.0, np.nan])):
        with pytest.raises(FloatingPointError, match="outside float32's range"):
            _as_float32(bad, "the mean uploaded second moment")
