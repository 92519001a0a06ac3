"""Flower's metered baselines compute what Flower's own strategies compute: on honest replies ``MeteredFedAvg``,
``MeteredFedAdam``, ``MeteredFedYogi`` and ``MeteredFedAdagrad`` end a run bit-identical to
``flwr.serverapp.strategy.FedAvg`` / ``FedAdam`` / ``FedYogi`` / ``FedAdagrad`` built with the same arguments:
the same nodes sampled (Flower samples with the global ``random``, seeded before each run), the same global
model, the same moments and the same metrics. The metering (bytes, reply checks, the outlier screen, the
round's transaction) observes and holds back untrusted replies; it changes nothing of an honest round.

pollen's collector hands the replies to Flower's aggregation in client-id order, whatever order they came in
(so the bits do not depend on which client finished first); Flower's own strategy sums them in the order they
came. The runs agree when the replies come back in that order; a metered run gives the same bits in any order.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from flwr.app import MessageType, MetricRecord
from flwr.serverapp import strategy as flower

from pollen.strategies import MeteredFedAdagrad, MeteredFedAdam, MeteredFedAvg, MeteredFedYogi
from pollen.testing.fakes import FakeGrid, config_of, full_model_reply, model_record, named_arrays, reply, tiny_model
from pollen.wire import protocol

pytestmark = pytest.mark.flower_compat

NODES = [1, 2, 3, 4, 5, 6]
SEED = 2024
SAMPLING = {"fraction_train": 0.5, "fraction_evaluate": 0.5, "min_available_nodes": 2}
OPTIMISER = {"eta": 0.05, "eta_l": 0.02, "beta_1": 0.8, "beta_2": 0.95, "tau": 1e-3}
PAIRS = {
    "fedavg": (MeteredFedAvg, flower.FedAvg, {}),
    "fedadam": (MeteredFedAdam, flower.FedAdam, OPTIMISER),
    "fedyogi": (MeteredFedYogi, flower.FedYogi, OPTIMISER),
    "fedadagrad": (MeteredFedAdagrad, flower.FedAdagrad, {"eta": 0.05, "eta_l": 0.02, "tau": 1e-3}),
}


@pytest.fixture(autouse=True)
def _keep_the_global_random_state():
    """The runs seed Python's global ``random`` (Flower's sampler): leave it as it was for other tests."""
    state = random.getstate()
    yield
    random.setstate(state)


def honest_client(msg):  # noqa: ANN001, ANN201
    """Trains to a model drawn from (node, round): no value with a short binary expansion, so the sum's order
    shows in the bits; evaluates to a loss of its own."""
    node = msg.metadata.dst_node_id
    server_round = int(config_of(msg)[protocol.CFG_SERVER_ROUND])
    rng = np.random.default_rng(1000 * node + server_round)
    if msg.metadata.message_type == MessageType.EVALUATE:
        metrics = {protocol.NUM_EXAMPLES: 7 * node, "loss": float(rng.uniform(0.1, 2.0))}
        return reply(msg, {protocol.METRICS_RECORD: MetricRecord(metrics)})
    arrays = {
        name: value + rng.normal(0.0, 0.05, value.shape).astype(value.dtype) if value.dtype.kind == "f" else value + 1
        for name, value in named_arrays(msg.content.array_records[protocol.ARRAYS_RECORD]).items()
    }
    return full_model_reply(msg, arrays, num_examples=10 * node + server_round, loss=float(rng.uniform(0.1, 2.0)))


class InClientIdOrder(FakeGrid):
    """Hands the replies back ordered by node (here: by client id), as a SuperLink may when they finish so."""

    def send_and_receive(self, messages, *, timeout=None):  # noqa: ANN001, ANN201
        replies = super().send_and_receive(messages, timeout=timeout)
        return sorted(replies, key=lambda message: message.metadata.src_node_id)


def run(make, grid_class: type[FakeGrid]):  # noqa: ANN001, ANN201
    random.seed(SEED)
    grid = grid_class(NODES, honest_client)
    strategy = make()
    result = strategy.start(grid=grid, initial_arrays=model_record(tiny_model()), num_rounds=3, timeout=5.0)
    return strategy, result, grid


def differences(name: str, grid_class: type[FakeGrid]) -> list[str]:
    """What differs between the metered baseline's run and Flower's own (empty: bit-identical)."""
    metered_class, flower_class, method = PAIRS[name]
    metered, ours, our_grid = run(lambda: metered_class(**SAMPLING, **method), grid_class)
    flowers, theirs, their_grid = run(lambda: flower_class(**SAMPLING, **method), grid_class)
    assert our_grid.sampled_per_call() == their_grid.sampled_per_call()  # the same nodes, round after round
    assert our_grid.sampled_per_call(MessageType.EVALUATE) == their_grid.sampled_per_call(MessageType.EVALUATE)
    assert all(stats.failures == 0 for stats in metered.accounting.rounds.values())  # every reply was honest
    found = []
    mine, want = named_arrays(ours.arrays), named_arrays(theirs.arrays)
    if list(mine) != list(want):
        found.append(f"model arrays {list(mine)} vs {list(want)}")
    for key in want:
        if mine[key].dtype != want[key].dtype or not np.array_equal(mine[key], want[key]):
            found.append(f"model '{key}'")
    for moment in ("m_t", "v_t"):
        for key, value in (getattr(flowers, moment, None) or {}).items():
            if not np.array_equal(getattr(metered, moment)[key], value):
                found.append(f"{moment} '{key}'")
    for field in ("train_metrics_clientapp", "evaluate_metrics_clientapp"):
        if {r: dict(m) for r, m in getattr(ours, field).items()} != {
            r: dict(m) for r, m in getattr(theirs, field).items()
        }:
            found.append(field)
    return found


@pytest.mark.parametrize("name", list(PAIRS))
def test_on_honest_replies_a_metered_baseline_ends_bit_identical_to_flowers_own(name: str) -> None:
    assert differences(name, InClientIdOrder) == []


@pytest.mark.parametrize("name", list(PAIRS))
def test_the_runs_train_and_evaluate_every_round(name: str) -> None:
    metered_class, _, method = PAIRS[name]
    _, result, grid = run(lambda: metered_class(**SAMPLING, **method), InClientIdOrder)
    assert [len(nodes) for nodes in grid.sampled_per_call()] == [3, 3, 3]
    assert sorted(result.train_metrics_clientapp) == sorted(result.evaluate_metrics_clientapp) == [1, 2, 3]
    start, end = tiny_model(), named_arrays(result.arrays)
    assert not np.array_equal(end["conv.weight"], start["conv.weight"])  # the model moved: the runs compare work


@pytest.mark.parametrize("name", list(PAIRS))
def test_a_metered_baselines_result_does_not_depend_on_which_client_finished_first(name: str) -> None:
    """pollen's choice where Flower's own strategy sums in arrival order: the replies reach Flower's aggregation
    in client-id order, so the same replies give the same bits in any arrival order (and Flower's result in
    that order, above)."""
    metered_class, _, method = PAIRS[name]
    _, by_id, _ = run(lambda: metered_class(**SAMPLING, **method), InClientIdOrder)
    _, as_sampled, _ = run(lambda: metered_class(**SAMPLING, **method), FakeGrid)
    for key, value in named_arrays(by_id.arrays).items():
        assert np.array_equal(named_arrays(as_sampled.arrays)[key], value), key
