"""The contract of :class:`~pollen.strategies.engine.sampling.ClientSampler`: who takes part in a round.

It samples ``max(floor(fraction * n), minimum)`` clients (at most all) without replacement from its own
generator seeded by ``seed``, over the connected nodes ordered by their stable client ids (asked once per
new node with ``query.pollen_identify`` when ``identify_clients``; ``node-<id>`` otherwise), so the same
seed samples the same clients whatever node ids they have and in whatever order they connected. It waits
until ``min_available_nodes`` are connected. In population mode (``population`` = N) the clients are
``partition-0`` .. ``partition-<N-1>``, drawn exactly as N identified nodes would be, and bound one to one
to the lowest connected node ids for the round. Its state (generator, identities) is saved and restored:
a restored sampler draws what the uninterrupted one draws; a bad saved state is a ``StateError`` naming
the field, and the sampler is unchanged.
"""

from __future__ import annotations

import pytest

from pollen.core.state_fields import StateError
from pollen.strategies.engine import sampling
from pollen.strategies.engine.sampling import ClientSampler
from pollen.testing.fakes import FakeGrid
from pollen.wire import protocol

pytestmark = pytest.mark.flower_compat

#: Five clients on five nodes, connected in an order unrelated to their ids.
CLIENTS = {10: "c", 11: "a", 12: "d", 13: "b", 14: "e"}


def grid_of(clients: dict[int, str], **kwargs) -> FakeGrid:  # noqa: ANN003
    return FakeGrid(list(clients), lambda msg: None, client_ids=clients, **kwargs)


@pytest.fixture(autouse=True)
def _never_sleep(monkeypatch: pytest.MonkeyPatch) -> None:
    """Waiting for nodes sleeps a second per try: here a wait nobody arranged fails the test at once."""

    def unexpected(seconds: float) -> None:
        raise AssertionError("the sampler waited for nodes that will never connect")

    monkeypatch.setattr(sampling.time, "sleep", unexpected)


def draws(sampler: ClientSampler, grid: FakeGrid, rounds: int = 4, fraction: float = 0.4) -> list[list[str]]:
    """The client ids sampled in each of ``rounds`` rounds."""
    return [[sampler.key(node) for node in sampler.sample(grid, fraction, 1)] for _ in range(rounds)]


# ---------------------------------------------------------------------------- construction
@pytest.mark.parametrize("population", [-1, 1.5, True, "10"])
def test_a_population_that_is_not_a_count_is_refused_naming_what_is_allowed(population: object) -> None:
    with pytest.raises(ValueError, match=rf"population={population!r} is invalid; allowed: 0 \(one client per node\)"):
        ClientSampler(population=population)


# ---------------------------------------------------------------------------- identity and order
def test_connected_nodes_are_identified_once_and_ordered_by_client_id() -> None:
    sampler, grid = ClientSampler(seed=3, identify_clients=True), grid_of(CLIENTS)
    nodes = sampler.connected(grid)
    assert [sampler.key(node) for node in nodes] == ["a", "b", "c", "d", "e"]
    assert nodes == [11, 13, 10, 12, 14]
    sampler.connected(grid)
    queries = [m for m in grid.sent if m.metadata.message_type == protocol.QUERY_IDENTIFY]
    assert sorted(m.metadata.dst_node_id for m in queries) == sorted(CLIENTS)  # once per node, not per call
    assert sampler.known_clients == set(CLIENTS.values())


def test_new_nodes_are_asked_in_batches_so_a_few_clientapps_start_at_a_time() -> None:
    """Issue 43: forty new SuperNodes asked at once start forty ClientApps at once; in batches of
    ``identify_batch`` (8), each waited for, the same identities come back."""
    clients = {100 + i: f"client-{i:02d}" for i in range(20)}
    batched, grid = ClientSampler(seed=3, identify_clients=True), grid_of(clients)
    order = batched.connected(grid)
    calls = [c for c in grid.calls if c and c[0].metadata.message_type == protocol.QUERY_IDENTIFY]
    assert [len(c) for c in calls] == [8, 8, 4]
    at_once, other = ClientSampler(seed=3, identify_clients=True, identify_batch=20), grid_of(clients)
    assert at_once.connected(other) == order and [len(c) for c in other.calls] == [20]
    assert [batched.key(n) for n in order] == sorted(clients.values())
    with pytest.raises(ValueError, match=r"identify_batch=0 is invalid; allowed: an integer >= 1"):
        ClientSampler(identify_batch=0)


def test_without_identification_a_node_is_keyed_by_its_node_id() -> None:
    sampler, grid = ClientSampler(seed=3), grid_of(CLIENTS)
    assert sampler.connected(grid) == [10, 11, 12, 13, 14]
    assert sampler.key(12) == "node-12"
    assert grid.sent == []  # nobody is asked


def test_a_node_that_cannot_say_its_client_id_is_keyed_by_its_node_id() -> None:
    sampler = ClientSampler(seed=3, identify_clients=True)
    sampler.connected(FakeGrid([10, 11], lambda msg: None, client_ids={11: "a"}))  # 10 answers with an error
    assert (sampler.key(10), sampler.key(11)) == ("node-10", "a")


def test_a_client_id_held_by_a_connected_node_is_not_given_to_another() -> None:
    sampler = ClientSampler(seed=3, identify_clients=True)
    sampler.connected(grid_of({10: "a", 11: "a"}))
    assert (sampler.key(10), sampler.key(11)) == ("a", "node-11")  # the lower node id wins, whatever the timing


def test_a_client_that_reconnects_under_a_new_node_id_keeps_its_client_id() -> None:
    sampler = ClientSampler(seed=3, identify_clients=True)
    sampler.connected(grid_of({10: "a", 11: "b"}))
    sampler.connected(grid_of({11: "b", 20: "a"}))  # node 10 is gone; client a came back as node 20
    assert (sampler.key(20), sampler.key(10)) == ("a", "node-10")


def test_clusters_group_the_nodes_by_the_cluster_they_report() -> None:
    clusters = {10: "x", 11: "y", 12: "x", 13: "y", 14: "x"}
    sampler = ClientSampler(seed=3, identify_clients=True)
    groups = sampler.clusters(grid_of(CLIENTS, cluster_ids=clusters))
    assert {name: [sampler.key(n) for n in nodes] for name, nodes in groups.items()} == {
        "x": ["c", "d", "e"],
        "y": ["a", "b"],
    }
    picked = sampler.sample_per_cluster(groups, 2)
    assert [len(picked[name]) for name in ("x", "y")] == [2, 2]
    with pytest.raises(ValueError, match="cannot sample 3 nodes from cluster 'y' of 2"):
        sampler.sample_per_cluster(groups, 3)


def test_a_node_without_a_cluster_is_refused_for_clustered_sampling() -> None:
    sampler = ClientSampler(seed=3, identify_clients=True)
    with pytest.raises(ValueError, match=r"a \(node 11\) reported no cluster id; every node needs one"):
        sampler.clusters(grid_of(CLIENTS, cluster_ids={10: "x"}))


# ---------------------------------------------------------------------------- sampling
def test_the_same_seed_samples_the_same_clients_round_after_round() -> None:
    first = draws(ClientSampler(seed=3, identify_clients=True), grid_of(CLIENTS))
    again = draws(ClientSampler(seed=3, identify_clients=True), grid_of(CLIENTS))
    other = draws(ClientSampler(seed=4, identify_clients=True), grid_of(CLIENTS))
    assert first == again
    assert first != other
    assert all(len(clients) == 2 and len(set(clients)) == 2 for clients in first)  # floor(0.4 * 5), no repeats


def test_sampling_is_keyed_by_client_id_not_by_node_id_or_connection_order() -> None:
    renumbered = {100 + i: client for i, client in enumerate(["e", "d", "c", "b", "a"])}
    by_ids = draws(ClientSampler(seed=3, identify_clients=True), grid_of(CLIENTS))
    assert draws(ClientSampler(seed=3, identify_clients=True), grid_of(renumbered)) == by_ids


@pytest.mark.parametrize(
    ("fraction", "minimum", "size"),
    [(0.4, 1, 2), (0.0, 3, 3), (0.99, 1, 4), (1.0, 1, 5)],
)
def test_the_sample_size_is_floor_of_fraction_times_n_at_least_minimum(fraction, minimum, size) -> None:  # noqa: ANN001
    assert len(ClientSampler(seed=3, min_available_nodes=1).sample(grid_of(CLIENTS), fraction, minimum)) == size


def test_a_population_sample_is_at_most_the_population() -> None:
    sampler = ClientSampler(seed=3, population=5)
    assert (sampler.sample_size(0.2, 9), sampler.sample_size(0.5, 1), sampler.sample_size(0.0, 2)) == (5, 2, 2)


def test_sampling_waits_until_enough_nodes_are_connected(monkeypatch: pytest.MonkeyPatch) -> None:
    grid = FakeGrid([1], lambda msg: None)
    waits: list[float] = []

    def one_more_connects(seconds: float) -> None:  # instead of sleeping: a node connects
        waits.append(seconds)
        grid.node_ids.append(len(grid.node_ids) + 1)

    monkeypatch.setattr(sampling.time, "sleep", one_more_connects)
    nodes = ClientSampler(seed=3, min_available_nodes=3).sample(grid, 1.0, 1)
    assert waits == [1.0, 1.0]
    assert nodes == [1, 2, 3]


def test_a_minimum_above_min_available_nodes_is_waited_for_too(monkeypatch: pytest.MonkeyPatch) -> None:
    grid = FakeGrid([1, 2], lambda msg: None)
    monkeypatch.setattr(sampling.time, "sleep", lambda seconds: grid.node_ids.append(3))
    assert ClientSampler(seed=3, min_available_nodes=1).sample(grid, 0.0, 3) == [1, 2, 3]


# ---------------------------------------------------------------------------- population mode
def test_population_mode_binds_the_drawn_clients_to_the_lowest_node_ids() -> None:
    sampler = ClientSampler(seed=3, population=5)
    grid = FakeGrid([7, 3, 9], lambda msg: None)
    nodes = sampler.sample(grid, 0.4, 1)
    assert nodes == [3, 7]
    clients = [sampler.key(node) for node in nodes]
    assert all(client.startswith("partition-") for client in clients)
    assert [sampler.partition(node) for node in nodes] == [protocol.partition_of_client_id(c) for c in clients]
    assert sampler.partition(9) is None
    assert grid.sent == []  # no identity round: the clients are the population's
    assert sampler.known_clients == {f"partition-{i}" for i in range(5)}


def test_each_population_draw_replaces_the_binding() -> None:
    sampler = ClientSampler(seed=3, population=12)
    grid = FakeGrid([1, 2, 3], lambda msg: None)
    bindings = []
    for _ in range(4):
        nodes = sampler.sample(grid, 0.2, 1)
        bindings.append({node: sampler.key(node) for node in nodes})
        assert set(sampler.node_partitions) == set(nodes) == {1, 2}
    assert len({tuple(b.values()) for b in bindings}) > 1


def test_population_mode_draws_the_clients_node_mode_draws_from_the_same_seed() -> None:
    population = 12  # partition-10 sorts before partition-2: both modes order by client id
    as_nodes = {100 + i: f"partition-{i}" for i in range(population)}
    by_nodes = draws(ClientSampler(seed=3, identify_clients=True), grid_of(as_nodes), fraction=0.25)
    by_population = draws(
        ClientSampler(seed=3, population=population), FakeGrid([1, 2, 3], lambda m: None), fraction=0.25
    )
    assert by_population == by_nodes


def test_population_mode_has_no_clusters() -> None:
    with pytest.raises(ValueError, match=r"population mode .* allowed: population=0"):
        ClientSampler(population=5).clusters(FakeGrid([1, 2], lambda msg: None))


# ---------------------------------------------------------------------------- state
def test_a_restored_sampler_draws_what_the_uninterrupted_one_draws() -> None:
    sampler, grid = ClientSampler(seed=3, identify_clients=True), grid_of(CLIENTS)
    draws(sampler, grid, rounds=2)
    saved = sampler.state_dict()
    assert saved["node_keys"] == {str(node): client for node, client in CLIENTS.items()}
    resumed = ClientSampler(seed=3, identify_clients=True)
    resumed.load_state_dict(saved)
    assert draws(resumed, grid) == draws(sampler, grid)
    assert resumed.key(11) == "a"


def test_a_restored_population_sampler_draws_what_the_uninterrupted_one_draws() -> None:
    sampler, grid = ClientSampler(seed=3, population=12), FakeGrid([1, 2, 3], lambda m: None)
    draws(sampler, grid, rounds=2, fraction=0.25)
    saved = sampler.state_dict()
    assert saved["population"] == 12 and saved["known_clients"] == []
    resumed = ClientSampler(seed=3, population=12)
    resumed.load_state_dict(saved)
    assert resumed.node_partitions == sampler.node_partitions  # the last binding
    assert draws(resumed, grid, fraction=0.25) == draws(sampler, grid, fraction=0.25)


def saved_state(**change: object) -> dict:
    sampler = ClientSampler(seed=3, identify_clients=True)
    sampler.connected(grid_of(CLIENTS, cluster_ids={10: "x"}))
    state = sampler.state_dict()
    state.update(change)
    return state


@pytest.mark.parametrize(
    ("state", "field", "expected"),
    [
        (saved_state(seed=4), "sampler/seed", r"is 4; expected 3 \(the run's seed\)"),
        (saved_state(node_keys={"10": "a", "11": "a"}), "sampler/node_keys/11", "held by node 10 too"),
        (saved_state(node_keys={"10": "zz"}, node_clusters={}), "sampler/known_clients", "lacks client id 'zz'"),
        (saved_state(node_keys={"ten": "a"}, node_clusters={}), "sampler/node_keys/ten", "not an integer"),
        (saved_state(node_clusters={"99": "x"}), "sampler/node_clusters/99", "a node 'node_keys' does not know"),
        (saved_state(known_clients=["x" * 257]), "sampler/known_clients/0", "at most 256"),
        (
            saved_state(rng={**saved_state()["rng"], "bit_generator": "MT19937"}),
            "sampler/rng/bit_generator",
            "is 'MT19937'; expected one of 'PCG64', 'PCG64DXSM'",
        ),
        (
            saved_state(rng={**saved_state()["rng"], "state": {"state": 1, "inc": 2}}),
            "sampler/rng/state/inc",
            "is even; expected an odd increment",
        ),
        (saved_state(population=5), "sampler/population", "is not a field of sampler"),
    ],
    ids=[
        "other-seed",
        "client-twice",
        "unknown-client",
        "word-node",
        "cluster-of-stranger",
        "long-id",
        "other-rng",
        "even-inc",
        "population-in-node-mode",
    ],
)
def test_a_bad_saved_state_is_refused_naming_the_field_and_the_sampler_is_unchanged(state, field, expected) -> None:  # noqa: ANN001
    sampler, twin = ClientSampler(seed=3, identify_clients=True), ClientSampler(seed=3, identify_clients=True)
    grid = grid_of(CLIENTS)
    draws(sampler, grid, rounds=1), draws(twin, grid, rounds=1)
    with pytest.raises(StateError, match=expected) as refused:
        sampler.load_state_dict(state)
    assert refused.value.field == field
    assert draws(sampler, grid) == draws(twin, grid)


def test_a_population_sampler_refuses_another_populations_state() -> None:
    saved = ClientSampler(seed=3, population=6).state_dict()
    sampler = ClientSampler(seed=3, population=5)
    with pytest.raises(StateError, match=r"is 6; expected 5 \(this run's population\)") as refused:
        sampler.load_state_dict(saved)
    assert refused.value.field == "sampler/population"


def test_a_cluster_keyed_by_digit_like_characters_is_refused_naming_the_field() -> None:
    with pytest.raises(StateError) as refused:
        ClientSampler(seed=3).load_state_dict(saved_state(node_clusters={"²": "x"}))
    assert refused.value.field == "sampler/node_clusters/²"
