"""The downlink and mid-round transport: messages to nodes, each counted in bytes once.

:class:`Transport` builds a round's train messages from one shared ``RecordDict`` (or per-node
content), sends the further messages of a multi-phase round (:meth:`Transport.exchange`), records
whom it asked in the :class:`~pollen.strategies.engine.collector.ReplyCollector`, and counts the bytes of
every record it sends (a record shared by several messages is measured once). In population mode
(:mod:`pollen.strategies.engine.sampling`) every message also names the partition its node plays
(:data:`~pollen.wire.protocol.CFG_PARTITION`, in a config record of the message's own).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from pollen.strategies.engine.accounting import Accounting, RoundStats
from pollen.strategies.engine.collector import EVALUATE_PHASE, ReplyCollector
from pollen.wire import protocol


def count_sent(stats: RoundStats, messages: list[Message], prefix: str = "") -> None:
    """Count each message's records once per message sent (a shared record is measured once)."""
    measured: dict[int, int] = {}
    for message in messages:
        sizes = {}
        for name, record in message.content.items():
            if id(record) not in measured:
                measured[id(record)] = int(record.count_bytes())
            sizes[name] = measured[id(record)]
        stats.add_downlink(sizes, prefix)


class Transport:
    """Sends a strategy's messages and keeps the book of whom it asked.

    Parameters
    ----------
    replies : ReplyCollector
        Where each phase's asked nodes are recorded and its replies are filtered.
    accounting : Callable[[], Accounting]
        Returns the strategy's current accounting.
    configrecord_key : str
        Name of the config record in a message (Flower's default ``"config"``).
    partition_of : Callable[[int], int | None], optional
        The partition a node plays in population mode (``None``: the node is its own client).
    """

    def __init__(
        self,
        replies: ReplyCollector,
        accounting: Callable[[], Accounting],
        configrecord_key: str,
        partition_of: Callable[[int], int | None] | None = None,
    ) -> None:
        self.replies = replies
        self._accounting = accounting
        self.configrecord_key = configrecord_key
        self._partition_of = partition_of if partition_of is not None else (lambda node: None)
        self._phases_sent: dict[int, int] = {}

    def train_messages(
        self, server_round: int, nodes: list[int], content_for: Callable[[int], RecordDict]
    ) -> list[Message]:
        """One train message per node with ``content_for(node)``; asked nodes recorded, bytes counted."""
        group = self.replies.ask(server_round, "train", nodes)
        messages = [
            Message(
                content=self._played(node, content_for(node)), message_type="train", dst_node_id=node, group_id=group
            )
            for node in nodes
        ]
        self.replies.note_sent(server_round, "train", messages)
        count_sent(self._accounting().round(server_round), messages)
        return messages

    def job_messages(
        self, server_round: int, jobs: list[tuple[int, str]], content_for: Callable[[int], RecordDict]
    ) -> list[Message]:
        """One train message per ``(node, group id)`` job of an asynchronous run, each with ``content_for(node)``
        and its own group id (the driver binds each reply to its job); bytes counted under ``server_round``."""
        messages = [
            Message(
                content=self._played(node, content_for(node)), message_type="train", dst_node_id=node, group_id=group
            )
            for node, group in jobs
        ]
        count_sent(self._accounting().round(server_round), messages)
        return messages

    def evaluate_messages(self, server_round: int, nodes: list[int], content: RecordDict) -> list[Message]:
        """One evaluate message per node, all with ``content``; asked nodes recorded, bytes counted."""
        group = self.replies.ask(server_round, EVALUATE_PHASE, nodes)
        stats = self._accounting().round(server_round)
        messages = [
            Message(
                content=self._played(node, content), message_type=MessageType.EVALUATE, dst_node_id=node, group_id=group
            )
            for node in nodes
        ]
        measured: dict[int, int] = {}
        for message in messages:
            for record in message.content.values():
                if id(record) not in measured:
                    measured[id(record)] = int(record.count_bytes())
                stats.eval_downlink_bytes += measured[id(record)]
        self.replies.note_sent(server_round, EVALUATE_PHASE, messages)
        return messages

    def exchange(
        self,
        server_round: int,
        grid: Grid,
        contents: Mapping[int, RecordDict],
        *,
        phase: str,
        timeout: float,
        message_type: str = protocol.PHASE_MESSAGE_TYPE,
    ) -> list[Message]:
        """Send ``contents[node]`` to each node as a mid-round message of ``phase``; return the replies.

        The messages have type ``message_type`` (default ``train.pollen_phase``; a phase that any ClientApp's
        train function answers through a mod, as secure aggregation's, is sent as ``train``) and carry
        ``pollen.phase``, the phase's index and the round in their config record (added here when missing), so
        pollen's ClientApp can route them. Bytes both ways are counted under ``<phase>/<record>``; only one reply
        per asked node is kept (others are failures with a logged reason).
        """
        stats = self._accounting().round(server_round)
        phase_index = self._phases_sent[server_round] = self._phases_sent.get(server_round, 0) + 1
        group = self.replies.ask(server_round, phase, contents)
        messages = []
        for node, content in contents.items():
            content = RecordDict(dict(content.items()))
            config = ConfigRecord(dict(content.config_records.get(self.configrecord_key, ConfigRecord())))
            config[protocol.CFG_PHASE] = phase
            config[protocol.CFG_PHASE_INDEX] = phase_index
            config[protocol.CFG_SERVER_ROUND] = server_round
            if (partition := self._partition_of(node)) is not None:
                config[protocol.CFG_PARTITION] = partition
            content[self.configrecord_key] = config
            messages.append(Message(content=content, message_type=message_type, dst_node_id=node, group_id=group))
        self.replies.note_sent(server_round, phase, messages)
        count_sent(stats, messages, prefix=f"{phase}/")
        stats.exchange_messages += len(messages)
        replies = list(grid.send_and_receive(messages, timeout=timeout)) if messages else []
        return self.replies.from_asked(server_round, phase, replies)

    def _played(self, node: int, content: RecordDict) -> RecordDict:
        """``content`` naming the partition ``node`` plays (population mode); ``content`` itself otherwise.

        The copy shares every record but the config record, which is the node's own.
        """
        partition = self._partition_of(node)
        if partition is None:
            return content
        played = RecordDict(dict(content.items()))
        config = ConfigRecord(dict(content.config_records.get(self.configrecord_key, ConfigRecord())))
        config[protocol.CFG_PARTITION] = partition
        played[self.configrecord_key] = config
        return played

    def forget(self, server_round: int) -> None:
        """Drop the phase counter of ``server_round`` (the round is over)."""
        for done in [r for r in self._phases_sent if r <= server_round]:
            del self._phases_sent[done]


def with_config(content: RecordDict, configrecord_key: str, entries: Mapping[str, Any]) -> RecordDict:
    """A copy of ``content`` whose config record also holds ``entries`` (the other records shared, not copied);
    ``content`` itself is never changed."""
    out = RecordDict(dict(content.items()))
    config = ConfigRecord(dict(content.config_records.get(configrecord_key, ConfigRecord())))
    config.update(entries)
    out[configrecord_key] = config
    return out


def train_config(
    config: ConfigRecord, server_round: int, buffer_keys: Iterable[str], extra: Mapping[str, Any]
) -> ConfigRecord:
    """A round's train config: the ServerApp's ``config``, the round, the buffers' names (when the model has
    any: Flower cannot count the bytes of an empty string) and the method's ``extra`` entries."""
    config = ConfigRecord(dict(config))
    config[protocol.CFG_SERVER_ROUND] = server_round
    if keys := list(buffer_keys):
        config[protocol.CFG_BUFFER_KEYS] = protocol.join_keys(keys)
    for key, value in extra.items():
        config[key] = value
    return config
