"""The round protocol's extension points on a fake grid: per-node downlink, extras, mid-round exchanges, resume.

- a strategy that overrides ``node_content`` sends each node its own content; bytes are counted per
  message sent;
- ``RelayAverage`` (the worked example) runs a mid-round exchange with per-node relays and reads one
  extra uplink record; its result equals a hand computation;
- extras and flags are validated like the update (shape, dtype, finite, sign, names);
- replies from nodes that were not asked are rejected, and two answers from one node are both refused;
- resume: a run stopped after round k and resumed from its checkpoint ends with bit-identical
  parameters to an uninterrupted run, for every kind of strategy; a checkpoint of another strategy
  or config is refused with one line.

No torch: these run against the newest Flower too.
"""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, RecordDict

from pollen.clientside import compression_mod
from pollen.core.checkpoint import CheckpointError
from pollen.strategies import (
    Extra,
    FedAdaVR,
    FedAMS,
    FedCAMS,
    FedLAMB,
    FedLazy,
    HAFed,
    MeteredFedAdam,
    ReplySpec,
    RunCheckpoint,
    RunInterrupted,
)
from pollen.strategies.engine.parts import ClientSampler, EngineParts
from pollen.testing.fakes import (
    TRAINABLE,
    FakeGrid,
    config_of,
    full_model_reply,
    global_arrays_of,
    model_record,
    named_arrays,
    reply,
    run_train_round,
    split_trainable,
    tiny_model,
)
from pollen.testing.relay_demo import CFG_WEIGHT, NORMS_EXTRA, RELAY_EXTRA, RELAY_PHASE, RelayAverage
from pollen.wire import protocol
from pollen.wire.records import arrays_to_record, record_to_arrays

pytestmark = pytest.mark.flower_compat

D = 19
NODES = [11, 12, 13, 14]
IDS = {node: f"client-{i}" for i, node in enumerate(NODES)}


def delta_for(key: str, rnd: int, phase: int = 0) -> np.ndarray:
    seed = [int(key.split("-")[-1]) if "-" in key else hash(key) % 1000, rnd, phase]
    return (np.random.default_rng(seed).standard_normal(D) * 0.1).astype(np.float32)


def moved(arrays: dict[str, np.ndarray], delta: np.ndarray) -> dict[str, np.ndarray]:
    out = dict(arrays)
    for name, part in split_trainable(delta, arrays, TRAINABLE).items():
        out[name] = (arrays[name] + part).astype(np.float32)
    return out


def keyed_client(msg):  # noqa: ANN001, ANN201
    """Full-model client whose update depends on its client id and the round only."""
    key = IDS[msg.metadata.dst_node_id]
    rnd = int(config_of(msg)[protocol.CFG_SERVER_ROUND])
    return full_model_reply(msg, moved(global_arrays_of(msg), delta_for(key, rnd)), num_examples=10 + rnd)


# --------------------------------------------------------------------------- per-node downlink
class PerNodeNote(FedAMS):
    """FedAMS that sends each node an extra vector of its own (a stand-in for a per-client increment)."""

    def node_content(self, server_round, node, shared):  # noqa: ANN001, ANN201
        content = RecordDict(dict(shared.items()))
        note = np.full(node % 5 + 1, float(node), dtype=np.float32)
        content[protocol.extra_record("note")] = arrays_to_record({protocol.EXTRA_ARRAY: note})
        return content


def test_node_content_sends_each_node_its_own_record_and_counts_each_message():
    strategy = PerNodeNote(
        fraction_train=1.0, fraction_evaluate=0.0, parts=EngineParts(sampler=ClientSampler(identify_clients=True))
    )
    grid = FakeGrid(NODES, keyed_client, client_ids=IDS)
    run_train_round(strategy, grid, 1, model_record(tiny_model()))
    sent = grid.train_messages()
    assert [m.metadata.dst_node_id for m in sent] == NODES
    for message in sent:
        note = record_to_arrays(message.content.array_records[protocol.extra_record("note")])[protocol.EXTRA_ARRAY]
        assert note.shape == (message.metadata.dst_node_id % 5 + 1,)
    # the shared model record is the same object in every message (built once)
    models = {id(m.content.array_records[protocol.ARRAYS_RECORD]) for m in sent}
    assert len(models) == 1
    stats = strategy.accounting.rounds[1]
    per_message = [sum(r.count_bytes() for r in m.content.values()) for m in sent]
    assert stats.downlink_bytes == sum(per_message)
    assert stats.messages_sent == len(NODES)
    assert stats.downlink_records[protocol.extra_record("note")] == sum(
        m.content[protocol.extra_record("note")].count_bytes() for m in sent
    )


# --------------------------------------------------------------------------- the worked example
def relay_client(steps_first: dict, steps_second: dict, seen: list):  # noqa: ANN001, ANN201
    """Numpy stand-in of the client side of pollen.testing.relay_demo: x_i = x_t + a_i; x'' = mix + b_i."""
    state: dict[int, dict] = {}

    def client(msg):  # noqa: ANN001, ANN202
        node = msg.metadata.dst_node_id
        key = IDS[node]
        config = config_of(msg)
        rnd = int(config[protocol.CFG_SERVER_ROUND])
        seen.append((msg.metadata.message_type, config.get(protocol.CFG_PHASE)))
        if msg.metadata.message_type == "train":
            assert config[protocol.CFG_LOCAL_STEP] == "relay-first-half"
            g = global_arrays_of(msg)
            a = steps_first[(key, rnd)]
            state[node] = {"g": g, "x_i": moved(g, a)}
            return full_model_reply(msg, state[node]["x_i"], num_examples=10)
        assert msg.metadata.message_type == protocol.PHASE_MESSAGE_TYPE and config[protocol.CFG_PHASE] == RELAY_PHASE
        relay = record_to_arrays(msg.content.array_records[protocol.extra_record(RELAY_EXTRA)])[protocol.EXTRA_ARRAY]
        weight = float(config[CFG_WEIGHT])
        x_i = np.concatenate([state[node]["x_i"][n].reshape(-1) for n in TRAINABLE])
        mix = (weight * x_i + (1 - weight) * relay).astype(np.float32)
        b = steps_second[(key, rnd)]
        final = moved(dict(state[node]["g"]), np.zeros(D, np.float32))
        final = moved({**final, **split_trainable(mix, final, TRAINABLE)}, b)
        norms = np.array([np.sum(np.square(p)) for p in split_trainable(b, final, TRAINABLE).values()], np.float32)
        records = {
            protocol.ARRAYS_RECORD: model_record(final),
            protocol.METRICS_RECORD: full_model_reply(msg, final).content.metric_records[protocol.METRICS_RECORD],
            protocol.extra_record(NORMS_EXTRA): arrays_to_record({protocol.EXTRA_ARRAY: norms}),
        }
        return reply(msg, records)

    return client


def test_relay_average_equals_the_hand_computation_and_counts_the_exchange():
    steps_first = {(IDS[n], 1): delta_for(IDS[n], 1, 0) for n in NODES}
    steps_second = {(IDS[n], 1): delta_for(IDS[n], 1, 1) for n in NODES}
    seen: list = []
    strategy = RelayAverage(
        fraction_train=1.0,
        fraction_evaluate=0.0,
        parts=EngineParts(sampler=ClientSampler(identify_clients=True)),
        eta=1.0,
    )
    grid = FakeGrid(NODES, relay_client(steps_first, steps_second, seen), client_ids=IDS)
    x0 = tiny_model(3)
    x_t = np.concatenate([x0[n].reshape(-1) for n in TRAINABLE]).astype(np.float64)

    strategy.start(grid=grid, initial_arrays=model_record(x0), num_rounds=1)

    # by hand: everyone mixes to the mean of the first halves, then takes its second half
    mean_first = np.mean([x_t + steps_first[(IDS[n], 1)] for n in NODES], axis=0)
    expected = np.mean([mean_first + steps_second[(IDS[n], 1)] for n in NODES], axis=0)
    np.testing.assert_allclose(strategy.params, expected, rtol=0, atol=1e-6)
    assert seen.count(("train", None)) == len(NODES)
    assert seen.count((protocol.PHASE_MESSAGE_TYPE, RELAY_PHASE)) == len(NODES)

    stats = strategy.accounting.rounds[1]
    assert stats.replies == len(NODES) and stats.failures == 0
    assert stats.exchange_messages == len(NODES) and stats.messages_sent == 2 * len(NODES)
    relay_bytes = stats.downlink_records[f"{RELAY_PHASE}/{protocol.extra_record(RELAY_EXTRA)}"]
    assert relay_bytes > len(NODES) * 4 * D  # one dense relay per client
    assert stats.uplink_records[f"{RELAY_PHASE}/{protocol.extra_record(NORMS_EXTRA)}"] > 0
    assert stats.uplink_records[protocol.ARRAYS_RECORD] > 0  # the first halves, unprefixed (train phase)
    assert stats.uplink_bytes == sum(stats.uplink_records.values())
    assert stats.downlink_bytes == sum(stats.downlink_records.values())
    want_norms = np.mean(
        [
            [np.sum(np.square(p)) for p in split_trainable(steps_second[(IDS[n], 1)], x0, TRAINABLE).values()]
            for n in NODES
        ],
        axis=0,
    )
    np.testing.assert_allclose(strategy.last_layer_sq_norms, want_norms, rtol=1e-5)


def test_relay_client_dropping_out_mid_round_is_a_failure_and_the_round_completes():
    steps_first = {(IDS[n], 1): delta_for(IDS[n], 1, 0) for n in NODES}
    steps_second = {(IDS[n], 1): delta_for(IDS[n], 1, 1) for n in NODES}
    inner = relay_client(steps_first, steps_second, [])

    def client(msg):  # noqa: ANN001, ANN202
        out = inner(msg)
        dropped = msg.metadata.dst_node_id == NODES[0] and msg.metadata.message_type != "train"
        return None if dropped else out

    strategy = RelayAverage(
        fraction_train=1.0, fraction_evaluate=0.0, parts=EngineParts(sampler=ClientSampler(identify_clients=True))
    )
    strategy.start(
        grid=FakeGrid(NODES, client, client_ids=IDS), initial_arrays=model_record(tiny_model(3)), num_rounds=1
    )
    stats = strategy.accounting.rounds[1]
    assert stats.replies == len(NODES) - 1 and stats.failures == 1
    assert "no reply before the timeout (relay-mix)" in stats.failure_reasons[0]


# --------------------------------------------------------------------------- extras and flags are validated
class WantsExtras(FedAMS):
    reply_spec = ReplySpec(extras=(Extra("v", size="model", nonnegative=True),), flags=("skip",))


def extras_client(bad: dict):  # noqa: ANN001, ANN201
    def client(msg):  # noqa: ANN001, ANN202
        node = msg.metadata.dst_node_id
        base = keyed_client(msg)
        records = dict(base.content.items())
        v = np.abs(delta_for(IDS[node], 1)).astype(np.float32)
        records[protocol.extra_record("v")] = arrays_to_record({protocol.EXTRA_ARRAY: v})
        records[protocol.FLAGS_RECORD] = ConfigRecord({"skip": False})
        for name, value in bad.get(node, {}).items():
            if value is None:
                records.pop(name, None)
            else:
                records[name] = value
        return reply(msg, records)

    return client


def extra(value) -> ArrayRecord:  # noqa: ANN001
    return arrays_to_record({protocol.EXTRA_ARRAY: np.asarray(value)})


@pytest.mark.parametrize(
    ("records", "reason"),
    [
        ({protocol.extra_record("v"): extra(-np.ones(D, np.float32))}, "negative"),
        ({protocol.extra_record("v"): extra(np.ones(D + 1, np.float32))}, "shape"),
        ({protocol.extra_record("v"): extra(np.full(D, np.nan, np.float32))}, "NaN"),
        ({protocol.extra_record("v"): extra(np.full(D, 1e300))}, "NaN or Inf"),  # finite float64, Inf as float32
        ({protocol.extra_record("v"): extra(np.ones(D, np.int64))}, "dtype"),
        ({protocol.extra_record("v"): None}, "lacks the extra record"),
        ({protocol.FLAGS_RECORD: ConfigRecord({"skip": 1})}, "true or false"),
        ({protocol.FLAGS_RECORD: ConfigRecord({"jump": True})}, "unknown flags"),
        ({protocol.FLAGS_RECORD: ArrayRecord()}, "expected a ConfigRecord"),
    ],
)
def test_bad_extras_and_flags_are_rejected_with_a_reason(records, reason):
    bad_node = NODES[1]
    strategy = WantsExtras(
        fraction_train=1.0, fraction_evaluate=0.0, parts=EngineParts(sampler=ClientSampler(identify_clients=True))
    )
    clean = WantsExtras(
        fraction_train=1.0, fraction_evaluate=0.0, parts=EngineParts(sampler=ClientSampler(identify_clients=True))
    )
    run_train_round(
        strategy, FakeGrid(NODES, extras_client({bad_node: records}), client_ids=IDS), 1, model_record(tiny_model())
    )
    stats = strategy.accounting.rounds[1]
    assert stats.replies == len(NODES) - 1 and stats.failures == 1
    assert reason in stats.failure_reasons[0] and IDS[bad_node] in stats.failure_reasons[0]

    # the rejected reply left no trace: same as a round where that client stayed silent
    def silent(msg):  # noqa: ANN001, ANN202
        return None if msg.metadata.dst_node_id == bad_node else extras_client({})(msg)

    run_train_round(clean, FakeGrid(NODES, silent, client_ids=IDS), 1, model_record(tiny_model()))
    np.testing.assert_array_equal(strategy.params, clean.params)
    for slot in strategy.opt_state.slots:
        np.testing.assert_array_equal(strategy.opt_state.slots[slot], clean.opt_state.slots[slot])


def test_extras_and_flags_reach_the_update():
    captured = {}

    class Capture(WantsExtras):
        def after_round(self, server_round, updates):  # noqa: ANN001, ANN202
            captured.update({u.client_key: u for u in updates})

    strategy = Capture(
        fraction_train=1.0, fraction_evaluate=0.0, parts=EngineParts(sampler=ClientSampler(identify_clients=True))
    )
    run_train_round(strategy, FakeGrid(NODES, extras_client({}), client_ids=IDS), 1, model_record(tiny_model()))
    update = captured[IDS[NODES[0]]]
    np.testing.assert_array_equal(update.extras["v"], np.abs(delta_for(IDS[NODES[0]], 1)))
    assert update.flags == {"skip": False}
    assert set(update.record_bytes) >= {protocol.ARRAYS_RECORD, protocol.extra_record("v"), protocol.FLAGS_RECORD}


def test_replies_from_nodes_not_asked_and_two_answers_to_one_message_are_rejected():
    strategy = FedAMS(
        fraction_train=0.5,
        fraction_evaluate=0.0,
        parts=EngineParts(sampler=ClientSampler(identify_clients=True, seed=1)),
    )
    grid = FakeGrid(NODES, keyed_client, client_ids=IDS)
    messages = list(strategy.configure_train(1, model_record(tiny_model()), ConfigRecord(), grid))
    asked = [m.metadata.dst_node_id for m in messages]
    replies = list(grid.send_and_receive(messages))
    stranger = next(n for n in NODES if n not in asked)
    forged = keyed_client(messages[0])
    forged.metadata.__dict__["_src_node_id"] = stranger
    replies += [forged, keyed_client(messages[0])]
    strategy.aggregate_train(1, replies)
    stats = strategy.accounting.rounds[1]
    assert stats.replies == len(asked) - 1  # both of the node's answers are refused
    assert stats.failures == 3
    assert any("not asked" in r for r in stats.failure_reasons) and any(
        "two answers to one message" in r for r in stats.failure_reasons
    )


# --------------------------------------------------------------------------- resume
def cams_client(state_dir):  # noqa: ANN001, ANN201
    """FedCAMS clients through the real compression mod, keeping EF residuals in files under state_dir."""
    contexts: dict[int, Context] = {}

    def client(msg):  # noqa: ANN001, ANN202
        node = msg.metadata.dst_node_id
        if node not in contexts:  # a resumed run starts with empty contexts, as in Flower
            contexts[node] = Context(
                run_id=1,
                node_id=node,
                node_config={"state-dir": str(state_dir), "client-id": IDS[node]},
                state=RecordDict(),
                run_config={},
            )
        return compression_mod(msg, contexts[node], lambda m, c: keyed_client(m))

    return client


def lazy_client(state_dir):  # noqa: ANN001, ANN201
    """FedBACA clients through the real lazy mod: model copies, references and residuals in files under state_dir."""
    import copy

    from pollen.clientside.lazy_mod import lazy_mod

    contexts: dict[int, Context] = {}

    def client(msg):  # noqa: ANN001, ANN202
        node = msg.metadata.dst_node_id
        if node not in contexts:
            contexts[node] = Context(
                run_id=1,
                node_id=node,
                node_config={"state-dir": str(state_dir), "client-id": IDS[node]},
                state=RecordDict(),
                run_config={},
            )
        return lazy_mod(copy.deepcopy(msg), contexts[node], lambda m, c: keyed_client(m))

    return client


STRATEGIES = {
    "fedams": lambda: FedAMS(
        eta=0.3,
        fraction_train=0.5,
        fraction_evaluate=0.0,
        parts=EngineParts(sampler=ClientSampler(seed=5, identify_clients=True)),
    ),
    "fedcams-sign": lambda: FedCAMS(
        compressor="sign",
        eta=0.3,
        fraction_train=0.5,
        fraction_evaluate=0.0,
        parts=EngineParts(sampler=ClientSampler(seed=5, identify_clients=True)),
    ),
    "fedadavr-int4": lambda: FedAdaVR(
        table_precision="int4",
        eta=0.05,
        fraction_train=0.5,
        fraction_evaluate=0.0,
        parts=EngineParts(sampler=ClientSampler(seed=5, identify_clients=True)),
    ),
    "flower-fedadam": lambda: MeteredFedAdam(fraction_train=0.5, fraction_evaluate=0.0, min_available_nodes=2),
    "relay-demo": lambda: RelayAverage(
        fraction_train=0.5,
        fraction_evaluate=0.0,
        parts=EngineParts(sampler=ClientSampler(seed=5, identify_clients=True)),
    ),
    "fed-lamb-z2": lambda: FedLAMB(
        variant="fed-lamb",
        sync_every=2,
        fraction_train=0.5,
        fraction_evaluate=0.0,
        parts=EngineParts(sampler=ClientSampler(seed=5, identify_clients=True)),
    ),
    "adp-fed": lambda: FedLAMB(
        variant="adp-fed",
        eta=0.05,
        fraction_train=0.5,
        fraction_evaluate=0.0,
        parts=EngineParts(sampler=ClientSampler(seed=5, identify_clients=True)),
    ),
    "hafed": lambda: HAFed(
        topology="full",
        local_steps=2,
        uploaders_per_cluster=1,
        fraction_evaluate=0.0,
        parts=EngineParts(sampler=ClientSampler(seed=5, identify_clients=True)),
    ),
    "fedbaca": lambda: FedLazy(
        up_rule="aa",
        up_tau=1.2,
        compressor="topk",
        topk_ratio=0.25,
        down_compressor="topk",
        down_rule="aa",
        down_tau=1.0,
        eta=0.3,
        fraction_train=0.5,
        fraction_evaluate=0.0,
        parts=EngineParts(sampler=ClientSampler(seed=5, identify_clients=True)),
    ),
}
CLUSTER_IDS = {node: "ab"[i // 2] for i, node in enumerate(NODES)}


def lamb_client(msg):  # noqa: ANN001, ANN201
    """keyed_client plus the local v a Fed-LAMB client uploads on sync rounds."""
    reply = keyed_client(msg)
    if config_of(msg).get(protocol.CFG_SYNC, False):
        rnd = int(config_of(msg)[protocol.CFG_SERVER_ROUND])
        v = np.square(delta_for(IDS[msg.metadata.dst_node_id], rnd, 2))
        reply.content[protocol.extra_record("v")] = arrays_to_record({protocol.EXTRA_ARRAY: v})
    return reply


def client_for(name: str, state_dir):  # noqa: ANN001, ANN201
    if name == "fedcams-sign":
        return cams_client(state_dir)
    if name == "fedbaca":
        return lazy_client(state_dir)
    if name == "relay-demo":
        firsts = {(IDS[n], r): delta_for(IDS[n], r, 0) for n in NODES for r in range(1, 6)}
        seconds = {(IDS[n], r): delta_for(IDS[n], r, 1) for n in NODES for r in range(1, 6)}
        return relay_client(firsts, seconds, [])
    if name == "fed-lamb-z2":
        return lamb_client
    return keyed_client


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_resumed_run_ends_bit_identical_to_an_uninterrupted_one(name, tmp_path):
    import random

    x0 = model_record(tiny_model(1))
    random.seed(0)  # Flower's own strategies sample with the global `random`
    full = STRATEGIES[name]()
    full_result = full.start(
        grid=FakeGrid(NODES, client_for(name, tmp_path / "full-state"), client_ids=IDS, cluster_ids=CLUSTER_IDS),
        initial_arrays=x0,
        num_rounds=4,
        checkpoint=RunCheckpoint(tmp_path / "full"),
    )

    random.seed(0)
    first = STRATEGIES[name]()
    with pytest.raises(RunInterrupted):
        first.start(
            grid=FakeGrid(NODES, client_for(name, tmp_path / "crash-state"), client_ids=IDS, cluster_ids=CLUSTER_IDS),
            initial_arrays=x0,
            num_rounds=4,
            checkpoint=RunCheckpoint(tmp_path / "crash", stop_after_round=2),
        )
    random.seed(12345)  # a new process: the global RNG is whatever it is; the checkpoint restores it
    resumed = STRATEGIES[name]()
    resumed_result = resumed.start(
        grid=FakeGrid(NODES, client_for(name, tmp_path / "crash-state"), client_ids=IDS, cluster_ids=CLUSTER_IDS),
        initial_arrays=x0,
        num_rounds=4,
        checkpoint=RunCheckpoint(tmp_path / "crash", resume=True),
    )
    want, got = named_arrays(full_result.arrays), named_arrays(resumed_result.arrays)
    assert list(want) == list(got)
    for key in want:
        assert want[key].dtype == got[key].dtype
        assert want[key].tobytes() == got[key].tobytes(), key
    assert sorted(resumed_result.train_metrics_clientapp) == sorted(full_result.train_metrics_clientapp)
    untimed = lambda acc: {r: {k: v for k, v in s.items() if k != "train_seconds"} for r, s in acc.to_dict().items()}  # noqa: E731
    assert untimed(resumed.accounting) == untimed(full.accounting)
    assert all(stats["replies"] > 0 and stats["failures"] == 0 for stats in full.accounting.to_dict().values())


def test_resume_refuses_another_strategy_or_config(tmp_path):
    grid = FakeGrid(NODES, keyed_client, client_ids=IDS)
    x0 = model_record(tiny_model(1))
    FedAMS(fraction_evaluate=0.0).start(
        grid=grid, initial_arrays=x0, num_rounds=1, checkpoint=RunCheckpoint(tmp_path, fingerprint={"server-lr": 0.1})
    )
    with pytest.raises(CheckpointError, match="written by FedAMS, this run uses FedCAMS"):
        RunCheckpoint(tmp_path, resume=True, fingerprint={"server-lr": 0.1}).validate("FedCAMS")
    with pytest.raises(CheckpointError, match="'server-lr' was 0.1 in the checkpoint and is 0.2 now"):
        RunCheckpoint(tmp_path, resume=True, fingerprint={"server-lr": 0.2}).validate("FedAMS")
    assert (
        RunCheckpoint(tmp_path, resume=True, fingerprint={"server-lr": 0.2}, ignore=("server-lr",)).validate("FedAMS")
        == 1
    )
    with pytest.raises(CheckpointError, match="nothing to resume"):
        RunCheckpoint(tmp_path / "elsewhere", resume=True).validate("FedAMS")


def test_a_crash_while_writing_a_checkpoint_keeps_the_previous_one(tmp_path, monkeypatch):
    import os

    strategy = FedAMS(fraction_evaluate=0.0, parts=EngineParts(sampler=ClientSampler(identify_clients=True)))
    checkpoint = RunCheckpoint(tmp_path)
    real_replace = os.replace
    calls = {"n": 0}

    def failing_replace(src, dst):  # noqa: ANN001, ANN202  (the second checkpoint fails to replace the first)
        if str(dst).endswith("checkpoint.npz"):
            calls["n"] += 1
            if calls["n"] == 2:
                raise OSError("disk full")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="disk full"):
        strategy.start(
            grid=FakeGrid(NODES, keyed_client, client_ids=IDS),
            initial_arrays=model_record(tiny_model()),
            num_rounds=3,
            checkpoint=checkpoint,
        )
    monkeypatch.setattr(os, "replace", real_replace)
    assert RunCheckpoint(tmp_path, resume=True).validate("FedAMS") == 1
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_a_table_on_disk_survives_a_crash_between_its_rows_and_the_checkpoint(tmp_path):
    """FedAdaVR with table-path: rows of round 3 are written, the process dies before checkpoint 3."""
    x0 = model_record(tiny_model(1))

    def make(path):  # noqa: ANN001, ANN202
        return FedAdaVR(
            table_precision="int8",
            table_path=str(path),
            eta=0.05,
            fraction_train=0.5,
            fraction_evaluate=0.0,
            parts=EngineParts(sampler=ClientSampler(seed=5, identify_clients=True)),
        )

    full = make(tmp_path / "full.table").start(
        grid=FakeGrid(NODES, keyed_client, client_ids=IDS),
        initial_arrays=x0,
        num_rounds=4,
        checkpoint=RunCheckpoint(tmp_path / "full"),
    )

    crashing = RunCheckpoint(tmp_path / "crash")
    real_save = crashing.save

    def save_then_die(server_round, *args):  # noqa: ANN001, ANN202
        if server_round == 3:
            raise KeyboardInterrupt("killed after round 3's table rows, before its checkpoint")
        real_save(server_round, *args)

    crashing.save = save_then_die
    with pytest.raises(KeyboardInterrupt):
        make(tmp_path / "crash.table").start(
            grid=FakeGrid(NODES, keyed_client, client_ids=IDS), initial_arrays=x0, num_rounds=4, checkpoint=crashing
        )
    resumed = make(tmp_path / "crash.table").start(
        grid=FakeGrid(NODES, keyed_client, client_ids=IDS),
        initial_arrays=x0,
        num_rounds=4,
        checkpoint=RunCheckpoint(tmp_path / "crash", resume=True),
    )
    want, got = named_arrays(full.arrays), named_arrays(resumed.arrays)
    for key in want:
        assert want[key].tobytes() == got[key].tobytes(), key


def test_a_stale_or_foreign_table_file_is_refused(tmp_path):
    from pollen.vr.journal import TableFileError

    x0 = model_record(tiny_model(1))
    grid = FakeGrid(NODES, keyed_client, client_ids=IDS)
    table = tmp_path / "table.bin"
    FedAdaVR(
        table_path=str(table),
        fraction_evaluate=0.0,
        parts=EngineParts(sampler=ClientSampler(seed=5, identify_clients=True)),
    ).start(grid=grid, initial_arrays=x0, num_rounds=1, checkpoint=RunCheckpoint(tmp_path / "a"))
    # another run writes its own table at the same path: the first run's checkpoint must not use it
    FedAdaVR(
        table_path=str(table),
        fraction_evaluate=0.0,
        parts=EngineParts(sampler=ClientSampler(seed=6, identify_clients=True)),
    ).start(grid=grid, initial_arrays=x0, num_rounds=3, checkpoint=RunCheckpoint(tmp_path / "b"))
    with pytest.raises(TableFileError, match="belongs to table"):
        FedAdaVR(
            table_path=str(table),
            fraction_evaluate=0.0,
            parts=EngineParts(sampler=ClientSampler(seed=5, identify_clients=True)),
        ).start(grid=grid, initial_arrays=x0, num_rounds=2, checkpoint=RunCheckpoint(tmp_path / "a", resume=True))


def test_streaming_and_kept_paths_give_the_same_bits_and_a_bounded_reduction_error():
    """The mean is now ``sum_i w_i delta_i`` then one multiplication by ``1/sum w`` (so a rejected reply
    never touches the sum); before, each delta was scaled by ``1/M`` first. The two orders differ by
    float32 rounding only: bounded here against a float64 mean. The streaming path (round >= 2, replies
    summed as read) and the path that keeps every delta (round 1) give identical bits."""
    from pollen.strategies.engine.replies import ClientUpdate
    from pollen.strategies.engine.screening import UpdateScreen
    from pollen.strategies.engine.strategy import RunningMean

    rng = np.random.default_rng(0)
    deltas = [rng.standard_normal(10_000).astype(np.float32) * s for s in (1e-3, 1.0, 5.0, 0.2)]
    for weighted in (False, True):
        weights = [3.0, 7.0, 1.0, 13.0] if weighted else [1.0] * 4
        streaming = RunningMean(10_000, UpdateScreen(), float("inf"), weighted=weighted)
        for d, w in zip(deltas, weights):
            streaming(ClientUpdate("c", 1, d.copy(), {}, w, None))
        kept = FedAMS(aggregation="weighted" if weighted else "mean")
        kept.model.layout = type("L", (), {"dim": 10_000})()
        kept_mean = kept.aggregate_deltas(1, [ClientUpdate("c", 1, d, {}, w, None) for d, w in zip(deltas, weights)])
        got = streaming.mean()
        assert got.tobytes() == kept_mean.tobytes()
        exact = sum(np.float64(w) * d.astype(np.float64) for d, w in zip(deltas, weights)) / sum(weights)
        assert np.max(np.abs(got - exact)) <= 4 * np.finfo(np.float32).eps * np.max(np.abs(exact)) * len(deltas)
