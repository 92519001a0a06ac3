"""The VR aggregate's algebra (spec papers/fedadavr.md sections 3.4, 6.A.3, 6.A.5-6)."""

from itertools import combinations

import numpy as np
import pytest

from pollen.compression.quant import PRECISIONS
from pollen.vr import VARIANTS, UpdateTable, get_variant, vr_aggregate

D = 12
SEGS = [5, 7]


def _fill(table, n_clients, rng, weights=None):
    for j in range(n_clients):
        table.replace(j, rng.standard_normal(D).astype(np.float32), 1.0 if weights is None else weights[j])


def _table_matrix(table, n_clients):
    return np.stack([table.get(j).astype(np.float64) for j in range(n_clients)])


def test_round_zero_is_fedavg():
    rng = np.random.default_rng(0)
    ys = {k: rng.standard_normal(D).astype(np.float32) for k in (3, 8, 41)}
    n = {3: 10.0, 8: 30.0, 41: 60.0}
    fedavg = sum(n[k] * ys[k].astype(np.float64) for k in ys) / 100.0
    for table in (None, UpdateTable(D, SEGS, "int4")):
        r = vr_aggregate(ys, table, num_clients=100, weights=n)
        np.testing.assert_allclose(r, fedavg, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(
            vr_aggregate(ys, table, num_clients=100, weights=n, weighting="none"), fedavg, rtol=1e-6
        )


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("weighting", ["sampled-normalised", "horvitz-thompson", "literal"])
def test_full_participation_equal_sizes_is_plain_mean(precision, weighting):
    rng = np.random.default_rng(1)
    N = 20
    table = UpdateTable(D, SEGS, precision)
    _fill(table, N, rng)  # arbitrary stale entries
    ys = {j: rng.standard_normal(D).astype(np.float32) for j in range(N)}
    r = vr_aggregate(ys, table, num_clients=N, weighting=weighting)
    mean = np.mean([ys[j].astype(np.float64) for j in range(N)], axis=0)
    np.testing.assert_allclose(r, mean, rtol=1e-5, atol=1e-6)  # VR terms cancel -> plain optimiser


@pytest.mark.parametrize("precision", PRECISIONS)
def test_equal_sizes_is_fedvarp(precision):
    rng = np.random.default_rng(2)
    N, S = 100, [4, 17, 52, 60, 99]
    table = UpdateTable(D, SEGS, precision)
    _fill(table, 70, rng)  # clients 70..99 never seen -> zero rows
    ys = {k: rng.standard_normal(D).astype(np.float32) for k in S}
    Y = np.vstack([_table_matrix(table, 70), np.zeros((30, D))])
    fedvarp = np.mean([ys[i] - Y[i] for i in S], axis=0) + Y.sum(axis=0) / N
    for weighting in ("sampled-normalised", "horvitz-thompson"):  # identical for equal sizes
        np.testing.assert_allclose(
            vr_aggregate(ys, table, num_clients=N, weighting=weighting), fedvarp, rtol=1e-5, atol=1e-6
        )
    # equal example counts give the same thing (weights are relative)
    same = vr_aggregate(ys, table, num_clients=N, weights=dict.fromkeys(S, 1.0))
    np.testing.assert_allclose(same, fedvarp, rtol=1e-5, atol=1e-6)


def test_literal_is_mifa_sag_after_replacement():
    rng = np.random.default_rng(3)
    N = 30
    sizes = rng.integers(5, 200, size=N).astype(float)
    table = UpdateTable(D, SEGS, "fp32")
    _fill(table, N, rng, weights=sizes)
    S = [2, 9, 11, 29]
    ys = {i: rng.standard_normal(D).astype(np.float32) for i in S}
    n = {i: sizes[i] for i in S}
    r = vr_aggregate(ys, table, num_clients=N, weights=n, total_weight=sizes.sum(), weighting="literal")
    table.replace_many(ys, n)
    sag = (sizes[:, None] * _table_matrix(table, N)).sum(axis=0) / sizes.sum()
    np.testing.assert_allclose(r, sag, rtol=1e-5, atol=1e-6)
    # with equal weights and a zero-initialised table this is MIFA: 1/N sum_j G_j
    t2 = UpdateTable(D, SEGS)
    r2 = vr_aggregate(ys, t2, num_clients=N, weighting="literal")
    np.testing.assert_allclose(r2, sum(ys.values()) / N, rtol=1e-6)


def _all_subsets(ys, table, N, M, weights, W, weighting):
    return np.array(
        [
            vr_aggregate(
                {i: ys[i] for i in S},
                table,
                num_clients=N,
                weights={i: weights[i] for i in S},
                total_weight=W,
                weighting=weighting,
            )
            for S in combinations(range(N), M)
        ],
        dtype=np.float64,
    )


def test_expectation_over_uniform_sampling():
    # Exact expectation by enumerating all C(9, 3) = 84 samples.
    rng = np.random.default_rng(4)
    N, M = 9, 3
    sizes = rng.integers(1, 50, size=N).astype(float)
    W = sizes.sum()
    table = UpdateTable(D, SEGS)
    _fill(table, N, rng, weights=sizes)
    Y = _table_matrix(table, N)
    ys = {i: (Y[i] + rng.standard_normal(D)).astype(np.float32) for i in range(N)}
    G = np.stack([ys[i].astype(np.float64) for i in range(N)])
    target = (sizes[:, None] * G).sum(axis=0) / W  # sum_j p_j g_j
    ht = _all_subsets(ys, table, N, M, sizes, W, "horvitz-thompson").mean(axis=0)
    np.testing.assert_allclose(ht, target, rtol=1e-5, atol=1e-5)  # unbiased for any sizes
    lit = _all_subsets(ys, table, N, M, sizes, W, "literal").mean(axis=0)
    biased = M / N * target + (1 - M / N) * (sizes[:, None] * Y).sum(axis=0) / W
    np.testing.assert_allclose(lit, biased, rtol=1e-5, atol=1e-5)  # SAG: biased towards stale entries
    assert np.linalg.norm(lit - target) > 0.1
    # equal sizes: the default is unbiased too, with Lemma A.4's variance
    ones = np.ones(N)
    eq = UpdateTable(D, SEGS)  # same rows, stored with weight 1 (weights must match the aggregate's)
    eq.replace_many({j: Y[j].astype(np.float32) for j in range(N)})
    sn = _all_subsets(ys, eq, N, M, ones, float(N), "sampled-normalised")
    mean_g = G.mean(axis=0)
    np.testing.assert_allclose(sn.mean(axis=0), mean_g, rtol=1e-5, atol=1e-5)
    x = G - Y
    lemma = (N - M) / (M * (N - 1)) * np.mean(np.sum((x - x.mean(axis=0)) ** 2, axis=1))
    var = np.mean(np.sum((sn - mean_g) ** 2, axis=1))
    assert var == pytest.approx(lemma, rel=1e-5)


def test_equal_sizes_ht_equals_sampled_normalised_and_estimated_population_weight():
    rng = np.random.default_rng(5)
    table = UpdateTable(D, SEGS, "int8")
    _fill(table, 15, rng, weights=[50.0] * 15)
    ys = {k: rng.standard_normal(D).astype(np.float32) for k in (1, 20, 30)}  # two never-seen clients
    n = dict.fromkeys(ys, 50.0)
    a = vr_aggregate(ys, table, num_clients=40, weights=n)
    b = vr_aggregate(ys, table, num_clients=40, weights=n, weighting="horvitz-thompson")
    c = vr_aggregate(ys, table, num_clients=40, weights=n, total_weight=40 * 50.0)  # estimate is exact here
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(a, c)


def test_dropout_keeps_entry_and_round_uses_only_replies():
    rng = np.random.default_rng(6)
    N = 10
    table = UpdateTable(D, SEGS, "fp16")
    _fill(table, N, rng)
    sampled = [1, 4, 7]
    replies = {1: rng.standard_normal(D).astype(np.float32), 7: rng.standard_normal(D).astype(np.float32)}  # 4 failed
    before = table.get(4)
    Y = _table_matrix(table, N)
    r = vr_aggregate(replies, table, num_clients=N)
    expected = np.mean([replies[i] - Y[i] for i in replies], axis=0) + Y.mean(axis=0)
    np.testing.assert_allclose(r, expected, rtol=1e-5, atol=1e-6)
    table.replace_many(replies)
    np.testing.assert_array_equal(table.get(4), before)
    assert sampled  # (4 was sampled, gave no reply, and is untouched)


def test_consecutive_rounds_use_own_previous_update():
    # mock client returning its round index: in round t+1 its control variate is its round-t update
    table = UpdateTable(D, SEGS)
    for t in range(3):
        ys = {"c": np.full(D, float(t + 1), np.float32)}
        r = vr_aggregate(ys, table, num_clients=1)
        # N = M = 1: r = (y - y_old) + y_old = y
        np.testing.assert_allclose(r, ys["c"])
        np.testing.assert_array_equal(table.get("c"), np.full(D, float(t), np.float32))  # round t-1's value
        table.replace_many(ys)


def test_aggregate_is_pure_and_scales_by_client_lr():
    rng = np.random.default_rng(7)
    table = UpdateTable(D, SEGS, "int4")
    _fill(table, 8, rng)
    snap = table.state_dict()
    ys = {0: rng.standard_normal(D).astype(np.float32), 99: rng.standard_normal(D).astype(np.float32)}
    r1 = vr_aggregate(ys, table, num_clients=8)
    r2 = vr_aggregate(ys, table, num_clients=8, client_lr=0.01)
    np.testing.assert_allclose(r2, 0.01 * r1, rtol=1e-6)
    after = table.state_dict()
    for k in snap:
        np.testing.assert_array_equal(after[k], snap[k])
    assert 99 not in table


def test_quantised_table_error_cancels_for_sampled_clients():
    # same D(y_i) in both sums: if everyone is sampled, the result is the exact mean whatever the precision
    rng = np.random.default_rng(8)
    N = 6
    big = UpdateTable(D, SEGS, "int4")
    _fill(big, N, rng)
    ys = {j: rng.standard_normal(D).astype(np.float32) for j in range(N)}
    np.testing.assert_allclose(
        vr_aggregate(ys, big, num_clients=N), np.mean(list(ys.values()), axis=0), rtol=1e-5, atol=1e-6
    )


def test_validation_messages():
    table = UpdateTable(D, SEGS)
    y = np.ones(D, np.float32)
    with pytest.raises(ValueError, match="allowed: sampled-normalised, horvitz-thompson, literal, none"):
        vr_aggregate({0: y}, table, num_clients=3, weighting="saga")
    assert np.array_equal(vr_aggregate({0: y}, table, num_clients=3, weighting="sampled_normalised"), y)
    with pytest.raises(ValueError, match="at least one update"):
        vr_aggregate({}, table, num_clients=3)
    with pytest.raises(ValueError, match="shape"):
        vr_aggregate({0: np.ones(D + 1, np.float32)}, table, num_clients=3)
    with pytest.raises(ValueError, match="NaN"):
        vr_aggregate({0: np.full(D, np.inf, np.float32)}, table, num_clients=3)
    with pytest.raises(KeyError):
        vr_aggregate({0: y}, table, num_clients=3, weights={1: 2.0})
    with pytest.raises(ValueError, match="duplicate"):
        vr_aggregate({0: y, "0": y}, table, num_clients=3)


def test_variants_are_valid_configurations():
    assert set(VARIANTS) == {"fedadavr", "fedadavr-quant", "fedvarp", "mifa", "novr", "noopt"}
    assert get_variant("mifa").weighting == "literal" and get_variant("mifa").equal_weights
    assert get_variant("fedvarp").weighting == "sampled-normalised" and get_variant("fedvarp").equal_weights
    assert get_variant("novr").weighting == "none" and not get_variant("novr").uses_table
    assert get_variant("fedadavr-quant").precision == "fp16"
    assert get_variant("noopt").optimizer == "sgd" and get_variant("fedvarp").optimizer == "sgd"
    with pytest.raises(ValueError, match="allowed"):
        get_variant("scaffold")


@pytest.mark.parametrize("precision", PRECISIONS)
def test_many_rounds_incremental_equals_naive_and_memmap_equals_ram(precision, tmp_path):
    # 300 rounds of random sampling with unequal sizes and dropouts: the O(M d) aggregate equals the naive
    # O(N d) Eq. 6/7 (corrected weighting) every round, and the memmap table gives bit-identical results.
    rng = np.random.default_rng(9)
    N, M = 25, 5
    sizes = rng.integers(10, 300, size=N).astype(float)
    W = sizes.sum()
    ram = UpdateTable(D, SEGS, precision, initial_capacity=1)
    mm = UpdateTable(D, SEGS, precision, path=tmp_path / "t.bin", initial_capacity=1)
    for _ in range(300):
        S = rng.choice(N, size=M, replace=False)
        replies = [int(i) for i in S if rng.random() > 0.2] or [int(S[0])]
        ys = {i: (rng.standard_normal(D) * 10.0 ** rng.uniform(-2, 2)).astype(np.float32) for i in replies}
        n = {i: sizes[i] for i in replies}
        Y = np.stack([ram.get(j).astype(np.float64) for j in range(N)])
        q = np.array([n[i] for i in replies]) / sum(n.values())
        naive = sum(qi * (ys[i] - Y[i]) for qi, i in zip(q, replies)) + (sizes[:, None] * Y).sum(axis=0) / W
        r = vr_aggregate(ys, ram, num_clients=N, weights=n, total_weight=W)
        np.testing.assert_allclose(r, naive, rtol=1e-5, atol=1e-5 * np.max(np.abs(naive)))
        np.testing.assert_array_equal(vr_aggregate(ys, mm, num_clients=N, weights=n, total_weight=W), r)
        ram.replace_many(ys, n)
        mm.replace_many(ys, n)
    full = ram.recompute_running_sum()
    assert np.max(np.abs(ram.running_sum - full)) <= 1e-10 * np.max(np.abs(full))
    np.testing.assert_array_equal(mm.running_sum, ram.running_sum)
    assert mm.capacity == ram.capacity == 32
    mm.close()


def _toy_run(variant_name, *, N, M, rounds, sizes=None, precision=None, eta=None, optimizer=None, seed=0):
    """A quadratic federation (f_i = |x - c_i|^2 / 2, 3 local GD steps) driven exactly as the lead will."""
    optim = pytest.importorskip("pollen.optim")
    v = get_variant(variant_name)
    rng = np.random.default_rng(seed)
    centres = np.random.default_rng(123).standard_normal((N, D)).astype(np.float32)
    sizes = np.ones(N) if sizes is None else sizes
    lr_c = 0.1
    opt = optim.make_server_optimizer(optimizer or v.optimizer, eta=v.server_lr if eta is None else eta)
    state = opt.init(D)
    x = np.zeros(D, np.float32)
    table = UpdateTable(D, SEGS, precision or v.precision) if v.uses_table else None
    traj = []
    for _ in range(rounds):
        S = sorted(rng.choice(N, size=M, replace=False).tolist())
        ys = {}
        for i in S:
            xl = x.copy()
            for _ in range(3):
                xl -= lr_c * (xl - centres[i])
            ys[i] = (xl - x) / lr_c
        w = None if v.equal_weights else {i: float(sizes[i]) for i in S}
        delta = vr_aggregate(ys, table, num_clients=N, weights=w, weighting=v.weighting, client_lr=lr_c)
        step, state = opt.update(state, delta, x)
        x = (x + step).astype(np.float32)
        if table is not None:
            table.replace_many(ys, w)
        traj.append(x.copy())
    return np.array(traj)


def test_full_participation_fedadavr_equals_novr_with_same_optimizer():
    # spec 6.A.5 (i): with M = N the VR terms cancel, so FedAdaVR's trajectory is the plain optimiser's
    for optimizer in ("adam", "adagrad"):
        a = _toy_run("fedadavr", N=6, M=6, rounds=25, optimizer=optimizer, sizes=np.arange(1.0, 7.0), precision="int4")
        b = _toy_run("novr", N=6, M=6, rounds=25, optimizer=optimizer, sizes=np.arange(1.0, 7.0), eta=0.01)
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_noopt_with_unit_lr_is_fedvarp_and_converges():
    # spec 6.A.5 (ii): NoOPT with eta_s = 1 and equal sizes reproduces FedVARP(eta_s = 1)
    a = _toy_run("noopt", N=20, M=4, rounds=60, eta=1.0, sizes=np.full(20, 30.0))
    b = _toy_run("fedvarp", N=20, M=4, rounds=60, eta=1.0)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # and it heads for the minimiser of the average objective (the mean centre)
    centre = np.random.default_rng(123).standard_normal((20, D)).mean(axis=0)
    assert np.linalg.norm(a[-1] - centre) < 0.2 * np.linalg.norm(centre)


@pytest.mark.parametrize("precision", ["fp16", "int8", "int4"])
def test_quant_table_stays_close_to_fp32(precision):
    ref = _toy_run("fedadavr", N=20, M=4, rounds=60, precision="fp32")
    q = _toy_run("fedadavr", N=20, M=4, rounds=60, precision=precision)
    tol = {"fp16": 1e-3, "int8": 2e-2, "int4": 2e-1}[precision]
    assert np.linalg.norm(q[-1] - ref[-1]) <= tol * np.linalg.norm(ref[-1])


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("weighting", ["sampled-normalised", "horvitz-thompson", "literal", "none"])
def test_a_streamed_round_equals_the_estimator_and_commits_what_replace_many_stores(precision, weighting):
    """VRRound (one update at a time, chunked float64 sums across several chunks) gives the boxed estimator
    written out in float64, leaves the table alone until commit, and then stores what replace_many would."""
    from pollen.vr.aggregate import VRRound

    rng = np.random.default_rng(7)
    dim, sizes = 70_001, [1, 40_000, 30_000]
    table, twin = UpdateTable(dim, sizes, precision), UpdateTable(dim, sizes, precision)
    for key in range(5):
        y, w = rng.normal(size=dim).astype(np.float32), float(key + 1)
        table.replace(key, y, w)
        twin.replace(key, y, w)
    before = {k: table.get(k) for k in table.keys()}
    ys = {k: rng.normal(size=dim).astype(np.float32) for k in (1, 3, 9)}
    ws = {1: 2.0, 3: 5.0, 9: 1.5}
    streamed = VRRound(table, dim, weighting=weighting)
    for k, y in ys.items():
        streamed.add(k, y.copy(), ws[k])
    got = streamed.delta(num_clients=12, client_lr=0.5).copy()
    n = np.array([ws[k] for k in ys])
    if weighting == "none":
        want = 0.5 * sum(ws[k] * ys[k].astype(np.float64) for k in ys) / n.sum()
    else:
        W = 12 * (sum(float(i + 1) for i in range(5)) - 2.0 - 4.0 + n.sum()) / 6  # N * mean weight of seen clients
        coef = {"sampled-normalised": n / n.sum(), "horvitz-thompson": (12 / 3) * n / W, "literal": n / W}[weighting]
        stored = sum(w * before[str(k)].astype(np.float64) for k, w in zip(range(5), [1.0, 2.0, 3.0, 4.0, 5.0]))
        fresh = sum(
            c * (ys[k].astype(np.float64) - (before[str(k)] if str(k) in before else 0.0)) for c, k in zip(coef, ys)
        )
        want = 0.5 * (stored / W + fresh)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for k, row in before.items():  # nothing stored before commit
        np.testing.assert_array_equal(table.get(k), row)
    streamed.commit()
    twin.replace_many(ys, ws)
    assert table.keys() == twin.keys()
    for k in twin.keys():
        np.testing.assert_array_equal(table.get(k), twin.get(k))
    np.testing.assert_array_equal(table.running_sum, twin.running_sum)
