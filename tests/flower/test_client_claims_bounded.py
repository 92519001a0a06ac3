"""What a client claims stays within bounds (issue 43): evaluation metrics, and the ids it reports.

One client's evaluation accuracy of 1e300 made the round's average 2.5e299 (and went to the trackers); a 1 MB
cluster id in HA-Fed's identify answer was refused but written whole into a log line. Now an evaluation metric
beyond 1e12 in magnitude (or not finite) skips that reply with a reason, for pollen's strategies and Flower's
baselines alike, and a cluster id longer than a client id may be is not kept and not logged.
"""

from __future__ import annotations

import logging

import pytest
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict

from pollen.strategies import FedAMS, MeteredFedAvg
from pollen.strategies.engine.collector import MAX_METRIC
from pollen.strategies.engine.parts import ClientSampler, EngineParts
from pollen.testing.fakes import FakeGrid, capture_flwr_logs, messages_text, model_record, tiny_model
from pollen.wire import protocol

pytestmark = pytest.mark.flower_compat

NODES = [1, 2, 3, 4]


def _evaluate(strategy, accuracies: dict[int, float]) -> MetricRecord | None:  # noqa: ANN001
    def answer(msg: Message) -> Message:
        node = msg.metadata.dst_node_id
        metrics = MetricRecord({"accuracy": accuracies[node], "loss": 0.5, protocol.NUM_EXAMPLES: 10})
        return Message(content=RecordDict({protocol.METRICS_RECORD: metrics}), reply_to=msg)

    grid = FakeGrid(NODES, answer)
    arrays = model_record(tiny_model())
    messages = list(strategy.configure_evaluate(1, arrays, ConfigRecord(), grid))
    return strategy.aggregate_evaluate(1, grid.send_and_receive(messages))


@pytest.mark.parametrize("make", [lambda: FedAMS(fraction_evaluate=1.0, min_evaluate_nodes=4), MeteredFedAvg])
@pytest.mark.parametrize("absurd", [1e300, -1e13, MAX_METRIC * 1.01])
def test_an_absurd_evaluation_metric_skips_that_reply_with_a_reason(make, absurd: float) -> None:  # noqa: ANN001
    strategy = make()
    if isinstance(strategy, MeteredFedAvg):
        strategy = MeteredFedAvg(fraction_evaluate=1.0, min_evaluate_nodes=4)
    with capture_flwr_logs(logging.WARNING) as records:
        metrics = _evaluate(strategy, {1: 0.5, 2: 0.7, 3: absurd, 4: 0.9})
    assert metrics is not None and metrics["accuracy"] == pytest.approx(0.7), metrics
    assert "evaluation metric 'accuracy' is not a finite number within +-1e+12" in messages_text(records)


def test_a_legal_metric_of_any_scale_within_the_bound_is_kept() -> None:
    """The server does not know a project's scale (an accuracy in percent is legal): only magnitude is bounded."""
    metrics = _evaluate(FedAMS(fraction_evaluate=1.0, min_evaluate_nodes=4), {1: 50.0, 2: 70.0, 3: 90.0, 4: 70.0})
    assert metrics["accuracy"] == pytest.approx(70.0)


def test_a_huge_cluster_id_is_not_kept_and_not_logged() -> None:
    grid = FakeGrid(
        NODES,
        lambda msg: None,
        client_ids={n: f"client-{n}" for n in NODES},
        cluster_ids={1: "x" * 1_000_000, 2: "a", 3: "a", 4: "a"},
    )
    sampler = ClientSampler(identify_clients=True)
    FedAMS(parts=EngineParts(sampler=sampler))  # the sampler is the strategy's
    with capture_flwr_logs(logging.DEBUG) as records:
        sampler.identify(grid, NODES)
    assert sampler.cluster(1) is None and sampler.cluster(2) == "a"
    assert sampler.key(1) == "client-1"
    longest = max(len(record.getMessage()) for record in records)
    assert longest < 500, longest
    assert "cluster id of 1000000 characters" in messages_text(records)
