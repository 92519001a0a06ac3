"""The lazy / bidirectional family end to end on a fake grid with pollen's ``lazy_mod``
(spec ``papers/fedbaca.md`` §5, §10).

Fake clients take one gradient step of a per-client quadratic from the model they were given,
``x_local = x_start - 0.3 (x_start - c_node) + noise(node, round)``, so an update depends on the start
(the downlink matters) and consecutive updates of a client are similar (the rules can fire). The
messages are deep-copied on the way to a client, as the wire does. No torch.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
from flwr.app import ConfigRecord, MessageType, RecordDict

from pollen.clientside.compression_mod import RESIDUAL, compression_mod
from pollen.clientside.lazy_mod import COPY_PREFIX, lazy_mod
from pollen.clientside.state import STATE_KEY
from pollen.compression import make_codec
from pollen.lazy import checksum
from pollen.optim import amsgrad
from pollen.strategies import FedAMS, FedCAMS, FedLazy
from pollen.strategies.engine.parts import ClientSampler, EngineParts
from pollen.testing.fakes import (
    TRAINABLE,
    FakeGrid,
    config_of,
    flat_trainable,
    full_model_reply,
    global_arrays_of,
    make_context,
    model_record,
    named_arrays,
    split_trainable,
    tiny_model,
)
from pollen.wire import protocol

pytestmark = pytest.mark.flower_compat

NODES = [3, 4, 5, 6, 7, 8]
D = 19
SERVER = dict(
    eta=0.1,
    beta_1=0.9,
    beta_2=0.99,
    eps=1e-3,
    option=1,
    bias_correction=False,
    fraction_train=0.5,
    fraction_evaluate=0.0,
)


def parts(identify_clients: bool = True) -> EngineParts:
    """Fresh parts for each strategy, the sampler seeded 5; ``identify_clients`` as the method's default
    (FedLazy's True, FedAMS's and FedCAMS's False)."""
    return EngineParts(sampler=ClientSampler(seed=5, identify_clients=identify_clients))


def centre(node: int) -> np.ndarray:
    return np.random.default_rng([node, 99]).standard_normal(D).astype(np.float32)


def trained(msg) -> dict:  # noqa: ANN001
    """One step of the client's quadratic from the arrays it was given (+ a little noise)."""
    node = msg.metadata.dst_node_id
    rnd = int(config_of(msg)[protocol.CFG_SERVER_ROUND])
    start = global_arrays_of(msg)
    x = flat_trainable(start).astype(np.float32)
    noise = np.random.default_rng([node, rnd]).standard_normal(D).astype(np.float32) * np.float32(0.02)
    delta = (np.float32(-0.3) * (x - centre(node)) + noise).astype(np.float32)
    local = dict(start)
    for name, part in split_trainable(delta, start).items():
        local[name] = (start[name] + part).astype(start[name].dtype)
    local["bn.running_mean"] = np.full(4, node, dtype=np.float32)
    return local


def train_fn(msg, context):  # noqa: ANN001, ANN201
    return full_model_reply(msg, trained(msg), num_examples=10)


def client_with(mod, contexts):  # noqa: ANN001, ANN201
    def client(msg):  # noqa: ANN001, ANN202
        wire = copy.deepcopy(msg)
        return mod(wire, contexts[msg.metadata.dst_node_id], train_fn) if mod else train_fn(wire, None)

    return client


def run(strategy, mod, rounds: int = 5, contexts=None, between=None):  # noqa: ANN001, ANN201
    """Run ``rounds`` rounds; ``between(r, strategy, contexts)`` runs after each round."""
    contexts = contexts or {n: make_context(n) for n in NODES}
    grid = FakeGrid(NODES, client_with(mod, contexts))
    arrays = model_record(tiny_model(2))
    for r in range(1, rounds + 1):
        messages = strategy.configure_train(r, arrays, ConfigRecord(), grid)
        replies = list(grid.send_and_receive(messages, timeout=5.0))
        new, _ = strategy.aggregate_train(r, replies)
        arrays = arrays if new is None else new
        if between is not None:
            between(r, strategy, contexts)
    return grid, contexts


def client_vector(context, name: str) -> np.ndarray | None:  # noqa: ANN001
    record = context.state.array_records.get(STATE_KEY)
    return None if record is None or name not in record else record[name].numpy()


def client_copy(context) -> np.ndarray:  # noqa: ANN001
    record = context.state.array_records[STATE_KEY]
    return flat_trainable({n: record[COPY_PREFIX + n].numpy() for n in TRAINABLE}).astype(np.float32)


def events(strategy) -> dict:  # noqa: ANN001
    total: dict[str, int] = {}
    for stats in strategy.accounting.rounds.values():
        for key, n in stats.method.get("lazy_events", {}).items():
            total[key] = total.get(key, 0) + n
    return total


# --------------------------------------------------------------------------- equivalences at tau = 0
@pytest.mark.parametrize("rule", ["nla", "aa"])
def test_uncompressed_at_tau_zero_is_fedams_bit_for_bit(rule):
    """FedNLAA(0) = FedAA(0) = FedAMS (spec §5.4, §10.2)."""
    ams = FedAMS(parts=parts(identify_clients=False), **SERVER)
    run(ams, None)
    lazy = FedLazy(up_rule=rule, up_tau=0.0, parts=parts(), **SERVER)
    run(lazy, lazy_mod)
    np.testing.assert_array_equal(lazy.params, ams.params)
    for slot in ("m", "v", "v_hat"):
        np.testing.assert_array_equal(lazy.opt_state.slots[slot], ams.opt_state.slots[slot])
    seen = events(lazy)
    assert seen["up-send"] == 15 and "up-skip" not in seen and "up-aa" not in seen and seen["down-dense"] == 15


@pytest.mark.parametrize("rule", ["nla", "aa"])
def test_compressed_at_tau_zero_is_fedcams_bit_for_bit(rule):
    """FedNLACA(0) = FedACA(0) = FedCAMS with the same codec, residuals included."""
    cams = FedCAMS(compressor="topk", topk_ratio=0.25, parts=parts(identify_clients=False), **SERVER)
    _, cams_contexts = run(cams, compression_mod)
    lazy = FedLazy(up_rule=rule, up_tau=0.0, compressor="topk", topk_ratio=0.25, parts=parts(), **SERVER)
    _, lazy_contexts = run(lazy, lazy_mod)
    np.testing.assert_array_equal(lazy.params, cams.params)
    for node in NODES:
        a, b = client_vector(cams_contexts[node], RESIDUAL), client_vector(lazy_contexts[node], RESIDUAL)
        assert (a is None) == (b is None)
        if a is not None:
            np.testing.assert_array_equal(a, b)


def test_bidirectional_at_tau_zero_is_fedcams_with_error_fed_downlink():
    """FedBNLACA(0, 0) = FedCAMS + the increment-reading downlink, against a plain transcription."""
    rounds = 5
    lazy = FedLazy(
        up_rule="nla",
        compressor="topk",
        topk_ratio=0.25,
        down_compressor="topk",
        down_rule="nla",
        down_topk_ratio=0.5,
        parts=parts(),
        **SERVER,
    )
    grid, _ = run(lazy, lazy_mod, rounds)
    sampled = grid.sampled_per_call(MessageType.TRAIN)

    theta = flat_trainable(tiny_model(2)).astype(np.float32)
    up, down = make_codec("topk", topk_ratio=0.25), make_codec("topk", topk_ratio=0.5)
    opt = amsgrad(eta=0.1, beta_1=0.9, beta_2=0.99, eps=1e-3, eps_mode="max")
    state = opt.init(D)
    x, e = {}, {}
    for r, nodes in zip(range(1, rounds + 1), sampled):
        used = []
        for node in nodes:
            if node not in x:
                x[node] = theta.copy()
            else:
                x[node] = np.add(
                    x[node],
                    down.decode(down.encode(np.subtract(theta, x[node], dtype=np.float32)), D),
                    dtype=np.float32,
                )
            delta = (
                np.float32(-0.3) * (x[node] - centre(node))
                + np.random.default_rng([node, r]).standard_normal(D).astype(np.float32) * np.float32(0.02)
            ).astype(np.float32)
            delta = ((x[node] + delta).astype(np.float32) - x[node]).astype(np.float32)  # what the client's model holds
            p = delta if node not in e else np.add(delta, e[node], dtype=np.float32)
            sent = up.decode(up.encode(p), D)
            e[node] = p - sent
            used.append(sent)
        total = np.zeros(D, dtype=np.float32)  # summed in float32 and scaled once, as the server's mean is
        for vector in used:
            total += vector
        total *= np.float32(1.0 / len(used))
        step, state = opt.update(state, total, theta)
        theta = theta + step
    np.testing.assert_array_equal(lazy.params, theta)
    seen = events(lazy)
    assert seen["down-full"] == len({n for nodes in sampled for n in nodes})
    assert seen["down-send"] == 15 - seen["down-full"] and "down-skip" not in seen


# --------------------------------------------------------------------------- rules on the wire
def test_nla_skip_is_one_flag_and_the_server_reuses_its_copy():
    """A huge tau: every participation after a client's first is a skip; the reply carries no vector."""
    used_by = []

    class Recording(FedLazy):
        def _resolve(self, server_round, update):  # noqa: ANN001
            ref = self._pending[update.client_key]["ref"]
            outcome = super()._resolve(server_round, update)
            used_by.append((update.client_key, update.flags.get(protocol.FLAG_SKIP, False), update.delta.copy(), ref))
            return outcome

    lazy = Recording(up_rule="nla", up_tau=1e6, compressor="topk", topk_ratio=0.25, parts=parts(), **SERVER)
    grid, contexts = run(lazy, lazy_mod)
    skips = [entry for entry in used_by if entry[1]]
    assert skips and len(skips) == events(lazy)["up-skip"] == events(lazy)["up-flags"]
    for _, _, used, ref in skips:
        np.testing.assert_array_equal(used, ref)
    for reply in [r for r in grid.replies if r.has_content()]:
        flags = reply.content.config_records.get(protocol.FLAGS_RECORD)
        if flags is not None and flags.get(protocol.FLAG_SKIP):
            assert protocol.UPDATE_RECORD not in reply.content and dict(flags) == {protocol.FLAG_SKIP: True}
    for stats in lazy.accounting.rounds.values():
        assert stats.failures == 0


def recording_lazy(*, record_sent: bool = False, **kwargs) -> tuple[FedLazy, dict[str, list]]:
    """A FedLazy that records, per client key, the vector of each resolved reply: what travelled
    (``record_sent``) or what the server used after resolving it (a skip's or a merge's stored copy)."""
    vectors: dict[str, list] = {}

    class Recording(FedLazy):
        def _resolve(self, server_round, update):  # noqa: ANN001
            if record_sent:
                vectors.setdefault(update.client_key, []).append(update.delta.astype(np.float64))
            outcome = super()._resolve(server_round, update)
            if not record_sent:
                vectors.setdefault(update.client_key, []).append(update.delta.astype(np.float64))
            return outcome

    return Recording(**kwargs, parts=parts(), **SERVER), vectors


def run_recording_deltas(lazy, rounds: int, *, lose_first_lazy_reply: bool = False):  # noqa: ANN001, ANN201
    """``rounds`` rounds through ``lazy_mod``; returns (contexts, each node's true local deltas, lost nodes).

    With ``lose_first_lazy_reply`` the first reply to a message carrying a lazy reference is dropped
    after the client has trained (a reply lost on the way back)."""
    contexts = {n: make_context(n) for n in NODES}
    deltas: dict[int, list] = {n: [] for n in NODES}
    lost: list[int] = []

    def train(msg, context):  # noqa: ANN001
        local = trained(msg)
        deltas[msg.metadata.dst_node_id].append(flat_trainable(local) - flat_trainable(global_arrays_of(msg)))
        return full_model_reply(msg, local, num_examples=10)

    def client(msg):  # noqa: ANN001, ANN202
        reply = lazy_mod(copy.deepcopy(msg), contexts[msg.metadata.dst_node_id], train)
        if lose_first_lazy_reply and not lost and protocol.CFG_LAZY_REF_SUM in config_of(msg):
            lost.append(msg.metadata.dst_node_id)
            return None
        return reply

    grid = FakeGrid(NODES, client)
    arrays = model_record(tiny_model(2))
    for r in range(1, rounds + 1):
        new, _ = lazy.aggregate_train(
            r, list(grid.send_and_receive(lazy.configure_train(r, arrays, ConfigRecord(), grid)))
        )
        arrays = new or arrays
    return contexts, deltas, lost


def assert_error_feedback_balances(contexts, deltas, vectors, node: int) -> None:  # noqa: ANN001
    """sum(recorded vectors) + the client's final residual = sum(its true deltas)."""
    residual = client_vector(contexts[node], RESIDUAL).astype(np.float64)
    np.testing.assert_allclose(
        np.sum(vectors[f"node-{node}"], axis=0) + residual, np.sum(deltas[node], axis=0), atol=1e-5
    )


def test_aa_adds_the_stored_vector_and_applied_error_feedback_balances():
    """AA: used = ref + cand; per client, sum(used) + e_final = sum(Delta) (applied EF, spec §10.4)."""
    lazy, used = recording_lazy(up_rule="aa", up_tau=1.5, compressor="topk", topk_ratio=0.25)
    contexts, deltas, _ = run_recording_deltas(lazy, 6)
    assert events(lazy).get("up-aa", 0) > 0
    for node in NODES:
        if f"node-{node}" in used:
            assert_error_feedback_balances(contexts, deltas, used, node)


def test_downlink_mirror_equals_the_client_copy_after_every_round_and_absent_clients_keep_theirs():
    """Mirror == client copy (checksums) for every client that took part; absent clients untouched."""
    before: dict[int, dict] = {}

    def check(r, strategy, contexts):  # noqa: ANN001
        asked = {strategy.sampler.key(n) for n in NODES if strategy.ledger.round_of(strategy.sampler.key(n)) == r}
        for node in NODES:
            key = strategy.sampler.key(node)
            if strategy.book.has("x", key):
                assert checksum(strategy.book.get("x", key)) == checksum(client_copy(contexts[node]))
            snapshot = {kind: strategy.book.get(kind, key) for kind in ("x", "c-prev", "up-ref")}
            record = contexts[node].state.array_records.get(STATE_KEY)
            client = {name: record[name].numpy().copy() for name in record} if record is not None else {}
            if key not in asked and node in before:
                old_server, old_client = before[node]
                for kind, value in snapshot.items():
                    if value is None:
                        assert old_server[kind] is None
                    else:
                        np.testing.assert_array_equal(value, old_server[kind])
                assert sorted(client) == sorted(old_client)
                for name, value in client.items():
                    np.testing.assert_array_equal(value, old_client[name])
            before[node] = (snapshot, client)

    lazy = FedLazy(
        up_rule="nla",
        up_tau=1.3,
        compressor="topk",
        topk_ratio=0.25,
        down_compressor="topk",
        down_rule="nla",
        down_tau=2.0,
        parts=parts(),
        **SERVER,
    )
    run(lazy, lazy_mod, rounds=8, between=check)
    seen = events(lazy)
    assert seen.get("down-skip", 0) > 0 and seen.get("down-send", 0) > 0


# --------------------------------------------------------------------------- lost state, hostile replies
def test_a_client_that_lost_its_state_is_resynced_and_the_run_goes_on():
    lost = {}

    def wipe(r, strategy, contexts):  # noqa: ANN001
        if r == 2:
            for node in NODES:
                if strategy.book.has("x", strategy.sampler.key(node)) and not lost:
                    contexts[node].state = RecordDict()  # a new SuperNode: no copy, no residual
                    lost["node"] = node

    lazy = FedLazy(
        up_rule="nla",
        compressor="topk",
        topk_ratio=0.25,
        down_compressor="topk",
        down_rule="nla",
        parts=parts(),
        **SERVER,
    )
    grid, contexts = run(lazy, lazy_mod, rounds=10, between=wipe)
    node = lost["node"]
    seen = events(lazy)
    assert seen["resync"] == 1
    reasons = [reason for stats in lazy.accounting.rounds.values() for reason in stats.failure_reasons]
    assert len(reasons) == 1 and "full model next time" in reasons[0]
    # after the resync request the client got the full model again and trains on
    sent_to = [m for m in grid.sent if m.metadata.dst_node_id == node and m.metadata.message_type == MessageType.TRAIN]
    kinds = [str(config_of(m)[protocol.CFG_LAZY_DOWN]) for m in sent_to]
    first_resync = kinds.index("full", 1)
    assert all(k != "full" for k in kinds[1 : first_resync - 1]) and kinds[first_resync - 1] != "full"
    assert np.isfinite(lazy.params).all()
    assert checksum(lazy.book.get("x", lazy.sampler.key(node))) == checksum(client_copy(contexts[node]))


def test_a_client_whose_copy_disagrees_asks_for_a_resync():
    def corrupt(r, strategy, contexts):  # noqa: ANN001
        for node in NODES:
            record = contexts[node].state.array_records.get(STATE_KEY)
            if record is not None and COPY_PREFIX + "conv.bias" in record and r == 1:
                value = record[COPY_PREFIX + "conv.bias"].numpy().copy()
                value[0] += 1.0
                from pollen.wire.records import numpy_to_array

                record[COPY_PREFIX + "conv.bias"] = numpy_to_array(value)

    lazy = FedLazy(up_rule="nla", compressor="topk", topk_ratio=0.25, down_compressor="topk", parts=parts(), **SERVER)
    run(lazy, lazy_mod, rounds=6, between=corrupt)
    assert events(lazy)["resync"] >= 1 and np.isfinite(lazy.params).all()


def hostile_client(contexts, forge):  # noqa: ANN001, ANN201
    def client(msg):  # noqa: ANN001, ANN202
        reply = lazy_mod(copy.deepcopy(msg), contexts[msg.metadata.dst_node_id], train_fn)
        return forge(msg, reply)

    return client


@pytest.mark.parametrize(
    ("case", "rule", "reason"),
    [
        ("skip-with-vector", "nla", "a skip flag together with a vector"),
        ("skip-without-copy", "nla", "no stored copy to reuse"),
        ("aa-without-copy", "aa", "no stored copy to add"),
        ("both-flags", "nla", "both the skip and the aa flag"),
        ("nothing", "nla", "neither an update nor a skip flag"),
        ("aa-on-nla", "nla", "this method's uplink rule is 'nla'"),
        ("skip-on-aa", "aa", "this method's uplink rule is 'aa'"),
        ("aa-beyond-tau", "aa", "larger than tau=0.5 times the reference"),
        ("resync-without-downlink", "nla", "this method sends the full model every round"),
    ],
)
def test_hostile_lazy_replies_are_rejected_with_a_reason(case, rule, reason):
    victim = NODES[0]

    def forge(msg, reply):  # noqa: ANN001, ANN202
        if msg.metadata.dst_node_id != victim:
            return reply
        content = reply.content
        if case == "skip-with-vector" and protocol.UPDATE_RECORD in content:
            content[protocol.FLAGS_RECORD] = ConfigRecord({protocol.FLAG_SKIP: True})
        elif case in ("skip-without-copy", "aa-without-copy") and protocol.CFG_LAZY_REF_SUM not in config_of(msg):
            if case == "skip-without-copy":
                for name in (protocol.UPDATE_RECORD, protocol.UPDATE_META_RECORD):
                    del content[name]
            content[protocol.FLAGS_RECORD] = ConfigRecord(
                {protocol.FLAG_SKIP if case == "skip-without-copy" else protocol.FLAG_AA: True}
            )
        elif case == "both-flags":
            content[protocol.FLAGS_RECORD] = ConfigRecord({protocol.FLAG_SKIP: True, protocol.FLAG_AA: True})
        elif case == "nothing":
            for name in (protocol.UPDATE_RECORD, protocol.UPDATE_META_RECORD):
                if name in content:
                    del content[name]
        elif case == "aa-on-nla" and protocol.UPDATE_RECORD in content:
            content[protocol.FLAGS_RECORD] = ConfigRecord({protocol.FLAG_AA: True})
        elif case == "skip-on-aa" and protocol.CFG_LAZY_REF_SUM in config_of(msg):
            for name in (protocol.UPDATE_RECORD, protocol.UPDATE_META_RECORD):
                if name in content:
                    del content[name]
            content[protocol.FLAGS_RECORD] = ConfigRecord({protocol.FLAG_SKIP: True})
        elif (
            case == "aa-beyond-tau"
            and protocol.CFG_LAZY_REF_SUM in config_of(msg)
            and protocol.UPDATE_RECORD in content
        ):
            content[protocol.FLAGS_RECORD] = ConfigRecord(
                {protocol.FLAG_AA: True}
            )  # top-k with EF: rel is about 1.2-1.4
        elif case == "resync-without-downlink":
            for name in (protocol.UPDATE_RECORD, protocol.UPDATE_META_RECORD):
                if name in content:
                    del content[name]
            content[protocol.FLAGS_RECORD] = ConfigRecord({protocol.FLAG_RESYNC: True})
        return reply

    lazy = FedLazy(up_rule=rule, up_tau=0.5, compressor="topk", topk_ratio=0.25, parts=parts(), **SERVER)
    contexts = {n: make_context(n) for n in NODES}
    grid = FakeGrid(NODES, hostile_client(contexts, forge))
    arrays = model_record(tiny_model(2))
    for r in range(1, 6):
        new, _ = lazy.aggregate_train(
            r, list(grid.send_and_receive(lazy.configure_train(r, arrays, ConfigRecord(), grid)))
        )
        arrays = new or arrays
    reasons = [reason for stats in lazy.accounting.rounds.values() for reason in stats.failure_reasons]
    assert reasons and all(text.startswith(f"node-{victim}: ") for text in reasons)
    assert any(reason in text for text in reasons)
    assert np.isfinite(lazy.params).all()


# --------------------------------------------------------------------------- ablations and settings
def test_model_keep_and_literal_downlinks_run_and_the_literal_one_inflates_the_model():
    keep = FedLazy(
        up_rule="nla",
        compressor="topk",
        topk_ratio=0.25,
        down_compressor="topk",
        down_rule="nla",
        down_tau=10.0,
        downlink_mode="model-keep",
        parts=parts(),
        **SERVER,
    )
    run(keep, lazy_mod, rounds=6)
    assert events(keep).get("down-keep", 0) > 0
    sparse = dict(
        up_rule="none", compressor="topk", topk_ratio=0.25, down_compressor="topk", down_topk_ratio=0.05, **SERVER
    )  # k = 1
    literal = FedLazy(downlink_mode="literal", parts=parts(), **sparse)
    _, contexts = run(literal, lazy_mod, rounds=30)
    increment = FedLazy(parts=parts(), **sparse)
    _, inc_contexts = run(increment, lazy_mod, rounds=30)
    error = max(
        np.linalg.norm(literal.book.get("error", f"node-{n}")) for n in NODES if literal.book.has("error", f"node-{n}")
    )
    assert error > 3 * np.linalg.norm(literal.params)  # unsent coordinates pile up copies of theta (spec §5.3)
    inc_error = max(
        np.linalg.norm(increment.params - increment.book.get("x", f"node-{n}"))
        for n in NODES
        if increment.book.has("x", f"node-{n}")
    )
    assert error > 2 * inc_error  # the increment reading's implicit error theta - x_i stays small


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(up_rule="lazy"), "up_rule='lazy' is unknown"),
        (dict(up_tau=-1.0), "up_tau=-1.0 is out of range"),
        (dict(down_rule="nla"), "needs a compressed downlink"),
        (dict(down_compressor="topk", down_rule="aa", downlink_mode="model-keep"), "no AA reading"),
        (dict(ef_mode="later"), "ef_mode='later' is unknown"),
        (dict(ref_mode="x"), "ref_mode='x' is unknown"),
        (dict(topk_ratio=0.0), "topk_ratio=0.0 is out of range"),
    ],
)
def test_bad_settings_name_what_is_allowed(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FedLazy(**kwargs)


def test_consecutive_only_reference_needs_the_previous_round():
    lazy = FedLazy(
        up_rule="nla",
        up_tau=1e6,
        ref_mode="consecutive-only",
        compressor="topk",
        topk_ratio=0.25,
        parts=parts(),
        **SERVER,
    )
    grid, _ = run(lazy, lazy_mod, rounds=6)
    refs = 0
    for r, call in enumerate(grid.calls, start=1):
        for msg in call:
            if msg.metadata.message_type != MessageType.TRAIN:
                continue
            key = lazy.sampler.key(msg.metadata.dst_node_id)
            had_ref = protocol.CFG_LAZY_REF_SUM in config_of(msg)
            previous = [
                m for m in (grid.calls[r - 2] if r >= 2 else []) if m.metadata.message_type == MessageType.TRAIN
            ]
            took_part_before = any(m.metadata.dst_node_id == msg.metadata.dst_node_id for m in previous)
            assert had_ref == took_part_before, key  # a reference exactly when it took part in the round before
            refs += had_ref
    assert refs > 0 and events(lazy).get("up-skip", 0) == refs  # tau huge: every upload with a reference is a skip


def test_state_dict_resumes_bit_for_bit():
    settings = dict(
        up_rule="aa",
        up_tau=1.2,
        compressor="topk",
        topk_ratio=0.25,
        down_compressor="topk",
        down_rule="aa",
        down_tau=1.0,
        **SERVER,
    )
    whole = FedLazy(parts=parts(), **settings)
    _, _ = run(whole, lazy_mod, rounds=6)

    first = FedLazy(parts=parts(), **settings)
    contexts = {n: make_context(n) for n in NODES}
    grid = FakeGrid(NODES, client_with(lazy_mod, contexts))
    arrays = model_record(tiny_model(2))
    for r in range(1, 7):
        if r == 4:
            state = first.state_dict()
            first = FedLazy(parts=parts(), **settings)
            first.load_state_dict(copy.deepcopy(state))
            first.sampler.node_keys.update({n: f"node-{n}" for n in NODES})
        new, _ = first.aggregate_train(
            r, list(grid.send_and_receive(first.configure_train(r, arrays, ConfigRecord(), grid)))
        )
        arrays = new or arrays
    np.testing.assert_array_equal(first.params, whole.params)
    assert named_arrays(arrays).keys() == set(tiny_model(2))


@pytest.mark.parametrize("bidirectional", [False, True])
def test_a_reply_lost_after_the_client_moved_on_costs_no_resync(bidirectional):
    """The client committed round r but its reply never arrived: its copies of one round back match the server's."""
    contexts = {n: make_context(n) for n in NODES}
    lost = []

    def client(msg):  # noqa: ANN001, ANN202
        reply = lazy_mod(copy.deepcopy(msg), contexts[msg.metadata.dst_node_id], train_fn)
        if not lost and protocol.CFG_LAZY_REF_SUM in config_of(msg):
            lost.append((msg.metadata.dst_node_id, int(config_of(msg)[protocol.CFG_SERVER_ROUND])))
            return None  # the client's state moved on; the server hears nothing
        return reply

    down = dict(down_compressor="topk", down_rule="nla", down_tau=2.0) if bidirectional else {}
    lazy = FedLazy(up_rule="nla", up_tau=1.3, compressor="topk", topk_ratio=0.25, **down, parts=parts(), **SERVER)
    grid = FakeGrid(NODES, client)
    arrays = model_record(tiny_model(2))
    for r in range(1, 13):
        new, _ = lazy.aggregate_train(
            r, list(grid.send_and_receive(lazy.configure_train(r, arrays, ConfigRecord(), grid)))
        )
        arrays = new or arrays
    assert lost
    reasons = [text for stats in lazy.accounting.rounds.values() for text in stats.failure_reasons]
    assert len(reasons) == 1 and "no reply" in reasons[0], reasons
    assert "resync" not in events(lazy)
    node, round_lost = lost[0]
    asked_later = [
        m
        for m in grid.sent
        if m.metadata.message_type == MessageType.TRAIN
        and m.metadata.dst_node_id == node
        and int(config_of(m)[protocol.CFG_SERVER_ROUND]) > round_lost
    ]
    assert asked_later  # it took part again, from the copies the server held
    if bidirectional:
        assert checksum(lazy.book.get("x", f"node-{node}")) == checksum(client_copy(contexts[node]))


def test_relative_changes_are_recorded_where_the_server_sees_both_vectors():
    """At tau = 0 nothing fires, and every upload against a reference leaves its ||cand - ref|| / ||ref||."""
    lazy = FedLazy(
        up_rule="nla",
        compressor="topk",
        topk_ratio=0.25,
        down_compressor="topk",
        down_rule="nla",
        parts=parts(),
        **SERVER,
    )
    grid, _ = run(lazy, lazy_mod, rounds=6)
    for r, call in enumerate(grid.calls[-6:], start=1):
        with_ref = sum(
            1
            for m in call
            if m.metadata.message_type == MessageType.TRAIN and protocol.CFG_LAZY_REF_SUM in config_of(m)
        )
        rel = lazy.accounting.rounds[r].method.get("lazy_rel", {})
        assert len(rel.get("up", [])) == with_ref, r
        assert all(value > 0 for value in rel.get("up", []) + rel.get("down", []))
    downs = [v for stats in lazy.accounting.rounds.values() for v in stats.method.get("lazy_rel", {}).get("down", [])]
    increments = sum(
        stats.method.get("lazy_events", {}).get("down-send", 0) for stats in lazy.accounting.rounds.values()
    )
    assert 0 < len(downs) < increments  # a client's first increment has no earlier one to compare with


def test_error_feedback_balances_across_a_lost_reply():
    """sum(used the server applied) + e_final = sum(Delta) for a client whose reply was lost once (applied EF)."""
    lazy, used = recording_lazy(up_rule="nla", up_tau=1.3, compressor="topk", topk_ratio=0.25)
    contexts, deltas, lost = run_recording_deltas(lazy, 10, lose_first_lazy_reply=True)
    node = lost[0]
    assert len(deltas[node]) >= len(used[f"node-{node}"]) + 1 >= 3  # it took part again after the loss
    assert_error_feedback_balances(contexts, deltas, used, node)


def test_compressed_error_feedback_keeps_what_the_codec_dropped():
    """ef_mode='compressed' (proof identities D.1/E.1): e <- Delta + e - cand, so sum(cand) + e = sum(Delta),
    AA or not."""
    lazy, sent = recording_lazy(
        record_sent=True, up_rule="aa", up_tau=2.0, ef_mode="compressed", compressor="topk", topk_ratio=0.25
    )
    contexts, deltas, _ = run_recording_deltas(lazy, 6)
    assert events(lazy).get("up-aa", 0) > 0
    for node in NODES:
        if deltas[node]:
            assert_error_feedback_balances(contexts, deltas, sent, node)


def test_a_memory_mapped_book_resumes_bit_for_bit(tmp_path):
    """bookkeeping_dir keeps the per-client copies in files; a strategy rebuilt from state_dict goes on exactly."""
    settings = dict(
        up_rule="nla",
        up_tau=1.3,
        compressor="topk",
        topk_ratio=0.25,
        down_compressor="topk",
        down_rule="nla",
        down_tau=1.0,
        **SERVER,
    )
    whole = FedLazy(parts=parts(), **settings, bookkeeping_dir=str(tmp_path / "whole"))
    run(whole, lazy_mod, rounds=6)
    assert sorted(p.name for p in (tmp_path / "whole").iterdir()) == ["c-prev.f32", "error.f32", "up-ref.f32", "x.f32"]

    first = FedLazy(parts=parts(), **settings, bookkeeping_dir=str(tmp_path / "first"))
    contexts = {n: make_context(n) for n in NODES}
    grid = FakeGrid(NODES, client_with(lazy_mod, contexts))
    arrays = model_record(tiny_model(2))
    for r in range(1, 7):
        if r == 4:
            state = first.state_dict()
            first = FedLazy(parts=parts(), **settings, bookkeeping_dir=str(tmp_path / "resumed"))
            first.load_state_dict(copy.deepcopy(state))
            first.sampler.node_keys.update({n: f"node-{n}" for n in NODES})
        new, _ = first.aggregate_train(
            r, list(grid.send_and_receive(first.configure_train(r, arrays, ConfigRecord(), grid)))
        )
        arrays = new or arrays
    np.testing.assert_array_equal(first.params, whole.params)
    for node in NODES:
        key = f"node-{node}"
        for kind in ("x", "up-ref"):
            a, b = whole.book.get(kind, key), first.book.get(kind, key)
            assert (a is None) == (b is None)
            if a is not None:
                np.testing.assert_array_equal(a, b)


def test_the_downlink_is_a_part_the_strategy_receives_and_equals_the_flat_arguments() -> None:
    """FedLazy(downlink=Downlink(...)) is FedBNLACA built from the down_* arguments, bit for bit."""
    from pollen.strategies.engine.downlink import Downlink

    settings = dict(up_rule="nla", up_tau=0.5, compressor="topk", topk_ratio=0.25, **SERVER)
    flat = FedLazy(
        down_compressor="topk", down_rule="nla", down_tau=0.3, down_topk_ratio=0.5, parts=parts(), **settings
    )
    part = FedLazy(downlink=Downlink("topk", topk_ratio=0.5, rule="nla", tau=0.3), parts=parts(), **settings)
    assert flat.downlink == part.downlink
    run(flat, lazy_mod, 4)
    run(part, lazy_mod, 4)
    assert flat.params.tobytes() == part.params.tobytes()
    assert events(flat) == events(part)
    with pytest.raises(ValueError, match="down_tau=-1.0 is out of range"):
        Downlink("topk", tau=-1.0)
    with pytest.raises(ValueError, match="down_compressor='gzip' is unknown"):
        Downlink("gzip")
