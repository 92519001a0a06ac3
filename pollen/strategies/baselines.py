"""Flower's own FedAvg / FedAdam / FedYogi / FedAdagrad, with pollen's byte accounting.

The baselines are Flower's implementations unchanged (``flwr.serverapp.strategy``);
``Metered`` observes the messages going out and the replies coming in, so the app
reports the same per-round numbers (sampled, replies, failures, bytes each way) for
every method, and it holds back replies that cannot be trusted (wrong names or
shapes, NaN/Inf, no positive ``num-examples``): Flower's aggregation would raise on
some of them or average them into the model. They count as failures, with a reason.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from logging import WARNING

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAdagrad, FedAdam, FedAvg, FedYogi

from pollen import protocol
from pollen.layout import ModelLayout
from pollen.strategies.accounting import Accounting
from pollen.wire import content_bytes, record_to_arrays


class Metered:
    """Mixin: count messages and bytes around a Flower strategy's own steps."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: D107
        super().__init__(*args, **kwargs)
        self.accounting = Accounting()
        self._started: dict[int, float] = {}
        self._layout: ModelLayout | None = None

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        self._started[server_round] = time.perf_counter()
        if self._layout is None:  # the model's shapes do not change between rounds
            self._layout = ModelLayout.from_arrays(record_to_arrays(arrays))
        messages = list(super().configure_train(server_round, arrays, config, grid))
        stats = self.accounting.round(server_round)
        stats.sampled = len(messages)
        stats.downlink_bytes += sum(content_bytes(m.content) for m in messages)
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        received = list(replies)
        stats = self.accounting.round(server_round)
        replies = []
        for reply in received:
            node = reply.metadata.src_node_id
            if reply.has_error():
                stats.fail(f"node {node}: {reply.error.reason}")
                continue
            stats.uplink_bytes += content_bytes(reply.content)
            reason = self._untrusted(reply)
            if reason:
                stats.fail(f"node {node}: {reason}")
                log(WARNING, "\t> rejected reply from node %d: %s", node, reason)
                continue
            replies.append(reply)
            stats.replies += 1
            update_bytes = reply.content.array_records[protocol.ARRAYS_RECORD].count_bytes()
            stats.uplink_update_bytes += update_bytes
            stats.uplink_fp32_bytes += update_bytes
        for _ in range(stats.sampled - len(received)):
            stats.fail("no reply before the timeout")
        result = super().aggregate_train(server_round, replies)
        stats.train_metrics = dict(result[1] or {})
        stats.train_seconds = time.perf_counter() - self._started.get(server_round, time.perf_counter())
        return result

    def _untrusted(self, reply: Message) -> str:
        """Why a train reply cannot be aggregated, or ``""`` when it can."""
        records = reply.content.array_records
        if protocol.ARRAYS_RECORD not in records:
            return f"reply has no '{protocol.ARRAYS_RECORD}' record"
        try:
            arrays = record_to_arrays(records[protocol.ARRAYS_RECORD])
            if self._layout is not None:
                self._layout.check_arrays(arrays, self._layout.trainable + self._layout.buffers)
        except ValueError as err:
            return str(err)
        metrics = next(iter(reply.content.metric_records.values()), None)
        weight = None if metrics is None else metrics.get(protocol.NUM_EXAMPLES)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
            return f"metrics lack a positive '{protocol.NUM_EXAMPLES}' (got {weight!r})"
        return ""

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        replies = list(replies)
        stats = self.accounting.round(server_round)
        stats.eval_uplink_bytes += sum(content_bytes(r.content) for r in replies if not r.has_error())
        aggregated = super().aggregate_evaluate(server_round, replies)
        stats.evaluate_metrics = dict(aggregated or {})
        return aggregated


class MeteredFedAvg(Metered, FedAvg):
    """Flower's FedAvg, metered."""


class MeteredFedAdam(Metered, FedAdam):
    """Flower's FedAdam (bias-corrected eta, tau outside the sqrt), metered."""


class MeteredFedYogi(Metered, FedYogi):
    """Flower's FedYogi, metered."""


class MeteredFedAdagrad(Metered, FedAdagrad):
    """Flower's FedAdagrad, metered."""
