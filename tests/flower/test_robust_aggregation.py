"""Robust aggregation as a part (``aggregator=``): wired into every method it fits, refused where it does not.

With the server optimiser plain SGD at rate 1 the model moves by exactly the aggregate, so a round's
result can be checked against :mod:`pollen.aggregate.robust` applied to the deltas the server decoded.
"""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ConfigRecord

from pollen.aggregate import MajorityVote, Mean, Median, TrimmedMean
from pollen.app.config import AppConfig, schema_defaults
from pollen.app.registry import build_strategy
from pollen.clientside.compression_mod import compression_mod
from pollen.clientside.lazy_mod import lazy_mod
from pollen.compression import decode_payload
from pollen.strategies import FedAdaVR, FedAMS, FedCAMS, FedLAMB, FedLazy, FedOpt, HAFed, Uplink
from pollen.strategies.engine.parts import ClientSampler, EngineParts
from pollen.testing.fakes import (
    FakeGrid,
    capture_flwr_logs,
    full_model_reply,
    global_arrays_of,
    make_context,
    messages_text,
    model_record,
    named_arrays,
    split_trainable,
    tiny_model,
)
from pollen.wire import protocol
from pollen.wire.records import records_to_payload
from tests.flower.test_strategy_lazy import events
from tests.flower.test_strategy_lazy import run as run_lazy

pytestmark = pytest.mark.flower_compat

NODES = [1, 2, 3, 4, 5]
ATTACKER = 5
ONE_ROUND = dict(fraction_train=1.0, min_train_nodes=5, min_available_nodes=5, fraction_evaluate=0.0)
TRAINABLE = ("conv.weight", "conv.bias", "bn.weight")


def parts(identify_clients: bool = False) -> EngineParts:
    """Fresh parts for each strategy (seed 3); ``identify_clients`` as the method's default."""
    return EngineParts(sampler=ClientSampler(seed=3, identify_clients=identify_clients))


def honest_delta(node: int) -> np.ndarray:
    base = np.linspace(-1, 1, 19, dtype=np.float32)
    return (base + 0.1 * np.random.default_rng(node).standard_normal(19)).astype(np.float32)


def local_model(msg):  # noqa: ANN001, ANN201
    """The node's trained model: its honest delta, or (the attacker) that delta scaled by -3."""
    node = msg.metadata.dst_node_id
    delta = honest_delta(node) * np.float32(-3.0 if node == ATTACKER else 1.0)
    start = global_arrays_of(msg)
    local = dict(start)
    for name, part in split_trainable(delta, start).items():
        local[name] = (start[name] + part).astype(np.float32)
    return local


def dense_client(msg):  # noqa: ANN001, ANN201
    return full_model_reply(msg, local_model(msg), num_examples=10)


def sign_client(contexts):  # noqa: ANN001, ANN201
    def client(msg):  # noqa: ANN001, ANN202
        return compression_mod(msg, contexts[msg.metadata.dst_node_id], lambda m, c: dense_client(m))

    return client


def flat(arrays) -> np.ndarray:  # noqa: ANN001
    return np.concatenate([np.asarray(arrays[n], dtype=np.float32).ravel() for n in TRAINABLE])


def one_round(strategy, client, reverse: bool = False):  # noqa: ANN001, ANN201
    """Round 1 on the fake grid; returns (x0, x1, replies); ``reverse`` hands the replies over backwards."""
    grid = FakeGrid(NODES, client)
    arrays = model_record(tiny_model(4))
    messages = strategy.configure_train(1, arrays, ConfigRecord(), grid)
    replies = list(grid.send_and_receive(messages, timeout=5.0))
    replies.sort(key=lambda r: r.metadata.src_node_id, reverse=reverse)
    new, _ = strategy.aggregate_train(1, replies)
    assert new is not None, strategy.accounting.rounds[1].failure_reasons
    return flat(named_arrays(arrays)), flat(named_arrays(new)), replies


def server_deltas(x0: np.ndarray, replies) -> list[np.ndarray]:  # noqa: ANN001
    """What the server decodes from full-model replies: ``x_local - x_global`` in float32."""
    return [flat(named_arrays(r.content.array_records[protocol.ARRAYS_RECORD])) - x0 for r in replies]


@pytest.mark.parametrize(
    ("name", "reference"),
    [("median", Median()), ("trimmed-mean", TrimmedMean(0.2)), ("mean", Mean())],
)
def test_a_round_moves_the_model_by_the_aggregate_of_the_decoded_deltas(name, reference) -> None:  # noqa: ANN001
    aggregator = reference if name == "trimmed-mean" else name
    strategy = FedOpt(optimizer="sgd", eta=1.0, aggregator=aggregator, parts=parts(), **ONE_ROUND)
    x0, x1, replies = one_round(strategy, dense_client)
    deltas = server_deltas(x0, replies)
    np.testing.assert_allclose(x1 - x0, reference.combine(deltas), rtol=0, atol=2e-6)
    honest = Mean().combine(deltas[:-1])
    error = np.linalg.norm((x1 - x0) - honest) / np.linalg.norm(honest)
    if name == "mean":
        assert error > 0.5  # one client in five, scaled by -3, drags the mean most of the way back
    else:
        assert error < 0.15


@pytest.mark.parametrize("aggregator", ["median", "trimmed-mean"])
def test_the_robust_round_is_bit_identical_whatever_the_order_of_the_replies(aggregator: str) -> None:
    results = [
        one_round(
            FedOpt(optimizer="adam", eta=0.1, aggregator=aggregator, parts=parts(), **ONE_ROUND), dense_client, reverse
        )[1]
        for reverse in (False, True)
    ]
    assert results[0].tobytes() == results[1].tobytes()


@pytest.mark.parametrize("granularity", ["model", "tensor"])
def test_majority_vote_of_scaled_sign_uploads(granularity: str) -> None:
    contexts = {n: make_context(n) for n in NODES}
    uplink = Uplink("sign", error_feedback=False, granularity=granularity)
    strategy = FedOpt(optimizer="sgd", eta=1.0, uplink=uplink, aggregator="majority-vote", parts=parts(), **ONE_ROUND)
    x0, x1, replies = one_round(strategy, sign_client(contexts))
    segments = strategy.layout.segments
    decoded = [
        decode_payload(
            records_to_payload(
                r.content.array_records[protocol.UPDATE_RECORD], r.content.config_records[protocol.UPDATE_META_RECORD]
            ),
            19,
            segments,
        )
        for r in replies
    ]
    expected = MajorityVote().combine(decoded, segments)
    np.testing.assert_allclose(x1 - x0, expected, rtol=0, atol=1e-6)
    assert np.sign(x1 - x0).tolist() == np.sign(expected).tolist()


def test_fed_sgd_takes_the_median_of_the_models() -> None:
    strategy = FedLAMB(variant="fed-sgd", aggregator="median", parts=parts(identify_clients=True), **ONE_ROUND)
    x0, x1, replies = one_round(strategy, dense_client)
    models = [flat(named_arrays(r.content.array_records[protocol.ARRAYS_RECORD])) for r in replies]
    np.testing.assert_allclose(x1, Median().combine(models), rtol=0, atol=2e-6)  # x <- median_i x_i


def test_fedadavr_without_a_table_takes_the_robust_aggregate() -> None:
    strategy = FedAdaVR(
        variant="novr",
        server_optimizer="sgd",
        eta=1.0,
        aggregator="median",
        parts=parts(identify_clients=True),
        **ONE_ROUND,
    )
    x0, x1, replies = one_round(strategy, dense_client)
    np.testing.assert_allclose(x1 - x0, Median().combine(server_deltas(x0, replies)), rtol=0, atol=2e-6)


def test_the_lazy_family_aggregates_its_resolved_vectors_robustly() -> None:
    strategy = FedLazy(
        up_rule="nla", up_tau=0.6, eta=0.1, eps=1e-3, fraction_train=0.5, fraction_evaluate=0.0,
        parts=EngineParts(sampler=ClientSampler(seed=5, identify_clients=True)), aggregator="median",
    )  # fmt: skip
    seen = []
    aggregate = strategy.aggregate_deltas

    def spy(server_round, updates):  # noqa: ANN001, ANN202
        out = aggregate(server_round, updates)
        seen.append(([u.delta.copy() for u in updates], out.copy()))
        return out

    strategy.aggregate_deltas = spy
    run_lazy(strategy, lazy_mod, rounds=6)
    assert events(strategy).get("up-skip", 0) > 0  # some vectors were the server's stored copies
    assert len(seen) == 6
    for deltas, out in seen:
        assert out.tobytes() == Median().combine(deltas).tobytes()
    assert any(not np.array_equal(out, Mean().combine(deltas)) for deltas, out in seen)


def test_summary_shows_the_aggregator() -> None:
    with capture_flwr_logs() as records:
        FedAMS(aggregator=TrimmedMean(0.25)).summary()
    assert "aggregator: coordinate-wise trimmed mean (beta=0.25" in messages_text(records)


def test_methods_it_does_not_fit_refuse_with_a_reason() -> None:
    with pytest.raises(ValueError, match="HAFed cannot use aggregator='median': its round aggregate is the uploaders'"):
        HAFed(aggregator="median")
    with pytest.raises(ValueError, match="FedAdaVR cannot use aggregator='trimmed-mean': variant 'fedadavr' aggr"):
        FedAdaVR(aggregator="trimmed-mean")
    with pytest.raises(ValueError, match="aggregator='median' gives every client one vote.*aggregation='weighted'"):
        FedAMS(aggregator="median", aggregation="weighted")
    with pytest.raises(ValueError, match="FedAMS: aggregator='majority-vote' needs scaled-sign uploads .*'none'"):
        FedAMS(aggregator="majority-vote")
    with pytest.raises(ValueError, match="needs scaled-sign uploads .* this strategy's uploads are 'topk'"):
        FedCAMS(compressor="topk", aggregator="majority-vote")
    with pytest.raises(ValueError, match="uploads are 'sign added to the stored copy \\(aa\\)'"):
        FedLazy(up_rule="aa", compressor="sign", aggregator="majority-vote")
    lazy = FedLazy(up_rule="nla", compressor="sign", error_feedback=False, aggregator="majority-vote")
    assert lazy.aggregator == MajorityVote()
    assert FedCAMS(aggregator="majority-vote", error_feedback=False).aggregator == MajorityVote()
    with pytest.raises(ValueError, match="aggregator='krum' is unknown"):
        FedAMS(aggregator="krum")


@pytest.mark.parametrize("aggregator", ["median", "trimmed-mean", "majority-vote"])
def test_error_fed_uploads_are_refused_with_a_robust_aggregator_and_fit_without_error_feedback(aggregator: str) -> None:
    """A robust aggregate has no per-client share, so the ledger could not tell an error-fed client what of its
    upload was applied (issue 43): refused at construction, one line naming the aggregator, the uploads and
    what is allowed; the same aggregator without error feedback, or with dense uploads, fits."""
    reason = {"median": "no per-client share", "trimmed-mean": "differs per coordinate", "majority-vote": "Bernstein"}
    allowed = "allowed: error_feedback=False (run-config 'error-feedback' = false) with it, or aggregator='mean'"
    with pytest.raises(ValueError, match=f"^FedCAMS: aggregator='{aggregator}' cannot take error-fed 'sign' uploads"):
        FedCAMS(aggregator=aggregator)
    codec = "sign" if aggregator == "majority-vote" else "topk"
    for build in (
        lambda: FedCAMS(compressor=codec, aggregator=aggregator),
        lambda: FedOpt(uplink=Uplink(codec), aggregator=aggregator),
        lambda: FedAdaVR(variant="novr", uplink=Uplink(codec), aggregator=aggregator),
        lambda: FedLAMB(variant="fed-sgd", uplink=Uplink(codec), aggregator=aggregator),
        lambda: FedLazy(up_rule="nla", compressor=codec, aggregator=aggregator),
    ):
        with pytest.raises(ValueError) as refusal:
            build()
        line = str(refusal.value)
        assert "\n" not in line and reason[aggregator] in line and line.endswith(allowed), line
        assert f"aggregator={aggregator!r} cannot take error-fed {codec!r} uploads" in line, line
    assert FedCAMS(compressor=codec, error_feedback=False, aggregator=aggregator).ledger.tell is False
    assert FedOpt(uplink=Uplink(codec, error_feedback=False), aggregator=aggregator).aggregator.name == aggregator
    if aggregator != "majority-vote":  # dense uploads have no residual, so nothing to tell
        assert FedCAMS(compressor="none", aggregator=aggregator).ledger.tell is False


def test_a_ledger_told_to_tell_refuses_a_robust_aggregator_and_the_trimmed_mean_without_trim_fits() -> None:
    from pollen.strategies.engine.ledger import AppliedLedger

    with pytest.raises(ValueError, match=r"^FedOpt: aggregator='median' cannot take a ledger set to tell clients "):
        FedOpt(aggregator="median", parts=EngineParts(ledger=AppliedLedger(tell=True)))
    assert FedOpt(aggregator="median", parts=EngineParts(ledger=AppliedLedger(tell=False))).ledger.tell is False
    strategy = FedCAMS(aggregator=TrimmedMean(0.0))  # beta 0 is the mean: each upload applied in full
    assert strategy.ledger.tell is True
    assert Mean().feedback_refusal() is None and TrimmedMean(0.0).feedback_refusal() is None
    assert all(a.feedback_refusal() for a in (Median(), TrimmedMean(0.1), MajorityVote()))


def test_the_run_config_refuses_error_fed_uploads_with_a_robust_aggregator_in_one_line() -> None:
    def build(**keys):  # noqa: ANN003, ANN202
        return build_strategy(AppConfig.from_run_config({**schema_defaults(), **keys}, given=set(keys)))

    for strategy in ("fedcams", "fedopt", "fednlaca", "fedbaca", "fedadavr-novr"):
        with pytest.raises(ValueError, match=r"cannot take error-fed 'topk' .*run-config 'error-feedback' = false"):
            build(strategy=strategy, compressor="topk", aggregator="median")
        fits = build(strategy=strategy, compressor="topk", aggregator="median", **{"error-feedback": False})
        assert fits.aggregator == Median()
    with pytest.raises(ValueError, match="^FedCAMS: aggregator='majority-vote' cannot take error-fed 'sign' uploads"):
        build(strategy="fedcams", aggregator="majority-vote")


def test_the_run_config_builds_the_aggregator_and_refuses_it_for_flowers_strategies() -> None:
    def build(**keys):  # noqa: ANN003, ANN202
        return build_strategy(AppConfig.from_run_config({**schema_defaults(), **keys}, given=set(keys)))

    signs = build(strategy="fedcams", aggregator="majority-vote", **{"error-feedback": False})
    assert signs.aggregator == MajorityVote()
    assert build(strategy="fedams", aggregator="trimmed-mean", **{"trim-fraction": 0.3}).aggregator == TrimmedMean(0.3)
    assert build(strategy="fednlaa", aggregator="median").aggregator == Median()
    assert build(strategy="fedadavr-novr", aggregator="median").aggregator == Median()
    assert build(strategy="fed-lamb", aggregator="median").aggregator == Median()
    with pytest.raises(ValueError, match="'aggregator' = 'median' does not fit Flower's own FedAdam: .*allowed: mean"):
        build(strategy="fedadam", aggregator="median")
    with pytest.raises(ValueError, match="HAFed cannot use aggregator='median'"):
        build(strategy="hafed", aggregator="median")
    with pytest.raises(ValueError, match=r"'trim-fraction' = 0.5 is out of range; allowed: a number in \[0, 0.5\)"):
        build(strategy="fedams", aggregator="trimmed-mean", **{"trim-fraction": 0.5})
