"""Flower's privacy and secure-aggregation pieces around pollen: what works, and what stops at once with its reason.

- Flower's four DP strategy wrappers add noise to the model the wrapped strategy returns: around a server
  optimiser (pollen's strategies, Flower's FedAdam) that is after the optimiser stepped on the noiseless mean,
  so they are refused before a message is sent; around FedAvg (``MeteredFedAvg``) they run as in Flower.
- ``compression_mod`` inside Flower's ``LocalDpMod`` would get an error reply Flower cannot deliver (the round
  waits for its timeout); it raises instead and the server stops in round 1 with the reason. The order that
  works (``ClientApp(mods=[compression_mod])`` and ``@app.train(mods=[LocalDpMod(...)])``) runs.
- ``secaggplus_mod`` and Flower's legacy mods answer every pollen train message with a ``KeyError``: the server
  stops in round 1 and says why, instead of running empty rounds.

The clients are real ``ClientApp`` objects; :func:`flower_runtime` hands each message to one the way Flower's
runtime does: an exception becomes an error reply to the message, and a reply that does not answer the
message it was given never reaches the server (Flower's LinkState refuses it).
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.client.mod import LocalDpMod as LegacyLocalDpMod
from flwr.client.mod import secaggplus_mod
from flwr.clientapp import ClientApp
from flwr.clientapp.mod import LocalDpMod, fixedclipping_mod
from flwr.common.constant import ErrorCode
from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideAdaptiveClipping,
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideAdaptiveClipping,
    DifferentialPrivacyServerSideFixedClipping,
)

from pollen.clientside import compression_mod
from pollen.strategies import FedAdaVR, FedAMS, FedCAMS, MeteredFedAdam, MeteredFedAvg
from pollen.strategies.engine.client_errors import ClientAppIncompatible, client_error_text
from pollen.strategies.engine.rounds import SetupError
from pollen.testing.fakes import FakeGrid, capture_flwr_logs, make_context, messages_text, model_record, tiny_model

NODES = [11, 12, 13]

WRAPPERS = {
    "server-fixed": lambda s: DifferentialPrivacyServerSideFixedClipping(s, 1.0, 1.0, 3),
    "client-fixed": lambda s: DifferentialPrivacyClientSideFixedClipping(s, 1.0, 1.0, 3),
    "server-adaptive": lambda s: DifferentialPrivacyServerSideAdaptiveClipping(s, 0.5, 3, clipped_count_stddev=1.0),
    "client-adaptive": lambda s: DifferentialPrivacyClientSideAdaptiveClipping(s, 0.5, 3, clipped_count_stddev=1.0),
}
ADAPTIVE = {
    "fedams": lambda: FedAMS(fraction_evaluate=0.0),
    "fedcams": lambda: FedCAMS(fraction_evaluate=0.0, compressor="sign"),
    "fedadavr": lambda: FedAdaVR(fraction_evaluate=0.0, eta=0.05),
    "flower-fedadam": lambda: MeteredFedAdam(fraction_evaluate=0.0),
}


def _train(msg: Message, context: Context) -> Message:
    """A ClientApp's train function: a step away from the global model (floats only), and its metrics."""
    rng = np.random.default_rng(context.node_id + 100 * int(msg.content["config"].get("server-round", 0)))
    arrays = {}
    for name, array in msg.content["arrays"].items():
        value = array.numpy()
        arrays[name] = (
            value + 0.05 * rng.standard_normal(value.shape).astype(value.dtype) if value.dtype.kind == "f" else value
        )
    metrics = MetricRecord({"num-examples": 10, "loss": float(context.node_id)})
    return Message(RecordDict({"arrays": model_record(arrays), "metrics": metrics}), reply_to=msg)


def _evaluate(msg: Message, context: Context) -> Message:
    return Message(RecordDict({"metrics": MetricRecord({"num-examples": 10, "loss": 1.0})}), reply_to=msg)


def client_app(mods: list | None = None, train_mods: list | None = None) -> ClientApp:
    app = ClientApp(mods=mods)
    app.train(mods=train_mods)(_train)
    app.evaluate()(_evaluate)
    return app


def flower_runtime(app: ClientApp, undelivered: list[Message] | None = None):  # noqa: ANN201
    """``client_fn`` for FakeGrid: Flower's handling of one message by the node's ClientApp.

    An exception becomes ``Error(CLIENT_APP_RAISED_EXCEPTION, "<class 'X'>:<'text'>")`` to the message (as
    ``run_clientapp`` writes it); a reply whose ``reply_to_message_id`` is not the message's is refused by the
    LinkState and never arrives (kept in ``undelivered``).
    """
    contexts = {node: make_context(node) for node in NODES}

    def handle(msg: Message) -> Message | None:
        try:
            reply = app(msg, contexts[msg.metadata.dst_node_id])
        except Exception as ex:  # noqa: BLE001 - what Flower's runtime does
            reason = str(type(ex)) + ":<'" + str(ex) + "'>"
            return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason), reply_to=msg)
        if reply.metadata.reply_to_message_id != msg.metadata.message_id:
            if undelivered is not None:
                undelivered.append(reply)
            return None
        return reply

    return handle


def start(strategy, grid: FakeGrid, num_rounds: int = 2):  # noqa: ANN001, ANN201
    return strategy.start(grid=grid, initial_arrays=model_record(tiny_model()), num_rounds=num_rounds, timeout=5.0)


# --------------------------------------------------------------------------- Flower's DP strategy wrappers
@pytest.mark.parametrize("method", sorted(ADAPTIVE))
@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
def test_dp_wrappers_around_a_server_optimiser_are_refused_before_a_message_is_sent(wrapper: str, method: str) -> None:
    strategy = ADAPTIVE[method]()
    grid = FakeGrid(NODES, flower_runtime(client_app()))
    wrapped = WRAPPERS[wrapper](strategy)
    with pytest.raises(SetupError) as refused:
        start(wrapped, grid)
    line = str(refused.value)
    assert "\n" not in line
    assert f"{type(strategy).__name__} cannot run inside Flower's {type(wrapped).__name__}" in line
    assert "noiseless mean" in line and "MeteredFedAvg" in line
    assert grid.sent == []


def test_a_pollen_strategy_driven_by_its_own_loop_or_directly_is_not_refused() -> None:
    strategy = FedAMS(fraction_evaluate=0.0)
    grid = FakeGrid(NODES, flower_runtime(client_app()))
    start(strategy, grid, num_rounds=1)
    strategy.summary()  # a caller that is not a wrapper
    messages = strategy.configure_train(2, model_record(tiny_model()), ConfigRecord(), grid)
    assert len(list(messages)) == len(NODES)


def test_dp_wrappers_around_metered_fedavg_are_dp_fedavg() -> None:
    """Noise after FedAvg's mean is noise on the mean: without noise and clipping the wrapped run is FedAvg's."""
    plain = start(MeteredFedAvg(fraction_evaluate=0.0), FakeGrid(NODES, flower_runtime(client_app())))
    quiet = DifferentialPrivacyServerSideFixedClipping(MeteredFedAvg(fraction_evaluate=0.0), 0.0, 1e6, len(NODES))
    quiet_result = start(quiet, FakeGrid(NODES, flower_runtime(client_app())))
    noisy = DifferentialPrivacyServerSideFixedClipping(MeteredFedAvg(fraction_evaluate=0.0), 1.0, 1e6, len(NODES))
    noisy_result = start(noisy, FakeGrid(NODES, flower_runtime(client_app())))
    for name, array in plain.arrays.items():
        assert np.array_equal(quiet_result.arrays[name].numpy(), array.numpy()), name
    floats = [n for n, a in plain.arrays.items() if a.numpy().dtype.kind == "f"]
    assert any(not np.allclose(noisy_result.arrays[n].numpy(), plain.arrays[n].numpy()) for n in floats)


def test_client_side_clipping_wrapper_and_fixedclipping_mod_around_metered_fedavg_run() -> None:
    strategy = MeteredFedAvg(fraction_evaluate=0.0)
    wrapped = DifferentialPrivacyClientSideFixedClipping(strategy, 0.5, 0.01, len(NODES))
    grid = FakeGrid(NODES, flower_runtime(client_app(mods=[fixedclipping_mod, compression_mod])))
    result = start(wrapped, grid)
    assert strategy.accounting.round(2).replies == len(NODES)
    assert strategy.accounting.round(2).failures == 0
    assert len(result.arrays) == len(tiny_model())


# --------------------------------------------------------------------------- mod orders
def test_compression_mod_inside_local_dp_stops_round_1_with_the_reason_instead_of_waiting() -> None:
    undelivered: list[Message] = []
    app = client_app(mods=[LocalDpMod(1.0, 0.1, 1.0, 1e-5), compression_mod])
    grid = FakeGrid(NODES, flower_runtime(app, undelivered))
    with capture_flwr_logs(logging.ERROR) as records, pytest.raises(ClientAppIncompatible) as stopped:
        start(FedCAMS(fraction_evaluate=0.0, compressor="sign"), grid, num_rounds=3)
    line = str(stopped.value)
    assert line.startswith("stopped in round 1: ")
    assert "compression_mod runs inside Flower's LocalDpMod" in line
    assert "@app.train(mods=[LocalDpMod])" in line
    assert len(grid.calls) == 1 and undelivered == []
    assert "answered train of round 1 with: ValueError: pollen setup error: compression_mod runs inside" in (
        messages_text(records)
    )


def _as_compressed(msg: Message, context: Context, call_next) -> Message:  # noqa: ANN001
    """A stand-in for a compressing mod without pollen's check: the reply's model becomes another ArrayRecord."""
    reply = call_next(msg, context)
    content = RecordDict({"pollen.update": model_record({"bits": np.zeros(3, np.uint8)})})
    content["metrics"] = reply.content["metrics"]
    return Message(content, reply_to=msg)


def test_without_the_check_that_mod_order_is_an_undeliverable_reply() -> None:
    """Why the check exists: Flower's LocalDpMod answers a compressed reply with an error addressed to that reply,
    not to the server's message; Flower cannot deliver it and the round waits for its timeout."""
    undelivered: list[Message] = []
    grid = FakeGrid(
        NODES, flower_runtime(client_app(mods=[LocalDpMod(1.0, 0.1, 1.0, 1e-5), _as_compressed]), undelivered)
    )
    strategy = FedCAMS(fraction_evaluate=0.0, compressor="sign")
    start(strategy, grid, num_rounds=1)
    assert len(undelivered) == len(NODES) and all(reply.has_error() for reply in undelivered)
    assert all(reply.metadata.reply_to_message_id == "" for reply in undelivered)
    assert strategy.accounting.round(1).failure_reasons == [
        f"node-{node}: no reply before the timeout (train)" for node in NODES
    ]


def test_local_dp_on_the_train_function_inside_compression_mod_runs_and_adds_noise() -> None:
    def run(train_mods: list) -> tuple:
        strategy = FedCAMS(fraction_evaluate=1.0, min_evaluate_nodes=3, compressor="sign")
        grid = FakeGrid(NODES, flower_runtime(client_app(mods=[compression_mod], train_mods=train_mods)))
        return strategy, start(strategy, grid)

    strategy, private = run([LocalDpMod(1.0, 0.1, 1.0, 1e-5)])
    for server_round in (1, 2):
        stats = strategy.accounting.round(server_round)
        assert (stats.replies, stats.failures) == (len(NODES), 0), stats.failure_reasons
        assert stats.uplink_records.get("pollen.update", 0) > 0
    assert sorted(private.evaluate_metrics_clientapp) == [1, 2]
    _, plain = run([])
    assert any(not np.array_equal(private.arrays[name].numpy(), plain.arrays[name].numpy()) for name in plain.arrays)


def test_secaggplus_mod_stops_round_1_with_the_reason() -> None:
    grid = FakeGrid(NODES, flower_runtime(client_app(mods=[secaggplus_mod])))
    with pytest.raises(ClientAppIncompatible) as stopped:
        start(FedAMS(fraction_evaluate=0.0), grid, num_rounds=5)
    assert "secaggplus_mod" in str(stopped.value) and "SecAggPlusWorkflow" in str(stopped.value)
    assert len(grid.calls) == 1


def test_one_client_whose_error_says_secaggplus_does_not_stop_everybodys_run() -> None:
    """The reason of an error reply is the client's to write: one such reply among usable ones is rejected like
    any other error and the run goes on; only a phase where every reply says so stops the run."""
    honest, secagg = flower_runtime(client_app()), flower_runtime(client_app(mods=[secaggplus_mod]))
    grid = FakeGrid(NODES, lambda msg: (secagg if msg.metadata.dst_node_id == NODES[0] else honest)(msg))
    strategy = FedAMS(fraction_evaluate=0.0)
    start(strategy, grid, num_rounds=2)
    for rnd in (1, 2):
        stats = strategy.accounting.rounds[rnd]
        assert stats.replies == len(NODES) - 1 and any("secaggplus_configs" in r for r in stats.failure_reasons)


def test_flower_legacy_local_dp_mod_stops_round_1_with_the_reason() -> None:
    grid = FakeGrid(NODES, flower_runtime(client_app(mods=[LegacyLocalDpMod(1.0, 0.1, 1.0, 1e-5)])))
    with pytest.raises(ClientAppIncompatible, match="fitins.parameters.*flwr.clientapp.mod"):
        start(MeteredFedAvg(fraction_evaluate=0.0), grid, num_rounds=5)


# --------------------------------------------------------------------------- a client's error, read
RAY_REASON = (
    "<class 'ray.exceptions.RayTaskError(ClientAppException)'>:<'\x1b[36mray::ClientAppActor.run()\x1b[39m "
    "(pid=12766, ip=192.0.2.2, actor_id=04e58bb3a4e51ffc24650e0601000000, repr=<flwr.simulation.ray_transport."
    "ray_actor.ClientAppActor object at 0x7f33a05816d0>)\n                  ^^^^^^^^^^^^^^^^^^^^^^\n"
    '  File "/site-packages/flwr/clientapp/client_app.py", line 161, in __call__\n'
    "    return self._registered_funcs[full_name](message, context)\n"
    '  File "/home/user/project/task.py", line 88, in train\n    scale = total / count\n'
    "ZeroDivisionError: float division by zero\n\nThe above exception was the direct cause of the following "
    "exception:\n\n\x1b[36mray::ClientAppActor.run()\x1b[39m (pid=12766, ip=192.0.2.2)\n"
    '  File "/site-packages/flwr/simulation/ray_transport/ray_actor.py", line 65, in run\n'
    "    raise ClientAppException(str(ex)) from ex\nflwr.clientapp.client_app.ClientAppException: \n"
    "Exception ClientAppException occurred. Message: float division by zero'>"
)


def test_a_ray_traceback_reason_is_read_down_to_the_exception_the_client_app_raised() -> None:
    assert client_error_text(RAY_REASON) == "ZeroDivisionError: float division by zero"
    assert client_error_text("<class 'KeyError'>:<''x''>") == "KeyError: 'x'"
    assert client_error_text("client crashed") == "client crashed"
    assert len(client_error_text("<class 'ValueError'>:<'" + "y" * 5000 + "'>")) == 1000


def test_a_client_error_is_logged_and_counted_with_its_exception_and_the_run_goes_on() -> None:
    def handle(msg: Message) -> Message:
        if msg.metadata.dst_node_id == NODES[0]:
            return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=RAY_REASON), reply_to=msg)
        return flower_runtime(client_app())(msg)

    strategy = FedAMS(fraction_evaluate=0.0)
    with capture_flwr_logs(logging.WARNING) as records:
        start(strategy, FakeGrid(NODES, handle), num_rounds=2)
    for server_round in (1, 2):
        stats = strategy.accounting.round(server_round)
        assert stats.replies == len(NODES) - 1
        assert stats.failure_reasons == [f"node-{NODES[0]}: client error: ZeroDivisionError: float division by zero"]
    assert "client error: ZeroDivisionError: float division by zero" in messages_text(records)
