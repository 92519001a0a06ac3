"""HA-Fed with partially active clients: idle clients are not screened as movers (issue 24).

With ``active-prob`` < 1 a client idle for a whole gossip segment returns the model it was sent; its
move is float round-off (about 1e-8). Judged as a mover, it made the step's median move round-off and
every active client "10x the median": 400 of 2,560 replies rejected at p = 0.5. The real ClientApp
(torch, a small model on the embedded data) runs every message here, through the fake grid.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from flwr.app import ArrayRecord, Context, RecordDict

from pollen.app.config import defaults_from_pyproject
from pollen.strategies.engine.parts import ClientSampler, EngineParts
from pollen.testing.fakes import FakeGrid, model_record, named_arrays
from pollen.wire import protocol

ROOT = Path(__file__).resolve().parents[2]
NUM_NODES, CLUSTER = 8, 4
SETTINGS = {
    "strategy": "hafed",
    "model": "mlp",
    "batch-size": 16,
    "partitioner": "iid",
    "local-lr": 0.05,
    "fraction-evaluate": 0.0,
    "min-evaluate-nodes": 0,
    "eval-every": 100,
    "cluster-size": CLUSTER,
    "topology": "ring",
    "local-steps": 4,
    "gossip-every": 1,
    "min-train-nodes": NUM_NODES,
}


def run_hafed(active_prob: float, rounds: int = 2, poison: tuple[int, int, int] | None = None):  # noqa: ANN201
    """HA-Fed for ``rounds`` rounds; ``poison=(node, round, segment)``: that reply's model moved by +5."""
    import pollen.client_app as client_module
    from pollen.app.config import AppConfig
    from pollen.app.experiment import build_model
    from pollen.app.registry import build_strategy

    run_config = {**defaults_from_pyproject(str(ROOT / "pyproject.toml")), **SETTINGS, "active-prob": active_prob}
    contexts = {
        node: Context(
            run_id=1,
            node_id=node,
            node_config={"partition-id": node - 1, "num-partitions": NUM_NODES},
            state=RecordDict(),
            run_config=run_config,
        )
        for node in range(1, NUM_NODES + 1)
    }

    def client(msg):  # noqa: ANN001, ANN202
        out = client_module.app(msg, contexts[msg.metadata.dst_node_id])
        config = msg.content.config_records[protocol.CONFIG_RECORD]
        where = (
            msg.metadata.dst_node_id,
            int(config[protocol.CFG_SERVER_ROUND]),
            int(config.get(protocol.CFG_GOSSIP_SEGMENT, 0)),
        )
        if where == poison:
            arrays = named_arrays(out.content.array_records[protocol.ARRAYS_RECORD])
            first = next(name for name, value in arrays.items() if value.dtype.kind == "f")
            arrays[first] = arrays[first] + np.float32(5.0)
            out.content[protocol.ARRAYS_RECORD] = model_record(arrays)
        return out

    grid = FakeGrid(
        list(contexts),
        client,
        client_ids={n: f"partition-{n - 1}" for n in contexts},
        cluster_ids={n: str((n - 1) // CLUSTER) for n in contexts},
    )
    cfg = AppConfig.from_run_config(run_config)
    strategy = build_strategy(cfg)
    strategy.start(grid=grid, initial_arrays=ArrayRecord(build_model(cfg).state_dict()), num_rounds=rounds)
    return strategy


@pytest.mark.parametrize("active_prob", [0.25, 0.5])
def test_no_honest_reply_is_rejected_when_clients_idle_and_an_attacker_still_is(active_prob: float) -> None:
    honest = run_hafed(active_prob)
    for rnd, stats in honest.accounting.rounds.items():
        assert stats.failures == 0, (rnd, stats.failure_reasons)
    assert np.isfinite(honest.params).all()

    attacked = run_hafed(active_prob, rounds=1, poison=(3, 1, 2))
    reasons = attacked.accounting.rounds[1].failure_reasons
    assert len(reasons) == 1 and "partition-2" in reasons[0] and "outlier screen" in reasons[0], reasons


def test_a_reply_that_says_it_took_no_steps_but_moved_is_rejected_and_idle_ones_are_not_movers() -> None:
    """No torch: most clients idle (they send back what they got, ``num-steps`` 0), two move a little,
    one says ``num-steps`` 0 and moves. Only that one is rejected; the movers are not "10x" the idle."""
    from pollen.strategies import HAFed
    from pollen.testing.fakes import config_of, full_model_reply, global_arrays_of, tiny_model

    nodes = list(range(101, 109))
    movers, liar = {101, 105}, 102

    def client(msg):  # noqa: ANN001, ANN202
        node, config = msg.metadata.dst_node_id, config_of(msg)
        local = dict(global_arrays_of(msg))
        segment = int(config.get(protocol.CFG_GOSSIP_SEGMENT, 0))
        if node in movers or node == liar:
            step = np.random.default_rng([node, segment]).standard_normal(local["conv.bias"].shape) * 0.01
            local["conv.bias"] = local["conv.bias"] + step.astype(np.float32)
        return full_model_reply(msg, local, **{"num-steps": 1 if node in movers else 0})

    strategy = HAFed(
        fraction_evaluate=0.0,
        parts=EngineParts(sampler=ClientSampler(seed=5, identify_clients=True)),
        min_available_nodes=8,
        local_steps=3,
        active_prob=0.25,
    )
    grid = FakeGrid(
        nodes,
        client,
        client_ids={n: f"c{n}" for n in nodes},
        cluster_ids={n: str(i // 4) for i, n in enumerate(nodes)},
    )
    strategy.start(grid=grid, initial_arrays=model_record(tiny_model()), num_rounds=1)
    reasons = strategy.accounting.rounds[1].failure_reasons
    assert reasons and all(r.startswith(f"c{liar}: reports no local steps but moved") for r in reasons), reasons
