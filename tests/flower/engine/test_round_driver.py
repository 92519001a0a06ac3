"""The contract of the round driver, :class:`~pollen.strategies.engine.rounds.SyncRounds`, and of ``start``.

A strategy's ``start(grid, initial_arrays, num_rounds, timeout, train_config, evaluate_config, evaluate_fn,
checkpoint=...)`` is Flower's ``Strategy.start`` call; it hands the whole run to ``strategy.driver.run(strategy,
grid, ...)`` and returns the driver's ``Result``. The default driver, ``SyncRounds``, runs the rounds in
Flower's order: ``evaluate_fn`` on round 0, then per round ``configure_train``, ``aggregate_train``,
``configure_evaluate``, ``aggregate_evaluate`` and ``evaluate_fn``, each handed the arrays the round before
produced. ``start(checkpoint=...)`` overrides a checkpoint handed in through ``EngineParts(checkpoint=...)``,
which is used when ``start`` gets none.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from flwr.app import ConfigRecord, MessageType, MetricRecord
from flwr.serverapp.strategy import FedAvg, Result

from pollen.strategies import FedAMS, MeteredFedAvg, RunCheckpoint
from pollen.strategies.engine.parts import EngineParts, SyncRounds
from pollen.strategies.engine.resume import CHECKPOINT_FILE
from pollen.testing.fakes import FakeGrid, full_model_reply, model_record, named_arrays, reply, tiny_model
from pollen.wire import protocol

pytestmark = pytest.mark.flower_compat

NODES = [1, 2, 3]


def client(msg):  # noqa: ANN001, ANN201
    """Trains by moving every float value by 0.01 x its node id; evaluates to a loss of its node id."""
    node = msg.metadata.dst_node_id
    if msg.metadata.message_type == MessageType.EVALUATE:
        return reply(msg, {protocol.METRICS_RECORD: MetricRecord({protocol.NUM_EXAMPLES: 10, "loss": float(node)})})
    arrays = {
        k: v + np.asarray(0.01 * node, dtype=v.dtype) if v.dtype.kind == "f" else v
        for k, v in named_arrays(msg.content.array_records[protocol.ARRAYS_RECORD]).items()
    }
    return full_model_reply(msg, arrays, num_examples=10, loss=float(node))


class RecordingDriver:
    """A round driver that runs nothing: it keeps what ``start`` handed it and returns its own ``Result``."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple, dict]] = []
        self.result = Result()

    def run(self, *args, **kwargs) -> Result:  # noqa: ANN002, ANN003
        self.calls.append((args, kwargs))
        return self.result


class Recording:
    """Notes each of Flower's four round methods as it is called, with the round and the arrays it got."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self.trace: list[tuple[str, int]] = []
        self.arrays_in: dict[tuple[str, int], object] = {}
        self.arrays_out: dict[int, object] = {}

    def configure_train(self, server_round, arrays, config, grid):  # noqa: ANN001, ANN201
        self.trace.append(("configure_train", server_round))
        self.arrays_in["configure_train", server_round] = arrays
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round, replies):  # noqa: ANN001, ANN201
        self.trace.append(("aggregate_train", server_round))
        arrays, metrics = super().aggregate_train(server_round, replies)
        self.arrays_out[server_round] = arrays
        return arrays, metrics

    def configure_evaluate(self, server_round, arrays, config, grid):  # noqa: ANN001, ANN201
        self.trace.append(("configure_evaluate", server_round))
        self.arrays_in["configure_evaluate", server_round] = arrays
        return super().configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round, replies):  # noqa: ANN001, ANN201
        self.trace.append(("aggregate_evaluate", server_round))
        return super().aggregate_evaluate(server_round, replies)


class RecordingFedAMS(Recording, FedAMS):
    pass


class RecordingFlowerFedAvg(Recording, FedAvg):
    pass


def evaluate_fn_for(strategy: Recording):  # noqa: ANN201
    def evaluate_fn(server_round: int, arrays) -> MetricRecord:  # noqa: ANN001
        strategy.trace.append(("evaluate_fn", server_round))
        strategy.arrays_in["evaluate_fn", server_round] = arrays
        return MetricRecord({"central": float(server_round)})

    return evaluate_fn


FLOWERS_ORDER = [
    ("evaluate_fn", 0),
    *[
        (step, server_round)
        for server_round in (1, 2, 3)
        for step in ("configure_train", "aggregate_train", "configure_evaluate", "aggregate_evaluate", "evaluate_fn")
    ],
]


@pytest.fixture(autouse=True)
def _keep_the_global_random_state():
    """Flower's own strategy samples with Python's global ``random``: leave it as it was for other tests."""
    state = random.getstate()
    yield
    random.setstate(state)


# ---------------------------------------------------------------------------- start hands the run to the driver
@pytest.mark.parametrize("make", [FedAMS, MeteredFedAvg], ids=["fedams", "metered-fedavg"])
def test_start_hands_the_run_to_the_strategys_driver(make: type, tmp_path) -> None:  # noqa: ANN001
    driver = RecordingDriver()
    strategy = make(parts=EngineParts(driver=driver))
    grid, arrays = FakeGrid(NODES, client), model_record(tiny_model())
    train_config, evaluate_config = ConfigRecord({"lr": 0.1}), ConfigRecord({"batch": 8})
    checkpoint = RunCheckpoint(tmp_path)

    def evaluate_fn(server_round: int, arrays) -> None:  # noqa: ANN001
        return None

    result = strategy.start(
        grid=grid,
        initial_arrays=arrays,
        num_rounds=7,
        timeout=9.0,
        train_config=train_config,
        evaluate_config=evaluate_config,
        evaluate_fn=evaluate_fn,
        checkpoint=checkpoint,
    )
    assert result is driver.result
    [(args, kwargs)] = driver.calls
    assert args[0] is strategy and args[1] is grid and args[2] is arrays
    assert args[3:] == (7, 9.0, train_config, evaluate_config, evaluate_fn)
    assert kwargs == {"checkpoint": checkpoint}
    assert grid.sent == []  # the driver ran nothing: start itself sends nothing


def test_start_with_flowers_defaults_hands_them_on() -> None:
    driver = RecordingDriver()
    strategy = FedAMS(parts=EngineParts(driver=driver))
    grid, arrays = FakeGrid(NODES, client), model_record(tiny_model())
    strategy.start(grid=grid, initial_arrays=arrays)
    [(args, kwargs)] = driver.calls
    assert args == (strategy, grid, arrays, 3, 3600, None, None, None)  # Flower's defaults of Strategy.start
    assert kwargs == {"checkpoint": None}


# ---------------------------------------------------------------------------- the default driver
def test_the_default_driver_runs_the_rounds_in_flowers_order() -> None:
    pollen = RecordingFedAMS(eta=1.0, min_available_nodes=3)
    assert type(pollen.driver) is SyncRounds
    result = pollen.start(
        grid=FakeGrid(NODES, client),
        initial_arrays=model_record(tiny_model()),
        num_rounds=3,
        evaluate_fn=evaluate_fn_for(pollen),
    )
    flower = RecordingFlowerFedAvg(min_available_nodes=3)
    random.seed(0)  # Flower samples with the global random (the order of the steps does not depend on it)
    flower.start(
        grid=FakeGrid(NODES, client),
        initial_arrays=model_record(tiny_model()),
        num_rounds=3,
        evaluate_fn=evaluate_fn_for(flower),
    )
    assert flower.trace == FLOWERS_ORDER  # what Flower's own Strategy.start does
    assert pollen.trace == FLOWERS_ORDER
    assert sorted(result.train_metrics_clientapp) == [1, 2, 3]
    assert sorted(result.evaluate_metrics_clientapp) == [1, 2, 3]
    assert {r: dict(m) for r, m in result.evaluate_metrics_serverapp.items()} == {r: {"central": r} for r in range(4)}


def test_each_step_gets_the_arrays_the_round_before_produced() -> None:
    strategy = RecordingFedAMS(eta=1.0, min_available_nodes=3)
    initial = model_record(tiny_model())
    result = strategy.start(
        grid=FakeGrid(NODES, client), initial_arrays=initial, num_rounds=3, evaluate_fn=evaluate_fn_for(strategy)
    )
    assert strategy.arrays_in["evaluate_fn", 0] is initial
    assert strategy.arrays_in["configure_train", 1] is initial
    for server_round in (1, 2, 3):
        produced = strategy.arrays_out[server_round]
        assert produced is not None
        assert strategy.arrays_in["configure_evaluate", server_round] is produced
        assert strategy.arrays_in["evaluate_fn", server_round] is produced
        if server_round < 3:
            assert strategy.arrays_in["configure_train", server_round + 1] is produced
    assert result.arrays is strategy.arrays_out[3]


def test_one_driver_serves_two_runs_and_holds_nothing_between_them() -> None:
    driver = SyncRounds()
    settings = dict(vars(driver))
    first = FedAMS(eta=1.0, min_available_nodes=3, parts=EngineParts(driver=driver))
    second = FedAMS(eta=1.0, min_available_nodes=3, parts=EngineParts(driver=driver))
    one = first.start(grid=FakeGrid(NODES, client), initial_arrays=model_record(tiny_model()), num_rounds=2)
    two = second.start(grid=FakeGrid(NODES, client), initial_arrays=model_record(tiny_model()), num_rounds=2)
    assert vars(driver) == settings and set(settings) == {"timed", "speed"}  # its settings, no run's state
    a, b = named_arrays(one.arrays), named_arrays(two.arrays)
    assert all(np.array_equal(a[name], b[name]) for name in a)


# ---------------------------------------------------------------------------- the checkpoint
def test_starts_checkpoint_overrides_the_one_handed_in_with_the_parts(tmp_path) -> None:  # noqa: ANN001
    handed_in, given = RunCheckpoint(tmp_path / "parts"), RunCheckpoint(tmp_path / "start")
    driver = RecordingDriver()
    FedAMS(parts=EngineParts(driver=driver, checkpoint=handed_in)).start(
        grid=FakeGrid(NODES, client), initial_arrays=model_record(tiny_model()), checkpoint=given
    )
    assert driver.calls[0][1] == {"checkpoint": given}

    strategy = FedAMS(eta=1.0, min_available_nodes=3, parts=EngineParts(checkpoint=handed_in))
    strategy.start(
        grid=FakeGrid(NODES, client), initial_arrays=model_record(tiny_model()), num_rounds=1, checkpoint=given
    )
    assert (tmp_path / "start" / CHECKPOINT_FILE).is_file()
    assert not (tmp_path / "parts" / CHECKPOINT_FILE).exists()


def test_the_checkpoint_handed_in_is_used_when_start_gets_none(tmp_path) -> None:  # noqa: ANN001
    handed_in = RunCheckpoint(tmp_path / "parts")
    driver = RecordingDriver()
    FedAMS(parts=EngineParts(driver=driver, checkpoint=handed_in)).start(
        grid=FakeGrid(NODES, client), initial_arrays=model_record(tiny_model())
    )
    assert driver.calls[0][1] == {"checkpoint": handed_in}

    strategy = FedAMS(eta=1.0, min_available_nodes=3, parts=EngineParts(checkpoint=handed_in))
    strategy.start(grid=FakeGrid(NODES, client), initial_arrays=model_record(tiny_model()), num_rounds=2)
    assert (tmp_path / "parts" / CHECKPOINT_FILE).is_file()
    assert handed_in.validate("FedAMS") == 2  # written after the last round
