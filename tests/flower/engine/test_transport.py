"""The contract of :class:`~pollen.strategies.engine.messages.Transport`: the messages a strategy sends.

``train_messages(round, nodes, content_for)`` builds one ``train`` message per node with that node's
content, ``evaluate_messages(round, nodes, content)`` one ``evaluate`` message per node; both record the
nodes in the :class:`~pollen.strategies.engine.collector.ReplyCollector` as asked (every message of a phase
carries that phase's group id, so a reply is bound to it) and count the bytes of every record sent in the
round's :class:`~pollen.strategies.engine.accounting.RoundStats` (per message; a record shared by several
messages is measured once). ``exchange`` sends a mid-round phase (type ``train.pollen_phase``, the phase, its
index in the round and the round in the config record, bytes under ``<phase>/<record>``) through the grid
and returns the replies of asked nodes only. ``forget(round)`` ends a round: the next round's phases count
from 1 again. In population mode each message names the partition its node plays, in a config record of
its own.
"""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message, MessageType, RecordDict

from pollen.strategies.engine.accounting import Accounting
from pollen.strategies.engine.collector import ReplyCollector
from pollen.strategies.engine.messages import Transport
from pollen.strategies.engine.sampling import ClientSampler
from pollen.testing.fakes import FakeGrid, model_record, reply
from pollen.wire import protocol

pytestmark = pytest.mark.flower_compat


def parts(partition_of=None) -> tuple[Transport, ReplyCollector, Accounting]:  # noqa: ANN001
    accounting = Accounting()
    collector = ReplyCollector(ClientSampler(seed=0), lambda: accounting)
    return Transport(collector, lambda: accounting, protocol.CONFIG_RECORD, partition_of), collector, accounting


def shared_content() -> RecordDict:
    model = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.zeros(2, dtype=np.float32)}
    return RecordDict({protocol.ARRAYS_RECORD: model_record(model), protocol.CONFIG_RECORD: ConfigRecord({"lr": 0.5})})


def echo(msg: Message) -> Message:
    return reply(msg, {"answer": ConfigRecord({"from": msg.metadata.dst_node_id})})


# ---------------------------------------------------------------------------- train
def test_train_messages_are_one_train_message_per_node_with_that_nodes_content() -> None:
    transport, collector, _ = parts()
    contents = {5: shared_content(), 7: shared_content()}
    messages = transport.train_messages(3, [5, 7], contents.__getitem__)
    assert [m.metadata.dst_node_id for m in messages] == [5, 7]
    assert all(m.metadata.message_type == MessageType.TRAIN for m in messages)
    assert [m.content for m in messages] == [contents[5], contents[7]]
    assert collector.asked(3) == [5, 7]


def test_a_phase_has_one_group_id_and_every_round_and_phase_its_own() -> None:
    transport, _, _ = parts()
    content = shared_content()
    train3 = transport.train_messages(3, [5, 7], lambda node: content)
    eval3 = transport.evaluate_messages(3, [5, 7], content)
    train4 = transport.train_messages(4, [5, 7], lambda node: content)
    groups = [{m.metadata.group_id for m in batch} for batch in (train3, eval3, train4)]
    assert all(len(group) == 1 and "" not in group for group in groups)
    assert len(set.union(*groups)) == 3


def test_train_bytes_are_counted_per_message_and_by_record() -> None:
    transport, _, accounting = parts()
    content = shared_content()
    model_bytes = content[protocol.ARRAYS_RECORD].count_bytes()
    config_bytes = content[protocol.CONFIG_RECORD].count_bytes()
    transport.train_messages(3, [5, 7, 9], lambda node: content)
    stats = accounting.round(3)
    assert stats.messages_sent == 3
    assert stats.downlink_records == {protocol.ARRAYS_RECORD: 3 * model_bytes, protocol.CONFIG_RECORD: 3 * config_bytes}
    assert stats.downlink_bytes == 3 * (model_bytes + config_bytes)
    assert stats.eval_downlink_bytes == 0
    assert accounting.round(4).downlink_bytes == 0  # another round's book


# ---------------------------------------------------------------------------- evaluate
def test_evaluate_messages_are_evaluate_messages_counted_apart_from_training() -> None:
    transport, collector, accounting = parts()
    content = shared_content()
    messages = transport.evaluate_messages(2, [4, 8], content)
    assert [m.metadata.message_type for m in messages] == [MessageType.EVALUATE] * 2
    assert [m.metadata.dst_node_id for m in messages] == [4, 8]
    assert all(m.content is content for m in messages)
    assert collector.asked(2, "evaluate") == [4, 8] and collector.asked(2) == []
    stats = accounting.round(2)
    assert stats.eval_downlink_bytes == 2 * sum(record.count_bytes() for record in content.values())
    assert stats.downlink_bytes == 0 and stats.messages_sent == 0


# ---------------------------------------------------------------------------- population mode
def test_in_population_mode_each_message_names_the_partition_its_node_plays() -> None:
    transport, _, _ = parts(partition_of={5: 12, 7: 3}.get)
    content = shared_content()
    messages = transport.train_messages(1, [5, 7], lambda node: content)
    assert [m.content[protocol.CONFIG_RECORD][protocol.CFG_PARTITION] for m in messages] == [12, 3]
    for message in messages:  # the model is shared, the config record is the node's own
        assert message.content[protocol.ARRAYS_RECORD] is content[protocol.ARRAYS_RECORD]
        assert message.content[protocol.CONFIG_RECORD]["lr"] == 0.5
    assert protocol.CFG_PARTITION not in content[protocol.CONFIG_RECORD]  # the caller's content is not written
    evaluated = transport.evaluate_messages(1, [7], content)
    assert evaluated[0].content[protocol.CONFIG_RECORD][protocol.CFG_PARTITION] == 3


# ---------------------------------------------------------------------------- exchange
def test_exchange_sends_a_phase_message_with_phase_index_and_round_and_returns_the_replies() -> None:
    transport, collector, _ = parts()
    grid = FakeGrid([5, 7, 9], echo)
    contents = {5: RecordDict({protocol.CONFIG_RECORD: ConfigRecord({"k": 1})}), 7: RecordDict()}
    replies = transport.exchange(3, grid, contents, phase="relay", timeout=2.5)
    assert grid.timeouts == [2.5]
    sent = grid.calls[0]
    assert [m.metadata.message_type for m in sent] == [protocol.PHASE_MESSAGE_TYPE] * 2
    assert [m.metadata.dst_node_id for m in sent] == [5, 7]
    configs = [dict(m.content[protocol.CONFIG_RECORD]) for m in sent]
    phase = {protocol.CFG_PHASE: "relay", protocol.CFG_PHASE_INDEX: 1, protocol.CFG_SERVER_ROUND: 3}
    assert configs == [{"k": 1, **phase}, phase]
    assert dict(contents[5][protocol.CONFIG_RECORD]) == {"k": 1}  # the caller's content is not written
    assert sorted(r.metadata.src_node_id for r in replies) == [5, 7]
    assert collector.asked(3, "relay") == [5, 7]


def test_each_exchange_of_a_round_has_the_next_index_and_forget_starts_again() -> None:
    transport, _, _ = parts()
    grid = FakeGrid([5], echo)

    def index() -> int:
        return grid.sent[-1].content[protocol.CONFIG_RECORD][protocol.CFG_PHASE_INDEX]

    transport.exchange(3, grid, {5: RecordDict()}, phase="a", timeout=1.0)
    transport.exchange(3, grid, {5: RecordDict()}, phase="b", timeout=1.0)
    assert index() == 2
    transport.exchange(4, grid, {5: RecordDict()}, phase="a", timeout=1.0)
    assert index() == 1  # another round counts on its own
    transport.forget(3)
    transport.exchange(3, grid, {5: RecordDict()}, phase="a", timeout=1.0)
    assert index() == 1


def test_exchange_bytes_are_counted_under_the_phase_name() -> None:
    transport, _, accounting = parts()
    content = shared_content()
    transport.exchange(3, FakeGrid([5, 7], echo), {5: content, 7: content}, phase="relay", timeout=1.0)
    stats = accounting.round(3)
    model_bytes = content[protocol.ARRAYS_RECORD].count_bytes()
    assert stats.downlink_records[f"relay/{protocol.ARRAYS_RECORD}"] == 2 * model_bytes
    assert set(stats.downlink_records) == {f"relay/{protocol.ARRAYS_RECORD}", f"relay/{protocol.CONFIG_RECORD}"}
    assert stats.exchange_messages == 2 and stats.messages_sent == 2
    assert stats.downlink_bytes == sum(stats.downlink_records.values())


def test_exchange_keeps_only_replies_from_asked_nodes_once_each() -> None:
    transport, _, accounting = parts()
    stranger = Message(RecordDict(), dst_node_id=9, message_type=MessageType.TRAIN)

    class NoisyGrid(FakeGrid):
        """Hands back node 5's reply twice (both refused) and a reply from node 9, which was not asked."""

        def send_and_receive(self, messages, *, timeout=None):  # noqa: ANN001, ANN202
            replies = list(super().send_and_receive(messages, timeout=timeout))
            return [*replies, replies[0], echo(stranger)]

    grid = NoisyGrid([5, 7, 9], echo)
    replies = transport.exchange(3, grid, {5: RecordDict(), 7: RecordDict()}, phase="relay", timeout=1.0)
    assert sorted(r.metadata.src_node_id for r in replies) == [7]
    reasons = accounting.round(3).failure_reasons
    assert sorted(reasons) == [
        "node-5: two answers to one message in relay of round 3: both refused",
        "node-5: two answers to one message in relay of round 3: both refused",
        "node-9: reply from a node not asked in relay of round 3",
    ]


def test_an_exchange_with_no_one_to_ask_sends_nothing() -> None:
    transport, _, accounting = parts()
    grid = FakeGrid([5], echo)
    assert transport.exchange(3, grid, {}, phase="relay", timeout=1.0) == []
    assert grid.calls == [] and accounting.round(3).messages_sent == 0


def test_exchange_in_population_mode_names_the_partition() -> None:
    transport, _, _ = parts(partition_of={5: 12}.get)
    grid = FakeGrid([5], echo)
    transport.exchange(3, grid, {5: RecordDict()}, phase="relay", timeout=1.0)
    assert grid.sent[0].content[protocol.CONFIG_RECORD][protocol.CFG_PARTITION] == 12
