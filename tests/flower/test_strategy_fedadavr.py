"""FedAdaVR as a Flower strategy: table bookkeeping, identities, drop-outs, state (fedadavr.md §3.3-3.5)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from flwr.app import ConfigRecord

from pollen.optim import make_server_optimizer
from pollen.strategies import FedAdaVR
from pollen.strategies.engine.parts import ClientSampler, EngineParts, RoundTransaction
from pollen.strategies.fedadavr import TableAggregate
from pollen.testing.fakes import (
    TRAINABLE,
    FakeGrid,
    flat_trainable,
    full_model_reply,
    global_arrays_of,
    model_record,
    named_arrays,
    run_train_round,
    tiny_model,
)

pytestmark = pytest.mark.flower_compat

CLIENT_LR = 0.1
NODES = [11, 12, 13, 14, 15, 16]


def delta_of(key: str, rnd: int, dim: int) -> np.ndarray:
    seed = int(key.split("-")[-1]) * 100 + rnd
    return np.random.default_rng(seed).normal(0, 0.05, dim).astype(np.float32)


def make_client(ids: dict[int, str], drop: set[int] = frozenset(), rnd_of=lambda: 0):  # noqa: ANN001, ANN201
    def client(msg):  # noqa: ANN001, ANN202
        node = msg.metadata.dst_node_id
        if node in drop:
            return None
        x = global_arrays_of(msg)
        flat = flat_trainable(x).astype(np.float32) + delta_of(ids[node], rnd_of(), 19)
        start = 0
        out = dict(x)
        for name in TRAINABLE:
            size = x[name].size
            out[name] = flat[start : start + size].reshape(x[name].shape).astype(np.float32)
            start += size
        return full_model_reply(msg, out, num_examples=10)

    return client


def strategy(*, min_replies: int = 1, **kwargs) -> FedAdaVR:  # noqa: ANN003
    """FedAdaVR as these tests run it (seeded sampling by client ids); ``kwargs``: its own arguments."""
    options = dict(
        variant="fedadavr",
        server_optimizer="adam",
        eta=0.01,
        eps=1e-8,
        beta_2=0.999,  # the paper's Adam (Appendix B); the constructor's defaults are the drop-in's
        bias_correction=True,
        unseen_clients="zero",  # the paper's N (the constructor's default is the drop-in's)
        client_lr=CLIENT_LR,
        fraction_train=0.5,
        fraction_evaluate=0.0,
        min_train_nodes=3,
        parts=EngineParts(
            sampler=ClientSampler(seed=3, identify_clients=True), transaction=RoundTransaction(min_replies=min_replies)
        ),
    )
    options.update(kwargs)
    return FedAdaVR(**options)


def test_round_one_is_fedavg_aggregate_then_adam_step():
    """With an empty table the VR aggregate is the plain weighted mean (spec §6.A)."""
    ids = {n: f"partition-{i}" for i, n in enumerate(NODES)}
    grid = FakeGrid(NODES, make_client(ids, rnd_of=lambda: 1), client_ids=ids)
    s = strategy()
    x0 = tiny_model(0)
    arrays, _, replies = run_train_round(s, grid, 1, model_record(x0))
    sampled = [ids[r.metadata.src_node_id] for r in replies]
    mean_delta = np.mean([delta_of(k, 1, 19) for k in sampled], axis=0).astype(np.float32)
    opt = make_server_optimizer("adam", eta=0.01, beta_1=0.9, beta_2=0.999, eps=1e-8, bias_correction=True)
    step, _ = opt.update(opt.init(19), mean_delta)
    want = flat_trainable(x0) + step
    np.testing.assert_allclose(flat_trainable(named_arrays(arrays)), want, rtol=1e-5, atol=1e-7)
    for key in sampled:  # rows hold update / eta_c after the step
        np.testing.assert_allclose(s.table.get(key), delta_of(key, 1, 19) / CLIENT_LR, rtol=1e-5, atol=1e-6)
    assert s.table.known_clients == 3
    assert s.accounting.rounds[1].server_state_bytes == s.table.memory_bytes() > 0


def test_dropped_client_keeps_its_row_and_the_sum_stays_consistent():
    ids = {n: f"partition-{i}" for i, n in enumerate(NODES)}
    current = {"round": 1}
    s = strategy(table_precision="int8")
    grid = FakeGrid(NODES, make_client(ids, rnd_of=lambda: current["round"]), client_ids=ids)
    arrays = model_record(tiny_model(0))
    for r in (1, 2):
        current["round"] = r
        arrays, _, _ = run_train_round(s, grid, r, arrays)
    before = {key: s.table.get(key).copy() for key in s.table.keys()}
    # round 3: every sampled node but one replies
    current["round"] = 3
    messages = list(s.configure_train(3, arrays, ConfigRecord(), grid))
    dropped = messages[0].metadata.dst_node_id
    grid.client_fn = make_client(ids, drop={dropped}, rnd_of=lambda: 3)
    replies = list(grid.send_and_receive(messages, timeout=1.0))
    new_arrays, _ = s.aggregate_train(3, replies)
    assert new_arrays is not None
    stats = s.accounting.rounds[3]
    assert stats.failures == 1 and any("no reply" in reason for reason in stats.failure_reasons)
    key = ids[dropped]
    if key in before:
        np.testing.assert_array_equal(s.table.get(key), before[key])
    else:
        np.testing.assert_array_equal(s.table.get(key), np.zeros(19, np.float32))
    np.testing.assert_allclose(s.table.running_sum, s.table.recompute_running_sum(), rtol=0, atol=1e-9)


def test_rows_follow_the_client_id_across_a_reconnect():
    """A SuperNode that reconnects gets a new node id; its row is found by its client id."""
    ids = {11: "partition-0", 12: "partition-1", 13: "partition-2"}
    s = strategy(fraction_train=1.0)
    grid = FakeGrid(list(ids), make_client(ids, rnd_of=lambda: 1), client_ids=ids)
    arrays, _, _ = run_train_round(s, grid, 1, model_record(tiny_model(0)))
    # partition-1 comes back as node 99
    ids2 = {11: "partition-0", 99: "partition-1", 13: "partition-2"}
    grid2 = FakeGrid(list(ids2), make_client(ids2, rnd_of=lambda: 2), client_ids=ids2)
    run_train_round(s, grid2, 2, arrays)
    assert s.table.known_clients == 3
    np.testing.assert_allclose(
        s.table.get("partition-1"), delta_of("partition-1", 2, 19) / CLIENT_LR, rtol=1e-5, atol=1e-5
    )


def test_state_dict_roundtrip_includes_the_table():
    ids = {n: f"partition-{i}" for i, n in enumerate(NODES)}
    current = {"round": 1}
    grid = FakeGrid(NODES, make_client(ids, rnd_of=lambda: current["round"]), client_ids=ids)
    a, b = strategy(table_precision="int4"), strategy(table_precision="int4")
    arrays = model_record(tiny_model(0))
    for r in (1, 2):
        current["round"] = r
        arrays, _, _ = run_train_round(a, grid, r, arrays)
    b.load_state_dict(pickle.loads(pickle.dumps(a.state_dict())))
    current["round"] = 3
    out_a, _, _ = run_train_round(a, grid, 3, arrays)
    out_b, _, _ = run_train_round(b, grid, 3, arrays)
    np.testing.assert_array_equal(flat_trainable(named_arrays(out_a)), flat_trainable(named_arrays(out_b)))
    for key in a.table.keys():
        np.testing.assert_array_equal(a.table.get(key), b.table.get(key))


def test_memory_mapped_table_on_disk(tmp_path):
    ids = {n: f"partition-{i}" for i, n in enumerate(NODES)}
    path = tmp_path / "table.bin"
    s = strategy(table_path=str(path), table_precision="fp16")
    grid = FakeGrid(NODES, make_client(ids, rnd_of=lambda: 1), client_ids=ids)
    run_train_round(s, grid, 1, model_record(tiny_model(0)))
    assert path.is_file() and path.stat().st_size > 0
    assert s.table.known_clients == 3


@pytest.mark.parametrize("name", ["adagrad", "adam", "adabelief", "yogi", "lamb", "sgd"])
@pytest.mark.parametrize("layerwise", [True, False])
def test_server_optimizer_gets_the_settings_of_appendix_b(name, layerwise):
    """Built by name only (no branch per optimiser), each gets what the paper's Appendix B gives it:
    eta and eps; beta_1, beta_2 and bias correction for the Adam family; LAMB the model's segments."""
    from pollen.core.layout import ModelLayout
    from pollen.optim import BY_NAME

    s = FedAdaVR(
        server_optimizer=name,
        eta=0.02,
        beta_1=0.8,
        beta_2=0.95,
        eps=1e-6,
        bias_correction=True,
        lamb_layerwise=layerwise,
    )
    layout = ModelLayout.from_arrays(tiny_model(0), None)
    want = {"eta": 0.02}
    if name != "sgd":
        want["eps"] = 1e-6
    if name not in ("sgd", "adagrad"):
        want.update(beta_1=0.8, beta_2=0.95, bias_correction=True)
    if name == "lamb":
        want.update(segments=layout.segments, layerwise=layerwise)
    built = s.build_optimizer(layout)
    assert built.name == name
    assert built.hyperparameters() == BY_NAME[name](**want).hyperparameters()
    if name == "adagrad":
        assert built.hyperparameters()["beta_1"] == 0.0  # FedAdaVR's Alg. 3: no first moment


@pytest.mark.parametrize(
    "kwargs, word",
    [
        (dict(variant="nope"), "variant"),
        (dict(server_optimizer="rmsprop"), "server_optimizer"),
        (dict(client_lr=0.0), "client_lr"),
        (dict(num_clients=0), "num_clients"),
        (dict(vr_weighting="odd"), "weighting"),
        (dict(unseen_clients="skip"), "unseen_clients.*left-out, zero"),
        (dict(unseen_clients="left-out", num_clients=6), "num_clients=6 is the N of unseen_clients='zero'"),
    ],
)
def test_bad_settings_are_refused(kwargs, word):
    with pytest.raises(ValueError, match=word):
        strategy(**kwargs)


def mifa(**kwargs) -> FedAdaVR:  # noqa: ANN003
    """MIFA as these tests run it: half of the six nodes sampled, a plain step at server lr 1."""
    options = dict(variant="mifa", client_lr=CLIENT_LR, fraction_train=0.5, fraction_evaluate=0.0, min_train_nodes=3)
    options.update(kwargs)
    options["parts"] = EngineParts(sampler=ClientSampler(seed=3, identify_clients=True))
    return FedAdaVR(**options)


@pytest.mark.parametrize(
    "kwargs, unseen, denominator",
    [
        ({}, "left-out", "heard"),
        (dict(unseen_clients="zero"), "zero", "nodes"),
        (dict(num_clients=10), "zero", 10),
    ],
)
def test_unseen_clients_are_left_out_of_mifas_average_unless_they_count_as_zero(kwargs, unseen, denominator):
    """MIFA's step is the average of the table after replacement: over the clients heard from by default (round 1
    is FedAvg's plain mean), over N with zero rows for the others with ``unseen_clients="zero"`` (the papers')."""
    ids = {n: f"partition-{i}" for i, n in enumerate(NODES)}
    current = {"round": 1}
    grid = FakeGrid(NODES, make_client(ids, rnd_of=lambda: current["round"]), client_ids=ids)
    s = mifa(**kwargs)
    assert s.unseen_clients == unseen
    arrays = model_record(tiny_model(0))
    table: dict[str, np.ndarray] = {}
    for rnd in (1, 2, 3):
        current["round"] = rnd
        sent = flat_trainable(named_arrays(arrays)).astype(np.float64)
        arrays, _, replies = run_train_round(s, grid, rnd, arrays)
        for r in replies:
            key = ids[r.metadata.src_node_id]
            table[key] = (flat_trainable(global_arrays_of(r)).astype(np.float64) - sent) / CLIENT_LR
        n = len(table) if denominator == "heard" else len(NODES) if denominator == "nodes" else denominator
        want = sent + CLIENT_LR * sum(table.values()) / n
        np.testing.assert_allclose(flat_trainable(named_arrays(arrays)), want, rtol=1e-5, atol=1e-6)
        if rnd == 1 and denominator == "heard":  # round 1: the plain mean of the three replies, as FedAvg's
            fresh = [flat_trainable(global_arrays_of(r)) - sent for r in replies]
            np.testing.assert_allclose(want, sent + np.mean(fresh, axis=0), rtol=1e-6, atol=1e-7)
    assert 3 < len(table) <= len(NODES)  # later rounds mixed fresh and stale rows


@pytest.mark.parametrize("precision", ["fp32", "int4"])
def test_streamed_rounds_equal_a_plain_transcription_of_the_boxed_estimator(precision, monkeypatch):
    """Rounds 2.. stream each reply into the aggregate and a staged row (no per-reply vector kept);
    the model and table still follow r = mean_S(y_i - D(y_i_old)) + sum_j p_j D(y_j_old), Adam on eta_c r,
    rows replaced after the step, over five rounds with a client dropping out in one of them."""
    streamed = []
    original = TableAggregate.sink
    monkeypatch.setattr(
        TableAggregate,
        "sink",
        lambda self, strategy, rnd, bound: streamed.append(rnd) or original(self, strategy, rnd, bound),
    )
    ids = {n: f"partition-{i}" for i, n in enumerate(NODES)}
    current = {"round": 1, "drop": set()}
    grid = FakeGrid(NODES, lambda msg: make_client(ids, current["drop"], lambda: current["round"])(msg), client_ids=ids)
    s = strategy(table_precision=precision)
    arrays = model_record(tiny_model(0))
    x = flat_trainable(tiny_model(0)).astype(np.float64)
    opt = make_server_optimizer("adam", eta=0.01, beta_1=0.9, beta_2=0.999, eps=1e-8, bias_correction=True)
    opt_state = opt.init(19)
    table: dict[str, np.ndarray] = {}
    for rnd in range(1, 6):
        current["round"], current["drop"] = rnd, ({NODES[2], NODES[3]} if rnd == 4 else set())
        sent = flat_trainable(named_arrays(arrays)).astype(np.float32)
        arrays, _, replies = run_train_round(s, grid, rnd, arrays)
        replied = [ids[r.metadata.src_node_id] for r in replies if r.has_content()]
        ys = {
            ids[r.metadata.src_node_id]: (flat_trainable(global_arrays_of(r)).astype(np.float32) - sent)
            / np.float32(CLIENT_LR)
            for r in replies
            if r.has_content()
        }
        population = len(NODES)  # every node identified itself in round 1
        r_vec = sum(table.values(), np.zeros(19)) / population
        r_vec = r_vec + np.mean([ys[k].astype(np.float64) - table.get(k, 0.0) for k in replied], axis=0)
        step, opt_state = opt.update(opt_state, (CLIENT_LR * r_vec).astype(np.float32))
        x = x + step
        for k in replied:
            table[k] = _stored(ys[k], s, precision)
        np.testing.assert_allclose(flat_trainable(named_arrays(arrays)), x, rtol=1e-6, atol=1e-7)
        for k, row in table.items():
            np.testing.assert_array_equal(s.table.get(k), row.astype(np.float32))
    assert streamed == [2, 3, 4, 5]
    np.testing.assert_allclose(s.table.running_sum, s.table.recompute_running_sum(), rtol=0, atol=1e-9)


def _stored(y: np.ndarray, s: FedAdaVR, precision: str) -> np.ndarray:
    """What the table holds for ``y``: each tensor quantised on its own (pollen.compression.quant's scheme)."""
    from pollen.compression import quant

    parts = [quant.dequantize(quant.quantize(y[a:b], precision)) for a, b in s.layout.segments]
    return np.concatenate(parts).astype(np.float64)


def test_a_skipped_streamed_round_leaves_the_table_as_it_was():
    """Replies read (and staged) in a round that is then skipped (fewer than min_replies) change no row."""
    ids = {n: f"partition-{i}" for i, n in enumerate(NODES)}
    current = {"round": 1, "drop": set()}
    grid = FakeGrid(NODES, lambda msg: make_client(ids, current["drop"], lambda: current["round"])(msg), client_ids=ids)
    s = strategy(table_precision="int8", min_replies=3)
    arrays = model_record(tiny_model(0))
    for rnd in (1, 2):
        current["round"] = rnd
        arrays, _, _ = run_train_round(s, grid, rnd, arrays)
    before = {k: s.table.get(k) for k in s.table.keys()}
    running = s.table.running_sum.copy()
    current["round"], current["drop"] = 3, set(NODES[:4])
    messages = list(s.configure_train(3, arrays, ConfigRecord(), grid))
    replies = list(grid.send_and_receive(messages, timeout=1.0))
    assert sum(r.has_content() for r in replies) < 3
    out, _ = s.aggregate_train(3, replies)
    assert out is None
    assert sorted(s.table.keys()) == sorted(before)
    for k, row in before.items():
        np.testing.assert_array_equal(s.table.get(k), row)
    np.testing.assert_array_equal(s.table.running_sum, running)
