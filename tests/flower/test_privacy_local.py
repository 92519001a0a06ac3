"""Local differential privacy as an engine part (issue 39; ``privacy.md`` §6, §13).

``EngineParts(privacy=LocalPrivacy(clip=C, noise_multiplier=z))``: every train message asks its client to
clip ``Delta + e`` to ``C`` and add ``N(0, (zC)^2)`` before compressing (the client side is tested in
``test_privacy_client_mod.py``); the server counts the train messages each client was sent and reports the
largest client epsilon: each upload is a Gaussian mechanism of multiplier ``z / 2`` against the client's own
data (sensitivity ``2C``), composed without amplification. Checked: the train config, the per-client counts
(sync and async drivers, replies or not), the epsilon and ``dp_uploads_max`` columns, resume, the settings'
checks, and which methods take local DP.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest
from flwr.app import ConfigRecord

pytest.importorskip("dp_accounting")

from pollen.privacy import PrivacyAccountant, PrivacySetting  # noqa: E402
from pollen.strategies import FedAdaVR, FedAMS, FedLAMB, FedLazy, HAFed  # noqa: E402
from pollen.strategies.engine.buffered import AsyncRule, BufferedAsync  # noqa: E402
from pollen.strategies.engine.local_privacy import LocalPrivacy  # noqa: E402
from pollen.strategies.engine.parts import ClientSampler, EngineParts, MeanAggregate  # noqa: E402
from pollen.strategies.engine.private import PrivateMean  # noqa: E402
from pollen.testing.fakes import (  # noqa: E402
    TRAINABLE,
    FakeGrid,
    config_of,
    full_model_reply,
    global_arrays_of,
    model_record,
    run_train_round,
    split_trainable,
    tiny_model,
)
from pollen.wire import protocol  # noqa: E402

pytestmark = pytest.mark.flower_compat

D = 19
NODES = 6
DELTA = 1e-5


def client_with(silent: Any = None) -> Any:
    """``x_start + Delta(node, round)`` (no noise: the server cannot tell, and does not check)."""

    def client(msg):  # noqa: ANN001, ANN202
        node, rnd = msg.metadata.dst_node_id, int(config_of(msg)[protocol.CFG_SERVER_ROUND])
        if silent is not None and silent(node, rnd):
            return None
        start = global_arrays_of(msg)
        local = dict(start)
        delta = (np.random.default_rng([node, rnd]).standard_normal(D) * 0.1).astype(np.float32)
        for name, part in split_trainable(delta, start, TRAINABLE).items():
            local[name] = (start[name] + part).astype(start[name].dtype)
        return full_model_reply(msg, local)

    return client


def local(**kwargs: Any) -> LocalPrivacy:
    return LocalPrivacy(**{"clip": 0.5, "noise_multiplier": 1.2, "delta": DELTA, **kwargs})


def build(privacy: Any, *, n: int = 3, driver: Any = None, cls: type = FedAMS) -> Any:
    parts = EngineParts(
        sampler=ClientSampler(seed=4), privacy=privacy, **({"driver": driver} if driver is not None else {})
    )
    return cls(
        fraction_train=n / NODES,
        min_train_nodes=n,
        fraction_evaluate=0.0,
        min_evaluate_nodes=0,
        min_available_nodes=n,
        parts=parts,
    )


def client_epsilon(uploads: int, z: float = 1.2) -> float:
    """One client's epsilon after ``uploads`` uploads: multiplier z/2 (sensitivity 2C), no amplification."""
    accountant = PrivacyAccountant(PrivacySetting(z / 2, DELTA, "none"))
    accountant.record(uploads)
    return accountant.epsilon()


def column(strategy: Any, name: str) -> list[Any]:
    return [strategy.accounting.rounds[r].method.get(name) for r in sorted(strategy.accounting.rounds)]


def play(strategy: Any, grid: FakeGrid, first: int, last: int, arrays: Any) -> Any:
    for rnd in range(first, last + 1):
        arrays, _, _ = run_train_round(strategy, grid, rnd, arrays)
    return arrays


# --------------------------------------------------------------------------- what clients are asked
@pytest.mark.parametrize("seed", [None, 7])
def test_every_train_message_asks_for_local_dp_with_the_clip_and_multiplier(seed: int | None) -> None:
    strategy = build(local(seed=seed))
    grid = FakeGrid(range(1, NODES + 1), client_with())
    messages = list(strategy.configure_train(1, model_record(tiny_model()), ConfigRecord(), grid))
    assert len(messages) == 3
    for message in messages:
        config = config_of(message)
        assert config[protocol.CFG_DP_MODE] == "local"
        assert config[protocol.CFG_DP_CLIP] == 0.5
        assert config[protocol.CFG_DP_NOISE] == 1.2
        if seed is None:
            assert protocol.CFG_DP_SEED not in config
        else:
            assert config[protocol.CFG_DP_SEED] == seed


def test_local_dp_keeps_the_strategys_own_aggregate_and_screen_and_takes_float_buffers() -> None:
    """The server does nothing private itself: the mean and the default screen stay, and a model with BatchNorm
    statistics is the client's business (it refuses to send them un-noised)."""
    strategy = build(local())
    assert type(strategy.round_aggregate) is MeanAggregate and not isinstance(strategy.round_aggregate, PrivateMean)
    assert strategy.screen.rule == "clip"
    grid = FakeGrid(range(1, NODES + 1), client_with())
    play(strategy, grid, 1, 1, model_record(tiny_model()))  # bn.running_mean is a float buffer
    assert strategy.accounting.rounds[1].failures == 0


# --------------------------------------------------------------------------- what is counted
def test_uploads_are_counted_per_client_from_the_messages_sent_and_epsilon_is_the_largest() -> None:
    """A client that was sent a train message uploaded (even if its reply never came: the message left with
    the client); method.dp_epsilon is the accountant's epsilon at z/2 after the most uploads any client had,
    method.dp_uploads_max that count."""
    silent = client_with(silent=lambda node, rnd: node == 2)  # node 2 never answers, and still counts
    strategy = build(local())
    grid = FakeGrid(range(1, NODES + 1), silent)
    sent: Counter[str] = Counter()
    most = []
    arrays = model_record(tiny_model())
    for rnd in range(1, 6):
        arrays = play(strategy, grid, rnd, rnd, arrays)
        sent.update(f"node-{node}" for node in grid.sampled_per_call()[-1])
        most.append(max(sent.values()))
    assert len(grid.train_messages()) == 15 and sent["node-2"] > 0
    assert strategy.privacy.uploads == dict(sent)
    assert column(strategy, "dp_uploads_max") == most
    assert column(strategy, "dp_epsilon") == [client_epsilon(k) for k in most]
    assert most[-1] > 15 / NODES  # the largest count, not the mean, decides


def test_the_asynchronous_driver_counts_every_job_it_sends() -> None:
    driver = BufferedAsync(concurrency=3, buffer_size=2, rule=AsyncRule.fadas())
    strategy = build(local(), driver=driver)
    grid = FakeGrid(range(1, NODES + 1), client_with(), arrival_seed=2)
    strategy.start(grid=grid, initial_arrays=model_record(tiny_model()), num_rounds=4)
    sent = Counter(f"node-{message.metadata.dst_node_id}" for message in grid.train_messages())
    assert strategy.privacy.uploads == dict(sent)
    assert max(column(strategy, "dp_uploads_max")) == max(sent.values())
    assert strategy.privacy.epsilon_of(max(sent.values())) == client_epsilon(max(sent.values()))


def test_epsilon_of_composes_without_amplification_at_half_the_multiplier() -> None:
    privacy = local(noise_multiplier=2.0)
    assert privacy.epsilon_of(0) == 0.0
    assert privacy.setting() == PrivacySetting(1.0, DELTA, "none")
    for uploads in (1, 4, 30):
        assert privacy.epsilon_of(uploads) == client_epsilon(uploads, z=2.0)
    assert privacy.epsilon_of(1) < privacy.epsilon_of(4) < privacy.epsilon_of(30)
    assert privacy.allows_release(1) is True  # local DP never stops the run


# --------------------------------------------------------------------------- resume
def test_a_state_without_uploads_round_trips() -> None:
    state = local().state_dict()
    assert state == {
        "kind": "local-dp",
        "version": 1,
        "settings": {"clip": 0.5, "noise_multiplier": 1.2, "delta": DELTA},
        "uploads": {},
    }
    fresh = local()
    fresh.prepare_load(state)()
    assert fresh.uploads == {}


def test_a_resumed_run_keeps_the_upload_counts() -> None:
    whole = build(local())
    play(whole, FakeGrid(range(1, NODES + 1), client_with()), 1, 4, model_record(tiny_model()))

    first = build(local())
    arrays = play(first, FakeGrid(range(1, NODES + 1), client_with()), 1, 2, model_record(tiny_model()))
    state = first.state_dict()
    assert state["privacy"]["uploads"] == dict(sorted(first.privacy.uploads.items()))
    second = build(local())
    second.load_state_dict(state, server_round=2)
    assert second.privacy.uploads == first.privacy.uploads
    play(second, FakeGrid(range(1, NODES + 1), client_with()), 3, 4, arrays)
    assert second.privacy.uploads == whole.privacy.uploads
    assert column(second, "dp_epsilon")[-1] == column(whole, "dp_epsilon")[-1]


@pytest.mark.parametrize(("field", "changed"), [("clip", 0.25), ("noise_multiplier", 2.0), ("delta", 1e-6)])
def test_a_changed_local_setting_is_refused_on_resume_naming_it(field: str, changed: float) -> None:
    first = build(local())
    play(first, FakeGrid(range(1, NODES + 1), client_with()), 1, 1, model_record(tiny_model()))
    other = build(local(**{field: changed}))
    with pytest.raises(ValueError, match=rf"privacy/settings/{field}.*a resumed run must continue the same privacy"):
        other.load_state_dict(first.state_dict(), server_round=1)
    assert other.privacy.uploads == {}


def test_a_central_state_is_not_a_local_one() -> None:
    from pollen.core.state_fields import StateError
    from pollen.strategies.engine.private import CentralPrivacy

    central_state = CentralPrivacy(clip=0.5, noise_multiplier=1.2).state_dict()
    with pytest.raises(StateError):
        local().prepare_load(central_state)


# --------------------------------------------------------------------------- settings and methods
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"clip": -1.0}, r"^dp clip=-1\.0 is out of range"),
        ({"noise_multiplier": 0}, r"^dp noise_multiplier=0 is out of range"),
        ({"delta": 0.0}, r"^dp delta=0\.0 is out of range"),
        ({"seed": True}, r"^dp seed=True is invalid"),
    ],
)
def test_local_privacy_refuses_bad_settings(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        local(**kwargs)


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (HAFed, r"^HAFed does not take local differential privacy: its clusters gossip models"),
        (FedLAMB, r"^FedLAMB does not take local differential privacy: its clients share their Adam/LAMB moments"),
        (FedLazy, r"^FedLazy does not take local differential privacy: the server keeps each client's last upload"),
    ],
    ids=["hafed", "fedlamb", "fedlazy"],
)
def test_methods_whose_clients_send_more_than_the_update_refuse_local_dp(make: type, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        make(parts=EngineParts(privacy=local()))


def test_fedadavr_takes_local_dp_with_its_own_table_aggregate() -> None:
    """Its table is built from noised uploads (post-processing), unlike under central DP where it is refused."""
    from pollen.strategies.fedadavr import TableAggregate

    strategy = FedAdaVR(parts=EngineParts(privacy=local()))
    assert isinstance(strategy.round_aggregate, TableAggregate) and strategy.privacy.mode == "local"
    config = strategy.round_config(1)
    assert config[protocol.CFG_DP_MODE] == "local" and config[protocol.CFG_DP_CLIP] == 0.5


def test_describe_names_the_mechanism_and_a_seed_as_simulation_only() -> None:
    assert "local DP" in local().describe() and "simulation only" in local(seed=3).describe()
    assert "seeded" not in local().describe()
