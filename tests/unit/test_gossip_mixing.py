"""HA-Fed gossip mixing matrices against the spec's numbers and invariants (papers/hafed.md §3.5, §7 C1).

References are closed forms or hand-built matrices, never the code under test.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from pollen.gossip import (
    TOPOLOGIES,
    check_mixing_matrix,
    circulant,
    cluster_of,
    complete_bipartite,
    fully_connected,
    gossip_step,
    identity,
    interpolated,
    lambda_for_rho,
    mixing_matrix,
    ring,
    spectral_gap_rho,
    validate_clusters,
    without_absent,
)
from pollen.gossip import mixing as mixing_module

SIZES = (3, 4, 8, 16)


def _cases():
    """(id, W) for every topology and every n in SIZES where the topology is defined."""
    for n in SIZES:
        yield f"ring-{n}", mixing_matrix("ring", n)
        yield f"full-{n}", mixing_matrix("full", n)
        yield f"identity-{n}", mixing_matrix("identity", n)
        yield f"interpolated-{n}-0.3", mixing_matrix("interpolated", n, lam=0.3)
        yield f"circulant-{n}-(1,)", mixing_matrix("circulant", n, offsets=(1,))
        if n % 2 == 0:
            yield f"bipartite-{n}", mixing_matrix("bipartite", n)
        if n >= 8:
            yield f"circulant-{n}-(1,3)", mixing_matrix("circulant", n, offsets=(1, 3))
        if n >= 4:
            yield f"circulant-{n}-(1,{n // 2})", mixing_matrix("circulant", n, offsets=(1, n // 2))


CASES = list(_cases())
CASE_IDS = [c[0] for c in CASES]
MATRICES = [c[1] for c in CASES]


# --------------------------------------------------------------------------- spec numbers (§3.5, §7 C1)


def test_ring_n8_rho_is_the_papers_0_805():
    rho = spectral_gap_rho(ring(8))
    assert round(rho, 5) == 0.80474
    assert round(rho, 3) == 0.805
    # closed form of §3.5: 1/3 + (2/3) cos(2 pi / 8)
    assert rho == pytest.approx(1 / 3 + 2 / 3 * math.cos(2 * math.pi / 8), abs=1e-14)


@pytest.mark.parametrize("n", [4, 5, 8, 16, 32])
def test_ring_rho_closed_form(n):
    # eigenvalues 1/3 + (2/3) cos(2 pi k / n); rho is the largest magnitude over k != 0
    want = max(abs(1 / 3 + 2 / 3 * math.cos(2 * math.pi * k / n)) for k in range(1, n))
    assert spectral_gap_rho(ring(n)) == pytest.approx(want, abs=1e-14)


def test_rho_of_the_named_topologies_n8():
    assert spectral_gap_rho(fully_connected(8)) == pytest.approx(0.0, abs=1e-15)
    assert spectral_gap_rho(identity(8)) == pytest.approx(1.0, abs=1e-15)
    assert spectral_gap_rho(complete_bipartite(8)) == pytest.approx(0.6, abs=1e-14)  # the paper's 0.599
    assert round(spectral_gap_rho(circulant(8, (1, 2))), 3) == 0.483  # §3.5's list of candidates
    assert round(spectral_gap_rho(circulant(8, (1, 2, 4))), 3) == 0.333
    assert round(spectral_gap_rho(ring(32)), 3) == 0.987  # §3.7's 32-ring


def test_k44_is_c8_1_3_with_weights_one_fifth():
    want = np.zeros((8, 8))
    for i in range(8):
        for j in range(8):
            if i == j or (i - j) % 2 == 1:
                want[i, j] = 1 / 5
    np.testing.assert_array_equal(complete_bipartite(8), want)
    np.testing.assert_array_equal(circulant(8, (1, 3)), want)


def test_ring_n8_entries():
    w = ring(8)
    for i in range(8):
        for j in range(8):
            want = 1 / 3 if (i - j) % 8 in (0, 1, 7) else 0.0
            assert w[i, j] == want


@pytest.mark.parametrize(("rho", "lam4"), [(0.125, 0.1553), (0.599, 0.7443)])
def test_lambda_for_rho_hits_the_ablation_values(rho, lam4):
    lam = lambda_for_rho(8, rho)
    assert round(lam, 4) == lam4  # §3.5
    assert spectral_gap_rho(interpolated(8, lam)) == pytest.approx(rho, abs=1e-12)
    assert spectral_gap_rho(mixing_matrix("interpolated", 8, lam=lam)) == pytest.approx(rho, abs=1e-12)


def test_lambda_for_rho_endpoints():
    assert lambda_for_rho(8, 0.0) == 0.0
    assert lambda_for_rho(8, spectral_gap_rho(ring(8))) == pytest.approx(1.0, abs=1e-15)
    assert lambda_for_rho(8, 0.805) == 1.0  # the paper's rounding of 0.80474
    np.testing.assert_allclose(interpolated(8, 1.0), ring(8), atol=0)
    np.testing.assert_allclose(interpolated(8, 0.0), fully_connected(8), atol=0)


@pytest.mark.parametrize("lam", [0.0, 0.25, 0.5, 0.9, 1.0])
def test_interpolated_rho_is_linear_in_lambda(lam):
    for n in SIZES:
        assert spectral_gap_rho(interpolated(n, lam)) == pytest.approx(lam * spectral_gap_rho(ring(n)), abs=1e-14)


# --------------------------------------------------------------------------- small n rules


def test_n1_is_identity_for_every_topology():
    for name in ("ring", "full", "identity"):
        np.testing.assert_array_equal(mixing_matrix(name, 1), [[1.0]])
    np.testing.assert_array_equal(mixing_matrix("interpolated", 1, lam=0.4), [[1.0]])


def test_n2_ring_is_the_single_edge_with_weights_one_half():
    half = [[0.5, 0.5], [0.5, 0.5]]
    np.testing.assert_array_equal(ring(2), half)  # §7 C5's W = J/2
    np.testing.assert_array_equal(complete_bipartite(2), half)
    np.testing.assert_array_equal(circulant(2, (1,)), half)


def test_n3_ring_is_the_complete_graph():
    np.testing.assert_allclose(ring(3), np.full((3, 3), 1 / 3), atol=0)
    assert lambda_for_rho(3, 0.0) == 0.0
    with pytest.raises(ValueError, match="not reachable"):
        lambda_for_rho(3, 0.1)


def test_circulant_with_half_offset_counts_the_opposite_node_once():
    # C4(1, 2) is K4: degree 3, weights 1/4
    np.testing.assert_allclose(circulant(4, (1, 2)), np.full((4, 4), 0.25), atol=0)
    # C8(1, 4): degree 3, weights 1/4
    w = circulant(8, (1, 4))
    assert sorted(set(np.round(w[0], 12))) == [0.0, 0.25]
    assert np.count_nonzero(w[0]) == 4


# --------------------------------------------------------------------------- invariants


@pytest.mark.parametrize("w", MATRICES, ids=CASE_IDS)
def test_every_topology_is_a_mixing_matrix(w):
    n = w.shape[0]
    assert w.dtype == np.float64 and w.shape == (n, n)
    assert np.all(w >= 0)
    np.testing.assert_array_equal(w, w.T)
    np.testing.assert_allclose(w.sum(axis=0), 1.0, rtol=0, atol=1e-12)
    np.testing.assert_allclose(w.sum(axis=1), 1.0, rtol=0, atol=1e-12)
    assert np.all(np.diag(w) > 0)  # the neighbour set includes the client itself (§8 A1)
    check_mixing_matrix(w)
    assert 0.0 <= spectral_gap_rho(w) <= 1.0 + 1e-12


@pytest.mark.parametrize("w", MATRICES, ids=CASE_IDS)
def test_gossip_preserves_the_cluster_mean(w):
    # eq. (B.1): W doubly stochastic => mean of W X equals mean of X
    x = np.random.default_rng(0).standard_normal((w.shape[0], 5))
    np.testing.assert_allclose((w @ x).mean(axis=0), x.mean(axis=0), rtol=0, atol=1e-14)
    got = gossip_step(w, x.astype(np.float32))
    np.testing.assert_allclose(got.mean(axis=0), x.astype(np.float32).mean(axis=0), rtol=0, atol=1e-6)


@pytest.mark.parametrize("w", MATRICES, ids=CASE_IDS)
def test_one_gossip_step_contracts_by_rho(w):
    # ||W X - 1 xbar^T||_F <= rho ||X - 1 xbar^T||_F  (spectral norm bound on the disagreement)
    rho = spectral_gap_rho(w)
    rng = np.random.default_rng(1)
    for _ in range(5):
        x = rng.standard_normal((w.shape[0], 7)).astype(np.float32)
        x64 = x.astype(np.float64)
        before = np.linalg.norm(x64 - x64.mean(axis=0))
        y = gossip_step(w, x).astype(np.float64)
        after = np.linalg.norm(y - x64.mean(axis=0))
        assert after <= rho * before + 1e-5


def test_contraction_bound_is_tight_on_the_slowest_mode():
    w = ring(8)
    # eigenvector of 1/3 + (2/3) cos(2 pi / 8): cos(2 pi i / 8)
    v = np.cos(2 * np.pi * np.arange(8) / 8)[:, None]
    assert np.linalg.norm(w @ v) == pytest.approx(spectral_gap_rho(w) * np.linalg.norm(v), rel=1e-12)


@pytest.mark.parametrize("name", ["ring", "bipartite", "interpolated"])
def test_repeated_gossip_converges_to_the_mean(name):
    w = mixing_matrix(name, 8, lam=0.5) if name == "interpolated" else mixing_matrix(name, 8)
    x0 = np.random.default_rng(2).standard_normal((8, 33)).astype(np.float32)
    mean = x0.astype(np.float64).mean(axis=0)
    x = x0
    for _ in range(150):  # 0.805 ** 150 ~ 1e-14
        x = gossip_step(w, x)
    np.testing.assert_allclose(x, np.broadcast_to(mean, x.shape), rtol=0, atol=1e-5)


def test_identity_never_mixes():
    x = np.random.default_rng(3).standard_normal((4, 6)).astype(np.float32)
    np.testing.assert_array_equal(gossip_step(identity(4), x), x)


# --------------------------------------------------------------------------- gossip_step


def ordered_product(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """``W @ X`` summed over j in order, in float64, rounded to float32 once."""
    acc = np.zeros((w.shape[0], x.shape[1]), np.float64)
    for j in range(w.shape[0]):
        acc += w[:, j : j + 1] * x[j].astype(np.float64)
    return acc.astype(np.float32)


def test_gossip_step_accumulates_in_float64_and_returns_float32():
    rng = np.random.default_rng(4)
    w = ring(8)
    x = (rng.standard_normal((8, 40)) * 1e3).astype(np.float32)
    got = gossip_step(w, x)
    assert got.dtype == np.float32 and got.shape == x.shape
    np.testing.assert_array_equal(got, ordered_product(w, x))
    np.testing.assert_allclose(got, (w @ x.astype(np.float64)).astype(np.float32), rtol=1e-6)
    assert got is not x


def test_gossip_step_across_column_blocks():
    d = mixing_module._GOSSIP_BLOCK + 3
    x = np.random.default_rng(5).standard_normal((4, d)).astype(np.float32)
    w = ring(4)
    np.testing.assert_array_equal(gossip_step(w, x), ordered_product(w, x))


def test_gossip_step_rejects_bad_shapes():
    w = ring(4)
    with pytest.raises(ValueError, match=r"one row per client \(4 rows\); got shape \(3, 5\)"):
        gossip_step(w, np.zeros((3, 5), np.float32))
    with pytest.raises(ValueError, match="got shape \\(4,\\)"):
        gossip_step(w, np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="square"):
        gossip_step(np.ones((2, 3)), np.zeros((2, 5), np.float32))
    with pytest.raises(ValueError, match="finite"):
        gossip_step(np.full((2, 2), np.nan), np.zeros((2, 5), np.float32))
    with pytest.raises(ValueError, match="real numbers"):
        gossip_step(w, np.zeros((4, 2), dtype=object))


# --------------------------------------------------------------------------- fault rule


def test_all_present_gives_w_back():
    for w in MATRICES:
        got = without_absent(w, np.ones(w.shape[0], dtype=bool))
        np.testing.assert_array_equal(got, w)


@pytest.mark.parametrize("w", MATRICES, ids=CASE_IDS)
def test_one_absent_client_keeps_w_doubly_stochastic(w):
    n = w.shape[0]
    present = np.ones(n, dtype=bool)
    present[1] = False
    got = without_absent(w, present)
    check_mixing_matrix(got)  # symmetric, non-negative, rows and columns sum to 1
    np.testing.assert_array_equal(got[present, 1], 0.0)  # nobody mixes the missing model
    np.testing.assert_array_equal(got[1], np.eye(n)[1])  # the absent client keeps its own model
    for i in np.flatnonzero(present):  # the missing weight went to the diagonal
        assert got[i, i] == pytest.approx(w[i, i] + w[i, 1], abs=1e-15)
    x = np.random.default_rng(0).standard_normal((n, 5)).astype(np.float32)
    np.testing.assert_allclose(gossip_step(got, x).mean(axis=0), x.mean(axis=0), atol=1e-6)


def test_ring_fault_rule_by_hand():
    present = np.ones(8, dtype=bool)
    present[3] = False
    got = without_absent(ring(8), present)
    third = 1 / 3
    np.testing.assert_allclose(got[2], [0, third, 2 * third, 0, 0, 0, 0, 0], atol=1e-15)
    np.testing.assert_allclose(got[4], [0, 0, 0, 0, 2 * third, third, 0, 0], atol=1e-15)
    np.testing.assert_allclose(got[0], ring(8)[0], atol=1e-15)  # rows not touching 3 are unchanged
    x = np.arange(8, dtype=np.float32)[:, None] * np.ones((1, 3), np.float32)
    y = gossip_step(got, x)
    np.testing.assert_array_equal(y[3], x[3])
    np.testing.assert_allclose(y[2], (1 + 2 * 2) / 3, rtol=1e-6)


def test_present_client_with_no_weight_left_keeps_its_model():
    w = np.array([[0.0, 1.0], [1.0, 0.0]])  # a valid mixing matrix with zero self-weight
    got = without_absent(w, np.array([True, False]))
    np.testing.assert_array_equal(got, np.eye(2))


def test_nobody_present_is_identity():
    np.testing.assert_array_equal(without_absent(ring(4), np.zeros(4, dtype=bool)), np.eye(4))


def test_without_absent_rejects_bad_present():
    with pytest.raises(ValueError, match=r"boolean array of shape \(4,\).*int64"):
        without_absent(ring(4), np.array([1, 1, 0, 1], dtype=np.int64))
    with pytest.raises(ValueError, match=r"shape \(4,\).*got dtype bool, shape \(3,\)"):
        without_absent(ring(4), np.ones(3, dtype=bool))
    with pytest.raises(ValueError, match="symmetric"):
        without_absent(np.array([[0.5, 0.5], [0.0, 1.0]]), np.ones(2, dtype=bool))


# --------------------------------------------------------------------------- check_mixing_matrix


@pytest.mark.parametrize(
    ("w", "message"),
    [
        (np.ones((2, 3)) / 3, r"non-empty square 2-D array; got shape \(2, 3\)"),
        (np.ones(4) / 4, r"square 2-D array; got shape \(4,\)"),
        (np.zeros((0, 0)), r"non-empty square.*\(0, 0\)"),
        (np.array([["a", "b"], ["c", "d"]]), "real numbers; got dtype <U1"),
        (np.array([[0.5, np.nan], [0.5, 0.5]]), r"finite; entry \(0, 1\) is nan"),
        (np.array([[0.5, np.inf], [0.5, 0.5]]), r"finite; entry \(0, 1\) is inf"),
        (np.array([[1.5, -0.5], [-0.5, 1.5]]), r"non-negative; entry \(0, 1\) is -0.5"),
        (np.array([[0.5, 0.5], [0.25, 0.75]]), r"symmetric \(tolerance 1e-12\); W\[0,1\] = 0.5 but W\[1,0\] = 0.25"),
        (np.array([[0.5, 0.4], [0.4, 0.5]]), r"every row of the mixing matrix must sum to 1.*row 0 sums to 0.9"),
        (np.array([[0.5, 0.5], [0.5, 0.5 + 1e-9]]), r"row 1 sums to 1.000000001"),
    ],
)
def test_check_mixing_matrix_names_the_problem(w, message):
    with pytest.raises(ValueError, match=message):
        check_mixing_matrix(w)


def test_check_mixing_matrix_tolerance():
    w = np.array([[0.5, 0.5], [0.5, 0.5]]) + 1e-13
    np.fill_diagonal(w, 0.5 - 1e-13)
    assert check_mixing_matrix(w).dtype == np.float64
    check_mixing_matrix(np.eye(3, dtype=np.int64))  # integer identity is fine, returned as float64


def test_spectral_gap_rho_refuses_a_non_mixing_matrix():
    with pytest.raises(ValueError, match="row 0 sums to 2"):
        spectral_gap_rho(np.ones((2, 2)))


# --------------------------------------------------------------------------- mixing_matrix errors


def test_topologies_tuple_lists_every_name():
    assert TOPOLOGIES == ("ring", "full", "bipartite", "circulant", "identity", "interpolated")
    extra = {"interpolated": {"lam": 0.5}, "circulant": {"offsets": (1, 3)}}
    for name in TOPOLOGIES:
        check_mixing_matrix(mixing_matrix(name, 8, **extra.get(name, {})))


def test_mixing_matrix_dispatches_to_the_named_function():
    np.testing.assert_array_equal(mixing_matrix("ring", 8), ring(8))
    np.testing.assert_array_equal(mixing_matrix("full", 8), fully_connected(8))
    np.testing.assert_array_equal(mixing_matrix("bipartite", 8), complete_bipartite(8))
    np.testing.assert_array_equal(mixing_matrix("circulant", 8, offsets=[1, 3]), circulant(8, (1, 3)))
    np.testing.assert_array_equal(mixing_matrix("circulant", 8, offsets=np.array([1, 3])), circulant(8, (1, 3)))
    np.testing.assert_array_equal(mixing_matrix("identity", 8), identity(8))
    np.testing.assert_array_equal(mixing_matrix("interpolated", 8, lam=0.2), interpolated(8, 0.2))


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        (("torus", 8), {}, "gossip topology 'torus' is unknown; allowed: ring, full, bipartite, circulant, identity"),
        ((None, 8), {}, "gossip topology None is unknown; allowed: ring"),
        (("ring", 0), {}, "n must be an integer >= 1; got 0"),
        (("ring", -3), {}, "n must be an integer >= 1; got -3"),
        (("ring", 8.0), {}, "n must be an integer >= 1; got 8.0"),
        (("ring", True), {}, "n must be an integer >= 1; got True"),
        (("bipartite", 7), {}, "bipartite .* needs an even cluster size n >= 2; got n = 7"),
        (("interpolated", 8), {}, r"'interpolated' needs lam, a real number in \[0, 1\]"),
        (("interpolated", 8), {"lam": 1.5}, r"lam must be a real number in \[0, 1\]; got 1.5"),
        (("interpolated", 8), {"lam": -0.1}, r"lam must be a real number in \[0, 1\]; got -0.1"),
        (("interpolated", 8), {"lam": float("nan")}, r"lam must be a real number in \[0, 1\]; got nan"),
        (("interpolated", 8), {"lam": "0.5"}, r"lam must be a real number in \[0, 1\]; got '0.5'"),
        (("ring", 8), {"lam": 0.5}, "lam=0.5 is only used by topology 'interpolated', not 'ring'"),
        (("circulant", 8), {}, r"'circulant' needs offsets, distinct integers in \[1, 4\]"),
        (("circulant", 8), {"offsets": ()}, "non-empty sequence of integers; got \\(\\)"),
        (("circulant", 8), {"offsets": "13"}, "non-empty sequence of integers; got '13'"),
        (
            ("circulant", 8),
            {"offsets": (1, 5)},
            r"offset 5 is out of range for n = 8; allowed: distinct integers in \[1, 4\]",
        ),
        (("circulant", 8), {"offsets": (0,)}, "offset 0 is out of range"),
        (("circulant", 8), {"offsets": (1.0,)}, "offset 1.0 is out of range"),
        (("circulant", 8), {"offsets": (1, 1)}, r"offsets \[1, 1\] repeat a value"),
        (("circulant", 8), {"offsets": (2, 4)}, r"offsets \[2, 4\] give a disconnected graph for n = 8 \(gcd = 2\)"),
        (("circulant", 1), {"offsets": (1,)}, "n must be an integer >= 2; got 1"),
        (("full", 8), {"offsets": (1,)}, "offsets=\\(1,\\) are only used by topology 'circulant', not 'full'"),
    ],
)
def test_mixing_matrix_errors(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        mixing_matrix(*args, **kwargs)


@pytest.mark.parametrize(
    ("n", "rho", "message"),
    [
        (8, 0.9, r"rho = 0.9 is not reachable by interpolated\(n=8, lam\); allowed: 0 <= rho <= rho\(ring\) = 0.80474"),
        (8, -0.1, "rho = -0.1 is not reachable"),
        (8, float("inf"), "rho must be a real number; got inf"),
        (0, 0.1, "n must be an integer >= 1; got 0"),
    ],
)
def test_lambda_for_rho_errors(n, rho, message):
    with pytest.raises(ValueError, match=message):
        lambda_for_rho(n, rho)


# --------------------------------------------------------------------------- cluster layout


def test_cluster_of_follows_i_div_n():
    assert [cluster_of(i, 8) for i in range(32)] == [i // 8 for i in range(32)]
    assert cluster_of(np.int64(9), 8) == 1


@pytest.mark.parametrize(
    ("pid", "size", "message"),
    [
        (-1, 8, "partition_id must be an integer >= 0; got -1"),
        (1.0, 8, "partition_id must be an integer >= 0; got 1.0"),
        (3, 0, "cluster_size must be an integer >= 1; got 0"),
    ],
)
def test_cluster_of_errors(pid, size, message):
    with pytest.raises(ValueError, match=message):
        cluster_of(pid, size)


def test_validate_clusters_groups_and_sorts():
    assignment = {str(i): cluster_of(i, 4) for i in (7, 0, 3, 5, 1, 2, 6, 4)}
    got = validate_clusters(assignment)
    assert got == {0: ["0", "1", "2", "3"], 1: ["4", "5", "6", "7"]}
    assert list(got) == [0, 1]
    assert validate_clusters({"a": 0}) == {0: ["a"]}


@pytest.mark.parametrize(
    ("assignment", "message"),
    [
        ({"a": 0, "b": 0, "c": 1}, r"same size; sizes: \{0: 2, 1: 1\}; allowed: equal, non-empty clusters"),
        ({"a": 0, "b": 2}, r"0..2 with no empty cluster; empty: \[1\]; sizes: \{0: 1, 1: 0, 2: 1\}"),
        ({"a": 1}, r"empty: \[0\]"),
        ({"a": 0, "b": -1}, "client 'b': cluster id must be an integer >= 0; got -1"),
        ({"a": 0, "b": 1.0}, "client 'b': cluster id must be an integer >= 0; got 1.0"),
        ({"a": True}, "client 'a': cluster id must be an integer >= 0; got True"),
        ({3: 0}, "client keys must be non-empty strings; got 3 \\(int\\)"),
        ({"": 0}, "client keys must be non-empty strings; got ''"),
        ({}, "non-empty mapping client key -> cluster id"),
    ],
)
def test_validate_clusters_errors(assignment, message):
    with pytest.raises(ValueError, match=message):
        validate_clusters(assignment)


def test_equal_rows_of_w_give_bit_identical_models():
    x = np.random.default_rng(3).standard_normal((8, 70_001)).astype(np.float32)
    mixed = gossip_step(fully_connected(8), x)
    assert all(np.array_equal(mixed[0], mixed[i]) for i in range(8))
