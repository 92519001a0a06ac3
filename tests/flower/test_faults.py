"""The simulation fault switch: seeded, repeatable, about the asked fraction, each kind as documented."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Context, RecordDict

from pollen.app.spec import ConfigError
from pollen.testing.fakes import full_model_reply, tiny_model, train_message
from pollen.testing.faults import InjectedFault, fault_for, fault_mod
from pollen.wire import protocol

pytestmark = pytest.mark.flower_compat


def test_faults_are_seeded_and_close_to_the_fraction():
    draws = [fault_for(7, r, f"partition-{c}", 0.3, "error") for r in range(1, 51) for c in range(40)]
    share = sum(d is not None for d in draws) / len(draws)
    assert 0.26 < share < 0.34
    assert draws == [fault_for(7, r, f"partition-{c}", 0.3, "error") for r in range(1, 51) for c in range(40)]
    assert fault_for(7, 1, "partition-0", 0.0, "error") is None
    assert {fault_for(7, r, "p", 1.0, "mixed") for r in range(60)} == {"error", "garbage", "timeout"}


def context(fraction: float, kind: str) -> Context:
    run = {"fault-fraction": fraction, "fault-kind": kind, "seed": 1, "fault-delay": 0.0}
    return Context(run_id=1, node_id=1, node_config={"partition-id": 0}, state=RecordDict(), run_config=run)


def trainer(msg, ctx):  # noqa: ANN001, ANN201
    return full_model_reply(msg, tiny_model(1))


def test_each_kind_does_what_it_says():
    msg = train_message(tiny_model(), {protocol.CFG_SERVER_ROUND: 1})
    with pytest.raises(InjectedFault):
        fault_mod(msg, context(1.0, "error"), trainer)
    garbage = fault_mod(msg, context(1.0, "garbage"), trainer)
    model = garbage.content.array_records[protocol.ARRAYS_RECORD]
    assert np.isnan(model["conv.weight"].numpy()).all()
    assert model["bn.num_batches_tracked"].numpy().dtype == np.int64
    untouched = fault_mod(msg, context(0.0, "error"), trainer)
    np.testing.assert_array_equal(
        untouched.content.array_records[protocol.ARRAYS_RECORD]["conv.weight"].numpy(), tiny_model(1)["conv.weight"]
    )


def test_node_config_wins_over_the_run_config():
    """A SuperNode's own fault settings (node-config) come first; the run-config keys are the testing app's fallback."""
    msg = train_message(tiny_model(), {protocol.CFG_SERVER_ROUND: 1})
    ctx = context(0.0, "error")
    ctx.node_config.update({"fault-fraction": 1.0, "fault-kind": "garbage"})
    garbage = fault_mod(msg, ctx, trainer)
    assert np.isnan(garbage.content.array_records[protocol.ARRAYS_RECORD]["conv.weight"].numpy()).all()
    ctx = context(1.0, "error")
    ctx.node_config["fault-fraction"] = 0.0
    untouched = fault_mod(msg, ctx, trainer)
    np.testing.assert_array_equal(
        untouched.content.array_records[protocol.ARRAYS_RECORD]["conv.weight"].numpy(), tiny_model(1)["conv.weight"]
    )
    off = Context(run_id=1, node_id=1, node_config={"partition-id": 0}, state=RecordDict(), run_config={"seed": 1})
    fault_mod(msg, off, trainer)  # no fault keys anywhere: off


@pytest.mark.parametrize(
    ("where", "key", "value", "allowed"),
    [
        ("run-config", "fault-kind", "boom", "one of error, garbage, timeout, mixed"),
        ("run-config", "fault-fraction", 1.5, "a number in [0, 1]"),
        ("node-config", "fault-delay", -1.0, "a number >= 0"),
        ("node-config", "fault-fraction", "0.3", "a number in [0, 1]"),
    ],
)
def test_a_bad_fault_setting_is_one_line_naming_key_value_and_allowed(where, key, value, allowed):
    msg = train_message(tiny_model(), {protocol.CFG_SERVER_ROUND: 1})
    ctx = context(1.0, "error")
    (ctx.run_config if where == "run-config" else ctx.node_config)[key] = value
    with pytest.raises(ConfigError) as info:
        fault_mod(msg, ctx, trainer)
    assert str(info.value) == f"{where} '{key}' = {value!r} is out of range; allowed: {allowed}"
