"""Flower's metered baselines read replies through pollen's one collector: the same guarantees.

A duplicate reply, a reply from a node that was not sampled, or a late reply from an earlier round is
a failure with a reason and never reaches Flower's aggregation; a reply left out for its metric names
leaves nothing in the outlier screen's history.
"""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ConfigRecord, MetricRecord

from pollen.strategies import MeteredFedAdam, MeteredFedAvg
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
    assert stats.replies == len(asked)
    assert stats.failures == len(extra)
    assert any("second reply" in reason for reason in stats.failure_reasons)
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
