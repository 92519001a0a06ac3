"""Reply collection: who was asked in each phase of a round, one reply each, rejections with reasons.

One :class:`ReplyCollector` serves every strategy, pollen's own and Flower's metered baselines, so
a guarantee about replies is written once:

- a reply counts only if its node was asked in that phase of that round, and only once (a
  duplicate, an unsampled node's or a previous round's reply is a failure with a reason; each
  phase's messages carry a group id that Flower copies into their replies, so an answer to an
  earlier message is known as such);
- every rejection is counted in the round's :class:`~pollen.strategies.engine.accounting.RoundStats` and
  logged with the client's stable id;
- a node that was asked and did not answer is a failure too ("no reply before the timeout");
- an error reply the SuperLink writes itself for a message it could not deliver (the node went offline:
  Flower's ``NODE_UNAVAILABLE``, sent from the SuperLink's own node id) is that node's failure, found by
  the id of the message it answers (:meth:`ReplyCollector.note_sent`), and counted once;
- :meth:`ReplyCollector.read` judges each reply once with
  :func:`~pollen.strategies.engine.replies.read_reply` against the method's
  :class:`~pollen.strategies.engine.replies.ReplySpec`; a reply that cannot be trusted never reaches a sink.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from logging import ERROR, INFO, WARNING
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.app import Message, Metadata, MetricRecord, RecordDict
from flwr.common import log

from pollen.core.layout import ModelLayout
from pollen.strategies.engine.accounting import Accounting
from pollen.strategies.engine.client_errors import (
    MAX_CLIENT_ERROR_LENGTH,
    ClientAppIncompatible,
    client_error_text,
    incompatibility,
)
from pollen.strategies.engine.replies import (
    ClientErrorReply,
    ClientUpdate,
    ReplyRejected,
    ReplySpec,
    count_records,
    read_reply,
)
from pollen.strategies.engine.sampling import ClientSampler
from pollen.wire import protocol

if TYPE_CHECKING:
    from pollen.strategies.engine.jobs import StepJobs

try:  # the node id the SuperLink's own replies come from (1 in every Flower this library supports)
    from flwr.common.constant import SUPERLINK_NODE_ID
except ImportError:  # pragma: no cover - a Flower that moved the constant
    SUPERLINK_NODE_ID = 1

TRAIN_PHASE = "train"
EVALUATE_PHASE = "evaluate"

#: The longest a device name reported by a client may be before it is ignored.
_MAX_DEVICE_NAME = 64


def reason_of(err: BaseException) -> str:
    """A short, one-line reason for a rejected reply (a client's own error: long enough for its exception)."""
    text = str(err).replace("\n", " ")
    reason = text if isinstance(err, ReplyRejected | ValueError) and text else f"{type(err).__name__}: {text}"
    return reason[: MAX_CLIENT_ERROR_LENGTH + 20] if isinstance(err, ClientErrorReply) else reason[:200]


#: The largest magnitude an evaluation metric may have (as the weight: a count of examples up to 1e12). A
#: metric's own range (an accuracy a fraction or a percentage) is the project's to know, not the server's.
MAX_METRIC = 1e12


def evaluation_reading(
    content: RecordDict, weighted_by_key: str, bounds: Mapping[str, tuple[float, float]] | None = None
) -> tuple[MetricRecord, float]:
    """An evaluation reply's metrics and weight, the one rule for every strategy (pollen's and Flower's
    baselines): the ``metrics`` MetricRecord (or the only one), a positive ``weighted_by_key`` as Flower's
    strategies require, finite numbers at most :data:`MAX_METRIC` in magnitude (one client's accuracy of
    1e300 would otherwise make the round's average 1e299), and each metric with a declared range (``bounds``,
    the screen's ``metric_bounds``) within it; ``ReplyRejected`` with the reason otherwise."""
    metrics = content.metric_records.get(protocol.METRICS_RECORD)
    if metrics is None:
        metrics = next(iter(content.metric_records.values()), None)
    if metrics is None:
        raise ReplyRejected("an evaluation reply without a MetricRecord")
    weight = positive_weight(metrics, weighted_by_key)
    if weight is None:
        raise ReplyRejected(f"evaluation metrics lack a positive '{weighted_by_key}'")
    if not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        for v in metrics.values()
        if not isinstance(v, list)
    ):
        raise ReplyRejected("evaluation metrics hold non-finite values")
    for name, value in metrics.items():
        values = value if isinstance(value, list) else [value]
        if any(not (isinstance(v, (int, float)) and math.isfinite(v) and abs(v) <= MAX_METRIC) for v in values):
            shown = name if len(name) <= 64 else name[:64] + "..."
            raise ReplyRejected(f"evaluation metric '{shown}' is not a finite number within +-{MAX_METRIC:g}")
    for name, (low, high) in (bounds or {}).items():
        value = metrics.get(name)
        values = value if isinstance(value, list) else [] if value is None else [value]
        if any(not low <= v <= high for v in values):
            shown = f"= {value!r}" if not isinstance(value, list) else "holds a value"  # a log line of bounded length
            raise ReplyRejected(f"evaluation metric '{name}' {shown} is outside its declared range [{low:g}, {high:g}]")
    return metrics, weight


def positive_weight(metrics: Mapping[str, Any] | None, key: str) -> float | None:
    """``metrics[key]`` when it is a number in ``(0, 1e12]``, else ``None`` (a client's claim, checked)."""
    value = metrics.get(key) if metrics is not None else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1e12:
        return None
    return float(value)


class ReplyCollector:
    """The round's book of asked nodes and the one reader of replies.

    Parameters
    ----------
    sampler : ClientSampler
        Maps node ids to stable client ids (for reasons and per-client state).
    accounting : Callable[[], Accounting]
        Returns the strategy's current accounting (replaced on ``load_state_dict``).
    """

    def __init__(self, sampler: ClientSampler, accounting: Callable[[], Accounting]) -> None:
        self.sampler = sampler
        self._accounting = accounting
        self._asked: dict[tuple[int, str], list[int]] = {}
        self._phase: dict[int, str] = {}
        self._groups: dict[tuple[int, str], str] = {}
        self._sent: dict[tuple[int, str], int] = {}
        self._metadata: dict[tuple[int, str], list[Metadata]] = {}
        self._undelivered: dict[tuple[int, str], set[int]] = {}
        self.client_devices: dict[str, str] = {}
        self._refused: dict[int, set[str]] = {}

    # ------------------------------------------------------------------ the book
    def ask(self, server_round: int, phase: str, nodes: Iterable[int]) -> str:
        """Record that ``nodes`` are sent a message of ``phase`` in ``server_round``; return its group id.

        The messages must carry the returned id as their ``group_id`` (Flower copies it into every
        reply): a reply with another one answers an earlier round or phase and is refused.
        """
        self._asked[(server_round, phase)] = list(nodes)
        self._sent[(server_round, phase)] = sent = self._sent.get((server_round, phase), 0) + 1
        group = self._groups[(server_round, phase)] = f"pollen/{server_round}/{phase}/{sent}"
        if phase != EVALUATE_PHASE:
            self._phase[server_round] = phase
        return group

    def ask_jobs(self, server_round: int, phase: str, groups: Mapping[int, str]) -> None:
        """Record that ``server_round`` reads the replies of jobs sent earlier, one per node, each with its own
        group id (an asynchronous step: :mod:`~pollen.strategies.engine.buffered`); a reply must carry its own
        node's group."""
        self._asked[(server_round, phase)] = list(groups)
        self._groups[(server_round, phase)] = dict(groups)  # type: ignore[assignment]
        if phase != EVALUATE_PHASE:
            self._phase[server_round] = phase

    def note_sent(self, server_round: int, phase: str, messages: Iterable[Message]) -> None:
        """Keep the metadata of the messages of ``phase``: the grid writes each one's id into it when it
        pushes, which is how a reply the SuperLink writes for an undeliverable message is traced to its node."""
        self._metadata.setdefault((server_round, phase), []).extend(message.metadata for message in messages)

    def asked(self, server_round: int, phase: str = TRAIN_PHASE) -> list[int]:
        """The nodes asked in ``phase`` of ``server_round`` (empty when none were)."""
        return list(self._asked.get((server_round, phase), []))

    def phase_of(self, server_round: int) -> str:
        """The last training phase sent in ``server_round``: its replies are the ones aggregated."""
        return self._phase.get(server_round, TRAIN_PHASE)

    def forget(self, server_round: int) -> None:
        """Drop the book of ``server_round`` and every earlier round (a late reply is then unasked)."""
        for book in (self._asked, self._groups, self._sent, self._metadata, self._undelivered):
            for key in [key for key in book if key[0] <= server_round]:
                del book[key]
        for done in [r for r in self._phase if r <= server_round]:
            del self._phase[done]
        for done in [r for r in self._refused if r <= server_round]:
            del self._refused[done]

    # ------------------------------------------------------------------ judging
    def reject(self, server_round: int, node: int, reason: str) -> None:
        """Count ``node``'s reply in ``server_round`` as a failure, with ``reason`` logged."""
        client = self.sampler.key(node)
        self._accounting().round(server_round).fail(f"{client}: {reason}")
        log(WARNING, "\t> rejected reply from %s (node %d): %s", client, node, reason)

    def refuse(self, server_round: int, node: int, reason: str) -> None:
        """:meth:`reject` a reply the server read and refused for its content (validation, the outlier screen):
        an error-fed client is told to drop that upload, not to owe it (:mod:`~pollen.strategies.engine.ledger`)."""
        self.reject(server_round, node, reason)
        self._refused.setdefault(server_round, set()).add(self.sampler.key(node))

    def refused(self, server_round: int) -> list[str]:
        """The clients whose train reply of ``server_round`` was refused for its content (:meth:`refuse`)."""
        return sorted(self._refused.get(server_round, ()))

    def from_asked(self, server_round: int, phase: str, replies: Iterable[Message]) -> list[Message]:
        """Replies from nodes asked in this phase, one each, in a fixed order; the rest are failures with a reason.

        The kept replies come back ordered by stable client id (then node id), not in the order they
        arrived: everything downstream (the float32 running sum, a method's per-client loop, the
        metrics' average) then gives the same bits whatever order the clients finished in and however
        many workers ran them. Two answers from one node to one message are both refused and counted:
        which of them is the node's own is not the server's to guess, and arrival order must not decide.
        """
        asked = set(self._asked.get((server_round, phase), []))
        group = self._groups.get((server_round, phase))
        answers: dict[int, list[Message]] = {}
        seen: set[int] = set()
        sent_to: dict[str, int] | None = None  # message id -> its node, built at the first SuperLink error reply
        for reply in self.in_fixed_order(replies):
            node = reply.metadata.src_node_id
            expected = group.get(node) if isinstance(group, Mapping) else group
            if node not in asked and reply.has_error() and node == SUPERLINK_NODE_ID:
                if sent_to is None:
                    sent_to = self._sent_to(server_round, phase)
                undelivered = sent_to.get(reply.metadata.reply_to_message_id)
            else:
                undelivered = None
            if undelivered is not None:
                if undelivered not in seen:
                    seen.add(undelivered)
                    self._undelivered.setdefault((server_round, phase), set()).add(undelivered)
                    self.reject(server_round, undelivered, f"{phase} message not delivered: {reply.error.reason}")
            elif node not in asked:
                self.reject(server_round, node, f"reply from a node not asked in {phase} of round {server_round}")
            elif expected is not None and not reply.has_error() and reply.metadata.group_id != expected:
                self.reject(
                    server_round,
                    node,
                    f"reply to another message (group '{reply.metadata.group_id}', this one is '{expected}'): "
                    "an earlier round's or phase's answer",
                )
            elif node in seen:  # the SuperLink said it could not deliver this node's message
                self.reject(server_round, node, f"second reply in {phase} of round {server_round}")
            else:
                answers.setdefault(node, []).append(reply)
        kept = []
        for node, given in answers.items():  # in the fixed order of each node's first answer
            if len(given) == 1:
                kept.append(given[0])
                continue
            self._undelivered.setdefault((server_round, phase), set()).add(node)  # already failures: not "missing"
            for _ in given:
                self.reject(server_round, node, f"two answers to one message in {phase} of round {server_round}: "
                            "both refused")  # fmt: skip
        self._stop_if_none_can_answer(server_round, phase, kept)
        return kept

    def _stop_if_none_can_answer(self, server_round: int, phase: str, kept: list[Message]) -> None:
        """Stop the run when *every* reply of the phase is an error saying its ClientApp can never answer
        (:func:`incompatibility`). One such reply among usable ones is rejected like any other error: its
        reason is the client's to write, and one client must not be able to stop everybody's run."""
        verdicts = [incompatibility(reply.error.reason) if reply.has_error() else None for reply in kept]
        if kept and all(why is not None for why in verdicts):
            first = kept[0]
            self.stop_on(server_round, phase, first.metadata.src_node_id, first.error.reason, verdicts[0])

    def stop_on(self, server_round: int, phase: str, node: int, reason: str, why: str) -> None:
        """Stop the run: ``node``'s ClientApp answered with an error that says it can never answer this server."""
        client = self.sampler.key(node)
        log(
            ERROR,
            "\t> %s (node %d) answered %s of round %d with: %s",
            client,
            node,
            phase,
            server_round,
            client_error_text(reason),
        )
        raise ClientAppIncompatible(f"stopped in round {server_round}: {client}'s ClientApp cannot answer: {why}")

    def _sent_to(self, server_round: int, phase: str) -> dict[str, int]:
        """Message id -> destination node of the messages of ``phase`` the grid has pushed (ids set on push)."""
        return {m.message_id: m.dst_node_id for m in self._metadata.get((server_round, phase), []) if m.message_id}

    def in_fixed_order(self, replies: Iterable[Message]) -> list[Message]:
        """``replies`` ordered by (stable client id, node id): an order that does not depend on arrival."""
        return sorted(replies, key=lambda reply: (self.sampler.key(node := reply.metadata.src_node_id), node))

    def missing(self, server_round: int, phase: str, replies: Iterable[Message]) -> None:
        """Count every node asked in ``phase`` that is not among ``replies`` as a failure."""
        answered = {reply.metadata.src_node_id for reply in replies}
        answered |= self._undelivered.get((server_round, phase), set())  # already a failure, with its reason
        for node in self._asked.get((server_round, phase), []):
            if node not in answered:
                self.reject(server_round, node, f"no reply before the timeout ({phase})")

    def read(  # noqa: PLR0913 - the reader's settings, passed through
        self,
        server_round: int,
        replies: Iterable[Message],
        *,
        phase: str,
        spec: ReplySpec,
        layout: ModelLayout,
        params: np.ndarray,
        arrayrecord_key: str,
        weighted_by_key: str,
        weight_required: bool,
        max_abs: float,
        scratch: np.ndarray | None = None,
        sink: Callable[[ClientUpdate], None] | None = None,
        jobs: StepJobs | None = None,
    ) -> list[ClientUpdate]:
        """Read every reply of ``phase`` once against ``spec``; rejected ones are failures with a reason.

        Counts each reply's bytes by record. With a ``sink``, each update is handed to it as soon
        as it is read (into ``scratch``, one reused buffer) and its vector is not kept; the sink may
        reject it by raising ``ReplyRejected``. With ``jobs`` (an asynchronous step) each reply is read
        against the model its job started from and moved to the driver's rule (:class:`StepJobs`).
        """
        stats = self._accounting().round(server_round)
        prefix = "" if phase == TRAIN_PHASE else f"{phase}/"
        replies = self.from_asked(server_round, phase, replies)
        updates: list[ClientUpdate] = []
        for reply in replies:
            node = reply.metadata.src_node_id
            try:
                if not reply.has_error():
                    stats.add_uplink(count_records(reply), prefix)
                    self.check_played(node, reply.content)
                update = read_reply(
                    reply,
                    client_key=self.sampler.key(node),
                    layout=layout,
                    params=params if jobs is None else jobs.base(node, params),
                    spec=spec,
                    arrayrecord_key=arrayrecord_key,
                    weighted_by_key=weighted_by_key,
                    weight_required=weight_required,
                    max_abs=max_abs,
                    scratch=scratch if sink is not None else None,
                )
                if jobs is not None:
                    jobs.adjust(update, params)
                if sink is not None:
                    sink(update)
            except Exception as err:  # noqa: BLE001 - every failure is a rejected reply, never a crash
                (self.refuse if phase == TRAIN_PHASE else self.reject)(server_round, node, reason_of(err))
                continue
            self.note_device(node, reply.content)
            updates.append(update)
        self.missing(server_round, phase, replies)
        return updates

    def evaluation_metrics(
        self,
        server_round: int,
        replies: Iterable[Message],
        weighted_by_key: str,
        bounds: Mapping[str, tuple[float, float]] | None = None,
    ) -> list[tuple[RecordDict, MetricRecord, float]]:
        """The content, metrics and weight of each usable evaluation reply of ``server_round`` (``bounds``: the
        declared ranges of metrics, :func:`evaluation_reading`).

        A failed or malformed evaluation reply is skipped with a logged reason (evaluation never
        fails a round); bytes are counted.
        """
        stats = self._accounting().round(server_round)
        usable = []
        for reply in self.from_asked(server_round, EVALUATE_PHASE, replies):
            node = reply.metadata.src_node_id
            try:
                if reply.has_error():
                    raise ClientErrorReply(f"client error: {client_error_text(reply.error.reason)}")
                stats.eval_uplink_bytes += sum(count_records(reply).values())
                metrics, weight = evaluation_reading(reply.content, weighted_by_key, bounds)
                usable.append((reply.content, metrics, weight))
            except Exception as err:  # noqa: BLE001 - evaluation never crashes the server either
                log(
                    WARNING,
                    "\t> evaluation reply from %s (node %d) skipped: %s",
                    self.sampler.key(node),
                    node,
                    reason_of(err),
                )
        for book in (self._asked, self._groups, self._sent, self._metadata, self._undelivered):
            book.pop((server_round, EVALUATE_PHASE), None)
        return usable

    # ------------------------------------------------------------------ client info
    def check_played(self, node: int, content: RecordDict) -> None:
        """Population mode: ``ReplyRejected`` unless the reply says it is from the client ``node`` plays.

        A ClientApp that ignores ``pollen.partition`` trains the node's own data; its update must not be filed
        under the client the node was bound to (its table row, its lazy book, its ledger).
        """
        if not self.sampler.population:
            return
        info = content.config_records.get(protocol.CLIENT_INFO_RECORD)
        claimed = info.get(protocol.IDENTITY_CLIENT_ID) if info is not None else None
        if claimed != (playing := self.sampler.key(node)):
            raise ReplyRejected(
                f"answered as client {claimed!r} but plays {playing} (population mode); allowed: a ClientApp that "
                f"reads '{protocol.CFG_PARTITION}' and reports it in '{protocol.CLIENT_INFO_RECORD}', as pollen's does"
            )

    def note_device(self, node: int, content: RecordDict) -> None:
        """Log the device a client trained on (pollen's ClientApp reports it), once per change."""
        info = content.config_records.get(protocol.CLIENT_INFO_RECORD)
        device = info.get("device") if info is not None else None
        client = self.sampler.key(node)
        if isinstance(device, str) and len(device) < _MAX_DEVICE_NAME and self.client_devices.get(client) != device:
            self.client_devices[client] = device
            log(INFO, "\t> %s trains on %s", client, device)
