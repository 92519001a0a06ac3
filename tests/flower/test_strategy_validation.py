"""Replies that cannot be trusted are rejected, logged and counted; the round goes on (DESIGN.md).

Four nodes train; one of them sends a bad reply. The round must complete with the
other three as if the bad reply had never arrived: the model equals ``x_0 + AMSGrad step(mean of the 3 good deltas)``,
the failure is counted with its reason in ``accounting.rounds[r].failure_reasons`` and a warning is
logged. When every reply is bad, the model is unchanged and ``aggregate_train`` returns
``(None, None)``. Constructor arguments out of range raise ``ValueError`` naming them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord

from pollen.clientside import compression_mod
from pollen.compression import decode_payload
from pollen.optim import amsgrad
from pollen.strategies import FedAMS, FedCAMS, MeteredFedAdam, MeteredFedAvg
from pollen.testing.fakes import (
    BUFFERS,
    FakeGrid,
    capture_flwr_logs,
    config_of,
    error_reply,
    flat_trainable,
    full_model_reply,
    global_arrays_of,
    make_context,
    messages_text,
    model_record,
    named_arrays,
    reply,
    run_train_round,
    split_trainable,
    tiny_model,
)
from pollen.wire import protocol
from pollen.wire.records import records_to_payload

pytestmark = pytest.mark.flower_compat

D = 19
NODES = [1, 2, 3, 4]
BAD = 3
NUM_EXAMPLES = {1: 10, 2: 20, 3: 30, 4: 40}
EPS = 1e-3
ETA = 0.5


def client_delta(node: int) -> np.ndarray:
    return (np.random.default_rng(node).standard_normal(D) * 0.1).astype(np.float32)


def good_local(msg: Message) -> dict[str, np.ndarray]:
    node = msg.metadata.dst_node_id
    g = global_arrays_of(msg)
    local = dict(g)
    for name, part in split_trainable(client_delta(node), g).items():
        local[name] = (g[name] + part).astype(np.float32)
    local["bn.running_mean"] = np.full(4, float(node), dtype=np.float32)
    local["bn.num_batches_tracked"] = np.array(10 * node, dtype=np.int64)
    return local


def good_full_reply(msg: Message) -> Message:
    return full_model_reply(msg, good_local(msg), num_examples=NUM_EXAMPLES[msg.metadata.dst_node_id])


def replace_records(msg: Message, good: Message, changes: dict[str, object]) -> Message:
    """A reply like ``good`` with some records replaced (``None`` drops one)."""
    records = {name: record for name, record in good.content.items()}
    for name, record in changes.items():
        if record is None:
            records.pop(name, None)
        else:
            records[name] = record
    return reply(msg, records)


def with_arrays(
    msg: Message, good: Message, edit: Callable[[dict], None], num_examples: float | None = None
) -> Message:
    arrays = named_arrays(good.content[protocol.ARRAYS_RECORD])
    edit(arrays)
    n = NUM_EXAMPLES[msg.metadata.dst_node_id] if num_examples is None else num_examples
    return full_model_reply(msg, arrays, num_examples=n)


def update_arrays(good: Message) -> dict[str, np.ndarray]:
    return named_arrays(good.content[protocol.UPDATE_RECORD])


def with_update(msg: Message, good: Message, edit: Callable[[dict], None]) -> Message:
    arrays = update_arrays(good)
    edit(arrays)
    record = ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in arrays.items()})
    return replace_records(msg, good, {protocol.UPDATE_RECORD: record})


def with_meta(msg: Message, good: Message, **meta: object) -> Message:
    values = dict(good.content[protocol.UPDATE_META_RECORD])
    values.update(meta)
    return replace_records(msg, good, {protocol.UPDATE_META_RECORD: ConfigRecord(values)})


def _set(arrays: dict, name: str, value: np.ndarray) -> None:
    arrays[name] = value


@dataclass(frozen=True)
class Case:
    id: str
    strategy: str  # "full", "weighted", "sign", "topk"
    tamper: Callable[[Message, Message], Message | None]
    reason: str


def _nan(arrays: dict) -> None:
    arrays["conv.weight"] = arrays["conv.weight"].copy()
    arrays["conv.weight"][1, 2] = np.nan


def _inf_buffer(arrays: dict) -> None:
    arrays["bn.running_mean"] = np.array([0, np.inf, 0, 0], dtype=np.float32)


def _nan_scale(arrays: dict) -> None:
    arrays["scale"] = np.array([np.nan], dtype=np.float32)


def _padding(arrays: dict) -> None:
    bits = arrays["bits"].copy()
    bits[-1] |= 1  # d = 19: the last 5 bits of byte 3 are padding and must be zero
    arrays["bits"] = bits


def _topk_out_of_range(arrays: dict) -> None:
    idx = arrays["indices"].copy()
    idx[-1] = 200  # uint8 index for d = 19; ascending, but >= d
    arrays["indices"] = idx


def _topk_duplicate(arrays: dict) -> None:
    idx = arrays["indices"].copy()
    idx[1] = idx[0]
    arrays["indices"] = idx


CASES = [
    # -- full-model replies (any Flower ClientApp)
    Case("nan-in-arrays", "full", lambda m, g: with_arrays(m, g, _nan), "NaN or Inf"),
    Case("inf-in-buffer", "full", lambda m, g: with_arrays(m, g, _inf_buffer), "NaN or Inf"),
    Case(
        "wrong-shape",
        "full",
        lambda m, g: with_arrays(m, g, lambda a: _set(a, "conv.bias", np.zeros(5, np.float32))),
        "shape",
    ),
    Case(
        "wrong-shape-same-size",
        "full",
        lambda m, g: with_arrays(m, g, lambda a: _set(a, "conv.weight", np.ascontiguousarray(a["conv.weight"].T))),
        "shape",
    ),
    Case(
        "missing-array", "full", lambda m, g: with_arrays(m, g, lambda a: a.pop("conv.bias")), "missing ['conv.bias']"
    ),
    Case(
        "extra-array",
        "full",
        lambda m, g: with_arrays(m, g, lambda a: _set(a, "head.weight", np.zeros(2, np.float32))),
        "unexpected ['head.weight']",
    ),
    Case("error-reply", "full", lambda m, g: error_reply(m, "CUDA out of memory"), "client error: CUDA out of memory"),
    Case("no-reply", "full", lambda m, g: None, "no reply"),
    Case(
        "no-model-at-all",
        "full",
        lambda m, g: reply(m, {"metrics": MetricRecord({"num-examples": 5})}),
        "neither",
    ),
    Case("zero-examples", "weighted", lambda m, g: with_arrays(m, g, lambda a: None, num_examples=0), "positive"),
    Case("negative-examples", "weighted", lambda m, g: with_arrays(m, g, lambda a: None, num_examples=-3), "positive"),
    Case(
        "no-num-examples",
        "weighted",
        lambda m, g: replace_records(m, g, {"metrics": MetricRecord({"loss": 0.1})}),
        "num-examples",
    ),
    # -- compressed replies (pollen's compression_mod)
    Case(
        "truncated-bits",
        "sign",
        lambda m, g: with_update(m, g, lambda a: _set(a, "bits", a["bits"][:-1].copy())),
        "length",
    ),
    Case("nan-scale", "sign", lambda m, g: with_update(m, g, _nan_scale), "scale"),
    Case("nonzero-padding-bits", "sign", lambda m, g: with_update(m, g, _padding), "padding"),
    Case(
        "extra-payload-array",
        "sign",
        lambda m, g: with_update(m, g, lambda a: _set(a, "junk", np.zeros(3, np.uint8))),
        "unexpected",
    ),
    Case("negative-dim", "sign", lambda m, g: with_meta(m, g, dim=-5), "dim"),
    Case("wrong-dim", "sign", lambda m, g: with_meta(m, g, dim=D - 1), "dim"),
    Case("garbage-dim", "sign", lambda m, g: with_meta(m, g, dim="nineteen"), "dim"),
    Case("float-dim", "sign", lambda m, g: with_meta(m, g, dim=19.0), "dim"),
    Case("unknown-codec", "sign", lambda m, g: with_meta(m, g, codec="gzip"), "unknown codec"),
    Case(
        "missing-meta", "sign", lambda m, g: replace_records(m, g, {protocol.UPDATE_META_RECORD: None}), "meta record"
    ),
    Case("missing-buffers", "sign", lambda m, g: replace_records(m, g, {protocol.BUFFERS_RECORD: None}), "buffers"),
    Case(
        "nan-in-buffers",
        "sign",
        lambda m, g: replace_records(
            m,
            g,
            {
                protocol.BUFFERS_RECORD: model_record(
                    {"bn.running_mean": np.full(4, np.nan, np.float32), "bn.num_batches_tracked": np.array(1)}
                )
            },
        ),
        "NaN or Inf",
    ),
    Case("topk-index-out-of-range", "topk", lambda m, g: with_update(m, g, _topk_out_of_range), "out of range"),
    Case("topk-duplicate-index", "topk", lambda m, g: with_update(m, g, _topk_duplicate), "duplicate"),
]


def make_strategy(kind: str):  # noqa: ANN201
    common = dict(eta=ETA, eps=EPS, option=1, fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=4)
    if kind == "full":
        return FedAMS(**common)
    if kind == "weighted":
        return FedAMS(aggregation="weighted", **common)
    if kind == "sign":
        return FedCAMS(compressor="sign", granularity="model", **common)
    return FedCAMS(compressor="topk", topk_ratio=1 / 8, **common)


def make_client(kind: str, tamper, bad_nodes) -> tuple[Callable, dict]:  # noqa: ANN001
    contexts = {n: make_context(n) for n in NODES}

    def train_fn(msg: Message, context) -> Message:  # noqa: ANN001
        return good_full_reply(msg)

    def client(msg: Message) -> Message | None:
        node = msg.metadata.dst_node_id
        good = compression_mod(msg, contexts[node], train_fn)
        if kind in ("sign", "topk"):
            assert protocol.UPDATE_RECORD in good.content.array_records  # the mod did compress
        return tamper(msg, good) if node in bad_nodes else good

    return client, contexts


def decoded_delta(good: Message, x0: np.ndarray) -> np.ndarray:
    content = good.content
    if protocol.UPDATE_RECORD in content.array_records:
        payload = records_to_payload(content[protocol.UPDATE_RECORD], content[protocol.UPDATE_META_RECORD])
        return decode_payload(payload, D).astype(np.float64)
    return flat_trainable(named_arrays(content[protocol.ARRAYS_RECORD])) - x0


def good_buffers(good: Message) -> dict[str, np.ndarray]:
    content = good.content
    name = protocol.BUFFERS_RECORD if protocol.BUFFERS_RECORD in content.array_records else protocol.ARRAYS_RECORD
    arrays = named_arrays(content[name])
    return {k: arrays[k] for k in BUFFERS}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bad_reply_is_rejected_and_round_completes(case: Case):
    strategy = make_strategy(case.strategy)
    client, _ = make_client(case.strategy, case.tamper, {BAD})
    grid = FakeGrid(NODES, client)
    x0 = tiny_model(0)
    x0_flat = flat_trainable(x0)
    with capture_flwr_logs() as logs:
        arrays, metrics, replies = run_train_round(strategy, grid, 1, model_record(x0))

    stats = strategy.accounting.rounds[1]
    assert (stats.sampled, stats.replies, stats.failures) == (4, 3, 1)
    assert len(stats.failure_reasons) == 1
    reason = stats.failure_reasons[0]
    assert reason.startswith(f"node-{BAD}: ")
    assert case.reason in reason
    warnings = [r for r in logs if r.levelname == "WARNING" and "rejected" in r.getMessage()]
    assert len(warnings) == 1 and case.reason in warnings[0].getMessage(), messages_text(logs)
    assert metrics is not None

    # The model moved with the three good updates only.
    good = [r for r in replies if r.metadata.src_node_id != BAD]
    assert len(good) == 3
    deltas = [decoded_delta(r, x0_flat) for r in good]
    if case.strategy == "weighted":
        w = np.array([NUM_EXAMPLES[r.metadata.src_node_id] for r in good], dtype=np.float64)
        delta = np.tensordot(w / w.sum(), np.array(deltas), axes=1)
        w_buf = w / w.sum()
    else:
        delta = np.mean(deltas, axis=0)
        w_buf = np.full(3, 1 / 3)
    optimizer = amsgrad(eta=ETA, eps=EPS, eps_mode="max")
    step, _ = optimizer.update(optimizer.init(D), delta.astype(np.float32))
    np.testing.assert_allclose(strategy.params, x0_flat + step, rtol=1e-6, atol=1e-7)
    out = named_arrays(arrays)
    np.testing.assert_allclose(flat_trainable(out), x0_flat + step, rtol=1e-6, atol=1e-7)
    buffers = [good_buffers(r) for r in good]
    want_mean = sum(wi * b["bn.running_mean"].astype(np.float64) for wi, b in zip(w_buf, buffers))
    np.testing.assert_allclose(out["bn.running_mean"], want_mean, rtol=1e-6)
    want_count = sum(wi * float(b["bn.num_batches_tracked"].reshape(())) for wi, b in zip(w_buf, buffers))
    assert out["bn.num_batches_tracked"].dtype == np.int64
    assert abs(int(out["bn.num_batches_tracked"].reshape(())) - want_count) <= 0.5


@pytest.mark.parametrize(
    "case",
    [
        c
        for c in CASES
        if c.id
        in (
            "nan-in-arrays",
            "error-reply",
            "no-reply",
            "truncated-bits",
            "unknown-codec",
            "zero-examples",
            "topk-index-out-of-range",
        )
    ],
    ids=lambda c: c.id,
)
def test_all_replies_bad_leaves_model_unchanged(case: Case):
    strategy = make_strategy(case.strategy)
    client, _ = make_client(case.strategy, case.tamper, set(NODES))
    grid = FakeGrid(NODES, client)
    x0 = tiny_model(0)
    messages = strategy.configure_train(1, model_record(x0), ConfigRecord(), grid)
    replies = list(grid.send_and_receive(messages, timeout=1.0))
    m_before = strategy.opt_state.slots["m"].copy()
    with capture_flwr_logs() as logs:
        result = strategy.aggregate_train(1, replies)
    assert result == (None, None)
    np.testing.assert_array_equal(strategy.params, flat_trainable(x0).astype(np.float32))
    assert strategy.opt_state.step == 0
    np.testing.assert_array_equal(strategy.opt_state.slots["m"], m_before)
    for name in BUFFERS:
        np.testing.assert_array_equal(strategy.buffers[name], x0[name])
    stats = strategy.accounting.rounds[1]
    assert (stats.replies, stats.failures) == (0, 4)
    assert all(case.reason in reason for reason in stats.failure_reasons)
    assert "model is unchanged" in messages_text(logs)
    # The next round starts from the same model and still works.
    grid.client_fn, _ = make_client(case.strategy, case.tamper, set())
    arrays, _, _ = run_train_round(strategy, grid, 2, model_record(x0))
    assert strategy.opt_state.step == 1
    assert strategy.accounting.rounds[2].failures == 0
    assert not np.array_equal(flat_trainable(named_arrays(arrays)), flat_trainable(x0))


def test_failures_in_start_do_not_stop_the_run():
    """Through ``Strategy.start``: one node always crashes, the run still finishes."""

    def client(msg: Message) -> Message:
        if msg.metadata.dst_node_id == BAD:
            return error_reply(msg, "boom")
        return good_full_reply(msg)

    grid = FakeGrid(NODES, client)
    strategy = make_strategy("full")
    result = strategy.start(grid=grid, initial_arrays=model_record(tiny_model(0)), num_rounds=3)
    assert [strategy.accounting.rounds[r].failures for r in (1, 2, 3)] == [1, 1, 1]
    assert [strategy.accounting.rounds[r].replies for r in (1, 2, 3)] == [3, 3, 3]
    assert all(config_of(m)[protocol.CFG_SERVER_ROUND] in (1, 2, 3) for m in grid.train_messages())
    assert strategy.opt_state.step == 3
    assert set(named_arrays(result.arrays)) == set(tiny_model(0))


# --------------------------------------------------------------------------- constructor errors
@pytest.mark.parametrize(
    ("build", "argument"),
    [
        (lambda: FedAMS(fraction_train=0.0), "fraction_train"),
        (lambda: FedAMS(fraction_train=1.5), "fraction_train"),
        (lambda: FedAMS(fraction_evaluate=-0.1), "fraction_evaluate"),
        (lambda: FedAMS(min_train_nodes=-1), "min_train_nodes"),
        (lambda: FedAMS(aggregation="median"), "aggregation"),
        (lambda: FedAMS(option=4), "option"),
        (lambda: FedAMS(eta=0.0), "eta"),
        (lambda: FedAMS(beta_1=1.0), "beta_?1"),
        (lambda: FedAMS(option=1, eps=0.0), "eps"),
        (lambda: FedCAMS(compressor="gzip"), "compressor"),
        (lambda: FedCAMS(compressor="topk", topk_ratio=0.0), "topk_ratio"),
        (lambda: FedCAMS(topk_ratio=1.5), "topk_ratio"),
        (lambda: FedCAMS(granularity="layer"), "granularity"),
        (lambda: FedCAMS(aggregation="sum"), "aggregation"),
    ],
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_constructor_rejects_bad_arguments(build, argument):
    with pytest.raises(ValueError, match=argument) as info:
        build()
    assert "allowed" in str(info.value)


def test_constructor_accepts_the_edges():
    FedAMS(fraction_train=1.0, fraction_evaluate=0.0, option=2, eps=0.0)
    FedCAMS(compressor="topk", topk_ratio=1.0, granularity="tensor", error_feedback=False)
    assert FedCAMS(compressor="none").round_config(1)[protocol.CFG_CODEC] == "none"


# --------------------------------------------------------------------------- Flower's own baselines
@pytest.mark.parametrize("strategy_cls", [MeteredFedAvg, MeteredFedAdam])
def test_flower_baselines_hold_back_untrusted_replies(strategy_cls):
    """Flower's own aggregation would average a NaN model in (or raise); the metered wrapper rejects it."""
    x0 = tiny_model(0)

    def client(msg):  # noqa: ANN001, ANN202
        node = msg.metadata.dst_node_id
        local = {k: (v + 0.1 if np.issubdtype(v.dtype, np.floating) else v) for k, v in global_arrays_of(msg).items()}
        if node == 1:
            local["conv.weight"] = np.full_like(local["conv.weight"], np.nan)
        if node == 2:
            return full_model_reply(msg, local, num_examples=0)
        if node == 3:
            local["fc.bias"] = np.zeros(7, np.float32)
        return full_model_reply(msg, local, num_examples=10)

    strategy = strategy_cls(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=5, min_available_nodes=5)
    grid = FakeGrid([1, 2, 3, 4, 5], client)
    arrays, _, _ = run_train_round(strategy, grid, 1, model_record(x0))
    stats = strategy.accounting.rounds[1]
    assert (stats.sampled, stats.replies, stats.failures) == (5, 2, 3)
    assert all(np.all(np.isfinite(a)) for a in named_arrays(arrays).values())
    assert any("NaN" in r for r in stats.failure_reasons)
    assert any("num-examples" in r for r in stats.failure_reasons)
