"""Flower's own FedAvg / FedAdam / FedYogi / FedAdagrad, with pollen's byte accounting, screening and state.

The baselines are Flower's implementations unchanged (``flwr.serverapp.strategy``);
``Metered`` observes the messages going out and the replies coming in, so the app
reports the same per-round numbers (sampled, replies, failures, bytes each way) for
every method. It holds back replies that cannot be trusted before Flower aggregates
them, with the same reader pollen's strategies use (:func:`pollen.strategies.replies.read_reply`:
names, shapes, dtypes, finite values after the cast, a positive bounded ``num-examples``),
plus what Flower's own consistency check would raise on (exactly one ArrayRecord and one
MetricRecord, the same metric names in every reply). They count as failures, with a reason.
It also runs pollen's round loop (resume from a checkpoint) and has ``state_dict`` /
``load_state_dict`` (Flower's moments, the global ``random`` state Flower samples with).
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Iterable
from logging import WARNING
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAdagrad, FedAdam, FedAvg, FedYogi

from pollen.core.layout import ModelLayout
from pollen.strategies.accounting import Accounting
from pollen.strategies.collector import EVALUATE_PHASE, TRAIN_PHASE, ReplyCollector, positive_weight, reason_of
from pollen.strategies.declared import ARRAYS, load_declared, save_declared
from pollen.strategies.replies import ReplyRejected, count_records, read_reply
from pollen.strategies.rounds import RoundLoop
from pollen.strategies.sampling import ClientSampler
from pollen.strategies.screening import UpdateScreen
from pollen.strategies.transport import count_sent
from pollen.wire import protocol
from pollen.wire.records import record_to_arrays


class Metered(RoundLoop):
    """Mixin: count messages and bytes around a Flower strategy's own steps, screen replies, keep state.

    Replies go through the same :class:`~pollen.strategies.collector.ReplyCollector` as pollen's
    strategies (asked nodes per round, one reply each, rejections with reasons, silent nodes counted)
    and the same :class:`~pollen.strategies.screening.UpdateScreen`; an outlier is rejected (Flower's
    aggregation cannot take a clipped reply).
    """

    #: Flower's own state of the FedOpt family (FedAvg keeps none of it), written and checked by
    #: :mod:`pollen.strategies.declared`.
    state_fields = {"current_arrays": ARRAYS, "m_t": ARRAYS, "v_t": ARRAYS}

    def __init__(self, *args, outlier_rule: str = "reject", outlier_factor: float = 10.0, **kwargs) -> None:  # noqa: D107
        super().__init__(*args, **kwargs)
        self.accounting = Accounting()
        self.screen = UpdateScreen(rule=outlier_rule, factor=outlier_factor)
        self.replies = ReplyCollector(ClientSampler(), lambda: self.accounting)
        self._started: dict[int, float] = {}
        self._layout: ModelLayout | None = None
        self._params: np.ndarray | None = None

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        self._started[server_round] = time.perf_counter()
        named = record_to_arrays(arrays)
        if self._layout is None:  # the model as the user gave it: its dtypes are the ones clients use
            self._layout = ModelLayout.from_arrays(named)
        self._params = self._layout.flatten(named)
        messages = list(super().configure_train(server_round, arrays, config, grid))
        self.replies.ask(server_round, TRAIN_PHASE, [message.metadata.dst_node_id for message in messages])
        stats = self.accounting.round(server_round)
        stats.sampled = len(messages)
        count_sent(stats, messages)
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        stats = self.accounting.round(server_round)
        received = self.replies.from_asked(server_round, TRAIN_PHASE, replies)
        judged: list[tuple[Message, float]] = []
        for reply in received:
            try:
                if not reply.has_error():
                    stats.add_uplink(count_records(reply))
                judged.append((reply, self._judge(reply)))
            except Exception as err:  # noqa: BLE001 - a bad reply is a failure, never a crash
                self.replies.reject(server_round, reply.metadata.src_node_id, reason_of(err))
        judged = self._without_outliers(server_round, judged)
        judged = self._same_metric_names(server_round, judged, "")
        usable = [reply for reply, _ in judged]
        for reply in usable:
            update_bytes = reply.content.array_records[protocol.ARRAYS_RECORD].count_bytes()
            stats.uplink_update_bytes += update_bytes
            stats.uplink_fp32_bytes += update_bytes
        stats.replies = len(usable)
        self.replies.missing(server_round, TRAIN_PHASE, received)
        self.replies.forget(server_round)
        try:
            result = super().aggregate_train(server_round, usable)
            if usable:
                self.screen.observe([norm for _, norm in judged])
        except Exception as err:  # noqa: BLE001 - Flower's own checks raise; the round fails, the run goes on
            stats.fail(f"aggregation failed: {type(err).__name__}: {err}")
            log(WARNING, "aggregate_train: Flower's aggregation failed (%s); the model is unchanged", err)
            result = (None, None)
        stats.train_metrics = dict(result[1] or {})
        if result[0] is not None:
            stats.count_grad_evals([reply.content.metric_records.get(protocol.METRICS_RECORD) for reply in usable])
        stats.train_seconds = time.perf_counter() - self._started.pop(server_round, time.perf_counter())
        return result

    def _without_outliers(self, server_round: int, judged: list[tuple[Message, float]]) -> list[tuple[Message, float]]:
        """pollen's outlier screen (history bound, else each against the others' median); outliers rejected."""
        bound = self.screen.bound()
        norms = [norm for _, norm in judged]
        bounds = [bound] * len(norms) if bound is not None else self.screen.within_round_bounds(norms)
        kept = []
        for (reply, norm), limit in zip(judged, bounds):
            if self.screen.judge(norm, limit)[0] == "accept":
                kept.append((reply, norm))
            else:  # Flower's aggregation cannot take a clipped reply; an outlier is rejected
                self.replies.reject(server_round, reply.metadata.src_node_id, self.screen.reason(norm, limit))
        return kept

    def _judge(self, reply: Message) -> float:
        """The update's norm; ``ReplyRejected`` when Flower's aggregation must not see this reply."""
        content = reply.content
        if reply.has_error():
            raise ReplyRejected(f"client error: {reply.error.reason}")
        if len(content.array_records) != 1 or protocol.ARRAYS_RECORD not in content.array_records:
            raise ReplyRejected(f"reply must carry exactly one ArrayRecord, '{protocol.ARRAYS_RECORD}'")
        if len(content.metric_records) != 1:
            raise ReplyRejected("reply must carry exactly one MetricRecord")
        metrics = next(iter(content.metric_records.values()))
        if positive_weight(metrics, protocol.NUM_EXAMPLES) is None:
            raise ReplyRejected(
                f"metrics lack a positive '{protocol.NUM_EXAMPLES}' (got {metrics.get(protocol.NUM_EXAMPLES)!r})"
            )
        if self._layout is None or self._params is None:
            return 0.0
        update = read_reply(
            reply,
            client_key="",
            layout=self._layout,
            params=self._params,
            weight_required=True,
            max_abs=self.screen.max_abs,
        )
        return update.norm

    def _same_metric_names(
        self, server_round: int, judged: list[tuple[Message, float]], phase: str
    ) -> list[tuple[Message, float]]:
        """Keep the replies whose metric names agree with most others (Flower raises on a mix)."""
        if not judged:
            return judged
        names = [frozenset(next(iter(reply.content.metric_records.values())).keys()) for reply, _ in judged]
        common = Counter(names).most_common(1)[0][0]
        kept = []
        for item, keys in zip(judged, names):
            if keys == common:
                kept.append(item)
            elif phase == EVALUATE_PHASE:
                log(
                    WARNING,
                    "\t> evaluation reply from node %d skipped: metric names differ from the round's other replies",
                    item[0].metadata.src_node_id,
                )
            else:
                self.replies.reject(
                    server_round, item[0].metadata.src_node_id, "metric names differ from the round's other replies"
                )
        return kept

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        messages = list(super().configure_evaluate(server_round, arrays, config, grid))
        self.replies.ask(server_round, EVALUATE_PHASE, [message.metadata.dst_node_id for message in messages])
        return messages

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        stats = self.accounting.round(server_round)
        usable = []
        for reply in self.replies.from_asked(server_round, EVALUATE_PHASE, replies):
            try:
                if reply.has_error():
                    continue
                stats.eval_uplink_bytes += sum(count_records(reply).values())
                metrics = list(reply.content.metric_records.values())
                if len(metrics) != 1 or positive_weight(metrics[0], protocol.NUM_EXAMPLES) is None:
                    raise ReplyRejected(f"evaluation metrics lack a positive '{protocol.NUM_EXAMPLES}'")
                if not all(
                    isinstance(v, (int, float)) and np.isfinite(v)
                    for v in metrics[0].values()
                    if not isinstance(v, list)
                ):
                    raise ReplyRejected("evaluation metrics hold non-finite values")
            except Exception as err:  # noqa: BLE001
                log(WARNING, "\t> evaluation reply from node %d skipped: %s", reply.metadata.src_node_id, err)
                continue
            usable.append((reply, 0.0))
        usable = self._same_metric_names(server_round, usable, EVALUATE_PHASE)
        self.replies.forget(server_round)
        try:
            aggregated = super().aggregate_evaluate(server_round, [reply for reply, _ in usable])
        except Exception as err:  # noqa: BLE001
            log(WARNING, "aggregate_evaluate: Flower's aggregation failed (%s)", err)
            aggregated = None
        stats.evaluate_metrics = dict(aggregated or {})
        return aggregated

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Flower's moments and current model (declared in ``state_fields``), the global ``random`` state
        Flower samples with, the accounting, the screen and the model's layout."""
        version, internal, gauss = random.getstate()
        state: dict[str, Any] = {
            "strategy": type(self).__name__,
            "random": [version, list(internal), gauss],
            "accounting": self.accounting.to_dict(),
            "screen": self.screen.state_dict(),
            **save_declared(self),
        }
        if self._layout is not None:
            specs = self._layout.trainable + self._layout.buffers
            state["model"] = [[spec.name, list(spec.shape), spec.dtype.str] for spec in specs]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` wrote (same strategy class); moments must be finite."""
        if state.get("strategy") != type(self).__name__:
            raise ValueError(f"state was written by {state.get('strategy')!r}, not {type(self).__name__}")
        load_declared(self, state)
        version, internal, gauss = state["random"]
        random.setstate((int(version), tuple(int(v) for v in internal), gauss))
        self.accounting = Accounting.from_dict(state["accounting"])
        self.screen.load_state_dict(state.get("screen", {}))
        if "model" in state:
            self._layout = ModelLayout.from_arrays(
                {name: np.zeros(shape, np.dtype(dtype)) for name, shape, dtype in state["model"]}
            )


class MeteredFedAvg(Metered, FedAvg):
    """Flower's FedAvg, metered."""


class MeteredFedAdam(Metered, FedAdam):
    """Flower's FedAdam (bias-corrected eta, tau outside the sqrt), metered."""


class MeteredFedYogi(Metered, FedYogi):
    """Flower's FedYogi, metered."""


class MeteredFedAdagrad(Metered, FedAdagrad):
    """Flower's FedAdagrad, metered."""
