"""Flower's metered baselines read replies through pollen's one collector: the same guarantees.

A duplicate reply, a reply from a node that was not sampled, or a late reply from an earlier round is
a failure with a reason and never reaches Flower's aggregation; a reply left out for its metric names
leaves nothing in the outlier screen's history. A checkpoint's saved model (and Flower's current model and
moments) is checked on resume like everyone's: dtypes, finite values, the hard limit (issue 43).
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from flwr.app import ConfigRecord, MetricRecord

from pollen.core.checkpoint import load_checkpoint, save_checkpoint
from pollen.core.state_fields import StateError
from pollen.strategies import MeteredFedAdam, MeteredFedAvg, RunCheckpoint, RunInterrupted
from pollen.strategies.engine.parts import EngineParts, UpdateScreen
from pollen.testing.fakes import FakeGrid, full_model_reply, model_record, named_arrays, tiny_model
from pollen.wire import protocol

NODES = [21, 22, 23, 24]
pytestmark = pytest.mark.flower_compat


def moving_client(msg):  # noqa: ANN001, ANN201
    """A full-model client that moves every tensor by +0.01 x (its node id - 20)."""
    arrays = {
        k: v + np.asarray(0.01 * (msg.metadata.dst_node_id - 20), dtype=v.dtype) if v.dtype.kind == "f" else v
        for k, v in named_arrays(msg.content.array_records[protocol.ARRAYS_RECORD]).items()
    }
    return full_model_reply(msg, arrays, num_examples=10)


def start_round(strategy, grid: FakeGrid, server_round: int):  # noqa: ANN001, ANN201
    arrays = model_record(tiny_model())
    messages = list(strategy.configure_train(server_round, arrays, ConfigRecord(), grid))
    return messages, list(grid.send_and_receive(messages))


@pytest.mark.parametrize(
    "make",
    [
        lambda: MeteredFedAvg(fraction_train=0.5, fraction_evaluate=0.0, min_available_nodes=2),
        lambda: MeteredFedAdam(fraction_train=0.5, fraction_evaluate=0.0, min_available_nodes=2),
    ],
    ids=["fedavg", "fedadam"],
)
def test_duplicate_unasked_and_late_replies_are_failures_not_aggregated(make) -> None:  # noqa: ANN001
    grid = FakeGrid(NODES, moving_client)
    strategy = make()
    old_messages, old_replies = start_round(strategy, grid, 1)
    strategy.aggregate_train(1, old_replies)

    messages, replies = start_round(strategy, grid, 2)
    asked = {m.metadata.dst_node_id for m in messages}
    stranger_msg = (
        next(m for m in old_messages if m.metadata.dst_node_id not in asked)
        if any(m.metadata.dst_node_id not in asked for m in old_messages)
        else None
    )
    duplicate = moving_client(messages[0])
    late = [r for r in old_replies if r.metadata.src_node_id not in asked]
    extra = [duplicate, *late]
    if stranger_msg is None:  # the same nodes were sampled twice: forge a reply from a node never asked
        forged = moving_client(messages[0])
        forged.metadata.__dict__["_src_node_id"] = next(n for n in NODES if n not in asked)
        extra.append(forged)
    strategy.aggregate_train(2, replies + extra)
    stats = strategy.accounting.rounds[2]
    assert stats.replies == len(asked) - 1  # the duplicated node's two answers are both refused
    assert stats.failures == len(extra) + 1
    assert any("two answers to one message" in reason for reason in stats.failure_reasons)
    assert any("not asked" in reason for reason in stats.failure_reasons)


def test_a_silent_node_is_a_failure_with_its_reason() -> None:
    grid = FakeGrid(NODES, moving_client)
    strategy = MeteredFedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=2)
    _, replies = start_round(strategy, grid, 1)
    strategy.aggregate_train(1, replies[1:])
    stats = strategy.accounting.rounds[1]
    assert stats.replies == len(NODES) - 1
    assert stats.failure_reasons == [f"node-{replies[0].metadata.src_node_id}: no reply before the timeout (train)"]


def test_a_reply_left_out_for_its_metric_names_leaves_no_norm_in_the_screen() -> None:
    grid = FakeGrid(NODES, moving_client)
    strategy = MeteredFedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=2)
    _, replies = start_round(strategy, grid, 1)
    odd = replies[-1]
    odd.content[protocol.METRICS_RECORD] = MetricRecord({protocol.NUM_EXAMPLES: 10, "extra-metric": 1.0})
    strategy.aggregate_train(1, replies)
    stats = strategy.accounting.rounds[1]
    assert stats.replies == len(NODES) - 1
    assert any("metric names differ" in reason for reason in stats.failure_reasons)
    assert len(strategy.screen.history[-1]) == len(NODES) - 1


def test_flowers_moments_are_declared_state_and_a_non_finite_one_is_refused_on_load() -> None:
    grid = FakeGrid(NODES, moving_client)
    strategy = MeteredFedAdam(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=2)
    _, replies = start_round(strategy, grid, 1)
    strategy.aggregate_train(1, replies)
    state = strategy.state_dict()
    assert {"current_arrays", "m_t", "v_t"} <= set(state)
    fresh = MeteredFedAdam(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=2)
    fresh.load_state_dict(state)
    for name in ("m_t", "v_t"):
        for key, value in getattr(strategy, name).items():
            np.testing.assert_array_equal(getattr(fresh, name)[key], value)
    poisoned = dict(state)
    name, array = poisoned["v_t"][0]
    poisoned["v_t"] = [[name, np.full_like(array, np.nan)], *poisoned["v_t"][1:]]
    untouched = MeteredFedAdam(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=2)
    with pytest.raises(ValueError, match=r"state field 'strategy/v_t/.*' holds .*nan.*; expected finite values"):
        untouched.load_state_dict(poisoned)
    assert getattr(untouched, "v_t", None) is None  # nothing was loaded


# ---------------------------------------------------------------------------- refused up front
def _as_npy_1_1(value: np.ndarray):  # noqa: ANN202
    """An ``Array`` whose ``.npy`` stream says format 1.1 (np.load, Flower's reader, knows 1.0, 2.0, 3.0)."""
    from flwr.app import Array

    from pollen.wire.records import numpy_to_array

    good = numpy_to_array(value)
    data = bytes(good.data)
    return Array(dtype=good.dtype, shape=tuple(good.shape), stype=good.stype, data=data[:6] + b"\x01\x01" + data[8:])


def _with_loss(msg, loss: float | list[float] = 0.45):  # noqa: ANN001, ANN202
    """``moving_client`` that also reports a training loss (a number, or a list of per-epoch losses)."""
    out = moving_client(msg)
    out.content[protocol.METRICS_RECORD] = MetricRecord({protocol.NUM_EXAMPLES: 10, "loss": loss})
    return out


def _list_metric(msg):  # noqa: ANN001, ANN202
    return _with_loss(msg, [0.5, 0.4])


def _renamed_metrics(msg):  # noqa: ANN001, ANN202
    out = _with_loss(msg)
    del out.content[protocol.METRICS_RECORD]
    out.content["my-metrics"] = MetricRecord({protocol.NUM_EXAMPLES: 10, "loss": 0.45})
    return out


def _counter_as_shape_1(msg):  # noqa: ANN001, ANN202
    arrays = named_arrays(moving_client(msg).content.array_records[protocol.ARRAYS_RECORD])
    counter = np.array([3], dtype=np.int64)
    return full_model_reply(msg, {**arrays, "bn.num_batches_tracked": counter}, num_examples=10, loss=0.45)


def _npy_1_1(msg):  # noqa: ANN001, ANN202
    out = _with_loss(msg)
    record = out.content.array_records[protocol.ARRAYS_RECORD]
    record["conv.bias"] = _as_npy_1_1(np.asarray(named_arrays(record)["conv.bias"]))
    return out


def _huge_running_mean(msg):  # noqa: ANN001, ANN202
    arrays = named_arrays(moving_client(msg).content.array_records[protocol.ARRAYS_RECORD])
    huge = np.full(4, 1e12, np.float32)
    return full_model_reply(msg, {**arrays, "bn.running_mean": huge}, num_examples=10, loss=0.45)


ODD_REPLIES = {
    "list-valued-metric": (_list_metric, "metric 'loss' is a list of 2 where the round's other replies have a number"),
    "renamed-metrics-record": (_renamed_metrics, "metrics record 'my-metrics' is named differently"),
    "0-d-buffer-as-shape-1": (_counter_as_shape_1, "array 'bn.num_batches_tracked' has shape (1,), the model has ()"),
    "npy-format-1.1": (_npy_1_1, "unknown .npy version 1.1"),
    "buffer-1e12": (_huge_running_mean, "buffer 'bn.running_mean' has norm"),
}


@pytest.mark.parametrize("make", [MeteredFedAvg, MeteredFedAdam], ids=["fedavg", "fedadam"])
@pytest.mark.parametrize("odd", sorted(ODD_REPLIES))
def test_a_reply_flowers_aggregation_would_refuse_is_refused_up_front_and_the_round_goes_on(make, odd) -> None:  # noqa: ANN001
    """pollen's reader would take each of these; Flower's aggregation raises on it (or broadcasts a shape
    into the model), which failed the whole round. Now it is one failure with a reason, the rest aggregate."""
    odd_client, reason = ODD_REPLIES[odd]
    victim = NODES[2]
    grid = FakeGrid(NODES, lambda msg: odd_client(msg) if msg.metadata.dst_node_id == victim else _with_loss(msg))
    silent_grid = FakeGrid(NODES, lambda msg: None if msg.metadata.dst_node_id == victim else _with_loss(msg))
    results = []
    for this_grid in (grid, silent_grid):
        strategy = make(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=2)
        _, replies = start_round(strategy, this_grid, 1)
        results.append((strategy, *strategy.aggregate_train(1, replies)))
    (strategy, arrays, metrics), (_, silent_arrays, _) = results
    stats = strategy.accounting.rounds[1]
    assert stats.replies == len(NODES) - 1, stats.failure_reasons
    assert len(stats.failure_reasons) == 1 and reason in stats.failure_reasons[0], stats.failure_reasons
    assert arrays is not None and metrics is not None
    for name, value in named_arrays(silent_arrays).items():  # Flower samples (and sums) in a random order
        np.testing.assert_allclose(named_arrays(arrays)[name], value, rtol=1e-6, atol=1e-7, err_msg=name)


def test_list_valued_metrics_that_agree_are_aggregated_by_flower() -> None:
    grid = FakeGrid(NODES, _list_metric)
    strategy = MeteredFedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=2)
    _, replies = start_round(strategy, grid, 1)
    _, metrics = strategy.aggregate_train(1, replies)
    assert strategy.accounting.rounds[1].failures == 0
    np.testing.assert_allclose(metrics["loss"], [0.5, 0.4])


def test_the_strategys_own_weight_key_is_the_one_required() -> None:
    def weighted_by_n(msg):  # noqa: ANN001, ANN202
        out = moving_client(msg)
        out.content[protocol.METRICS_RECORD] = MetricRecord({"n": 5 if msg.metadata.dst_node_id != NODES[0] else 0})
        return out

    grid = FakeGrid(NODES, weighted_by_n)
    strategy = MeteredFedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=2, weighted_by_key="n")
    _, replies = start_round(strategy, grid, 1)
    arrays, _ = strategy.aggregate_train(1, replies)
    stats = strategy.accounting.rounds[1]
    assert arrays is not None and stats.replies == len(NODES) - 1
    assert stats.failure_reasons == [f"node-{NODES[0]}: metrics lack a positive 'n' (got 0)"]


def test_flowers_moments_are_put_back_when_its_step_leaves_inf() -> None:
    """With the hard limit raised and the screen off, a 1e20 coordinate squares to +Inf in FedYogi's v_t."""
    from pollen.strategies import MeteredFedYogi

    def huge(msg):  # noqa: ANN001, ANN202
        arrays = named_arrays(moving_client(msg).content.array_records[protocol.ARRAYS_RECORD])
        if msg.metadata.dst_node_id == NODES[1]:
            arrays = {**arrays, "conv.bias": arrays["conv.bias"] + np.float32(1e20)}
        return full_model_reply(msg, arrays, num_examples=10)

    strategy = MeteredFedYogi(
        fraction_train=1.0,
        fraction_evaluate=0.0,
        min_available_nodes=2,
        parts=EngineParts(screen=UpdateScreen(rule="off")),
    )
    strategy.screen.max_abs = 1e30
    _, replies = start_round(strategy, FakeGrid(NODES, moving_client), 1)
    strategy.aggregate_train(1, replies)
    before = {name: dict(getattr(strategy, name)) for name in ("m_t", "v_t")}
    _, replies = start_round(strategy, FakeGrid(NODES, huge), 2)
    arrays, _ = strategy.aggregate_train(2, replies)
    assert arrays is None
    assert any("NaN or Inf" in reason for reason in strategy.accounting.rounds[2].failure_reasons)
    for name, values in before.items():
        for key, value in values.items():
            np.testing.assert_array_equal(getattr(strategy, name)[key], value, err_msg=f"{name}[{key}]")


# ---------------------------------------------------------------------------- the saved model on resume
LIMIT = r"expected values <= 1e\+15"


@pytest.mark.parametrize(
    ("make", "edit", "words"),
    [
        pytest.param(
            MeteredFedAvg, ("arrays", "conv.bias", 1e30), rf"'arrays/conv.bias' holds .*{LIMIT}", id="avg-1e30"
        ),
        pytest.param(
            MeteredFedAvg,
            ("arrays", "conv.bias", np.int64),
            r"'arrays/conv.bias' has dtype int64; expected float32",
            id="avg-int64",
        ),
        pytest.param(
            MeteredFedAvg,
            ("arrays", "conv.bias", np.float16),
            r"'arrays/conv.bias' has dtype float16; expected float32",
            id="avg-float16",
        ),
        pytest.param(
            MeteredFedAvg,
            ("arrays", "bn.num_batches_tracked", np.float32),
            r"tracked' has dtype float32; expected int64",
            id="avg-buffer-float32",
        ),
        pytest.param(
            MeteredFedAvg,
            ("arrays", "bn.num_batches_tracked", -1e16),
            r"tracked' holds .* expected values >= -1e\+15",
            id="avg-buffer-huge",
        ),
        pytest.param(
            MeteredFedAdam, ("arrays", "conv.weight", 1e30), rf"'arrays/conv.weight' holds .*{LIMIT}", id="adam-1e30"
        ),
        pytest.param(
            MeteredFedAdam,
            ("current_arrays", "conv.bias", 1e30),
            rf"'strategy/current_arrays/conv.bias' holds .*{LIMIT}",
            id="adam-current-1e30",
        ),
        pytest.param(
            MeteredFedAdam,
            ("m_t", "bn.weight", np.int64),
            r"'strategy/m_t/bn.weight' has dtype int64; expected float32",
            id="adam-m_t-int64",
        ),
        pytest.param(
            MeteredFedAdam,
            ("v_t", "bn.weight", np.inf),
            r"'strategy/v_t/bn.weight' holds .* expected finite values",
            id="adam-v_t-inf",
        ),
    ],
)
def test_a_saved_model_of_flowers_baselines_is_checked_like_everyones(make, edit, words, tmp_path) -> None:  # noqa: ANN001
    """Flower's baselines' checkpointed model (and FedAdam's current model and moments): the model's dtype or the
    float64 Flower's arithmetic gives it (its mean of an int64 buffer, FedAdam's step), finite, within the
    screen's hard limit; a checkpoint a run wrote loads (FedAvg keeps the float32 model, the buffer's mean in
    float64)."""

    def build():  # noqa: ANN202
        return make(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=2)

    def start(checkpoint):  # noqa: ANN001, ANN202
        return build().start(
            grid=FakeGrid(NODES, moving_client),
            initial_arrays=model_record(tiny_model()),
            num_rounds=3,
            checkpoint=checkpoint,
        )

    run_dir = tmp_path / "run"
    with pytest.raises(RunInterrupted):
        start(RunCheckpoint(run_dir, stop_after_round=2))
    tree = load_checkpoint(run_dir / "checkpoint.npz")
    saved = dict(tree["arrays"])
    assert saved["conv.bias"].dtype == (np.float32 if make is MeteredFedAvg else np.float64)  # FedAdam's step: f8
    assert saved["bn.num_batches_tracked"].dtype == np.float64  # Flower's mean of an int64 buffer
    start(RunCheckpoint(run_dir, resume=True))  # the checkpoint the run wrote resumes

    part, name, change = edit
    pairs = tree["arrays"] if part == "arrays" else tree["strategy"][part]
    for pair in pairs:
        if pair[0] == name:
            if isinstance(change, type):
                pair[1] = pair[1].astype(change)
            else:
                pair[1] = np.array(pair[1], copy=True)
                pair[1].reshape(-1)[0] = change
    save_checkpoint(run_dir / "checkpoint.npz", tree)
    with pytest.raises(StateError) as caught:
        start(RunCheckpoint(run_dir, resume=True, trust_file=True))
    assert re.search(words, str(caught.value)) and "\n" not in str(caught.value), str(caught.value)
