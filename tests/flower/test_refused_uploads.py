"""An error-fed client whose upload the server refused for its content drops it, and is accepted again.

Owing a refused upload (adding it back into the residual, as for a lost or skipped one) makes the client
send it again inside every later upload, refused every round: in advanced-pytorch with FedCAMS one client
whose local training diverged once was refused in 7 of the 13 rounds after (issue 44). The ledger records
the refusal, the next train message carries ``pollen.refused-round``, and ``compression_mod`` starts again
from ``e = 0``. The ledger's saved state keeps the refusal (a third entry) and its load checks it. No torch.
"""

from __future__ import annotations

import numpy as np
import pytest

from pollen.clientside import compression_mod
from pollen.strategies import FedCAMS
from pollen.strategies.engine.ledger import AppliedLedger
from pollen.strategies.engine.parts import ClientSampler, EngineParts, UpdateScreen
from pollen.testing.fakes import (
    FakeGrid,
    config_of,
    full_model_reply,
    global_arrays_of,
    make_context,
    model_record,
    split_trainable,
    tiny_model,
)
from pollen.wire import protocol

pytestmark = pytest.mark.flower_compat

NODES = [1, 2, 3, 4, 5]
DIVERGES = 3  # this node's local training blows up once, in round 2


def run(rounds: int = 6) -> tuple[FedCAMS, dict[int, list[dict]]]:
    contexts = {n: make_context(n) for n in NODES}
    configs: dict[int, list[dict]] = {n: [] for n in NODES}

    def train(msg, context):  # noqa: ANN001, ANN202
        node, r = msg.metadata.dst_node_id, int(config_of(msg)[protocol.CFG_SERVER_ROUND])
        start = global_arrays_of(msg)
        step = np.random.default_rng([node, r]).standard_normal(19).astype(np.float32) * np.float32(0.1)
        if node == DIVERGES and r == 2:
            step *= np.float32(1e4)
        local = {k: v.copy() for k, v in start.items()}
        for name, part in split_trainable(step, start).items():
            local[name] = (start[name] + part).astype(np.float32)
        return full_model_reply(msg, local, num_examples=10)

    def client(msg):  # noqa: ANN001, ANN202
        configs[msg.metadata.dst_node_id].append(dict(config_of(msg)))
        return compression_mod(msg, contexts[msg.metadata.dst_node_id], train)

    strategy = FedCAMS(
        fraction_train=1.0,
        fraction_evaluate=0.0,
        min_available_nodes=len(NODES),
        parts=EngineParts(sampler=ClientSampler(identify_clients=True), screen=UpdateScreen(rule="reject")),
    )
    grid = FakeGrid(NODES, client, client_ids={n: f"c{n}" for n in NODES})
    strategy.start(grid=grid, initial_arrays=model_record(tiny_model()), num_rounds=rounds)
    return strategy, configs


def test_a_refused_upload_is_dropped_and_the_client_is_accepted_again() -> None:
    strategy, configs = run()
    reasons = {r: strategy.accounting.rounds[r].failure_reasons for r in strategy.accounting.rounds}
    assert len(reasons[2]) == 1 and "c3" in reasons[2][0] and "outlier screen" in reasons[2][0]
    assert not any(reasons[r] for r in range(3, 7)), reasons  # owed, it would come back every round
    assert configs[DIVERGES][2][protocol.CFG_REFUSED_ROUND] == 2  # round 3's message said so
    assert strategy.ledger.refused == {"c3": 2} and strategy.ledger.round_of("c3") == 6


def test_owing_a_refused_upload_would_refuse_the_client_every_round(monkeypatch) -> None:  # noqa: ANN001
    import sys

    mod = sys.modules["pollen.clientside.compression_mod"]  # the package exports the function under this name
    monkeypatch.setattr(mod, "refused", lambda config, pending_round: False)  # the client owes it instead
    strategy, _ = run()
    refused = [r for r in range(2, 7) if any("c3" in why for why in strategy.accounting.rounds[r].failure_reasons)]
    assert refused == [2, 3, 4, 5, 6]


def test_the_ledger_saves_and_checks_a_refusal() -> None:
    ledger = AppliedLedger()
    ledger.refuse(4, ["c1"])
    ledger.record(3, [type("U", (), {"client_key": "c2", "applied_scale": 0.5})()])
    state = ledger.state_dict()
    assert state == {"c1": [0, 1.0, 4], "c2": [3, 0.5]}
    again = AppliedLedger()
    again.load_state_dict(state, last_round=4)
    assert (
        again.refused == {"c1": 4}
        and again.rounds == {"c2": 3}
        and again.config_for("c1")[protocol.CFG_REFUSED_ROUND] == 4
    )
    assert protocol.CFG_REFUSED_ROUND not in again.config_for("c2")
    for bad in ({"c1": [0, 1.0, 9]}, {"c1": [0, 1.0]}, {"c1": [1, 1.0, 1, 1]}, {"c1": [1]}):
        with pytest.raises(ValueError, match="ledger"):
            AppliedLedger().load_state_dict(bad, last_round=4)
