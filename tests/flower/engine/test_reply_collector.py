"""The contract of :class:`~pollen.strategies.engine.collector.ReplyCollector` and the :class:`ReplySpec` it reads by.

The collector keeps the book of whom each phase of a round asked (``ask``, which gives the phase's group id)
and is the one reader of replies: ``read`` keeps one reply per asked node, in a fixed order (by client id),
reads each once against the method's :class:`~pollen.strategies.engine.replies.ReplySpec` and returns the
validated :class:`ClientUpdate` s. Everything else is a failure of the round with a reason naming the client:
a second reply, a reply from a node not asked, a reply to an earlier round's message, a reply that cannot be
trusted (wrong shape, NaN, a missing weight, a client error), an asked node that never answered. A train
reply refused for its content is listed in ``refused(round)`` (its client is told to drop that upload). The
bytes of every reply read are counted by record, a mid-round phase under ``<phase>/<record>``. ``ReplySpec``
refuses a setting it does not know, naming what is allowed.
"""

from __future__ import annotations

import re
from collections import OrderedDict

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message, MessageType, MetricRecord, RecordDict

from pollen.core.layout import ModelLayout
from pollen.strategies.engine.accounting import Accounting
from pollen.strategies.engine.collector import EVALUATE_PHASE, TRAIN_PHASE, ReplyCollector
from pollen.strategies.engine.replies import Extra, ReplyRejected, ReplySpec
from pollen.strategies.engine.sampling import ClientSampler
from pollen.testing.fakes import FakeGrid, error_reply, full_model_reply, model_record, reply
from pollen.wire import protocol
from pollen.wire.records import arrays_to_record

pytestmark = pytest.mark.flower_compat


def model(shift: float = 0.0) -> OrderedDict[str, np.ndarray]:
    """The global model (``shift`` = 0) or a client's, every trainable value moved by ``shift`` (exact)."""
    return OrderedDict(
        [
            ("w", np.array([[0.5, 1.0], [-2.0, 4.0]], dtype=np.float32) + np.float32(shift)),
            ("b", np.array([0.25, -0.75], dtype=np.float32) + np.float32(shift)),
            ("bn.running_mean", np.array([1.0, 2.0], dtype=np.float32) * np.float32(1.0 + shift)),
        ]
    )


LAYOUT = ModelLayout.from_arrays(model())
PARAMS = LAYOUT.flatten(model())


class Round:
    """A collector with its sampler and accounting, and the train messages of one round sent to ``nodes``."""

    def __init__(
        self, server_round: int = 1, nodes: tuple[int, ...] = (11, 12, 13), sampler: ClientSampler | None = None
    ):
        self.accounting = Accounting()
        self.sampler = sampler or ClientSampler(seed=0)
        self.collector = ReplyCollector(self.sampler, lambda: self.accounting)
        self.round = server_round
        self.messages = self.send(server_round, nodes)

    def send(self, server_round: int, nodes, phase: str = TRAIN_PHASE) -> dict[int, Message]:  # noqa: ANN001
        group = self.collector.ask(server_round, phase, nodes)
        messages = {
            node: Message(RecordDict(), dst_node_id=node, message_type=MessageType.TRAIN, group_id=group)
            for node in nodes
        }
        for message in messages.values():
            FakeGrid._stamp(message)  # a message id, as the SuperLink gives on push
        self.collector.note_sent(server_round, phase, messages.values())
        return messages

    def read(self, replies, phase: str = TRAIN_PHASE, spec: ReplySpec | None = None, **kwargs):  # noqa: ANN001, ANN003, ANN201
        settings = {"weighted_by_key": protocol.NUM_EXAMPLES, "weight_required": False, "max_abs": 1e6, **kwargs}
        return self.collector.read(
            self.round,
            replies,
            phase=phase,
            spec=spec or ReplySpec(),
            layout=LAYOUT,
            params=PARAMS,
            arrayrecord_key=protocol.ARRAYS_RECORD,
            **settings,
        )

    @property
    def stats(self):  # noqa: ANN201
        return self.accounting.round(self.round)


def reply_bytes(message: Message) -> int:
    """The bytes of a reply's records, as Flower counts them."""
    return sum(record.count_bytes() for record in message.content.values())


def trained(msg: Message, shift: float = 1.0, examples: int = 10) -> Message:
    return full_model_reply(msg, model(shift), num_examples=examples)


# ---------------------------------------------------------------------------- one reply per asked node
def test_every_asked_node_that_answers_gives_one_validated_update() -> None:
    book = Round()
    updates = book.read([trained(book.messages[node], shift=node, examples=5 * node) for node in (11, 12, 13)])
    assert [u.node_id for u in updates] == [11, 12, 13]
    assert [u.client_key for u in updates] == ["node-11", "node-12", "node-13"]
    for node, update in zip((11, 12, 13), updates):
        np.testing.assert_array_equal(update.delta, np.full(6, float(node), np.float32))  # x_local - x_global
        np.testing.assert_array_equal(update.buffers["bn.running_mean"], [1.0 + node, 2.0 + 2 * node])
        assert update.num_examples == 5.0 * node
        assert update.norm == pytest.approx(node * np.sqrt(6))
    assert book.stats.failures == 0 and book.collector.refused(1) == []


def test_replies_come_back_in_client_id_order_whatever_order_they_arrived_in() -> None:
    sampler = ClientSampler(seed=0, identify_clients=True)
    sampler.identify(FakeGrid([11, 12, 13], lambda m: None, client_ids={11: "c", 12: "a", 13: "b"}), [11, 12, 13])
    book = Round(sampler=sampler)
    updates = book.read([trained(book.messages[node]) for node in (11, 13, 12)])
    assert [u.client_key for u in updates] == ["a", "b", "c"]


def test_the_bytes_of_every_reply_read_are_counted_by_record() -> None:
    book = Round(nodes=(11, 12))
    replies = [trained(book.messages[11]), trained(book.messages[12])]
    model_bytes = replies[0].content[protocol.ARRAYS_RECORD].count_bytes()
    metric_bytes = replies[0].content[protocol.METRICS_RECORD].count_bytes()
    book.read(replies)
    assert book.stats.uplink_records == {
        protocol.ARRAYS_RECORD: 2 * model_bytes,
        protocol.METRICS_RECORD: 2 * metric_bytes,
    }
    assert book.stats.uplink_bytes == 2 * (model_bytes + metric_bytes)


# ---------------------------------------------------------------------------- refused replies
def test_two_answers_from_a_node_to_one_message_are_both_refused() -> None:
    """Which of the two is the node's own is not the server's to guess; arrival order must not decide (issue 43)."""
    book = Round(nodes=(11, 12))
    first, second = trained(book.messages[11], shift=1.0), trained(book.messages[11], shift=2.0)
    for order in ([first, second], [second, first]):
        updates = book.read([trained(book.messages[12]), *order])
        assert [u.node_id for u in updates] == [12]
    assert book.stats.failures == 4
    assert set(book.stats.failure_reasons) == {"node-11: two answers to one message in train of round 1: both refused"}


def test_a_reply_from_a_node_not_asked_is_refused() -> None:
    book = Round(nodes=(11,))
    stranger = Message(RecordDict(), dst_node_id=9, message_type=MessageType.TRAIN)
    updates = book.read([trained(book.messages[11]), trained(stranger)])
    assert [u.node_id for u in updates] == [11]
    assert book.stats.failure_reasons == ["node-9: reply from a node not asked in train of round 1"]


def test_a_reply_to_an_earlier_rounds_message_is_refused() -> None:
    book = Round(server_round=2, nodes=(11, 12))
    earlier = book.send(1, (11,))  # what node 1 was sent in round 1: its answer comes in round 2
    updates = book.read([trained(earlier[11]), trained(book.messages[12])])
    assert [u.node_id for u in updates] == [12]
    late, silent = book.stats.failure_reasons
    assert re.fullmatch(
        r"node-11: reply to another message \(group '(.+)', this one is '(.+)'\): an earlier round's or phase's answer",
        late,
    )
    assert silent == "node-11: no reply before the timeout (train)"  # round 2's message got no answer


def test_once_a_round_is_forgotten_a_late_reply_is_a_node_not_asked() -> None:
    book = Round(nodes=(11,))
    book.collector.forget(1)
    assert book.read([trained(book.messages[11])]) == []
    assert book.stats.failure_reasons == ["node-11: reply from a node not asked in train of round 1"]


def test_an_asked_node_that_never_answers_is_a_failure() -> None:
    book = Round(nodes=(11, 12, 13))
    book.read([trained(book.messages[12])])
    assert book.stats.failures == 2
    assert book.stats.failure_reasons == [
        "node-11: no reply before the timeout (train)",
        "node-13: no reply before the timeout (train)",
    ]
    assert book.collector.refused(1) == []  # silence is not a refusal of content


def test_the_superlinks_reply_for_an_undelivered_message_is_that_nodes_one_failure() -> None:
    linkstate = pytest.importorskip("flwr.server.superlink.linkstate.utils")  # Flower's own reply for it
    book = Round(nodes=(11, 12))
    undelivered = linkstate.create_message_error_unavailable_res_message(book.messages[12].metadata, "node_unavail")
    assert undelivered.metadata.src_node_id != 12  # it comes from the SuperLink, pointing to the message by id
    assert [u.node_id for u in book.read([trained(book.messages[11]), undelivered])] == [11]
    assert book.stats.failure_reasons == [
        f"node-12: train message not delivered: {linkstate.NODE_UNAVAILABLE_ERROR_REASON}"
    ]  # once: not also "a node not asked" nor "no reply before the timeout"


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (
            lambda msg: full_model_reply(msg, {**model(1.0), "b": np.zeros(3, np.float32)}),
            r"array 'b' has shape \(3,\), the model has \(2,\)",
        ),
        (
            lambda msg: full_model_reply(msg, {**model(1.0), "w": np.full((2, 2), np.nan, np.float32)}),
            "update contains NaN or Inf",
        ),
        (lambda msg: full_model_reply(msg, model(1.0), num_examples=-3), r"'num-examples' must be a positive number"),
        (
            lambda msg: reply(msg, {protocol.METRICS_RECORD: MetricRecord({"num-examples": 1})}),
            "reply carries neither 'arrays' nor 'pollen.update' arrays",
        ),
        (lambda msg: full_model_reply(msg, model(2e6)), r"has a coordinate of magnitude .* \(hard limit\)"),
    ],
    ids=["wrong-shape", "nan", "negative-weight", "no-update", "beyond-hard-limit"],
)
def test_a_malformed_train_reply_is_refused_with_its_reason(make, reason: str) -> None:  # noqa: ANN001
    book = Round(nodes=(11, 12))
    bad, good = make(book.messages[11]), trained(book.messages[12])
    updates = book.read([bad, good])
    assert [u.node_id for u in updates] == [12]
    assert book.stats.failures == 1
    (failure,) = book.stats.failure_reasons
    assert failure.startswith("node-11: ")
    assert re.search(reason, failure), failure
    assert book.collector.refused(1) == ["node-11"]  # refused for its content: the client drops that upload
    assert book.stats.uplink_bytes == reply_bytes(bad) + reply_bytes(good)  # counted before it was judged


def test_a_client_error_is_refused_with_the_clients_reason() -> None:
    book = Round(nodes=(11,))
    assert book.read([error_reply(book.messages[11], "ValueError: out of memory")]) == []
    (failure,) = book.stats.failure_reasons
    assert failure.startswith("node-11: client error:") and "out of memory" in failure


def test_a_weight_is_required_only_when_asked_for() -> None:
    unweighted = Round(nodes=(11,))
    message = unweighted.messages[11]
    no_weight = reply(message, {protocol.ARRAYS_RECORD: model_record(model(1.0))})
    assert unweighted.read([no_weight])[0].num_examples == 1.0
    required = Round(nodes=(11,))
    no_weight = reply(required.messages[11], {protocol.ARRAYS_RECORD: model_record(model(1.0))})
    assert required.read([no_weight], weight_required=True) == []
    assert required.stats.failure_reasons == ["node-11: metrics lack 'num-examples', needed for weighted aggregation"]


def test_a_sink_takes_each_update_as_it_is_read_and_may_refuse_it() -> None:
    book = Round(nodes=(11, 12))
    seen = []

    def sink(update) -> None:  # noqa: ANN001
        if update.node_id == 12:
            raise ReplyRejected("outlier: 10x the median")
        seen.append((update.node_id, update.delta.copy()))

    updates = book.read(
        [trained(book.messages[11]), trained(book.messages[12], shift=3.0)],
        sink=sink,
        scratch=np.empty(LAYOUT.dim, np.float32),
    )
    assert [node for node, _ in seen] == [11]
    np.testing.assert_array_equal(seen[0][1], np.ones(6, np.float32))
    assert [u.node_id for u in updates] == [11]
    assert book.stats.failure_reasons == ["node-12: outlier: 10x the median"]
    assert book.collector.refused(1) == ["node-12"]


# ---------------------------------------------------------------------------- phases
def test_a_mid_round_phase_is_read_with_its_bytes_under_the_phase_name_and_rejections_not_refusals() -> None:
    book = Round(nodes=(11, 12))
    relay = book.send(1, (11, 12), phase="relay")
    good = trained(relay[11])
    updates = book.read([good, error_reply(relay[12])], phase="relay")
    assert [u.node_id for u in updates] == [11]
    assert book.stats.uplink_records == {f"relay/{name}": record.count_bytes() for name, record in good.content.items()}
    assert book.stats.failure_reasons[0].startswith("node-12: client error:")
    assert book.collector.refused(1) == []  # only a train reply's content is refused to its client
    assert book.collector.phase_of(1) == "relay"  # the phase whose replies are aggregated


def test_evaluation_replies_are_read_for_their_metrics_and_weight() -> None:
    book = Round(nodes=(11,))
    asked = book.send(1, (11, 12, 13), phase=EVALUATE_PHASE)
    replies = [
        reply(asked[11], {protocol.METRICS_RECORD: MetricRecord({"accuracy": 0.5, "num-examples": 20})}),
        reply(asked[12], {protocol.METRICS_RECORD: MetricRecord({"accuracy": 0.5, "num-examples": -1})}),
        error_reply(asked[13]),
    ]
    usable = book.collector.evaluation_metrics(1, replies, protocol.NUM_EXAMPLES)
    assert [(metrics["accuracy"], weight) for _, metrics, weight in usable] == [(0.5, 20.0)]
    assert book.stats.failures == 0  # evaluation never fails a round
    assert book.stats.eval_uplink_bytes == reply_bytes(replies[0]) + reply_bytes(replies[1])
    assert book.collector.asked(1, EVALUATE_PHASE) == []  # the phase is over


def test_in_population_mode_a_reply_must_say_it_is_the_client_its_node_plays() -> None:
    sampler = ClientSampler(seed=0, population=4)
    nodes = sampler.sample(FakeGrid([11, 12], lambda m: None), 0.5, 1)
    book = Round(nodes=tuple(nodes), sampler=sampler)
    honest, other = nodes
    plays = sampler.key(honest)
    info = {protocol.CLIENT_INFO_RECORD: ConfigRecord({protocol.IDENTITY_CLIENT_ID: plays})}
    replies = [
        reply(book.messages[honest], {protocol.ARRAYS_RECORD: model_record(model(1.0)), **info}),
        reply(book.messages[other], {protocol.ARRAYS_RECORD: model_record(model(1.0)), **info}),  # claims the same
    ]
    updates = book.read(replies)
    assert [u.client_key for u in updates] == [plays]
    (failure,) = book.stats.failure_reasons
    assert f"answered as client {plays!r} but plays {sampler.key(other)} (population mode)" in failure


# ---------------------------------------------------------------------------- ReplySpec
@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"update": "sometimes"}, "update='sometimes' is unknown; allowed: required, optional"),
        ({"buffers": "max"}, "buffers='max' is unknown; allowed: norm, off"),
        ({"extras": (Extra("v"), Extra("v"))}, r"extras \['v', 'v'\] are not unique"),
    ],
)
def test_reply_spec_refuses_a_setting_it_does_not_know(settings: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ReplySpec(**settings)


def test_an_extra_refuses_a_screen_mode_it_does_not_know() -> None:
    with pytest.raises(ValueError, match="extra 'v': screen='max' is unknown; allowed: norm, off"):
        Extra("v", screen="max")


def test_a_spec_with_an_optional_update_reads_a_flag_only_reply() -> None:
    spec = ReplySpec(flags=("lazy-skip",), update="optional")
    book = Round(nodes=(11,))
    flag_only = reply(book.messages[11], {protocol.FLAGS_RECORD: ConfigRecord({"lazy-skip": True})})
    (update,) = book.read([flag_only], spec=spec)
    assert update.delta is None and update.flags == {"lazy-skip": True}


def test_a_spec_reads_its_extras_and_refuses_a_reply_without_a_required_one() -> None:
    spec = ReplySpec(extras=(Extra("v", nonnegative=True),))
    book = Round(nodes=(11, 12))
    v = arrays_to_record({protocol.EXTRA_ARRAY: np.arange(6, dtype=np.float32)})
    with_v = reply(book.messages[11], {protocol.ARRAYS_RECORD: model_record(model(1.0)), protocol.extra_record("v"): v})
    (update,) = book.read([with_v, trained(book.messages[12])], spec=spec)
    np.testing.assert_array_equal(update.extras["v"], np.arange(6, dtype=np.float32))
    assert book.stats.failure_reasons == ["node-12: reply lacks the extra record 'pollen.x.v'"]


def test_a_flag_the_spec_does_not_know_is_refused() -> None:
    book = Round(nodes=(11,))
    flagged = reply(
        book.messages[11],
        {protocol.ARRAYS_RECORD: model_record(model(1.0)), protocol.FLAGS_RECORD: ConfigRecord({"x": True})},
    )
    assert book.read([flagged], spec=ReplySpec(flags=("lazy-skip",))) == []
    assert book.stats.failure_reasons == ["node-11: unknown flags ['x']; this method knows ['lazy-skip']"]
