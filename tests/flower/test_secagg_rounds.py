"""Secure aggregation through the engine: a round's sum is exact, the server never holds one client's update,
drop-outs are recovered above the threshold and abort the round cleanly below it, and the methods that need
one client's update refuse it before round 1."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from pollen.clientside import secagg_mod
from pollen.clientside.compression_mod import client_state_for
from pollen.clientside.secagg_mod import RESIDUAL, _rounding_rng
from pollen.secagg.codec import SummableCodec
from pollen.strategies import FedAdaVR, FedAMS, FedCAMS, FedLAMB, FedLazy, FedOpt, HAFed
from pollen.strategies.engine.parts import EngineParts
from pollen.strategies.engine.rounds import SetupError
from pollen.strategies.engine.screening import UpdateScreen
from pollen.strategies.engine.secure import SecureAggregation, rounding_seed
from pollen.testing.fakes import FakeGrid
from pollen.wire import protocol
from pollen.wire.records import arrays_to_record

pytestmark = pytest.mark.flower_compat

DIM = 40
#: Flower's node ids are unsigned 64-bit: two of them above 2**63, as real SuperNodes' are.
NODES = [9507328796357743299, 2, 3, 4, 5, 6, 7, 12754407852118411365]
SEED = 5
CLIP = 0.05


def client_delta(node: int, server_round: int) -> np.ndarray:
    """Each client's update: fixed by node and round, some coordinates beyond the codec's range."""
    return (
        np.random.default_rng([node & 0xFFFFFFFF, node >> 32, server_round]).normal(0.0, 0.03, DIM).astype(np.float32)
    )


def make_app() -> ClientApp:
    """A ClientApp, as a Flower project writes one, that adds ``client_delta`` to the model it gets."""
    app = ClientApp(mods=[secagg_mod])

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        config = msg.content.config_records["config"]
        node = msg.metadata.dst_node_id
        weights = msg.content.array_records["arrays"]["w"].numpy()
        delta = client_delta(node, int(config[protocol.CFG_SERVER_ROUND]))
        arrays = arrays_to_record({"w": np.asarray(weights + delta, dtype=np.float32)})
        metrics = MetricRecord({"num-examples": 10, "train_loss": float(node)})
        return Message(RecordDict({"arrays": arrays, "metrics": metrics}), reply_to=msg)

    return app


class Federation:
    """Eight in-process nodes with their contexts, a grid that keeps every reply, and what each client encoded."""

    def __init__(self, fail: dict[int, str] | None = None, fail_rounds: set[int] | None = None) -> None:
        """``fail``: node -> the phase in which it stops answering (``"train"`` for the train message), in the
        rounds ``fail_rounds`` (default: every round)."""
        self.app, self.fail, self.fail_rounds = make_app(), fail or {}, fail_rounds
        self.contexts = {
            n: Context(run_id=1, node_id=n, node_config={"partition-id": i}, state=RecordDict(), run_config={})
            for i, n in enumerate(NODES)
        }
        self.grid = FakeGrid(NODES, self.call)

    def call(self, msg: Message) -> Message | None:
        config = msg.content.config_records["config"]
        phase = str(config.get(protocol.CFG_PHASE, "train"))
        failing = self.fail_rounds is None or int(config.get(protocol.CFG_SERVER_ROUND, 0)) in self.fail_rounds
        if failing and self.fail.get(msg.metadata.dst_node_id) == phase:
            return None  # gone: no reply before the timeout
        try:
            return self.app(msg, self.contexts[msg.metadata.dst_node_id])
        except Exception as err:  # noqa: BLE001 - as the runtime: an error reply
            from flwr.app import Error

            return Message(Error(code=0, reason=f"{type(err).__name__}: {err}"), reply_to=msg)

    def run(self, strategy, rounds: int = 1):  # noqa: ANN001, ANN201
        return strategy.start(
            grid=self.grid, initial_arrays=arrays_to_record({"w": np.zeros(DIM, dtype=np.float32)}), num_rounds=rounds
        )


def secure_sgd(**secagg) -> FedOpt:  # noqa: ANN003
    """FedOpt's plain SGD with eta 1: the new model is the old plus the decoded mean, nothing else."""
    parts = EngineParts(secagg=SecureAggregation(clip=CLIP, seed=SEED, **secagg))
    return FedOpt(optimizer="sgd", eta=1.0, fraction_evaluate=0.0, min_available_nodes=8, parts=parts)


def expected_integers(node: int, server_round: int, bits: int, count: int) -> np.ndarray:
    """What ``node`` encodes in ``server_round`` (round 1, no residual), recomputed from the seed."""
    codec = SummableCodec(clip=CLIP, bits=bits, max_clients=count)
    config = ConfigRecord({protocol.CFG_SECAGG_SEED: rounding_seed(SEED, server_round)})
    return codec.quantize(client_delta(node, server_round), _rounding_rng(config, node))


def exact_mean(nodes: list[int], bits: int, count: int = 8) -> np.ndarray:
    """The mean the server must step on in round 1 when ``nodes`` survive a round set up for ``count``."""
    codec = SummableCodec(clip=CLIP, bits=bits, max_clients=count)
    total = sum(expected_integers(n, 1, bits, count) for n in nodes)
    return (total.astype(np.float64) * (CLIP / codec.levels) / len(nodes)).astype(np.float32)


@pytest.mark.parametrize("bits", [8, 16])
def test_the_round_steps_on_the_exact_mean_of_the_quantised_updates(bits: int) -> None:
    federation = Federation()
    result = federation.run(secure_sgd(bits=bits))
    codec = SummableCodec(clip=CLIP, bits=bits, max_clients=8)
    total = sum(expected_integers(n, 1, bits, 8) for n in NODES)
    mean = (total.astype(np.float64) * (CLIP / codec.levels) / 8).astype(np.float32)
    np.testing.assert_array_equal(result.arrays["w"].numpy(), np.zeros(DIM, np.float32) + mean)
    clipped_mean = np.mean([np.clip(client_delta(n, 1), -CLIP, CLIP) for n in NODES], axis=0)
    assert np.abs(mean - clipped_mean).max() < 2 * (CLIP / codec.levels)  # within a rounding step of the clipped mean


def test_the_server_never_receives_one_clients_update() -> None:
    federation = Federation()
    strategy = secure_sgd(bits=8)
    federation.run(strategy)
    codec = SummableCodec(clip=CLIP, bits=8, max_clients=8)
    plain = {n: codec.to_wire(expected_integers(n, 1, 8, 8)) for n in NODES}
    masked_seen = 0
    for reply in federation.grid.replies:
        arrays = {name: record for name, record in reply.content.array_records.items()}
        if not arrays:
            continue
        assert list(arrays) == [protocol.SECAGG_RECORD]  # only the masked input carries arrays
        vector = next(iter(arrays[protocol.SECAGG_RECORD].values())).numpy()
        node = reply.metadata.src_node_id
        assert vector.dtype == codec.dtype and vector.shape == (DIM,)
        assert np.mean(vector == plain[node]) < 0.05  # masked: not the client's integers
        masked_seen += 1
    assert masked_seen == len(NODES)
    stats = strategy.accounting.round(1)
    measured = sum(  # the masked records as they came, with Flower's framing
        int(r.content.array_records[protocol.SECAGG_RECORD].count_bytes())
        for r in federation.grid.replies
        if r.content.array_records
    )
    assert stats.uplink_update_bytes == measured
    assert len(NODES) * DIM * 2 <= measured < len(NODES) * (DIM * 2 + 200)  # 16-bit lanes for 8 bits of 8 clients
    assert stats.method["secagg_survivors"] == 8


def test_a_client_that_drops_after_sharing_is_recovered() -> None:
    federation = Federation(fail={3: protocol.SECAGG_MASKED_PHASE})
    strategy = secure_sgd(bits=16)
    result = federation.run(strategy)
    survivors = [n for n in NODES if n != 3]
    total = sum(expected_integers(n, 1, 16, 8) for n in survivors)
    codec = SummableCodec(clip=CLIP, bits=16, max_clients=8)
    mean = (total.astype(np.float64) * (CLIP / codec.levels) / len(survivors)).astype(np.float32)
    np.testing.assert_array_equal(result.arrays["w"].numpy(), mean)
    stats = strategy.accounting.round(1)
    assert stats.method["secagg_dropped"] == 1 and stats.method["secagg_survivors"] == 7
    assert any("node-3" in why and "no reply" in why for why in stats.failure_reasons)


def test_too_few_survivors_abort_the_round_and_change_nothing() -> None:
    fail = {n: protocol.SECAGG_UNMASK_PHASE for n in NODES[:5]}  # 3 of 8 answer the unmasking; threshold 5
    federation = Federation(fail=fail)
    strategy = secure_sgd(bits=16)
    result = federation.run(strategy)
    assert "w" not in result.arrays  # no round released a model
    assert strategy.params.tolist() == [0.0] * DIM
    stats = strategy.accounting.round(1)
    assert stats.method["secagg_aborted"] == 1 and stats.replies == 0


def bend(federation: Federation, node: int, phase: str, edit) -> None:  # noqa: ANN001
    """Make ``node``'s answer to ``phase`` ``edit(msg, reply)`` (a client that sends a malformed message)."""
    honest = federation.call

    def bent(msg: Message) -> Message:
        reply = honest(msg)
        config = msg.content.config_records["config"]
        if msg.metadata.dst_node_id == node and config.get(protocol.CFG_PHASE) == phase:
            return edit(msg, reply)
        return reply

    federation.grid = FakeGrid(NODES, bent)


def test_a_client_whose_masked_vector_is_malformed_is_dropped_and_recovered() -> None:
    federation = Federation()
    short = arrays_to_record({"masked": np.zeros(DIM - 1, dtype=np.uint16)})
    bend(
        federation,
        2,
        protocol.SECAGG_MASKED_PHASE,
        lambda m, r: Message(RecordDict({protocol.SECAGG_RECORD: short}), reply_to=m),
    )
    strategy = secure_sgd(bits=8)
    result = federation.run(strategy)
    stats = strategy.accounting.round(1)
    assert stats.method["secagg_survivors"] == 7 and stats.method["secagg_dropped"] == 1
    assert any("masked vector is uint16(39,)" in why for why in stats.failure_reasons)
    np.testing.assert_array_equal(result.arrays["w"].numpy(), exact_mean([n for n in NODES if n != 2], 8))


def test_a_client_whose_shares_are_malformed_is_left_out_and_the_rest_sum_exactly() -> None:
    federation = Federation()

    def misaddressed(msg: Message, reply: Message) -> Message:
        record = reply.content.config_records[protocol.SECAGG_RECORD]
        record["to"] = [v + 1 for v in record["to"]]  # addressed to clients that are not its neighbours
        return reply

    bend(federation, 5, protocol.SECAGG_SHARE_PHASE, misaddressed)
    strategy = secure_sgd(bits=16)
    result = federation.run(strategy)
    stats = strategy.accounting.round(1)
    assert any("node-5" in why and "do not address exactly its neighbours" in why for why in stats.failure_reasons)
    others = [n for n in NODES if n != 5]
    total = sum(expected_integers(n, 1, 16, 8) for n in others)
    codec = SummableCodec(clip=CLIP, bits=16, max_clients=8)
    mean = (total.astype(np.float64) * (CLIP / codec.levels) / len(others)).astype(np.float32)
    np.testing.assert_array_equal(result.arrays["w"].numpy(), mean)
    assert stats.method["secagg_survivors"] == 7 and stats.method["secagg_dropped"] == 0


def test_error_feedback_carries_what_the_integers_missed() -> None:
    federation = Federation()
    federation.run(secure_sgd(bits=8), rounds=1)

    context = federation.contexts[4]
    state = client_state_for(context, ConfigRecord({protocol.CFG_SERVER_ROUND: 2}), first_message=False)
    codec = SummableCodec(clip=CLIP, bits=8, max_clients=8)
    integers = expected_integers(4, 1, 8, 8)
    np.testing.assert_allclose(state.get(RESIDUAL), client_delta(4, 1) - codec.dequantize(integers), atol=1e-7)


def test_fedams_and_fedcams_run_securely() -> None:
    # the same server settings: the drop-in defaults differ (FedCAMS's for its sign uploads)
    fedcams = FedCAMS(
        eta=0.01,
        beta_1=0.9,
        bias_correction=False,
        fraction_evaluate=0.0,
        parts=EngineParts(secagg=SecureAggregation(seed=1)),
    )
    assert fedcams.uplink is None and FedCAMS().uplink is not None  # its sign uplink gives way to the summable codec
    fedams = FedAMS(eta=0.01, fraction_evaluate=0.0, parts=EngineParts(secagg=SecureAggregation(seed=1)))
    models = []
    for strategy in (fedams, fedcams):
        models.append(Federation().run(strategy, rounds=2).arrays["w"].numpy())
        assert strategy.accounting.round(2).method["secagg_survivors"] == 8
    assert np.abs(models[0]).max() > 0
    np.testing.assert_array_equal(models[0], models[1])  # FedCAMS under secure aggregation is FedAMS with its codec


@pytest.mark.parametrize(
    ("build", "words"),
    [
        (lambda p: FedAdaVR(parts=p), "stored-update table"),
        (lambda p: FedLazy(parts=p), "copy of each client's last upload"),
        (lambda p: HAFed(parts=p), "gossip"),
        (lambda p: FedLAMB(parts=p), "a max is not a sum"),
        (lambda p: FedAMS(aggregator="median", parts=p), "mean aggregator"),
        (lambda p: FedAMS(aggregation="weighted", parts=p), "aggregation='mean'"),
    ],
)
def test_methods_that_need_one_clients_update_refuse_in_one_line(build, words) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match="secure aggregation") as err:
        build(EngineParts(secagg=SecureAggregation()))
    assert words in str(err.value) and "\n" not in str(err.value)


def test_the_screen_must_be_off_and_float_buffers_are_refused() -> None:
    with pytest.raises(ValueError, match="outlier screen off"):
        FedAMS(parts=EngineParts(secagg=SecureAggregation(), screen=UpdateScreen(rule="reject")))
    strategy = FedAMS(fraction_evaluate=0.0, parts=EngineParts(secagg=SecureAggregation()))
    arrays = arrays_to_record({"w": np.zeros(DIM, np.float32), "bn.running_var": np.ones(3, np.float32)})
    with pytest.raises(SetupError, match="floating-point buffers"):
        strategy.start(grid=Federation().grid, initial_arrays=arrays, num_rounds=1)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"bits": 1}, "secagg bits"),
        ({"clip": -1.0}, "secagg clip"),
        ({"degree": 0}, "degree"),
        ({"threshold": 1}, "threshold"),
    ],
)
def test_bad_settings_are_refused_by_name(kwargs, words) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=words):
        SecureAggregation(**kwargs)


def test_a_foreign_flower_project_aggregates_securely_with_the_mod_alone() -> None:
    """Flower's quickstart-pytorch rebuilt with local data (its ClientApp as the example writes it, plus
    ``secagg_mod``): FedAMS under secure aggregation learns as it does without it (seed 1, 3 rounds)."""
    from pollen.testing.foreign import harness
    from pollen.testing.foreign.quickstart_pytorch import PROJECT

    plain = harness.run_project(PROJECT, FedAMS(fraction_evaluate=0.0), seed=1, num_rounds=3)
    strategy = FedAMS(fraction_evaluate=0.0, parts=EngineParts(secagg=SecureAggregation(bits=8, seed=1)))
    secure = harness.run_project(PROJECT, strategy, seed=1, num_rounds=3, mods=(secagg_mod,))
    assert all(strategy.accounting.round(r).method["secagg_survivors"] == 4 for r in (1, 2, 3))
    assert secure[-1] > secure[0] + 0.2 and abs(secure[-1] - plain[-1]) < 0.05, (plain, secure)


def test_a_round_too_small_or_a_threshold_it_cannot_meet_aborts_that_round_only() -> None:
    with pytest.raises(ValueError, match="an even integer >= 2"):
        SecureAggregation(degree=3)
    federation = Federation()
    strategy = FedOpt(
        optimizer="sgd",
        eta=1.0,
        fraction_train=0.5,
        min_train_nodes=2,
        fraction_evaluate=0.0,
        parts=EngineParts(secagg=SecureAggregation(threshold=6, seed=SEED)),
    )
    federation.run(strategy, rounds=2)  # 4 of 8 a round: 4 holders cannot meet a threshold of 6
    for r in (1, 2):
        assert strategy.accounting.round(r).method["secagg_aborted"] == 1
    assert strategy.params.tolist() == [0.0] * DIM
    assert not strategy.secagg._servers and not strategy.secagg._setups and not strategy.secagg._results


def test_a_phase_message_of_another_round_is_refused_by_the_client() -> None:
    """Round 1's unmask request to a client, delivered again while round 2 waits for that client's unmasking
    (the same stage of another round), is refused: answering it would hand over round-2 shares under round 1's
    survivor lists."""
    from pollen.clientside.secagg_mod import answer_phase
    from pollen.secagg.crypto import SecAggError

    federation = Federation()
    honest, stale, refusals = federation.call, [], []

    def replay(msg: Message) -> Message | None:
        config = msg.content.config_records["config"]
        if config.get(protocol.CFG_PHASE) == protocol.SECAGG_UNMASK_PHASE and msg.metadata.dst_node_id == 4:
            if stale:
                with pytest.raises(SecAggError, match="another round") as err:
                    answer_phase(stale[0], federation.contexts[4])
                refusals.append(str(err.value))
            else:
                stale.append(msg)
        return honest(msg)

    federation.grid = FakeGrid(NODES, replay)
    strategy = secure_sgd(bits=8)
    federation.run(strategy, rounds=2)
    assert len(refusals) == 1 and strategy.accounting.round(2).method["secagg_survivors"] == 8


def test_error_feedback_stays_exact_across_an_aborted_round() -> None:
    """Round 1 aborts (too few at the unmasking); round 2 completes: what client 4's round-2 integers stand for
    plus its residual is both rounds' updates, since the ledger told it round 1's integers were not taken."""
    fail = {n: protocol.SECAGG_UNMASK_PHASE for n in NODES[:5]}
    federation = Federation(fail=fail, fail_rounds={1})
    strategy = secure_sgd(bits=8)
    federation.run(strategy, rounds=2)
    assert strategy.accounting.round(1).method["secagg_aborted"] == 1
    assert strategy.accounting.round(2).method["secagg_survivors"] == 8
    from pollen.clientside.secagg_mod import PENDING

    state = client_state_for(federation.contexts[NODES[3]], ConfigRecord({protocol.CFG_SERVER_ROUND: 3}))
    carried = state.get(PENDING) + state.get(RESIDUAL)
    np.testing.assert_allclose(carried, client_delta(NODES[3], 1) + client_delta(NODES[3], 2), atol=1e-6)


def test_an_error_reply_without_a_reason_is_a_drop_out_not_a_crash() -> None:
    federation = Federation()
    bend(federation, 6, protocol.SECAGG_SHARE_PHASE, lambda m, r: Message(Error(code=0), reply_to=m))
    strategy = secure_sgd(bits=16)
    result = federation.run(strategy)
    stats = strategy.accounting.round(1)
    assert stats.method["secagg_survivors"] == 7 and stats.failures == 1
    np.testing.assert_array_equal(result.arrays["w"].numpy(), exact_mean([n for n in NODES if n != 6], 16))


#: Malformed answers a client can send in place of its protocol record, by name.
MALFORMED = {
    "metric-record": lambda: MetricRecord({"x": 1.0}),
    "empty-config": lambda: ConfigRecord(),
    "strings-for-ids": lambda: ConfigRecord({"to": ["a"], "sealed": ["b"], "ids": ["a"], "b_ids": ["x"], "b": ["y"]}),
    "negative-ids": lambda: ConfigRecord({"to": [-1], "sealed": [b"x" * 40], "b_ids": [-5], "b": [b"q"]}),
    "lists-unpaired": lambda: ConfigRecord({"to": [1, 2], "sealed": [b"x" * 40], "b_ids": [1, 2], "b": [b"q"]}),
    "booleans-for-ids": lambda: ConfigRecord({"to": [True], "sealed": [b"x" * 40]}),
    "repeated-ids": lambda: ConfigRecord({"to": [2, 2], "sealed": [b"x" * 40] * 2, "b_ids": [2, 2], "b": [b"q"] * 2}),
    "huge-blob": lambda: ConfigRecord({"to": [2], "sealed": [b"x" * 100_000]}),
    "two-arrays": lambda: arrays_to_record({"a": np.zeros(3, np.uint16), "b": np.zeros(3, np.uint16)}),
    "float-array": lambda: arrays_to_record({"a": np.zeros(DIM, np.float32)}),
    "wide-array": lambda: arrays_to_record({"a": np.zeros(DIM, np.uint64)}),
}


@pytest.mark.parametrize(
    "phase", ["train", protocol.SECAGG_SHARE_PHASE, protocol.SECAGG_MASKED_PHASE, protocol.SECAGG_UNMASK_PHASE]
)
@pytest.mark.parametrize("kind", [*MALFORMED, "error-without-reason", "no-record"])
def test_malformed_answers_at_any_stage_never_crash_the_server(phase: str, kind: str) -> None:
    """One client, then six of eight, answer ``phase`` with ``kind`` every round: the run finishes its two rounds,
    each a step on the well-formed clients' sum or an aborted round, never an exception."""

    def malformed(msg: Message, reply: Message) -> Message:
        if kind == "error-without-reason":
            return Message(Error(code=0), reply_to=msg)
        if kind == "no-record":
            return Message(RecordDict({"metrics": MetricRecord({"num-examples": 10})}), reply_to=msg)
        return Message(RecordDict({protocol.SECAGG_RECORD: MALFORMED[kind]()}), reply_to=msg)

    for bad in ([2], NODES[1:7]):
        federation = Federation()
        honest = federation.call

        def bent(msg: Message, bad: list[int] = bad, honest=honest) -> Message | None:  # noqa: ANN001
            reply = honest(msg)
            config = msg.content.config_records["config"]
            if msg.metadata.dst_node_id in bad and str(config.get(protocol.CFG_PHASE, "train")) == phase:
                return malformed(msg, reply)
            return reply

        federation.grid = FakeGrid(NODES, bent)
        strategy = secure_sgd(bits=8)
        federation.run(strategy, rounds=2)
        for r in (1, 2):
            stats = strategy.accounting.round(r)
            assert stats.failures >= len(bad) or stats.method.get("secagg_aborted") == 1, stats
            if not stats.method.get("secagg_aborted"):
                assert (
                    stats.method["secagg_survivors"]
                    == stats.replies
                    <= len(NODES) - len(bad) + (phase == protocol.SECAGG_UNMASK_PHASE) * len(bad)
                )
