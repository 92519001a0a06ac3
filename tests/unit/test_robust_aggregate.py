"""Robust aggregators (``pollen.aggregate.robust``): hand-computed equations, order independence, attacks."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from pollen.aggregate import robust
from pollen.aggregate.robust import MajorityVote, Mean, Median, TrimmedMean, make_aggregator


def rows(*values: list[float]) -> list[np.ndarray]:
    return [np.asarray(v, dtype=np.float32) for v in values]


# ---------------------------------------------------------------------- equations on small examples
def test_median_of_an_odd_count_is_the_middle_value() -> None:
    out = Median().combine(rows([3, -1], [1, 5], [2, 0]))
    np.testing.assert_array_equal(out, [2, 0])


def test_median_of_an_even_count_is_the_mean_of_the_two_middle_values() -> None:
    out = Median().combine(rows([4, 1], [1, 1], [2, 10], [3, -7]))
    np.testing.assert_array_equal(out, [2.5, 1.0])  # sorted (1,2,3,4) -> 2.5; (-7,1,1,10) -> 1


def test_trimmed_mean_cuts_floor_beta_m_from_each_side_with_ties() -> None:
    # M = 5, beta = 0.2: one value cut from each side; ties (the two 2s, the three 7s) are kept or cut once.
    out = TrimmedMean(0.2).combine(rows([2, 7], [2, 7], [9, 7], [-100, 1], [3, 100]))
    np.testing.assert_allclose(out, [(2 + 2 + 3) / 3, 7.0])
    assert TrimmedMean(0.2).trimmed(5) == 1 and TrimmedMean(0.2).trimmed(4) == 0
    assert TrimmedMean(0.49).trimmed(10) == 4  # at most M - 2 * 4 = 2 values averaged


def test_trimmed_mean_with_beta_zero_is_the_mean() -> None:
    data = rows([1, 2, 3], [4, -5, 6], [0.5, 0.25, -1])
    np.testing.assert_allclose(TrimmedMean(0.0).combine(data), Mean().combine(data), rtol=1e-7)


def test_majority_vote_is_the_sign_of_the_vote_times_the_median_scale_and_a_tie_is_zero() -> None:
    # four scaled-sign uploads with scales 1, 2, 3, 100: the median scale is 2.5; coordinate 2 ties 2-2.
    signs = [[1, 1, 1], [1, -1, 1], [-1, -1, 1], [1, 1, -1]]
    data = rows(*[np.multiply(s, scale) for s, scale in zip(signs, (1.0, 2.0, 3.0, 100.0))])
    out = MajorityVote().combine(data)
    np.testing.assert_array_equal(out, [2.5, 0.0, 2.5])


def test_majority_vote_takes_the_scale_per_segment() -> None:
    # per-tensor scales: tensor 0 (2 values) scales 1, 3, 5 -> 3; tensor 1 (1 value) scales 10, 20, 30 -> 20.
    data = rows([1, -1, 10], [3, 3, -20], [5, 5, 30])
    out = MajorityVote().combine(data, [(0, 2), (2, 3)])
    np.testing.assert_array_equal(out, [3, 3, 20])
    with pytest.raises(ValueError, match="do not tile"):
        MajorityVote().combine(data, [(0, 2)])


def test_the_mean_reference_and_median_agree_on_a_symmetric_example_without_attackers() -> None:
    rng = np.random.default_rng(0)
    centre = rng.standard_normal(50).astype(np.float32)
    spread = rng.standard_normal((4, 50)).astype(np.float32)
    data = [centre + s for s in spread] + [centre - s for s in spread] + [centre]  # symmetric around centre
    for aggregator in (Mean(), Median(), TrimmedMean(0.2)):
        np.testing.assert_allclose(aggregator.combine(data), centre, atol=1e-5)


# ---------------------------------------------------------------------- order and blocks
@pytest.mark.parametrize("aggregator", [Median(), TrimmedMean(0.25), MajorityVote()], ids=repr)
def test_the_result_is_bit_identical_whatever_the_order_of_the_updates(aggregator: robust.Aggregator) -> None:
    rng = np.random.default_rng(1)
    data = [rng.standard_normal(33).astype(np.float32) * 10.0 ** rng.integers(-6, 6) for _ in range(5)]
    data[2][:4] = 0.0
    data[3][:4] = -0.0  # zeros of both signs sort as equal: the result must still be the same bits
    if isinstance(aggregator, MajorityVote):
        data = [np.sign(d) * np.float32(abs(d).mean()) for d in data]
    reference = aggregator.combine(data).tobytes()
    for order in itertools.permutations(range(5)):
        assert aggregator.combine([data[i] for i in order]).tobytes() == reference


def test_column_blocks_give_the_same_bits_as_one_block(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(2)
    data = [rng.standard_normal(1001).astype(np.float32) for _ in range(6)]
    whole = [Median().combine(data), TrimmedMean(0.2).combine(data)]
    monkeypatch.setattr(robust, "BLOCK_BYTES", 8 * 6 * 7)  # 7 columns per block, the last one partial
    assert list(robust._blocks(1001, 6))[:2] == [(0, 7), (7, 14)]
    blocked = [Median().combine(data), TrimmedMean(0.2).combine(data)]
    for a, b in zip(whole, blocked):
        assert a.tobytes() == b.tobytes()


# ---------------------------------------------------------------------- attacks
@pytest.mark.parametrize("attack", [-1.0, -3.0], ids=["sign-flipped", "scaled-by-minus-3"])
def test_with_20_percent_bad_clients_median_and_trimmed_mean_stay_near_the_honest_mean(attack: float) -> None:
    rng = np.random.default_rng(3)
    direction = rng.standard_normal(200).astype(np.float32)
    honest = [direction + 0.3 * rng.standard_normal(200).astype(np.float32) for _ in range(8)]
    bad = [attack * h for h in honest[:2]]  # 2 of 10: norms within 3x of the honest ones (they pass a 10x screen)
    honest_mean = Mean().combine(honest)
    scale = np.linalg.norm(honest_mean)

    def error(aggregator: robust.Aggregator) -> float:
        return float(np.linalg.norm(aggregator.combine(honest + bad) - honest_mean) / scale)

    assert error(Mean()) > 0.3  # the mean is pulled a third of the way (or more) off
    assert error(Median()) < 0.2
    assert error(TrimmedMean(0.2)) < 0.2
    assert error(Mean()) > 2 * max(error(Median()), error(TrimmedMean(0.2)))


def test_majority_vote_with_20_percent_flipped_signs_keeps_the_honest_direction() -> None:
    rng = np.random.default_rng(4)
    direction = rng.standard_normal(400).astype(np.float32)
    honest = [np.sign(direction + 0.5 * rng.standard_normal(400)).astype(np.float32) * 0.1 for _ in range(8)]
    bad = [-h * 50 for h in honest[:2]]  # flipped, and a huge scale
    out = MajorityVote().combine(honest + bad)
    agree = np.mean(np.sign(out) == np.sign(direction))
    assert agree > 0.8
    assert np.mean(np.sign(Mean().combine(honest + bad)) == np.sign(direction)) < 0.25  # the mean flips
    assert np.abs(out).max() == pytest.approx(0.1)  # the median scale: the attackers' 5.0 does not get through


# ---------------------------------------------------------------------- names and errors
def test_make_aggregator_by_name_and_its_errors() -> None:
    assert make_aggregator("median") == Median()
    assert make_aggregator("trimmed-mean") == TrimmedMean(robust.DEFAULT_TRIM_FRACTION)
    assert make_aggregator("trimmed-mean", 0.3) == TrimmedMean(0.3)
    assert make_aggregator(TrimmedMean(0.2)) == TrimmedMean(0.2)
    assert make_aggregator("mean").streams and not make_aggregator("median").streams
    with pytest.raises(ValueError, match=r"aggregator='krum' is unknown; allowed: mean, median, trimmed-mean"):
        make_aggregator("krum")
    with pytest.raises(ValueError, match=r"trim_fraction=0.2 is set but aggregator='median'; allowed: trimmed-mean"):
        make_aggregator("median", 0.2)


@pytest.mark.parametrize("beta", [-0.1, 0.5, 0.7, True, "0.1", float("nan")])
def test_trim_fraction_out_of_range_is_refused(beta: object) -> None:
    with pytest.raises(ValueError, match=r"trim fraction beta=.* is out of range; allowed: a number in \[0, 0.5\)"):
        TrimmedMean(beta)  # type: ignore[arg-type]


def test_updates_of_different_shapes_or_none_are_refused() -> None:
    with pytest.raises(ValueError, match="needs at least one update"):
        Median().combine([])
    with pytest.raises(ValueError, match=r"update 1 has shape \(3,\)"):
        Median().combine(rows([1, 2], [1, 2, 3]))
