"""Extras and buffers are held to the same hard limit as updates (issue 24's first examples).

A finite but huge value is as harmful as a NaN once the server squares it or keeps it in a running max:
a Mime-style gradient entry of 1e20 squares to +Inf in float32, a Fed-LAMB second moment of 1e30 pins
``v_hat`` for the rest of the run, a BatchNorm buffer of 3.4e38 is averaged into the model. Each is now
refused by the one reply reader, with a reason, for every strategy that reads it.
"""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import MetricRecord

from pollen.core.layout import ModelLayout
from pollen.strategies.engine.replies import Extra, ReplyRejected, ReplySpec, read_reply
from pollen.strategies.engine.screening import DEFAULT_MAX_ABS
from pollen.testing.fakes import model_record, reply, tiny_model, train_message
from pollen.wire import protocol
from pollen.wire.records import arrays_to_record

pytestmark = pytest.mark.flower_compat


def a_reply(model: dict, extra: dict | None = None):  # noqa: ANN201
    records = {protocol.ARRAYS_RECORD: model_record(model), protocol.METRICS_RECORD: MetricRecord({"num-examples": 10})}
    for name, vector in (extra or {}).items():
        records[protocol.extra_record(name)] = arrays_to_record({protocol.EXTRA_ARRAY: vector})
    return reply(train_message(tiny_model()), records)


def read(message, spec: ReplySpec | None = None):  # noqa: ANN001, ANN201
    model = tiny_model()
    layout = ModelLayout.from_arrays(model)
    params = layout.flatten(model)
    spec = spec or ReplySpec()
    return read_reply(message, client_key="c", layout=layout, params=params, spec=spec, max_abs=DEFAULT_MAX_ABS)


@pytest.mark.parametrize(
    ("name", "value", "nonnegative"),
    [("grad", 1e20, False), ("grad", -1e20, False), ("v", 1e30, True), ("v", 3.4e38, True)],
    ids=["mime-gradient-1e20", "mime-gradient-minus-1e20", "second-moment-1e30", "second-moment-3.4e38"],
)
def test_a_huge_finite_extra_is_refused(name: str, value: float, nonnegative: bool) -> None:
    vector = np.full(19, 0.5, dtype=np.float32)
    vector[7] = value
    spec = ReplySpec(extras=(Extra(name, size="model", nonnegative=nonnegative),))
    with pytest.raises(ReplyRejected, match=rf"extra '{name}' has a value of magnitude .* > 1e\+15 \(hard limit\)"):
        read(a_reply(tiny_model(1), {name: vector}), spec)
    vector[7] = 2.0  # the same reply with a sane value is read
    assert read(a_reply(tiny_model(1), {name: vector}), spec).extras[name][7] == 2.0


def test_a_huge_finite_buffer_is_refused() -> None:
    model = tiny_model(1)
    model["bn.running_mean"] = np.array([0.0, 3.4e38, 0.0, 0.0], dtype=np.float32)
    with pytest.raises(ReplyRejected, match=r"buffer 'bn.running_mean' has a value of magnitude 3.4e\+38"):
        read(a_reply(model))
    model["bn.running_mean"] = np.array([0.0, 3.0, 0.0, 0.0], dtype=np.float32)
    assert read(a_reply(model)).buffers["bn.running_mean"][1] == 3.0


def test_flowers_baselines_refuse_the_buffer_too() -> None:
    """The metered baselines read replies with the same reader: the buffer never reaches Flower's mean."""
    from flwr.app import ConfigRecord

    from pollen.strategies import MeteredFedAvg
    from pollen.testing.fakes import FakeGrid, full_model_reply, named_arrays

    def client(msg):  # noqa: ANN001, ANN202
        local = named_arrays(msg.content.array_records[protocol.ARRAYS_RECORD])
        if msg.metadata.dst_node_id == 3:
            local = {**local, "bn.running_mean": np.full(4, 3.4e38, dtype=np.float32)}
        return full_model_reply(msg, local)

    grid = FakeGrid([1, 2, 3], client)
    strategy = MeteredFedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=2)
    messages = list(strategy.configure_train(1, model_record(tiny_model()), ConfigRecord(), grid))
    arrays, _ = strategy.aggregate_train(1, list(grid.send_and_receive(messages)))
    stats = strategy.accounting.rounds[1]
    assert stats.replies == 2
    assert any("buffer 'bn.running_mean' has a value of magnitude" in r for r in stats.failure_reasons)
    assert np.abs(named_arrays(arrays)["bn.running_mean"]).max() < 1.0


def test_a_float32_extra_is_read_without_a_copy_and_a_float64_one_is_cast() -> None:
    """A model-size extra (Fed-LAMB's v) is not copied on the server: the update keeps a read-only view of the
    reply's bytes; another float dtype is cast to float32 (a new array)."""
    spec = ReplySpec(extras=(Extra("v", size="model", nonnegative=True),))
    message = a_reply(tiny_model(1), {"v": np.full(19, 0.5, dtype=np.float32)})
    record = message.content[protocol.extra_record("v")]
    got = read(message, spec).extras["v"]
    assert got.dtype == np.float32 and not got.flags.writeable
    assert np.shares_memory(got, np.frombuffer(record[protocol.EXTRA_ARRAY].data, dtype=np.uint8))
    cast = read(a_reply(tiny_model(1), {"v": np.full(19, 0.5, dtype=np.float64)}), spec).extras["v"]
    assert cast.dtype == np.float32 and np.all(cast == 0.5)
