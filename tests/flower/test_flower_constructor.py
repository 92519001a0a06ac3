"""Every exported strategy takes every argument of Flower's ``FedAvg``, with Flower's meaning (issue 44).

A Flower project that passes ``FedAvg``'s own arguments (``train_metrics_aggr_fn``, ``weighted_by_key``, the
record keys, the sampling ones) swaps the class and nothing else. The signature is read from the installed
Flower, so a Flower that adds an argument fails here until pollen takes it too. Each strategy is then built
with every one of those arguments set to a value other than its default and run on an in-process grid with
a plain full-model client, and each argument is checked to do what it does in Flower: the sampling
arguments decide how many nodes train and evaluate and when a round may start, the record keys name the
records sent, ``weighted_by_key`` weighs the metrics, and the two metric functions are called with the
replies and the weight's name and their MetricRecords are what the run reports.
"""

from __future__ import annotations

import inspect
import re

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg, Strategy

import pollen.strategies as strategies
from pollen.optim import sgd
from pollen.strategies import AdaptiveStrategy, FedAMS, FedCAMS
from pollen.strategies.engine.strategy import FLOWER_ARGUMENTS
from pollen.strategies.fedcams import DROP_IN_BETA_1
from pollen.testing.fakes import FakeGrid, model_record, named_arrays, tiny_model

pytestmark = pytest.mark.flower_compat

FEDAVG = {name: p for name, p in inspect.signature(FedAvg.__init__).parameters.items() if name != "self"}
STRATEGIES = sorted(
    (
        cls
        for name in strategies.__all__
        if isinstance(cls := getattr(strategies, name), type) and issubclass(cls, Strategy)
    ),
    key=lambda cls: cls.__name__,
)
POLLEN = [cls for cls in STRATEGIES if issubclass(cls, AdaptiveStrategy)]
#: What each method needs to run with a plain Flower ClientApp (a full model back, nothing of pollen's).
METHOD_SETTINGS = {
    "AdaptiveStrategy": {"optimizer": sgd(eta=1.0)},
    "FedLAMB": {"variant": "fed-sgd"},
    "HAFed": {"topology": "identity", "clustered": False},
}
NODES = list(range(101, 111))  # 10 nodes
WEIGHT = "n-samples"


def examples(node: int) -> int:
    return 3 + node % 7


def loss(node: int) -> float:
    return 0.01 * node


def accuracy(node: int) -> float:
    return 0.001 * node


def plain_client(arrays_key: str, config_key: str, reply_key: str | None = None):  # noqa: ANN201
    """A Flower ClientApp as users write one: reads the model and config under the project's keys, replies
    the trained model (moved by a node's own step) and metrics weighted under ``WEIGHT``, not num-examples."""

    def client(msg: Message) -> Message:
        node = msg.metadata.dst_node_id
        assert isinstance(msg.content[config_key], ConfigRecord)
        arrays = named_arrays(msg.content[arrays_key])
        if msg.metadata.message_type == MessageType.EVALUATE:
            metrics = MetricRecord({WEIGHT: examples(node), "accuracy": accuracy(node)})
            return Message(RecordDict({"metrics": metrics}), reply_to=msg)
        step = np.float32(0.01 * (node - 100))
        trained = {k: (v + step).astype(v.dtype) if v.dtype.kind == "f" else v for k, v in arrays.items()}
        metrics = MetricRecord({WEIGHT: examples(node), "loss": loss(node)})
        return Message(RecordDict({reply_key or arrays_key: model_record(trained), "metrics": metrics}), reply_to=msg)

    return client


class GrowingGrid(FakeGrid):
    """Six nodes are connected at first; all ten once the strategy has looked three times (a federation filling
    up). Records how many were connected when the strategy first sent anything."""

    looked = 0
    connected_at_first_send: int | None = None

    def get_node_ids(self):  # noqa: ANN201
        self.looked += 1
        return list(self.node_ids if self.looked > 3 else self.node_ids[:6])

    def send_and_receive(self, messages, *, timeout=None):  # noqa: ANN001, ANN201
        if self.connected_at_first_send is None:
            self.connected_at_first_send = len(self.node_ids if self.looked > 3 else self.node_ids[:6])
        return super().send_and_receive(messages, timeout=timeout)


@pytest.fixture
def no_waiting(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sampling waits for nodes a second at a time (pollen's sampler and Flower's ``sample_nodes``): not here."""
    import time

    from flwr.serverapp.strategy import strategy_utils

    monkeypatch.setattr(time, "sleep", lambda seconds: None)
    monkeypatch.setattr(strategy_utils, "sleep", lambda seconds: None, raising=False)


def build(cls: type, **flower_arguments: object) -> Strategy:
    return cls(**flower_arguments, **METHOD_SETTINGS.get(cls.__name__, {}))


def _documented(cls: type) -> set[str]:
    """The names of the entries of the Parameters section of ``cls``'s own docstring (numpy style)."""
    doc = inspect.cleandoc(cls.__doc__ or "")
    section = re.search(r"^Parameters\n-+\n(.*?)(?:\n\n[A-Z][a-z]+\n-+\n|\Z)", doc, re.S | re.M)
    assert section, f"{cls.__name__} has no Parameters section"
    names = set()
    for line in section.group(1).splitlines():
        if line and not line.startswith(" "):
            names.update(name.strip().lstrip("*") for name in line.split(" : ")[0].split(","))
    return names


# --------------------------------------------------------------------------- the signature
@pytest.mark.parametrize("cls", STRATEGIES, ids=lambda cls: cls.__name__)
def test_every_fedavg_argument_is_in_the_signature_with_flowers_default(cls: type) -> None:
    signature = inspect.signature(cls)
    for name, flower in FEDAVG.items():
        assert name in signature.parameters, f"{cls.__name__} does not take Flower's {name}"
        assert signature.parameters[name].default == flower.default, name
    kinds = {p.kind for p in signature.parameters.values()}
    assert inspect.Parameter.VAR_KEYWORD not in kinds and inspect.Parameter.VAR_POSITIONAL not in kinds


@pytest.mark.parametrize("cls", POLLEN, ids=lambda cls: cls.__name__)
def test_pollens_strategies_take_them_first_in_flowers_order_and_positionally(cls: type) -> None:
    assert tuple(FEDAVG) == FLOWER_ARGUMENTS
    first = list(inspect.signature(cls).parameters.values())[: len(FEDAVG)]
    assert [(p.name, p.kind) for p in first] == [(p.name, p.kind) for p in FEDAVG.values()]
    values = (0.5, 0.25, 3, 4, 5, WEIGHT, "weights", "settings", len, max)
    by_position = cls(*values, **METHOD_SETTINGS.get(cls.__name__, {}))
    assert tuple(getattr(by_position, name) for name in FEDAVG) == values


@pytest.mark.parametrize("cls", POLLEN, ids=lambda cls: cls.__name__)
def test_every_argument_is_documented_in_the_class_docstring(cls: type) -> None:
    missing = set(inspect.signature(cls).parameters) - _documented(cls)
    assert not missing, f"{cls.__name__} does not document {sorted(missing)}"


@pytest.mark.parametrize("cls", [cls for cls in POLLEN if cls is not AdaptiveStrategy], ids=lambda cls: cls.__name__)
def test_an_argument_a_strategy_shares_with_its_base_has_the_bases_default(cls: type) -> None:
    """The explicit signatures repeat the base's arguments: their defaults must not drift apart. (Methods that
    key per-client state by a stable id ask nodes for it by default; FedOpt's optimizer is a name; FedCAMS's
    drop-in momentum is its own, measured on its sign uploads.)"""
    base = FedAMS if issubclass(cls, FedAMS) and cls is not FedAMS else AdaptiveStrategy
    own, shared = inspect.signature(cls).parameters, inspect.signature(base).parameters
    on_purpose = {FedCAMS: {"beta_1": (DROP_IN_BETA_1, 0.9), "bias_correction": (True, False)}}.get(cls, {})
    for name in set(own) & set(shared) - {"identify_clients", "optimizer"}:
        expected = on_purpose.get(name, (shared[name].default, shared[name].default))
        assert (own[name].default, shared[name].default) == expected, f"{cls.__name__}.{name}"


@pytest.mark.parametrize("cls", STRATEGIES, ids=lambda cls: cls.__name__)
def test_the_metered_baselines_document_their_own_arguments(cls: type) -> None:
    own = {"parts"} if not issubclass(cls, AdaptiveStrategy) else set(FEDAVG)
    documented = _documented(cls if issubclass(cls, AdaptiveStrategy) else strategies.baselines.Metered)
    assert own <= documented


# --------------------------------------------------------------------------- what each argument does
@pytest.mark.parametrize("cls", STRATEGIES, ids=lambda cls: cls.__name__)
def test_fedavgs_full_signature_each_argument_does_what_it_does_in_flower(cls: type) -> None:
    train_calls, evaluate_calls = [], []
    train_result, evaluate_result = MetricRecord({"custom-train": 1.5}), MetricRecord({"custom-evaluate": 2.5})

    def train_metrics(replies: list[RecordDict], weighted_by_key: str) -> MetricRecord:
        train_calls.append((replies, weighted_by_key))
        return train_result

    def evaluate_metrics(replies: list[RecordDict], weighted_by_key: str) -> MetricRecord:
        evaluate_calls.append((replies, weighted_by_key))
        return evaluate_result

    given = {
        "fraction_train": 0.5,  # of 10 nodes: 5, above min_train_nodes
        "fraction_evaluate": 0.1,  # of 10 nodes: 1, below min_evaluate_nodes
        "min_train_nodes": 3,
        "min_evaluate_nodes": 4,
        "min_available_nodes": 10,
        "weighted_by_key": WEIGHT,
        "arrayrecord_key": "weights",
        "configrecord_key": "settings",
        "train_metrics_aggr_fn": train_metrics,
        "evaluate_metrics_aggr_fn": evaluate_metrics,
    }
    assert set(given) == set(FEDAVG) and all(given[name] != p.default for name, p in FEDAVG.items())
    strategy = build(cls, **given)
    grid = FakeGrid(NODES, plain_client("weights", "settings"))
    start = model_record(tiny_model())
    result = strategy.start(grid=grid, initial_arrays=start, num_rounds=1)

    # fraction_* / min_*_nodes: max(floor(fraction n), min) of the n connected nodes
    train = [m for m in grid.sent if m.metadata.message_type == MessageType.TRAIN]
    evaluate = [m for m in grid.sent if m.metadata.message_type == MessageType.EVALUATE]
    assert len(train) == 5 and len(evaluate) == 4
    # the record keys name the records every message carries
    for message in train + evaluate:
        assert set(message.content.array_records) == {"weights"}, message.content.array_records.keys()
        assert "settings" in message.content.config_records and "config" not in message.content.config_records
        assert message.content["settings"]["server-round"] == 1
    # the round trained: the model moved (every client stepped up)
    moved = named_arrays(result.arrays)["conv.bias"] - named_arrays(start)["conv.bias"]
    assert np.all(moved > 0)
    # the functions were called once, with the replies and the weight's name; what they return is reported
    assert len(train_calls) == 1 and len(evaluate_calls) == 1
    for (replies, key), asked in ((train_calls[0], train), (evaluate_calls[0], evaluate)):
        assert key == WEIGHT
        weights = sorted(next(iter(r.metric_records.values()))[WEIGHT] for r in replies)
        assert weights == sorted(examples(m.metadata.dst_node_id) for m in asked)
    assert result.train_metrics_clientapp[1] is train_result
    assert result.evaluate_metrics_clientapp[1] is evaluate_result


@pytest.mark.parametrize("cls", STRATEGIES, ids=lambda cls: cls.__name__)
def test_min_available_nodes_holds_the_first_round_until_that_many_are_connected(cls: type, no_waiting: None) -> None:
    strategy = build(cls, min_available_nodes=10, fraction_evaluate=0.0, weighted_by_key=WEIGHT)
    grid = GrowingGrid(NODES, plain_client("arrays", "config"))
    strategy.start(grid=grid, initial_arrays=model_record(tiny_model()), num_rounds=1)
    assert grid.connected_at_first_send == 10 and grid.looked > 3


@pytest.mark.parametrize("cls", STRATEGIES, ids=lambda cls: cls.__name__)
def test_weighted_by_key_weighs_the_metrics_when_no_function_is_given(cls: type) -> None:
    strategy = build(cls, weighted_by_key=WEIGHT, min_available_nodes=4, min_evaluate_nodes=4)
    result = strategy.start(
        grid=FakeGrid(NODES[:4], plain_client("arrays", "config")),
        initial_arrays=model_record(tiny_model()),
        num_rounds=1,
    )
    n = np.array([examples(node) for node in NODES[:4]], dtype=np.float64)
    expected_loss = float(np.dot(n, [loss(node) for node in NODES[:4]]) / n.sum())
    expected_accuracy = float(np.dot(n, [accuracy(node) for node in NODES[:4]]) / n.sum())
    assert result.train_metrics_clientapp[1]["loss"] == pytest.approx(expected_loss, rel=1e-12)
    assert result.evaluate_metrics_clientapp[1]["accuracy"] == pytest.approx(expected_accuracy, rel=1e-12)
    unweighted = float(np.mean([loss(node) for node in NODES[:4]]))
    assert abs(expected_loss - unweighted) > 1e-4  # the weights matter for these numbers


@pytest.mark.parametrize("cls", STRATEGIES, ids=lambda cls: cls.__name__)
def test_a_reply_with_its_model_under_another_name_is_read_as_flower_reads_it(cls: type) -> None:
    """Flower names the model it sends ``arrayrecord_key`` and reads a reply's one ArrayRecord, whatever its name
    (a ClientApp that replies under "arrays" as Flower's quickstart does)."""
    strategy = build(
        cls, arrayrecord_key="weights", weighted_by_key=WEIGHT, min_available_nodes=4, fraction_evaluate=0.0
    )
    grid = FakeGrid(NODES[:4], plain_client("weights", "config", reply_key="arrays"))
    start = model_record(tiny_model())
    result = strategy.start(grid=grid, initial_arrays=start, num_rounds=1)
    assert np.all(named_arrays(result.arrays)["conv.bias"] > named_arrays(start)["conv.bias"])
    assert strategy.accounting.rounds[1].failures == 0
    assert strategy.accounting.rounds[1].uplink_update_bytes > 0


@pytest.mark.parametrize("cls", [cls for cls in POLLEN if cls is not AdaptiveStrategy], ids=lambda cls: cls.__name__)
def test_weighted_by_key_weighs_the_model_average_with_weighted_aggregation(cls: type) -> None:
    """pollen averages updates unweighted by default (the papers); ``aggregation="weighted"`` is Flower's FedAvg
    weighting, by ``weighted_by_key``: two clients step in opposite directions, and the one weighted more
    decides where the model goes (an adaptive step follows the sign of the aggregate)."""
    final = {}
    for key, node_weights in (("a", {101: 1, 102: 9}), ("b", {101: 9, 102: 1})):

        def client(msg: Message, node_weights=node_weights) -> Message:  # noqa: ANN001
            node = msg.metadata.dst_node_id
            step = np.float32(-0.05 if node == 101 else 0.05)
            arrays = named_arrays(msg.content["arrays"])
            trained = {k: (v + step).astype(v.dtype) if v.dtype.kind == "f" else v for k, v in arrays.items()}
            metrics = MetricRecord({WEIGHT: node_weights[node], "loss": 0.1})
            return Message(RecordDict({"arrays": model_record(trained), "metrics": metrics}), reply_to=msg)

        strategy = build(cls, weighted_by_key=WEIGHT, fraction_evaluate=0.0, aggregation="weighted")
        result = strategy.start(
            grid=FakeGrid([101, 102], client), initial_arrays=model_record(tiny_model()), num_rounds=1
        )
        final[key] = named_arrays(result.arrays)["conv.bias"]
    start = tiny_model()["conv.bias"]
    assert np.all(final["a"] > start) and np.all(final["b"] < start)


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"train_metrics_aggr_fn": "mean"}, r"^train_metrics_aggr_fn='mean' is not callable; allowed: a function"),
        ({"evaluate_metrics_aggr_fn": 3}, r"^evaluate_metrics_aggr_fn=3 is not callable"),
        ({"arrayrecord_key": "x", "configrecord_key": "x"}, r"^arrayrecord_key and configrecord_key are both 'x'"),
        ({"arrayrecord_key": ""}, r"^arrayrecord_key='' is invalid; allowed: a non-empty string"),
        ({"weighted_by_key": None}, r"^weighted_by_key=None is invalid"),
        ({"configrecord_key": "pollen.flags"}, r"^configrecord_key='pollen.flags' is in pollen's own record names"),
    ],
)
def test_a_bad_flower_argument_stops_the_constructor_with_one_line(arguments: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FedAMS(**arguments)


def test_a_metric_function_that_returns_no_metricrecord_is_named() -> None:
    strategy = FedAMS(train_metrics_aggr_fn=lambda replies, key: {"loss": 1.0}, fraction_evaluate=0.0)
    with pytest.raises(TypeError, match=r"^train_metrics_aggr_fn returned a dict; allowed: a flwr.app.MetricRecord"):
        strategy.start(
            grid=FakeGrid(NODES[:2], plain_client("arrays", "config")),
            initial_arrays=model_record(tiny_model()),
            num_rounds=1,
        )
    assert strategy.accounting.rounds[1].replies == 2  # the round itself was finished before the function ran


def test_without_functions_pollens_metrics_are_what_they_were(monkeypatch: pytest.MonkeyPatch) -> None:
    """``None`` keeps pollen's own aggregation: the weighted mean of each metric every reply reports (the weight
    metric included, non-finite values left out), not Flower's ``aggregate_metricrecords``."""
    strategy = FedAMS(min_available_nodes=4)
    result = strategy.start(
        grid=FakeGrid(NODES[:4], plain_client("arrays", "config")),
        initial_arrays=model_record(tiny_model()),
        num_rounds=1,
    )
    assert set(result.train_metrics_clientapp[1]) == {WEIGHT, "loss"}  # Flower's would drop the weight key
    assert strategy.train_metrics_aggr_fn is None and strategy.evaluate_metrics_aggr_fn is None
    assert isinstance(result.arrays, ArrayRecord)
