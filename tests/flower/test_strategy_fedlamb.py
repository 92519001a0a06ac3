"""The Fed-LAMB family's server (spec fedlamb.md §4.2-4.5) on a fake grid: v_hat, its broadcast, sync rounds.

The fake clients return ``x + a_i`` and, on sync rounds, a known statistic (``v_i`` or a gradient);
the server's ``v_hat`` is checked against the spec's equations: Fed-LAMB ``max(v_hat, mean v_i)``
(line 20), Mime ``v <- beta_2 v + (1 - beta_2) mean(G)^2``, ``v_hat <- max(v_hat, v)`` (lines 22-23).
No torch: these run against the newest Flower too.
"""

from __future__ import annotations

import numpy as np
import pytest

from pollen.strategies import FedLAMB
from pollen.strategies.engine.parts import ClientSampler, EngineParts
from pollen.testing.fakes import (
    FakeGrid,
    config_of,
    full_model_reply,
    global_arrays_of,
    model_record,
    reply,
    split_trainable,
    tiny_model,
)
from pollen.wire import protocol
from pollen.wire.records import arrays_to_record

pytestmark = pytest.mark.flower_compat

D = 19
TRAINABLE = ("conv.weight", "conv.bias", "bn.weight")
NODES = [31, 32, 33, 34]
IDS = {n: f"c{i}" for i, n in enumerate(NODES)}


def stat(node: int, rnd: int, kind: str) -> np.ndarray:
    rng = np.random.default_rng([node, rnd, 9])
    value = rng.standard_normal(D).astype(np.float32)
    return np.square(value) * 1e-3 if kind == "v" else value * 1e-2


def client(seen: list, kind: str, bad: dict | None = None):  # noqa: ANN001, ANN201
    def run(msg):  # noqa: ANN001, ANN202
        node, config = msg.metadata.dst_node_id, config_of(msg)
        rnd = int(config[protocol.CFG_SERVER_ROUND])
        sync = bool(config.get(protocol.CFG_SYNC, False))
        seen.append((rnd, node, protocol.extra_record("v_hat") in msg.content.array_records, sync))
        local = dict(global_arrays_of(msg))
        step = (np.random.default_rng([node, rnd]).standard_normal(D) * 0.01).astype(np.float32)
        for name, part in split_trainable(step, local, TRAINABLE).items():
            local[name] = local[name] + part
        evals = 10 + (5 if sync and kind == "grad" else 0)  # Mime's full pass adds its batches
        records = dict(full_model_reply(msg, local, **{"grad-evals": evals}).content.items())
        if sync:
            records[protocol.extra_record(kind)] = arrays_to_record({protocol.EXTRA_ARRAY: stat(node, rnd, kind)})
        if bad and (rnd, node) in bad:
            records[protocol.extra_record(kind)] = arrays_to_record({protocol.EXTRA_ARRAY: bad[(rnd, node)]})
        return reply(msg, records)

    return run


def run(variant: str, rounds: int, **kwargs):  # noqa: ANN001, ANN201
    seen: list = []
    kind = "v" if variant.startswith("fed") else "grad"
    bad = kwargs.pop("bad", None)
    strategy = FedLAMB(
        variant=variant,
        fraction_train=0.5,
        fraction_evaluate=0.0,
        parts=EngineParts(sampler=ClientSampler(seed=3, identify_clients=True)),
        **kwargs,
    )
    grid = FakeGrid(NODES, client(seen, kind, bad), client_ids=IDS)
    strategy.start(grid=grid, initial_arrays=model_record(tiny_model()), num_rounds=rounds)
    return strategy, grid, seen


def sampled(grid: FakeGrid) -> list[list[int]]:
    return grid.sampled_per_call()


def test_fed_lamb_v_hat_is_the_running_max_of_the_mean_uploaded_v():
    strategy, grid, _ = run("fed-lamb", 3)
    v_hat = np.full(D, 1e-8, np.float32)
    for rnd, nodes in enumerate(sampled(grid), start=1):
        mean = np.mean([stat(n, rnd, "v") for n in nodes], axis=0, dtype=np.float64).astype(np.float32)
        v_hat = np.maximum(v_hat, mean)
    np.testing.assert_array_equal(strategy.v_hat, v_hat)
    assert (strategy.v_hat >= 1e-8).all()


def test_mime_keeps_an_ema_of_the_squared_mean_gradient_and_its_running_max():
    strategy, grid, _ = run("mime-lamb", 3)
    v, v_hat = np.zeros(D, np.float32), np.full(D, 1e-8, np.float32)
    for rnd, nodes in enumerate(sampled(grid), start=1):
        mean = np.mean([stat(n, rnd, "grad") for n in nodes], axis=0, dtype=np.float64)  # squared in float64
        v = (0.999 * v.astype(np.float64) + (1 - 0.999) * np.square(mean)).astype(np.float32)
        v_hat = np.maximum(v_hat, v)
    np.testing.assert_array_equal(strategy.v_hat, v_hat)


def test_the_model_is_the_unweighted_mean_of_the_clients_models():
    strategy, grid, _ = run("fed-lamb", 1)
    x0 = np.concatenate([tiny_model()[n].reshape(-1) for n in TRAINABLE]).astype(np.float64)
    steps = [np.random.default_rng([n, 1]).standard_normal(D) * 0.01 for n in sampled(grid)[0]]
    np.testing.assert_allclose(strategy.params, x0 + np.mean(np.array(steps, np.float32), axis=0), atol=1e-7)


@pytest.mark.parametrize(("phase", "sync_rounds"), [("first", [1, 4, 7]), ("last", [3, 6])])
def test_skip_sync_every_z_rounds_both_readings(phase, sync_rounds):
    strategy, _, seen = run("fed-lamb", 7, sync_every=3, sync_phase=phase)
    assert sorted({rnd for rnd, _, _, sync in seen if sync}) == sync_rounds
    versions = strategy.v_hat_version
    assert 1 < versions <= 1 + len(sync_rounds)


def test_z_equal_one_is_the_non_skip_path_bit_for_bit():
    a, _, _ = run("fed-lamb", 4)
    b, _, _ = run("fed-lamb", 4, sync_every=1, sync_phase="last")
    np.testing.assert_array_equal(a.v_hat, b.v_hat)
    np.testing.assert_array_equal(a.params, b.params)


def test_v_hat_is_sent_only_to_clients_that_lack_its_current_version():
    strategy, _, seen = run("fed-lamb", 6, sync_every=3)
    version, held = 1, {}
    for rnd in range(1, 7):
        round_seen = [(node, got) for r, node, got, _ in seen if r == rnd]
        for node, got in round_seen:
            assert got == (held.get(node) != version), (rnd, node)
        for node, _ in round_seen:
            held[node] = version
        version = int(strategy.accounting.rounds[rnd].train_metrics.get("v-hat-version", version))
    assert sum(got for _, _, got, _ in seen) < len(seen)  # some messages went without it
    v_hat_bytes = [
        strategy.accounting.rounds[r].downlink_records.get(protocol.extra_record("v_hat"), 0) for r in range(1, 7)
    ]
    one_copy = arrays_to_record({protocol.EXTRA_ARRAY: np.zeros(D, np.float32)}).count_bytes()
    assert v_hat_bytes[0] == 2 * one_copy  # both clients of round 1 got it


def test_with_one_sync_a_round_every_message_carries_v_hat_and_clients_are_told_not_to_keep_it():
    """Z = 1: ``v_hat`` changes with nearly every round, so the server sends it with every message (and says so:
    ``pollen.v-hat-keep`` false), and a client's state need not carry it; with Z > 1 clients keep it."""
    _, grid, seen = run("fed-lamb", 4)
    assert seen and all(got for _, _, got, _ in seen)
    assert all(config_of(m)[protocol.CFG_VHAT_KEEP] is False for m in grid.sent if m.metadata.message_type == "train")
    _, grid, _ = run("fed-lamb", 4, sync_every=2)
    assert all(config_of(m)[protocol.CFG_VHAT_KEEP] is True for m in grid.sent if m.metadata.message_type == "train")


@pytest.mark.parametrize("bad_v", [-np.ones(D, np.float32), np.full(D, np.nan, np.float32), np.ones(D + 2, np.float32)])
def test_a_bad_v_is_rejected_and_the_round_goes_on(bad_v):
    probe, grid, _ = run("fed-lamb", 1)
    node = sampled(grid)[0][0]
    strategy, _, _ = run("fed-lamb", 1, bad={(1, node): bad_v})
    stats = strategy.accounting.rounds[1]
    assert stats.failures == 1 and stats.replies == 1
    assert (strategy.v_hat >= 1e-8).all() and np.isfinite(strategy.v_hat).all()


def test_state_round_trip_keeps_v_hat_and_who_holds_it():
    strategy, _, _ = run("mime", 2)
    restored = FedLAMB(
        variant="mime", parts=EngineParts(sampler=ClientSampler(seed=strategy.seed, identify_clients=True))
    )
    restored.load_state_dict(strategy.state_dict())
    np.testing.assert_array_equal(restored.v_hat, strategy.v_hat)
    np.testing.assert_array_equal(restored.v, strategy.v)
    assert restored.v_hat_version == strategy.v_hat_version and restored.client_versions == strategy.client_versions


def test_bad_settings_are_refused():
    for kwargs, word in (
        (dict(variant="lamb"), "variant"),
        (dict(sync_every=0), "sync_every"),
        (dict(eps=0), "eps"),
        (dict(sync_phase="mid"), "sync_phase"),
    ):
        with pytest.raises(ValueError, match=word):
            FedLAMB(**kwargs)


def client_steps(grid: FakeGrid, rounds: int) -> list[np.ndarray]:
    """The mean client step of each round, as the fake clients took it (float32 sums, float64 mean)."""
    return [
        np.mean(
            [np.random.default_rng([n, r]).standard_normal(D).astype(np.float32) * np.float32(0.01) for n in nodes],
            axis=0,
        )
        for r, nodes in zip(range(1, rounds + 1), sampled(grid))
    ]


def test_adp_fed_is_algorithm_2_server_adam_without_bias_correction():
    eta, beta_1, beta_2, eps = 0.05, 0.9, 0.99, 1e-8
    strategy, grid, seen = run("adp-fed", 3, eta=eta, beta_1=beta_1, beta_2=beta_2, eps=eps)
    x = np.concatenate([tiny_model()[n].reshape(-1) for n in TRAINABLE]).astype(np.float64)
    m, v = np.zeros(D), np.full(D, eps)
    for delta in client_steps(grid, 3):  # lines 13-15, v_0 = eps, nothing added to sqrt(v)
        m = beta_1 * m + (1 - beta_1) * delta
        v = beta_2 * v + (1 - beta_2) * delta**2
        x = x + eta * m / np.sqrt(v)
    np.testing.assert_allclose(strategy.params, x, rtol=1e-5, atol=1e-6)
    assert not any(got or sync for _, _, got, sync in seen)  # no v_hat, no statistic
    assert strategy.v_hat is None


def test_fed_sgd_averages_the_models_and_asks_for_plain_sgd():
    strategy, grid, seen = run("fed-sgd", 2)
    x0 = np.concatenate([tiny_model()[n].reshape(-1) for n in TRAINABLE]).astype(np.float64)
    np.testing.assert_allclose(strategy.params, x0 + np.sum(client_steps(grid, 2), axis=0), atol=1e-6)
    config = config_of(grid.train_messages()[0])
    assert config[protocol.CFG_LOCAL_STEP] == "sgd" and config["momentum"] == 0.0 and config["weight-decay"] == 0.0
    for rnd in (1, 2):
        records = {**strategy.accounting.rounds[rnd].uplink_records, **strategy.accounting.rounds[rnd].downlink_records}
        assert not [name for name in records if name.startswith(protocol.extra_record(""))]


@pytest.mark.parametrize("variant", ["fed-lamb", "mime-lamb"])
def test_skip_sync_z3_over_30_rounds_uploads_in_10_and_averages_four_thirds_tensors(variant):
    kind = "v" if variant == "fed-lamb" else "grad"
    strategy, _, seen = run(variant, 30, sync_every=3)
    sync_rounds = sorted({rnd for rnd, _, _, sync in seen if sync})
    assert len(sync_rounds) == 10
    changed = [
        r
        for r in range(2, 31)
        if strategy.accounting.rounds[r].train_metrics["v-hat-version"]
        != strategy.accounting.rounds[r - 1].train_metrics["v-hat-version"]
    ]
    assert set(changed) <= set(sync_rounds)
    one_copy = arrays_to_record({protocol.EXTRA_ARRAY: np.zeros(D, np.float32)}).count_bytes()
    rounds = strategy.accounting.rounds.values()
    replies = sum(r.replies for r in rounds)
    stat_uploads = sum(r.uplink_records.get(protocol.extra_record(kind), 0) for r in rounds) / one_copy
    assert (replies + stat_uploads) / replies == pytest.approx(1 + 1 / 3)


def test_gradient_evaluations_per_round_are_summed_over_the_applied_replies():
    strategy, _, _ = run("mime-lamb", 3, sync_every=2)
    evals = [strategy.accounting.rounds[r].grad_evals for r in (1, 2, 3)]
    assert evals == [2 * 15, 2 * 10, 2 * 15]  # sync rounds 1 and 3 carry the full pass


def test_fed_sgd_with_one_step_and_everyone_is_centralised_sgd_on_the_mean_gradient():
    """Spec 8.5 (a): clients take x - lr * A_i (x - b_i) (one step on a quadratic); the server's x is one
    centralised SGD step on the mean of their gradients."""
    lr = 0.1
    mats = {n: np.diag(np.random.default_rng([n, 7]).uniform(0.5, 2.0, D)).astype(np.float32) for n in NODES}
    targets = {n: np.random.default_rng([n, 8]).standard_normal(D).astype(np.float32) for n in NODES}

    def client(msg):  # noqa: ANN001, ANN202
        node, local = msg.metadata.dst_node_id, dict(global_arrays_of(msg))
        x = np.concatenate([local[n].reshape(-1) for n in TRAINABLE])
        step = -lr * mats[node] @ (x - targets[node])
        for name, part in split_trainable(step.astype(np.float32), local, TRAINABLE).items():
            local[name] = local[name] + part
        return full_model_reply(msg, local)

    strategy = FedLAMB(
        variant="fed-sgd",
        fraction_train=1.0,
        fraction_evaluate=0.0,
        min_train_nodes=4,
        parts=EngineParts(sampler=ClientSampler(seed=3, identify_clients=True)),
    )
    strategy.start(
        grid=FakeGrid(NODES, client, client_ids=IDS), initial_arrays=model_record(tiny_model()), num_rounds=3
    )
    x = x0 = np.concatenate([tiny_model()[n].reshape(-1) for n in TRAINABLE]).astype(np.float64)
    for _ in range(3):
        x = x - lr * np.mean([mats[n] @ (x - targets[n]) for n in NODES], axis=0)
    np.testing.assert_allclose(strategy.params, x, rtol=1e-5, atol=1e-6)
    assert not np.allclose(x, x0)
