"""Flower's own FedAvg / FedAdam / FedYogi / FedAdagrad, with pollen's byte accounting.

The baselines are Flower's implementations unchanged (``flwr.serverapp.strategy``);
``Metered`` only observes the messages going out and the replies coming in, so the
app can report the same per-round numbers (sampled, replies, failures, bytes each
way) for every method.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAdagrad, FedAdam, FedAvg, FedYogi

from pollen import protocol
from pollen.strategies.accounting import Accounting
from pollen.wire import content_bytes


class Metered:
    """Mixin: count messages and bytes around a Flower strategy's own steps."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: D107
        super().__init__(*args, **kwargs)
        self.accounting = Accounting()
        self._started: dict[int, float] = {}

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        self._started[server_round] = time.perf_counter()
        messages = list(super().configure_train(server_round, arrays, config, grid))
        stats = self.accounting.round(server_round)
        stats.sampled = len(messages)
        stats.downlink_bytes += sum(content_bytes(m.content) for m in messages)
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        stats = self.accounting.round(server_round)
        for reply in replies:
            if reply.has_error():
                stats.fail(f"node {reply.metadata.src_node_id}: {reply.error.reason}")
                continue
            stats.replies += 1
            stats.uplink_bytes += content_bytes(reply.content)
            if protocol.ARRAYS_RECORD in reply.content.array_records:
                record = reply.content.array_records[protocol.ARRAYS_RECORD]
                stats.uplink_update_bytes += record.count_bytes()
                stats.uplink_fp32_bytes += record.count_bytes()
        for _ in range(stats.sampled - len(replies)):
            stats.fail("no reply before the timeout")
        result = super().aggregate_train(server_round, replies)
        stats.train_metrics = dict(result[1] or {})
        stats.train_seconds = time.perf_counter() - self._started.get(server_round, time.perf_counter())
        return result

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
