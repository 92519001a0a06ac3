"""Population mode: N logical clients played by fewer nodes, bound anew each round.

A simulation of 10,000 clients cannot have 10,000 simulated SuperNodes (Flower's engine scans every node's
queue each sweep); with run-config ``population`` the server samples clients from N and binds them to the
connected nodes for the round, every message names the partition its node plays, and a client's state
follows it through its ``state-dir`` file. What must hold: the same clients are drawn as with one node per
client, each message names its node's partition, and a whole run ends bit-identical to one node per client
(the runs, which need torch: ``test_population_runs.py``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, RecordDict

from pollen.app.config import AppConfig, ConfigError, defaults_from_pyproject
from pollen.app.registry import build_strategy
from pollen.clientside.compression_mod import client_state_for
from pollen.strategies.engine.sampling import ClientSampler
from pollen.testing.fakes import FakeGrid, full_model_reply, model_record, run_train_round, tiny_model
from pollen.wire import protocol

pytestmark = pytest.mark.flower_compat

DEFAULTS = defaults_from_pyproject("pyproject.toml")


def _partition_of(message: Message) -> int | None:
    config = message.content.config_records.get(protocol.CONFIG_RECORD)
    return None if config is None else config.get(protocol.CFG_PARTITION)


# ------------------------------------------------------------------ the sampler
def test_population_draws_the_clients_one_node_per_client_would_draw():
    """Same seed, same order by client id ("partition-10" before "partition-2"): the same clients each round."""
    population = 12
    nodes = list(range(501, 513))
    per_node = FakeGrid(nodes, lambda m: None, client_ids={n: f"partition-{n - 501}" for n in nodes})
    by_node = ClientSampler(seed=5, identify_clients=True)
    by_population = ClientSampler(seed=5, identify_clients=True, population=population)
    workers = FakeGrid([7, 3, 9, 4], lambda m: None)
    for _ in range(6):
        want = sorted(by_node.key(n) for n in by_node.sample(per_node, 0.25, 2))
        played = by_population.sample(workers, 0.25, 2)
        assert sorted(by_population.key(n) for n in played) == want
        assert played == [3, 4, 7]  # the lowest node ids, one client each
        assert {by_population.partition(n) for n in played} == {int(k.split("-")[1]) for k in want}
    assert workers.sent == []  # no identity round: the clients are the population's
    assert len(by_population.known_clients) == population


def test_a_new_binding_replaces_the_last_one():
    sampler = ClientSampler(seed=1, population=100)
    grid = FakeGrid([1, 2, 3, 4, 5], lambda m: None)
    sampler.sample(grid, 0.05, 1)
    sampler.sample(grid, 0.03, 1)
    assert sorted(sampler.node_keys) == [1, 2, 3]
    assert sampler.partition(4) is None and sampler.key(4) == "node-4"
    assert sorted(sampler.node_partitions.values()) == sorted(int(k.split("-")[1]) for k in sampler.node_keys.values())


def test_the_sample_size_is_a_fraction_of_the_population():
    sampler = ClientSampler(seed=0, population=10_000)
    assert sampler.sample_size(0.01, 2) == 100
    assert sampler.sample_size(0.0001, 2) == 2
    assert ClientSampler(population=3).sample_size(1.0, 5) == 3


@pytest.mark.parametrize("bad", [-1, 2.5, True, "10"])
def test_a_bad_population_is_refused(bad):
    with pytest.raises(ValueError, match="population=.* is invalid; allowed: 0 .* or an integer > 0"):
        ClientSampler(population=bad)


def test_population_state_round_trip_continues_the_same_draws_and_stays_small():
    grid = FakeGrid(list(range(1, 11)), lambda m: None)
    first = ClientSampler(seed=4, population=50_000)
    first.sample(grid, 0.0002, 2)
    saved = first.state_dict()
    assert saved["known_clients"] == []  # the population's 50,000 ids are not written every round
    restored = ClientSampler(seed=4, population=50_000)
    restored.load_state_dict(saved)
    assert restored.node_partitions == first.node_partitions
    draws = [[first.key(n) for n in first.sample(grid, 0.0002, 2)] for _ in range(3)]
    assert draws == [[restored.key(n) for n in restored.sample(grid, 0.0002, 2)] for _ in range(3)]
    with pytest.raises(ValueError, match="'sampler/population' is 50000; expected 40000 .this run's population."):
        ClientSampler(seed=4, population=40_000).load_state_dict(saved)
    with pytest.raises(ValueError, match="'sampler/population' is not a field"):
        ClientSampler(seed=4).load_state_dict(saved)
    saved["known_clients"] = ["partition-1"]
    with pytest.raises(ValueError, match="known_clients.*expected \\[\\] .a population run's clients"):
        ClientSampler(seed=4, population=50_000).load_state_dict(saved)


def test_clusters_are_refused_in_population_mode():
    with pytest.raises(ValueError, match="nodes have no clusters; allowed: population=0"):
        ClientSampler(population=8).clusters(FakeGrid([1, 2], lambda m: None))


# ------------------------------------------------------------------ messages
def _strategy(**overrides):
    cfg = AppConfig.from_run_config({**DEFAULTS, "state-dir": "/tmp/unused", **overrides})
    return build_strategy(cfg)


def test_every_train_and_evaluate_message_names_the_partition_its_node_plays():
    """The partitions the messages name are the clients one node per client would have drawn (same seed)."""
    strategy = _strategy(strategy="fedcams", population=40, **{"fraction-train": 0.1, "fraction-evaluate": 0.05})
    grid = FakeGrid([11, 12, 13, 14, 15], lambda m: None)
    per_node = ClientSampler(seed=strategy.seed, identify_clients=True)
    nodes = list(range(100, 140))
    forty = FakeGrid(nodes, lambda m: None, client_ids={n: f"partition-{n - 100}" for n in nodes})
    model = model_record(tiny_model())
    train = list(strategy.configure_train(1, model, ConfigRecord(), grid))
    want = sorted(int(per_node.key(n).split("-")[1]) for n in per_node.sample(forty, 0.1, 2))
    assert [m.metadata.dst_node_id for m in train] == [11, 12, 13, 14]
    assert sorted(_partition_of(m) for m in train) == want
    evaluate = list(strategy.configure_evaluate(1, model, ConfigRecord(), grid))
    want = sorted(int(per_node.key(n).split("-")[1]) for n in per_node.sample(forty, 0.05, 2))
    assert [m.metadata.dst_node_id for m in evaluate] == [11, 12]
    assert sorted(_partition_of(m) for m in evaluate) == want
    # each message's config is its own; the model record is shared, not copied
    assert evaluate[0].content[protocol.ARRAYS_RECORD] is evaluate[1].content[protocol.ARRAYS_RECORD]


def test_a_reply_from_another_client_than_the_one_played_is_rejected():
    """A ClientApp that ignores ``pollen.partition`` trains the node's own data: its update is not filed under
    the played client; one that reports the client it played is read."""
    strategy = _strategy(strategy="fedams", population=10, **{"fraction-train": 0.3, "fraction-evaluate": 0.0})
    arrays = tiny_model()

    def client(msg: Message) -> Message:
        answer = full_model_reply(msg, {k: v + np.float32(0.01) for k, v in arrays.items()})
        partition = _partition_of(msg)
        claimed = f"partition-{partition}" if msg.metadata.dst_node_id != 2 else "partition-999"
        answer.content[protocol.CLIENT_INFO_RECORD] = ConfigRecord({protocol.IDENTITY_CLIENT_ID: claimed})
        return answer

    grid = FakeGrid([1, 2, 3], client)
    run_train_round(strategy, grid, 1, model_record(arrays))
    stats = strategy.accounting.round(1)
    assert stats.replies == 2 and stats.failures == 1
    played = strategy.sampler.key(2)
    assert stats.failure_reasons == [
        f"{played}: answered as client 'partition-999' but plays {played} (population mode); allowed: a ClientApp "
        "that reads 'pollen.partition' and reports it in 'pollen.client-info', as pollen's does"
    ]


def test_without_a_population_messages_name_no_partition():
    strategy = _strategy(strategy="fedams", **{"fraction-train": 1.0})
    grid = FakeGrid([1, 2, 3], lambda m: None, client_ids={n: f"partition-{n - 1}" for n in (1, 2, 3)})
    train = list(strategy.configure_train(1, model_record(tiny_model()), ConfigRecord(), grid))
    assert [_partition_of(m) for m in train] == [None, None, None]


# ------------------------------------------------------------------ refusals, one line each
def test_population_needs_a_state_dir():
    with pytest.raises(ConfigError, match="'population' = 10 needs 'state-dir'.*follows the client"):
        AppConfig.from_run_config({**DEFAULTS, "population": 10})


@pytest.mark.parametrize(
    ("strategy", "words"),
    [
        ("fedavg", "does not fit Flower's own FedAvg: it samples the connected nodes itself"),
        ("hafed", "does not fit HA-Fed's clusters: every client of every cluster trains and gossips"),
    ],
)
def test_methods_that_need_one_node_per_client_refuse_a_population(strategy, words):
    with pytest.raises(ValueError, match=words):
        _strategy(strategy=strategy, population=16, **{"cluster-size": 4})


def _context(node_config=None, **run_config) -> Context:
    return Context(
        run_id=1,
        node_id=1,
        node_config=node_config or {"partition-id": 0, "num-partitions": 2},
        state=RecordDict(),
        run_config={**DEFAULTS, **run_config},
    )


def test_a_played_clients_state_lives_under_the_runs_state_dir_not_the_nodes(tmp_path: Path):
    """A node's own state-dir would not follow the client to the next node that plays it."""
    context = _context({"partition-id": 0, "state-dir": str(tmp_path / "node")}, **{"state-dir": str(tmp_path / "run")})
    state = client_state_for(context, ConfigRecord({protocol.CFG_PARTITION: 3, protocol.CFG_SERVER_ROUND: 1}))
    assert state.path.parent.parent == tmp_path / "run" and state.path.name == "partition-3.npz"
    own = client_state_for(context, ConfigRecord({protocol.CFG_SERVER_ROUND: 1}))
    assert own.path.parent.parent == tmp_path / "node"  # the node's own client: node-config wins, as before


def test_fedadavr_refuses_a_number_of_clients_other_than_the_population():
    with pytest.raises(ValueError, match="'num-clients' = 500 but 'population' = 1000.*allowed: num-clients = 0"):
        _strategy(strategy="fedadavr", population=1000, **{"num-clients": 500})
    assert _strategy(strategy="fedadavr", population=1000, **{"num-clients": 1000}).sampler.population == 1000


def test_a_played_client_without_a_state_dir_is_a_clear_error():
    context = _context()
    with pytest.raises(ValueError, match="plays partition-4 .*must live in a file under the run-config state-dir"):
        client_state_for(context, ConfigRecord({protocol.CFG_PARTITION: 4, protocol.CFG_SERVER_ROUND: 1}))
