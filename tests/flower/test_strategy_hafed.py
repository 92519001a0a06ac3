"""HA-Fed's server (spec hafed.md §3.2-3.6) on a fake grid: relayed gossip, the absent-client rule, reductions.

The fake clients add a known step ``a(node, round, segment)`` to the model they were sent (the
global model for the train message, the mixed model of a ``hafed-gossip`` message), so the server's
mixing is checked against ``X <- W (X + A)`` computed by hand. No torch: these run against the
newest Flower too.
"""

from __future__ import annotations

import numpy as np
import pytest

from pollen.clientside.steps.hafed import CFG_SEGMENT, active_iterations, segment_bounds, stream_indices
from pollen.gossip import mixing_matrix, without_absent
from pollen.optim import amsgrad
from pollen.strategies import HAFed
from pollen.strategies.engine.parts import ClientSampler, EngineParts
from pollen.strategies.engine.rounds import SetupError
from pollen.strategies.engine.screening import MODEL_NORM_FLOOR, UpdateScreen
from pollen.strategies.hafed_clusters import ClusterPlan
from pollen.testing.fakes import (
    FakeGrid,
    config_of,
    error_reply,
    full_model_reply,
    global_arrays_of,
    model_record,
    split_trainable,
    tiny_model,
)
from pollen.wire import protocol
from pollen.wire.protocol import GOSSIP_PHASE

pytestmark = pytest.mark.flower_compat

D = 19
TRAINABLE = ("conv.weight", "conv.bias", "bn.weight")
K, N = 2, 4
NODES = list(range(101, 101 + K * N))
IDS = {node: f"partition-{i}" for i, node in enumerate(NODES)}
CLUSTERS = {node: str(i // N) for i, node in enumerate(NODES)}


def step(node: int, rnd: int, segment: int) -> np.ndarray:
    return (np.random.default_rng([node, rnd, segment]).standard_normal(D) * 0.01).astype(np.float32)


def gossip_client(seen: list, drop: set | None = None):  # noqa: ANN201
    """x_i^{1/2} = (the model it was sent) + a(node, round, segment); ``drop``: (node, round, segment) that fail."""

    def client(msg):  # noqa: ANN001, ANN202
        node, config = msg.metadata.dst_node_id, config_of(msg)
        rnd = int(config[protocol.CFG_SERVER_ROUND])
        segment = int(config.get(CFG_SEGMENT, 0))
        seen.append((rnd, node, segment, msg.metadata.message_type))
        if drop and (node, rnd, segment) in drop:
            return error_reply(msg, "gone for this step")
        local = dict(global_arrays_of(msg))
        for name, part in split_trainable(step(node, rnd, segment), local, TRAINABLE).items():
            local[name] = local[name] + part
        return full_model_reply(msg, local, **{"grad-evals": 3})

    return client


def run(rounds: int = 1, drop: set | None = None, **kwargs):  # noqa: ANN201
    seen: list = []
    kwargs.setdefault("local_steps", 3)
    kwargs.setdefault("eta", 0.01)  # the spec's server settings, which the hand computation uses
    kwargs.setdefault("eps", 1e-8)
    strategy = HAFed(
        fraction_evaluate=0.0,
        parts=EngineParts(sampler=ClientSampler(seed=5, identify_clients=True)),
        min_available_nodes=len(NODES),
        **kwargs,
    )
    grid = FakeGrid(NODES, gossip_client(seen, drop), client_ids=IDS, cluster_ids=CLUSTERS)
    strategy.start(grid=grid, initial_arrays=model_record(tiny_model()), num_rounds=rounds)
    return strategy, grid, seen


def x0() -> np.ndarray:
    return np.concatenate([tiny_model()[n].reshape(-1) for n in TRAINABLE]).astype(np.float64)


def hand_round(x: np.ndarray, rnd: int, w: np.ndarray, segments: int, drop: set | None = None) -> dict[int, np.ndarray]:
    """Every client's model after the round's last mixing, by the spec's X <- W' (X + A)."""
    models = {node: x.copy() for node in NODES}
    for segment in range(segments):
        for c in range(K):
            members = NODES[c * N : (c + 1) * N]
            present = np.array([not (drop and (node, rnd, segment) in drop) for node in members])
            half = np.stack(
                [models[node] + step(node, rnd, segment) if ok else models[node] for node, ok in zip(members, present)]
            )
            mixed = without_absent(w, present) @ half
            for i, node in enumerate(members):
                models[node] = mixed[i]
    return models


def uploaders(grid: FakeGrid, strategy: HAFed, rnd: int) -> list[int]:
    """The nodes whose final models were aggregated: replays the sampler's draw."""
    return strategy.sampler.plan._test_uploaders[rnd]


@pytest.fixture(autouse=True)
def remember_uploaders(monkeypatch):
    original = ClusterPlan.train_nodes

    def train_nodes(self, sampler, server_round, grid, fraction, minimum):  # noqa: ANN001, ANN202
        nodes = original(self, sampler, server_round, grid, fraction, minimum)
        self.__dict__.setdefault("_test_uploaders", {})[server_round] = list(self.uploaders(server_round))
        return nodes

    monkeypatch.setattr(ClusterPlan, "train_nodes", train_nodes)


def amsgrad_step(x: np.ndarray, delta: np.ndarray, eta: float = 0.01) -> np.ndarray:
    opt = amsgrad(eta=eta, beta_1=0.9, beta_2=0.99, eps=1e-8, eps_mode="inside")
    s, _ = opt.update(opt.init(D), delta.astype(np.float32))
    return x + s


@pytest.mark.parametrize(("topology", "every"), [("ring", 1), ("full", 1), ("ring", 2)])
def test_one_round_equals_the_hand_computed_gossip_and_server_amsgrad(topology, every):
    strategy, grid, seen = run(topology=topology, gossip_every=every, local_steps=3)
    segments = len(segment_bounds(3, every))
    models = hand_round(x0(), 1, mixing_matrix(topology, N), segments)
    ups = uploaders(grid, strategy, 1)
    assert len(ups) == K * 2 and all(sum(CLUSTERS[u] == str(c) for u in ups) == 2 for c in range(K))
    delta = np.mean([models[u] - x0() for u in ups], axis=0)
    np.testing.assert_allclose(strategy.params, amsgrad_step(x0(), delta), rtol=1e-5, atol=1e-6)
    stats = strategy.accounting.rounds[1]
    assert stats.exchange_messages == (segments - 1) * len(NODES)
    assert sum(1 for *_, kind in seen if kind == "train") == len(NODES)  # every client trains
    assert stats.grad_evals == 3 * segments * len(NODES) and stats.failures == 0


def test_gossip_keeps_each_cluster_mean():
    """Doubly stochastic W: with everyone uploading, Delta is the mean step as if nobody had gossiped."""
    strategy, _, _ = run(topology="ring", local_steps=4, uploaders_per_cluster=N)
    no_gossip = sum(np.mean([step(n, 1, s).astype(np.float64) for n in NODES], axis=0) for s in range(4))
    np.testing.assert_allclose(strategy.params, amsgrad_step(x0(), no_gossip), rtol=1e-5, atol=1e-6)
    models = hand_round(x0(), 1, mixing_matrix("ring", N), 4)
    assert max(np.abs(models[n] - models[NODES[0]]).max() for n in NODES[:N]) > 1e-4  # the clients did differ
    assert strategy.accounting.rounds[1].failures == 0


def test_a_dropped_gossip_reply_follows_the_rule_and_the_round_completes():
    victim = NODES[1]
    drop = {(victim, 1, 1)}
    strategy, grid, seen = run(topology="ring", local_steps=3, drop=drop)
    models = hand_round(x0(), 1, mixing_matrix("ring", N), 3, drop=drop)
    ups = uploaders(grid, strategy, 1)
    delta = np.mean([models[u] - x0() for u in ups], axis=0)
    np.testing.assert_allclose(strategy.params, amsgrad_step(x0(), delta), rtol=1e-5, atol=1e-6)
    stats = strategy.accounting.rounds[1]
    assert stats.failures == 1 and "gone for this step" in stats.failure_reasons[0]
    assert (1, victim, 2, protocol.PHASE_MESSAGE_TYPE) in seen  # asked again with its last model


def test_full_mixing_makes_two_uploaders_per_cluster_equal_full_participation():
    """W = 11^T/n: every client of a cluster holds the same model, so any m gives the same Delta (spec C2)."""
    a, _, _ = run(rounds=2, topology="full", uploaders_per_cluster=2)
    b, _, _ = run(rounds=2, topology="full", uploaders_per_cluster=N)
    np.testing.assert_allclose(a.params, b.params, rtol=0, atol=1e-7)


def test_identity_with_everyone_uploading_is_fedamsgrad_with_full_participation():
    a, _, seen_a = run(rounds=2, topology="identity", uploaders_per_cluster=N)
    b, _, seen_b = run(rounds=2, topology="identity", clustered=False, fraction_train=1.0)
    np.testing.assert_array_equal(a.params, b.params)
    assert a.accounting.rounds[1].exchange_messages == 0 and len(seen_a) == len(seen_b) == 2 * len(NODES)


def test_identity_trains_only_the_uploaders_in_one_message():
    strategy, _, seen = run(topology="identity", uploaders_per_cluster=1, local_steps=5)
    assert len(seen) == K and all(kind == "train" for *_, kind in seen)
    assert strategy.accounting.rounds[1].method["relayed_bytes"] == 0


def test_relayed_and_peer_bytes():
    strategy, _, _ = run(topology="ring", local_steps=2)
    stats = strategy.accounting.rounds[1]
    model = 4 * D + sum(b.nbytes for b in strategy.buffers.values())
    edges = K * N * 2  # a ring: two directed edges out of each client
    assert stats.method["peer_bytes"] == model * (edges * 2 + K * (N - 2))
    assert 0 < stats.method["relayed_bytes"] < stats.uplink_bytes + stats.downlink_bytes
    assert stats.downlink_records[f"{GOSSIP_PHASE}/arrays"] > 0


def test_bad_layouts_stop_before_round_one():
    with pytest.raises(SetupError, match="same size"):
        HAFed(parts=EngineParts(sampler=ClientSampler(seed=1, identify_clients=True))).start(
            grid=FakeGrid(
                NODES[:3], lambda m: None, client_ids=IDS, cluster_ids={NODES[0]: "a", NODES[1]: "a", NODES[2]: "b"}
            ),
            initial_arrays=model_record(tiny_model()),
            num_rounds=1,
        )
    with pytest.raises(SetupError, match="cluster of one client has no neighbours"):
        HAFed(parts=EngineParts(sampler=ClientSampler(seed=1, identify_clients=True)), uploaders_per_cluster=1).start(
            grid=FakeGrid(NODES[:2], lambda m: None, client_ids=IDS, cluster_ids={NODES[0]: "a", NODES[1]: "b"}),
            initial_arrays=model_record(tiny_model()),
            num_rounds=1,
        )
    with pytest.raises(SetupError, match="m=5 exceeds the cluster size n=4"):
        run(uploaders_per_cluster=5)
    with pytest.raises(SetupError, match="cluster id"):
        HAFed(parts=EngineParts(sampler=ClientSampler(seed=1, identify_clients=True))).start(
            grid=FakeGrid(NODES, lambda m: None, client_ids=IDS),
            initial_arrays=model_record(tiny_model()),
            num_rounds=1,
        )


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"local_steps": 2, "gossip_every": 3}, "gossip_every=3 is larger than local_steps"),
        ({"topology": "star"}, "topology='star' is unknown"),
        ({"active_prob": 0.0}, "active_prob"),
        ({"topology": "circulant"}, "needs offsets"),
        ({"topology": "interpolated", "lam": 2.0}, "lam"),
        ({"clustered": False}, "topology='identity'"),
    ],
)
def test_bad_settings_are_refused(kwargs, words):
    with pytest.raises(ValueError, match=words):
        HAFed(**kwargs)


def test_segments_end_with_a_gossip_after_every_g_and_after_the_last():
    assert segment_bounds(48, 1)[:2] == [(0, 1), (1, 2)] and len(segment_bounds(48, 1)) == 48
    assert segment_bounds(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert segment_bounds(5, 5) == [(0, 5)]


def test_the_batch_stream_does_not_depend_on_how_the_round_is_cut():
    whole = stream_indices(7, 3, 50, 0, 130)
    parts = np.concatenate([stream_indices(7, 3, 50, 0, 40), stream_indices(7, 3, 50, 40, 90)])
    np.testing.assert_array_equal(whole, parts)
    assert sorted(whole[:50]) == list(range(50))  # each epoch is a permutation
    assert not np.array_equal(whole[:50], stream_indices(7, 4, 50, 0, 50))  # clients differ


def test_partially_active_clients_draw_per_iteration():
    counts = [active_iterations(1, c, 1, 0, 48, 0.25) for c in range(200)]
    assert 0.2 < np.mean(counts) / 48 < 0.3
    assert active_iterations(1, 5, 2, 0, 8, 0.5) == active_iterations(1, 5, 2, 0, 4, 0.5) + active_iterations(
        1, 5, 2, 4, 8, 0.5
    )
    assert active_iterations(1, 5, 2, 0, 8, 1.0) == 8


def bad_gossip_client(seen: list, victim: int, kind: str):  # noqa: ANN201
    """Like gossip_client, but ``victim``'s reply to segment 1 of round 1 is broken in one way."""
    honest = gossip_client(seen)

    def client(msg):  # noqa: ANN001, ANN202
        node, config = msg.metadata.dst_node_id, config_of(msg)
        if (node, int(config[protocol.CFG_SERVER_ROUND]), int(config.get(CFG_SEGMENT, 0))) != (victim, 1, 1):
            return honest(msg)
        seen.append((1, node, 1, msg.metadata.message_type))
        local = dict(global_arrays_of(msg))
        if kind == "silent":
            return None
        if kind == "nan":
            local["conv.weight"] = np.full_like(local["conv.weight"], np.nan)
        elif kind == "shape":
            local["conv.weight"] = np.zeros((3, 3), np.float32)
        elif kind == "poison":
            local["conv.weight"] = local["conv.weight"] + 50.0
        elif kind == "metrics":
            for name, part in split_trainable(step(node, 1, 1), local, TRAINABLE).items():
                local[name] = local[name] + part
            return full_model_reply(msg, local, **{"grad-evals": float("inf")})
        return full_model_reply(msg, local)

    return client


@pytest.mark.parametrize("kind", ["nan", "shape", "poison", "silent", "metrics"])
def test_a_bad_gossip_reply_is_left_out_of_that_step_and_the_round_completes(kind):
    """With ``rule="reject"`` (the app's ``outlier-rule`` default) a poisoned move is refused like a broken reply."""
    victim = NODES[2]
    seen: list = []
    strategy = HAFed(
        fraction_evaluate=0.0,
        parts=EngineParts(sampler=ClientSampler(seed=5, identify_clients=True), screen=UpdateScreen(rule="reject")),
        min_available_nodes=len(NODES),
        local_steps=3,
        topology="ring",
        eta=0.01,
        eps=1e-8,
    )
    grid = FakeGrid(NODES, bad_gossip_client(seen, victim, kind), client_ids=IDS, cluster_ids=CLUSTERS)
    strategy.start(grid=grid, initial_arrays=model_record(tiny_model()), num_rounds=1)
    stats = strategy.accounting.rounds[1]
    drop = {(victim, 1, 1), (victim, 1, 2)} if kind == "silent" else ({(victim, 1, 1)} if kind != "metrics" else set())
    models = hand_round(x0(), 1, mixing_matrix("ring", N), 3, drop=drop)
    ups = [u for u in uploaders(grid, strategy, 1) if not (kind == "silent" and u == victim)]
    delta = np.mean([models[u] - x0() for u in ups], axis=0)
    np.testing.assert_allclose(strategy.params, amsgrad_step(x0(), delta), rtol=1e-5, atol=1e-6)
    assert np.isfinite(strategy.params).all()
    if kind == "metrics":  # a claim of infinite work counts as nothing; the model itself was fine
        assert stats.failures == 0 and stats.grad_evals == 3 * 3 * len(NODES) - 3
    else:
        assert stats.failures >= 1
    if kind == "silent":  # not asked again in that round
        assert (1, victim, 2, protocol.PHASE_MESSAGE_TYPE) not in seen
    if kind == "poison":
        assert any("outlier screen" in reason for reason in stats.failure_reasons)


def test_a_move_beyond_the_bound_is_clipped_along_itself_with_the_clip_rule():
    """The constructor's ``rule="clip"``: a gossip reply whose move is far beyond the step's bound (an honest
    client whose step diverged, issue 44; here +50 on one tensor) is not refused but pulled back along its move
    to the bound, ``factor x max(median of the other movers' moves, median of the round's earlier moves,
    MODEL_NORM_FLOOR x ||x||)``, and mixed; the round has no failure."""
    victim = NODES[2]
    strategy = HAFed(
        fraction_evaluate=0.0,
        parts=EngineParts(sampler=ClientSampler(seed=5, identify_clients=True)),
        min_available_nodes=len(NODES),
        local_steps=3,
        topology="ring",
    )
    assert strategy.screen.rule == "clip"
    steps: dict[int, tuple] = {}
    screen_step = strategy._screen_step

    def spy(server_round, updates, current, earlier_moves, index):  # noqa: ANN001, ANN202
        starts = {u.node_id: current[u.node_id].delta.copy() for u in updates}
        raw = {u.node_id: u.delta - starts[u.node_id] for u in updates}
        earlier = [m for m in earlier_moves if m > 0]
        kept = screen_step(server_round, updates, current, earlier_moves, index)
        steps[index] = (starts, raw, earlier, {u.node_id: u.delta.copy() for u in kept})  # before the mix
        return kept

    strategy._screen_step = spy
    grid = FakeGrid(NODES, bad_gossip_client([], victim, "poison"), client_ids=IDS, cluster_ids=CLUSTERS)
    strategy.start(grid=grid, initial_arrays=model_record(tiny_model()), num_rounds=1)

    assert strategy.accounting.rounds[1].failures == 0 and strategy.screen.clipped == 1
    starts, raw, earlier, kept = steps[1]
    moved = kept[victim] - starts[victim]
    others = [float(np.linalg.norm(raw[node])) for node in kept if node != victim]
    floor = MODEL_NORM_FLOOR * float(np.linalg.norm(x0()))
    bound = strategy.screen.factor * max(float(np.median(others)), float(np.median(earlier)), floor)
    raw_move = raw[victim]
    assert float(np.linalg.norm(raw_move)) > 10 * bound  # far beyond: a reject rule would refuse it
    np.testing.assert_allclose(np.linalg.norm(moved), bound, rtol=1e-4)
    np.testing.assert_allclose(moved, raw_move * (bound / np.linalg.norm(raw_move)), rtol=1e-4, atol=1e-6)
    assert all(np.array_equal(delta - starts[node], raw[node]) for node, delta in kept.items() if node != victim)
    assert np.isfinite(strategy.params).all()


def test_relaying_with_w_equal_identity_is_fedamsgrad():
    """The relay machinery itself (a gossip message after every step) with W = I changes nothing."""

    class RelayWithIdentity(HAFed):
        def check_setup(self, grid):  # noqa: ANN001, ANN202
            super().check_setup(grid)
            for cluster in self.sampler.plan.clusters:
                cluster.w = np.eye(N)

    seen: list = []
    relayed = RelayWithIdentity(
        fraction_evaluate=0.0,
        parts=EngineParts(sampler=ClientSampler(seed=5, identify_clients=True)),
        min_available_nodes=len(NODES),
        local_steps=3,
        uploaders_per_cluster=N,
        eta=0.01,
        eps=1e-8,
    )
    relayed.start(
        grid=FakeGrid(NODES, gossip_client(seen), client_ids=IDS, cluster_ids=CLUSTERS),
        initial_arrays=model_record(tiny_model()),
        num_rounds=1,
    )
    assert relayed.accounting.rounds[1].exchange_messages == 2 * len(NODES)
    direct = np.mean([sum(step(n, 1, s).astype(np.float64) for s in range(3)) for n in NODES], axis=0)
    np.testing.assert_allclose(relayed.params, amsgrad_step(x0(), direct), rtol=1e-5, atol=1e-6)
