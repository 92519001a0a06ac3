"""FedAMS / FedCAMS strategies end to end on a fake grid (fedcams §3.5-3.7, §7.1.3-7.1.4).

The fake clients return ``x_global + Delta_i`` with a known ``Delta_i`` per (node, round);
the server's trajectory is checked against a plain-numpy transcription of Algorithm 1
(Options 1 and 2), against Flower's own ``FedAdam``, and FedCAMS against FedAMS.
No torch: these run against the newest Flower too.
"""

from __future__ import annotations

import math
import pickle

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, MessageType
from flwr.serverapp.strategy import FedAdam

from pollen.clientside import compression_mod
from pollen.clientside.compression_mod import RESIDUAL
from pollen.clientside.state import STATE_KEY
from pollen.compression import decode_payload
from pollen.optim import amsgrad
from pollen.strategies import FedAMS, FedCAMS
from pollen.strategies.engine.parts import ClientSampler, EngineParts
from pollen.testing.fakes import (
    BUFFERS,
    TRAINABLE,
    FakeGrid,
    config_of,
    flat_trainable,
    full_model_reply,
    global_arrays_of,
    make_context,
    model_record,
    named_arrays,
    run_train_round,
    split_trainable,
    tiny_model,
)
from pollen.wire import protocol
from pollen.wire.records import records_to_payload

pytestmark = pytest.mark.flower_compat

D = 19  # trainable scalars of tiny_model: 12 + 3 + 4
LARGE = np.arange(D) < 10  # coordinates whose v rises above eps; the others stay below it
ROUND_SCALE = {1: 1.0, 2: 0.05, 3: 0.02, 4: 0.5}  # shrinking updates: v falls, v_hat keeps the max


# --------------------------------------------------------------------------- fake clients
def client_delta(node: int, rnd: int, dim: int = D) -> np.ndarray:
    """The known local update of ``node`` in round ``rnd`` (float32)."""
    rng = np.random.default_rng([node, rnd])
    magnitude = np.where(LARGE, 1.0, 0.01) if dim == D else 1e-2
    return (rng.standard_normal(dim) * magnitude * ROUND_SCALE.get(rnd, 0.3)).astype(np.float32)


def client_running_mean(node: int, rnd: int) -> np.ndarray:
    return np.random.default_rng([node, rnd, 7]).standard_normal(4).astype(np.float32)


def client_batches(node: int, rnd: int) -> int:
    return 10 * rnd + node % 7


def local_model(msg, names=TRAINABLE, delta_fn=client_delta):  # noqa: ANN001, ANN201
    """What a client ends local training with: x_global + Delta_i, its own buffers."""
    node = msg.metadata.dst_node_id
    rnd = int(config_of(msg)[protocol.CFG_SERVER_ROUND])
    g = global_arrays_of(msg)
    local = dict(g)
    dim = int(sum(np.asarray(g[n]).size for n in names))
    for name, part in split_trainable(delta_fn(node, rnd, dim), g, names).items():
        local[name] = (g[name] + part).astype(g[name].dtype)
    if "bn.num_batches_tracked" in g:
        local["bn.running_mean"] = client_running_mean(node, rnd)
        local["bn.num_batches_tracked"] = np.array(client_batches(node, rnd), dtype=np.int64)
    return local


def full_model_client(msg):  # noqa: ANN001, ANN201
    return full_model_reply(msg, local_model(msg), num_examples=20)


def train_rounds(grid: FakeGrid):  # noqa: ANN201
    """Per round: list of (node, sent train message, its reply or None), from what the grid saw."""
    by_parent = {r.metadata.reply_to_message_id: r for r in grid.replies}
    rounds = []
    for call in grid.calls:
        train = [m for m in call if m.metadata.message_type == MessageType.TRAIN]
        if train:
            rounds.append([(m.metadata.dst_node_id, m, by_parent.get(m.metadata.message_id)) for m in train])
    return rounds


# --------------------------------------------------------------------------- reference maths
def reference_algorithm1(x0, deltas, *, eta, beta_1, beta_2, eps, option, running_max=True):  # noqa: ANN001, ANN201
    """Algorithm 1 lines 14-17, float64, ``m_0 = v_0 = 0``; returns x after each round."""
    x = np.array(x0, dtype=np.float64)
    m = np.zeros_like(x)
    v = np.zeros_like(x)
    v_hat = np.zeros_like(x)
    xs, v_hats, vs = [], [], []
    for delta in deltas:
        m = beta_1 * m + (1 - beta_1) * delta
        v = beta_2 * v + (1 - beta_2) * delta**2
        previous = v_hat if running_max else np.zeros_like(v)
        if option == 1:
            v_hat = np.maximum(np.maximum(previous, v), eps)
            x = x + eta * m / np.sqrt(v_hat)
        else:
            v_hat = np.maximum(previous, v)
            x = x + eta * m / (np.sqrt(v_hat) + eps)
        xs.append(x.copy())
        v_hats.append(v_hat.copy())
        vs.append(v.copy())
    return xs, v_hats, vs


def mean_delta(entries, names=TRAINABLE) -> np.ndarray:  # noqa: ANN001
    """(1/|S_t|) sum_i (x_i - x_t), from what the clients actually sent back."""
    deltas = [
        flat_trainable(named_arrays(reply.content["arrays"]), names) - flat_trainable(global_arrays_of(sent), names)
        for _, sent, reply in entries
    ]
    return np.mean(deltas, axis=0)


# --------------------------------------------------------------------------- 1. Algorithm 1
@pytest.mark.parametrize("option", [1, 2])
def test_fedams_three_rounds_match_algorithm1(option):
    """x_{t+1} equals a numpy transcription of Alg. 1 (mean over the *sampled* clients, v_hat max,
    eps inside the max for Option 1 / outside the sqrt for Option 2); buffers are averaged, not
    optimised, and the integer buffer stays an integer."""
    eta, beta_1, beta_2, eps = 0.3, 0.9, 0.9, 1e-3
    nodes = [101, 205, 333, 478]
    grid = FakeGrid(nodes, full_model_client)
    strategy = FedAMS(
        eta=eta,
        beta_1=beta_1,
        beta_2=beta_2,
        eps=eps,
        option=option,
        fraction_train=0.5,
        fraction_evaluate=0.0,
        min_train_nodes=2,
        parts=EngineParts(sampler=ClientSampler(seed=5)),
    )
    x0 = tiny_model(0)
    result = strategy.start(grid=grid, initial_arrays=model_record(x0), num_rounds=3)

    rounds = train_rounds(grid)
    assert len(rounds) == 3
    for entries in rounds:
        assert len(entries) == 2 and all(reply is not None for _, _, reply in entries)
    deltas = [mean_delta(entries) for entries in rounds]
    expected_xs, v_hats, vs = reference_algorithm1(
        flat_trainable(x0), deltas, eta=eta, beta_1=beta_1, beta_2=beta_2, eps=eps, option=option
    )

    # x_2, x_3 are what the server sent in rounds 2 and 3; x_4 is the final result.
    sent = [flat_trainable(global_arrays_of(entries[0][1])) for entries in rounds[1:]]
    final = named_arrays(result.arrays)
    for got, want in zip(sent + [flat_trainable(final)], expected_xs):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(strategy.params, expected_xs[-1], rtol=1e-5, atol=1e-6)
    assert strategy.opt_state.step == 3 and strategy.opt_state.slots["m"].shape == (D,)

    # The numbers exercise every branch: v_hat kept a larger past value, and (Option 1) the eps floor.
    assert np.any(v_hats[-1] > np.maximum(vs[-1], eps if option == 1 else 0.0))
    if option == 1:
        assert np.any(v_hats[-1] == eps) and np.any(v_hats[-1] > eps)
    # ...and the test tells the variants apart by far more than its tolerance.
    x_final = flat_trainable(final)
    no_max, _, _ = reference_algorithm1(
        flat_trainable(x0), deltas, eta=eta, beta_1=beta_1, beta_2=beta_2, eps=eps, option=option, running_max=False
    )
    other, _, _ = reference_algorithm1(
        flat_trainable(x0), deltas, eta=eta, beta_1=beta_1, beta_2=beta_2, eps=eps, option=3 - option
    )
    all_clients = []
    for t, _entries in enumerate(rounds, start=1):
        all_clients.append(np.mean([client_delta(n, t).astype(np.float64) for n in nodes], axis=0))
    everyone, _, _ = reference_algorithm1(
        flat_trainable(x0), all_clients, eta=eta, beta_1=beta_1, beta_2=beta_2, eps=eps, option=option
    )
    for variant in (no_max, other, everyone):
        assert np.max(np.abs(variant[-1] - x_final)) > 1e-3

    # Buffers: the plain mean of the sampled clients' buffers, never a server step.
    assert strategy.layout.buffer_keys == BUFFERS
    for t, entries in enumerate(rounds, start=1):
        sampled = [node for node, _, _ in entries]
        after = final if t == 3 else global_arrays_of(rounds[t][0][1])
        want_mean = np.mean([client_running_mean(n, t) for n in sampled], axis=0)
        np.testing.assert_allclose(after["bn.running_mean"], want_mean, rtol=1e-6, atol=1e-7)
        assert after["bn.running_mean"].dtype == np.float32
        counter = after["bn.num_batches_tracked"]
        assert counter.dtype == np.int64 and counter.size == 1  # its shape: see the next test
        assert abs(int(counter.reshape(())) - np.mean([client_batches(n, t) for n in sampled])) <= 0.5
    assert strategy.buffers["bn.num_batches_tracked"].dtype == np.int64


def test_zero_dim_buffer_keeps_its_shape():
    """A 0-d buffer (PyTorch's BatchNorm ``num_batches_tracked``) goes back to clients as 0-d.

    The global model the server sends must have the shapes of the model it was given;
    a 0-d counter that comes back as shape (1,) is a different tensor to ``load_state_dict``
    and to any ClientApp that checks shapes.
    """
    grid = FakeGrid([1, 2], full_model_client)
    strategy = FedAMS(fraction_evaluate=0.0)
    x0 = tiny_model(0)
    arrays = model_record(x0)
    for r in (1, 2):
        arrays, _, _ = run_train_round(strategy, grid, r, arrays)
    final = named_arrays(arrays)
    assert {name: a.shape for name, a in final.items()} == {name: a.shape for name, a in x0.items()}
    sent = global_arrays_of(grid.train_messages()[-1])
    assert sent["bn.num_batches_tracked"].shape == ()


def test_weighted_aggregation_uses_num_examples():
    """aggregation="weighted": Delta_t = sum_i n_i Delta_i / sum_i n_i (Flower's FedAvg weighting)."""
    counts = {1: 10, 2: 30, 3: 60}

    def client(msg):  # noqa: ANN001, ANN202
        return full_model_reply(msg, local_model(msg), num_examples=counts[msg.metadata.dst_node_id])

    grid = FakeGrid(list(counts), client)
    strategy = FedAMS(option=2, eta=0.5, eps=1e-3, aggregation="weighted", fraction_evaluate=0.0)
    x0 = tiny_model(1)
    run_train_round(strategy, grid, 1, model_record(x0))
    (entries,) = train_rounds(grid)
    deltas = {
        node: flat_trainable(named_arrays(reply.content["arrays"])) - flat_trainable(global_arrays_of(sent))
        for node, sent, reply in entries
    }
    weighted = sum(counts[n] * deltas[n] for n in counts) / sum(counts.values())
    (want,), _, _ = reference_algorithm1(
        flat_trainable(x0), [weighted], eta=0.5, beta_1=0.9, beta_2=0.99, eps=1e-3, option=2
    )
    np.testing.assert_allclose(strategy.params, want, rtol=1e-5, atol=1e-6)
    (plain,), _, _ = reference_algorithm1(
        flat_trainable(x0),
        [np.mean(list(deltas.values()), axis=0)],
        eta=0.5,
        beta_1=0.9,
        beta_2=0.99,
        eps=1e-3,
        option=2,
    )
    assert np.max(np.abs(plain - want)) > 1e-3


# --------------------------------------------------------------------------- sampling
def sampled_keys(strategy, grid):  # noqa: ANN001, ANN201
    return [[strategy.node_keys[n] for n in call] for call in grid.sampled_per_call()]


def run_rounds(strategy, grid, rounds, x0=None):  # noqa: ANN001, ANN201
    arrays = model_record(tiny_model(0) if x0 is None else x0)
    for r in range(1, rounds + 1):
        arrays, _, _ = run_train_round(strategy, grid, r, arrays)
    return arrays


def test_sampling_is_seeded_and_keyed_by_client_id():
    nodes = [3, 14, 15, 92, 65, 35, 89, 79]

    def sample(seed, node_ids=nodes, client_ids=None):  # noqa: ANN001, ANN202
        grid = FakeGrid(node_ids, full_model_client, client_ids=client_ids)
        strategy = FedAMS(
            fraction_train=0.5,
            fraction_evaluate=0.0,
            parts=EngineParts(sampler=ClientSampler(seed=seed, identify_clients=client_ids is not None)),
        )
        run_rounds(strategy, grid, 5)
        return strategy, grid

    a, grid_a = sample(7)
    b, grid_b = sample(7)
    c, grid_c = sample(8)
    seq_a = grid_a.sampled_per_call()
    assert seq_a == grid_b.sampled_per_call()
    assert seq_a != grid_c.sampled_per_call()
    for call in seq_a:
        assert len(call) == 4 and len(set(call)) == 4 and set(call) <= set(nodes)
    assert len({tuple(sorted(call)) for call in seq_a}) > 1  # it does re-sample each round

    # Stable client ids (pollen's identify query): the same clients are sampled even when the
    # SuperNodes come back with other node ids, in another order.
    ids = {n: f"client-{i}" for i, n in enumerate(nodes)}
    renumbered = {1000 + 7 * i: f"client-{i}" for i in reversed(range(len(nodes)))}
    d, grid_d = sample(7, client_ids=ids)
    e, grid_e = sample(7, node_ids=list(renumbered), client_ids=renumbered)
    assert sampled_keys(d, grid_d) == sampled_keys(e, grid_e)
    assert d.node_keys[nodes[0]] == "client-0"


@pytest.mark.parametrize(
    ("num_nodes", "fraction", "minimum", "expected"),
    [(4, 0.5, 2, 2), (4, 0.1, 3, 3), (10, 0.75, 2, 7), (5, 1.0, 2, 5), (10, 0.35, 1, 3)],
)
def test_sampling_fraction_and_minimum(num_nodes, fraction, minimum, expected):
    grid = FakeGrid(range(1, num_nodes + 1), full_model_client)
    strategy = FedAMS(
        fraction_train=fraction, min_train_nodes=minimum, min_available_nodes=minimum, fraction_evaluate=0.0
    )
    run_rounds(strategy, grid, 2)
    assert [len(call) for call in grid.sampled_per_call()] == [expected, expected]
    assert strategy.accounting.rounds[1].sampled == expected


# --------------------------------------------------------------------------- 2. vs Flower's FedAdam
def test_option2_versus_flower_fedadam():
    """FedAMS Option 2 (FedAMSGrad) against ``flwr.serverapp.strategy.FedAdam`` on the same replies.

    Why they differ, and by exactly how much:

    - Flower's FedAdam takes ``x += eta_norm_t * m_t / (sqrt(v_t) + tau)`` with
      ``eta_norm_t = eta * sqrt(1 - beta_2**(t+1)) / (1 - beta_1**(t+1))``: a bias-corrected
      learning rate whose exponent is the *round number plus one* (so even round 1 is not
      Adam's textbook correction), and no running max on v.
    - FedAMS Option 2 (the paper's Algorithm 1, no bias correction) takes
      ``x += eta * m_t / (sqrt(v_hat_t) + eps)`` with ``v_hat_t = max(v_hat_{t-1}, v_t)``.

    m_t and v_t are the same recursions of the same Delta_t (equal num-examples make
    Flower's weighted mean the plain mean). In round 1 ``v_hat == v``, so
    ``Flower step == our step * eta_norm_1 / eta``. Later the strategy's max may bite, so the
    relation is checked on the optimiser level against
    ``amsgrad(eps_mode="add", max_stabilisation=False)``, i.e. FedAdam without bias
    correction: ``Flower step_t == that step_t * eta_norm_t / eta`` for every round; and the
    max-stabilised step really differs once v falls below its past maximum.
    """
    eta, beta_1, beta_2, tau = 0.3, 0.9, 0.99, 1e-3
    nodes = [11, 22, 33, 44]
    rounds = 3
    x0 = {name: tiny_model(2)[name] for name in TRAINABLE}  # Flower's FedAdam would "optimise" buffers

    def client(msg):  # noqa: ANN001, ANN202
        return full_model_reply(msg, local_model(msg), num_examples=25)

    def trajectory(strategy):  # noqa: ANN001, ANN202
        grid = FakeGrid(nodes, client)
        result = strategy.start(grid=grid, initial_arrays=model_record(x0), num_rounds=rounds)
        per_round = train_rounds(grid)
        xs = [flat_trainable(global_arrays_of(entries[0][1])) for entries in per_round]
        xs.append(flat_trainable(named_arrays(result.arrays)))
        steps = [xs[t + 1] - xs[t] for t in range(rounds)]
        deltas = [mean_delta(entries) for entries in per_round]
        assert all(len(entries) == 4 for entries in per_round)
        return steps, deltas

    sampling = dict(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=4, min_available_nodes=4)
    flower_steps, flower_deltas = trajectory(FedAdam(eta=eta, beta_1=beta_1, beta_2=beta_2, tau=tau, **sampling))
    our_steps, our_deltas = trajectory(FedAMS(option=2, eta=eta, beta_1=beta_1, beta_2=beta_2, eps=tau, **sampling))
    for a, b in zip(flower_deltas, our_deltas):  # same inputs to both optimisers
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)

    def eta_norm(t: int) -> float:
        return eta * math.sqrt(1 - beta_2 ** (t + 1)) / (1 - beta_1 ** (t + 1))

    # Flower averages the float32 client models in float32 before subtracting x_t, which costs
    # ~6e-8 absolute on Delta (1e-5 relative on the smallest coordinates): hence rtol 1e-4.
    close = dict(rtol=1e-4, atol=1e-6)
    # Round 1: v_hat == v, the only difference is Flower's learning-rate factor.
    np.testing.assert_allclose(flower_steps[0], our_steps[0] * eta_norm(1) / eta, **close)
    assert abs(eta_norm(1) / eta - 1) > 0.1  # the factor is real (~0.74), not a rounding matter

    # Every round, on the optimiser level: Flower == (AMSGrad without max) * eta_norm_t / eta.
    no_max = amsgrad(eta=eta, beta_1=beta_1, beta_2=beta_2, eps=tau, eps_mode="add", max_stabilisation=False)
    with_max = amsgrad(eta=eta, beta_1=beta_1, beta_2=beta_2, eps=tau, eps_mode="add")
    s_no, s_max = no_max.init(D), with_max.init(D)
    for t in range(1, rounds + 1):
        step_no, s_no = no_max.update(s_no, flower_deltas[t - 1].astype(np.float32))
        step_max, s_max = with_max.update(s_max, our_deltas[t - 1].astype(np.float32))
        np.testing.assert_allclose(flower_steps[t - 1], step_no * eta_norm(t) / eta, **close)
        np.testing.assert_allclose(our_steps[t - 1], step_max, rtol=1e-5, atol=1e-8)
        if t == 1:
            np.testing.assert_array_equal(step_no, step_max)
    # By round 3 the updates shrank, v fell below its past maximum and the max shrank the step
    # (v_hat >= v can only make it smaller; with beta_2 = 0.99 v decays by ~1% a round).
    ratio = np.abs(step_max) / np.maximum(np.abs(step_no), 1e-12)
    assert np.all(ratio <= 1 + 1e-5)
    assert np.min(ratio) < 0.995


# --------------------------------------------------------------------------- 3. FedCAMS "none" == FedAMS
def mod_client(contexts, codec_seen=None):  # noqa: ANN001, ANN201
    """A ClientApp with pollen's compression_mod around its train function."""

    def train_fn(msg, context):  # noqa: ANN001, ANN202
        return full_model_reply(msg, local_model(msg), num_examples=20)

    def client(msg):  # noqa: ANN001, ANN202
        if codec_seen is not None:
            codec_seen.append(config_of(msg).get(protocol.CFG_CODEC))
        return compression_mod(msg, contexts[msg.metadata.dst_node_id], train_fn)

    return client


def test_fedcams_none_equals_fedams_bit_for_bit():
    """C = identity: e stays 0 and FedCAMS == FedAMS exactly (fedcams §3.6, §7.1.3)."""
    nodes = [5, 6, 7, 8, 9, 10]
    server = dict(eta=0.3, beta_1=0.9, beta_2=0.9, eps=1e-3, option=1, bias_correction=False)
    settings = dict(server, fraction_train=0.5, fraction_evaluate=0.0)
    rounds = 4

    def run(strategy, codecs):  # noqa: ANN001, ANN202
        contexts = {n: make_context(n) for n in nodes}
        grid = FakeGrid(nodes, mod_client(contexts, codecs))
        result = strategy.start(grid=grid, initial_arrays=model_record(tiny_model(3)), num_rounds=rounds)
        return strategy, grid, contexts, named_arrays(result.arrays)

    seen_ams, seen_cams = [], []
    ams, grid_ams, _, final_ams = run(FedAMS(**settings, parts=EngineParts(sampler=ClientSampler(seed=11))), seen_ams)
    cams, grid_cams, contexts, final_cams = run(
        FedCAMS(compressor="none", **settings, parts=EngineParts(sampler=ClientSampler(seed=11))), seen_cams
    )

    assert set(seen_ams) == {None} and set(seen_cams) == {"none"}
    # FedAMS got full models; FedCAMS got pollen's compressed form (identity codec).
    assert all(protocol.ARRAYS_RECORD in r.content.array_records for r in grid_ams.replies)
    assert all(
        set(r.content.array_records) == {protocol.UPDATE_RECORD, protocol.BUFFERS_RECORD} for r in grid_cams.replies
    )

    assert grid_ams.sampled_per_call() == grid_cams.sampled_per_call()
    for ra, rc in zip(train_rounds(grid_ams), train_rounds(grid_cams)):
        for (_, sent_a, _), (_, sent_c, _) in zip(ra, rc):
            a, c = global_arrays_of(sent_a), global_arrays_of(sent_c)
            for name in a:
                assert a[name].dtype == c[name].dtype
                np.testing.assert_array_equal(a[name], c[name])
    for name in final_ams:
        np.testing.assert_array_equal(final_ams[name], final_cams[name])
    np.testing.assert_array_equal(ams.params, cams.params)
    for slot in ("m", "v", "v_hat"):
        np.testing.assert_array_equal(ams.opt_state.slots[slot], cams.opt_state.slots[slot])
    for name in BUFFERS:
        np.testing.assert_array_equal(ams.buffers[name], cams.buffers[name])
    # Every client that took part keeps e == 0 exactly.
    took_part = {n for call in grid_cams.sampled_per_call() for n in call}
    for node in took_part:
        residual = contexts[node].state.array_records[STATE_KEY][RESIDUAL].numpy()
        assert residual.shape == (D,) and not residual.any()


# --------------------------------------------------------------------------- 4. FedCAMS sign: bytes
def test_fedcams_sign_bytes_and_accounting():
    """Scaled sign uploads ceil(d/8) + 4 bytes (+ Flower's per-array header), measured on the wire;
    the accounting fields agree with the records; the ratio to dense FP32 is ~32 for d ~ 100k."""
    shapes = {"fc.weight": (250, 400), "fc.bias": (400,)}
    d = 250 * 400 + 400
    x0 = {name: np.random.default_rng(0).standard_normal(s).astype(np.float32) for name, s in shapes.items()}
    x0["bn.running_mean"] = np.zeros(400, dtype=np.float32)
    names = tuple(shapes)
    nodes = [1, 2, 3, 4]
    contexts = {n: make_context(n) for n in nodes}

    def train_fn(msg, context):  # noqa: ANN001, ANN202
        local = local_model(msg, names=names)
        local["bn.running_mean"] = np.full(400, float(msg.metadata.dst_node_id), dtype=np.float32)
        return full_model_reply(msg, local, num_examples=50)

    grid = FakeGrid(nodes, lambda msg: compression_mod(msg, contexts[msg.metadata.dst_node_id], train_fn))
    strategy = FedCAMS(
        compressor="sign",
        granularity="model",  # one scale (the paper's); per tensor adds 4 bytes a tensor
        fraction_train=0.5,
        fraction_evaluate=0.0,
        parts=EngineParts(sampler=ClientSampler(seed=1)),
    )
    run_rounds(strategy, grid, 2, x0=x0)

    payload_bytes = -(-d // 8) + 4
    empty = ArrayRecord({"bits": Array(np.zeros(0, np.uint8)), "scale": Array(np.zeros(0, np.float32))})
    overhead = empty.count_bytes()
    print(f"\nsign update: ceil(d/8)+4 = {payload_bytes} B, per-record overhead = {overhead} B (d = {d})")
    for r, entries in enumerate(train_rounds(grid), start=1):
        stats = strategy.accounting.rounds[r]
        replies = [reply for _, _, reply in entries]
        update_bytes = [reply.content.array_records[protocol.UPDATE_RECORD].count_bytes() for reply in replies]
        print(f"round {r}: measured update record bytes per client = {update_bytes}")
        for measured in update_bytes:
            assert abs(measured - (payload_bytes + overhead)) <= 0.05 * (payload_bytes + overhead)
            assert measured < 0.05 * 4 * d
        assert stats.sampled == stats.replies == 2 and stats.failures == 0
        assert stats.uplink_update_bytes == sum(update_bytes)
        assert stats.uplink_bytes == sum(sum(rec.count_bytes() for rec in reply.content.values()) for reply in replies)
        assert stats.uplink_bytes > stats.uplink_update_bytes  # meta, buffers and metrics travel too
        assert stats.uplink_fp32_bytes == 4 * d * len(replies)
        assert stats.downlink_bytes == sum(
            sum(rec.count_bytes() for rec in sent.content.values()) for _, sent, _ in entries
        )
        assert stats.downlink_bytes > 4 * d * len(entries)  # the dense global model goes down
        assert 30.0 < stats.compression_ratio <= 32.0
        # The decoded update takes two values only, +-||p||_1/d (one model-wide scale).
        payload = records_to_payload(
            replies[0].content.array_records[protocol.UPDATE_RECORD],
            replies[0].content.config_records[protocol.UPDATE_META_RECORD],
        )
        assert np.unique(np.abs(decode_payload(payload, d))).size == 1


# --------------------------------------------------------------------------- 7. state dict
def test_state_dict_roundtrip_resumes_identically():
    nodes = [21, 22, 23, 24, 25, 26]
    ids = {n: f"c{n}" for n in nodes}

    def make():  # noqa: ANN202
        return FedAMS(
            eta=0.3,
            beta_2=0.9,
            option=1,
            fraction_train=0.5,
            fraction_evaluate=0.0,
            parts=EngineParts(sampler=ClientSampler(seed=4, identify_clients=True)),
        )

    first = make()
    arrays = run_rounds(first, FakeGrid(nodes, full_model_client, client_ids=ids), 2, x0=tiny_model(5))
    state = pickle.loads(pickle.dumps(first.state_dict()))
    resumed = make()
    resumed.load_state_dict(state)
    fresh = make()  # control: no state loaded

    grids = {}
    for name, strategy in (("first", first), ("resumed", resumed), ("fresh", fresh)):
        grids[name] = FakeGrid(nodes, full_model_client, client_ids=ids)
        run_train_round(strategy, grids[name], 3, arrays)

    assert grids["first"].sampled_per_call() == grids["resumed"].sampled_per_call()
    assert len(grids["first"].calls) == len(grids["resumed"].calls) == 1  # node keys restored: no new query
    assert len(grids["fresh"].calls) == 2  # identify query + train
    assert set(resumed.node_keys.values()) == set(ids.values())
    np.testing.assert_array_equal(first.params, resumed.params)
    assert first.opt_state.step == resumed.opt_state.step == 3
    for slot in first.opt_state.slots:
        np.testing.assert_array_equal(first.opt_state.slots[slot], resumed.opt_state.slots[slot])
    for name in BUFFERS:
        np.testing.assert_array_equal(first.buffers[name], resumed.buffers[name])
        assert first.buffers[name].dtype == resumed.buffers[name].dtype
    assert first.sampler.rng.bit_generator.state == resumed.sampler.rng.bit_generator.state
    assert first.node_keys == resumed.node_keys
    assert first.accounting.rounds[2].failure_reasons == resumed.accounting.rounds[2].failure_reasons
    assert first.accounting.to_dict()["1"] == resumed.accounting.to_dict()["1"]
    out_first, out_resumed = named_arrays(first.global_arrays()), named_arrays(resumed.global_arrays())
    assert list(out_first) == list(out_resumed) == list(tiny_model())
    # The control shows the state matters: a fresh optimiser takes another step.
    assert not np.array_equal(first.params, fresh.params)


def test_state_dict_refuses_another_strategy_class():
    state = FedCAMS(compressor="sign").state_dict()
    with pytest.raises(ValueError, match="FedCAMS"):
        FedAMS().load_state_dict(state)
    empty = FedAMS(parts=EngineParts(sampler=ClientSampler(seed=9)))
    with pytest.raises(ValueError, match="'strategy/seed' is 9; expected 0 \\(the run's seed\\)"):
        FedAMS().load_state_dict(empty.state_dict())  # a state of another run (the seed is the run-config's)
    restored = FedAMS(parts=EngineParts(sampler=ClientSampler(seed=9)))
    restored.load_state_dict(pickle.loads(pickle.dumps(empty.state_dict())))
    assert restored.seed == 9 and restored.layout is None
    assert restored.sampler.rng.integers(1 << 30) == np.random.default_rng(9).integers(1 << 30)
