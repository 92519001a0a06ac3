"""The client-step tables: explicit, read-only, extendable by an app; a step runs without pollen's app."""

from __future__ import annotations

import pytest
from flwr.app import ConfigRecord

import pollen.clientside
from pollen.clientside.steps import LOCAL_STEPS, PHASES, LocalWork, fedlamb, hafed, lookup, sgd, with_steps
from pollen.testing import relay_demo
from pollen.wire import protocol


def test_the_production_tables_name_each_method_step_by_its_wire_name():
    assert dict(LOCAL_STEPS) == {
        "sgd": sgd.run,
        protocol.ADAPTIVE_LOCAL_STEP: fedlamb.run,
        protocol.GOSSIP_LOCAL_STEP: hafed.run_local,
    }
    assert dict(PHASES) == {protocol.GOSSIP_PHASE: hafed.run_gossip}
    with pytest.raises(TypeError):
        LOCAL_STEPS["mine"] = sgd.run  # type: ignore[index]  # no registration by mutation either


def test_the_relay_demo_is_not_in_the_product_only_in_the_testing_app():
    import pollen.client_app as client_app
    from pollen.testing import apps

    assert not set(relay_demo.CLIENT_STEPS) & set(client_app.LOCAL_STEPS)
    assert not set(relay_demo.CLIENT_PHASES) & set(client_app.PHASES)
    assert apps.STEPS["relay-first-half"] is relay_demo.first_half
    assert apps.PHASES["relay-mix"] is relay_demo.relay_mix
    assert {k: v for k, v in apps.STEPS.items() if k in LOCAL_STEPS} == dict(LOCAL_STEPS)


def test_with_steps_adds_an_apps_own_steps_and_refuses_to_shadow_pollens():
    def mine(work):  # noqa: ANN001, ANN202
        raise AssertionError

    local_steps, phases = with_steps(local_steps={"mine": mine}, phases={"my-phase": mine})
    assert local_steps["mine"] is mine and phases["my-phase"] is mine and local_steps["sgd"] is sgd.run
    assert "mine" not in LOCAL_STEPS  # pollen's table is untouched
    with pytest.raises(ValueError, match="local step 'sgd' is one of pollen's"):
        with_steps(local_steps={"sgd": mine})
    assert {**LOCAL_STEPS, "sgd": mine}["sgd"] is mine  # replacing one is a plain dict merge
    with pytest.raises(ValueError, match="phase 'nope' is unknown to this ClientApp; allowed: hafed-gossip"):
        lookup(PHASES, "nope", "phase")


def test_the_client_side_declares_its_public_api():
    assert sorted(pollen.clientside.__all__) == sorted(
        [
            "compression_mod",
            "lazy_mod",
            "secagg_mod",
            "compress_update",
            "ClientState",
            "LocalLAMB",
            "LocalWork",
            "StepOutcome",
            "LOCAL_STEPS",
            "PHASES",
        ]
    )
    from pollen.clientside.lamb import LocalLAMB

    assert pollen.clientside.LocalLAMB is LocalLAMB
    with pytest.raises(AttributeError):
        pollen.clientside.NotThere  # noqa: B018


def test_a_step_runs_without_pollens_app_from_the_message_and_a_plain_mapping():
    """A library user calls a step with their own task object and settings dict (no run-config, no schedule)."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    class Task:
        def __init__(self) -> None:
            torch.manual_seed(0)
            self.model = torch.nn.Linear(4, 3)
            self.device = torch.device("cpu")
            self.partition_id = 0
            g = torch.Generator().manual_seed(1)
            self.data = TensorDataset(torch.randn(20, 4, generator=g), torch.randint(0, 3, (20,), generator=g))

        def loaders(self, batch_size: int):  # noqa: ANN202
            return DataLoader(self.data, batch_size=batch_size, shuffle=True), None

    settings = {
        "local-lr": 0.1,
        "local-steps": 3,
        "local-epochs": 1,
        "batch-size": 5,
        "momentum": 0.0,
        "weight-decay": 0.0,
    }
    task = Task()
    before = task.model.weight.detach().clone()
    work = LocalWork(
        task=task,
        msg=None,
        config=ConfigRecord({"local-steps": 2}),
        state=None,
        server_round=7,
        seed=3,
        settings=settings,
    )
    assert work.setting("local-lr") == 0.1  # no lr-schedule given: constant
    outcome = sgd.run(work)
    assert outcome.metrics["num-steps"] == 2  # the message's config wins over the mapping
    assert outcome.metrics[protocol.NUM_EXAMPLES] == 20
    assert not torch.equal(task.model.weight, before)
    with pytest.raises(KeyError, match="'seed' is neither in the message's config nor in the settings"):
        work.setting("seed")
