"""The round reporter: the global model on the test set, one line and one results row per round.

:class:`RoundReporter` is the ServerApp's ``evaluate_fn``: it evaluates the global model on the held-out
test set every ``eval-every`` rounds (and after the last), logs the round's line (accuracy, bytes each way
by record, failures, the method's own counters by name) and hands the row to the run's
:class:`~pollen.app.results.RunRecorder` and, as written, to the run's experiment trackers
(:class:`~pollen.app.trackers.RunTrackers`); it keeps what it needs to resume with the run's checkpoint.
"""

from __future__ import annotations

import copy
import os
import time
from logging import INFO
from typing import Any

from flwr.app import ArrayRecord, MetricRecord
from flwr.common import log

from pollen.app.config import AppConfig
from pollen.app.results import METHOD_PREFIX, RunRecorder, human_bytes
from pollen.app.trackers import RunTrackers
from pollen.wire import protocol


class RoundReporter:
    """Centralised evaluation plus the per-round row and progress line (Flower's ``evaluate_fn``)."""

    def __init__(
        self,
        cfg: AppConfig,
        strategy: Any,
        recorder: RunRecorder,
        model: Any,
        test_loader: Any,
        trackers: RunTrackers | None = None,
    ) -> None:
        from pollen.task.device import resolve_device

        self.cfg = cfg
        self.strategy = strategy
        self.recorder = recorder
        self.trackers = trackers if trackers is not None else RunTrackers([])
        self.model = model
        self.test_loader = test_loader
        self.device = resolve_device(cfg["device"])
        self.started = time.perf_counter()
        self.last = self.started
        self.elapsed_before = 0.0  # seconds of the run before a resume

    def app_state(self) -> dict[str, Any]:
        """What a checkpoint keeps of the reporter: the rows so far and the elapsed time."""
        return {"rows": self.recorder.rows, "elapsed": self.elapsed_before + time.perf_counter() - self.started}

    def restore(self, app_state: dict[str, Any]) -> None:
        """Continue from a checkpoint's rows and elapsed time."""
        self.recorder.restore(app_state.get("rows", []))
        self.elapsed_before = float(app_state.get("elapsed", 0.0))

    def __call__(self, server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        from pollen.task.train import evaluate

        total = self.cfg["num-server-rounds"]
        due = server_round % self.cfg["eval-every"] == 0 or server_round == total
        if not due:
            now = time.perf_counter()
            self._record(self._row(server_round, None, None, now))
            self.last = now
            return None
        self.model.load_state_dict(arrays.to_torch_state_dict())
        loss, accuracy, _ = evaluate(self.model, self.test_loader, self.device)
        now = time.perf_counter()
        row = self._row(server_round, accuracy, loss, now)
        self._record(row)
        self.last = now
        log(
            INFO,
            "[pollen] round %d/%d  accuracy %.4f  loss %.4f  uplink %s (total %s, x%.1f vs fp32)  "
            "downlink total %s  %.1fs",
            server_round,
            total,
            accuracy,
            loss,
            human_bytes(row.get("uplink_bytes", 0) or 0),
            human_bytes(row["cum_uplink_bytes"]),
            row.get("compression_ratio", 1.0) or 1.0,
            human_bytes(row["cum_downlink_bytes"]),
            row["round_seconds"],
        )
        by_kind = _records_in_words(row.get("uplink_by_record"), row.get("downlink_by_record"))
        if by_kind:
            log(
                INFO,
                "[pollen]   round %d by record: %s; %d gradient evaluations",
                server_round,
                by_kind,
                row.get("grad_evals", 0),
            )
        counters = _method_in_words(
            {name.removeprefix(METHOD_PREFIX): value for name, value in row.items() if name.startswith(METHOD_PREFIX)}
        )
        if counters:
            log(INFO, "[pollen]   round %d method: %s", server_round, counters)
        return MetricRecord({"accuracy": accuracy, "loss": loss})

    def _record(self, row: dict[str, Any]) -> None:
        """Write the row to the results files, then hand the row as written to the trackers."""
        self.recorder.record(row)
        self.trackers.log_round(self.recorder.rows[-1])

    def _row(self, server_round: int, accuracy: float | None, loss: float | None, now: float) -> dict[str, Any]:
        accounting = self.strategy.accounting
        row: dict[str, Any] = {
            "round": server_round,
            "accuracy": accuracy,
            "loss": loss,
            "cum_uplink_bytes": accounting.cumulative("uplink_bytes", server_round),
            "cum_downlink_bytes": accounting.cumulative("downlink_bytes", server_round)
            + accounting.cumulative("eval_downlink_bytes", server_round),
            "round_seconds": now - self.last,
            "elapsed_seconds": self.elapsed_before + now - self.started,
            "server_rss_bytes": resident_bytes(),
            "server_anon_rss_bytes": anonymous_resident_bytes(),
        }
        stats = accounting.rounds.get(server_round)
        if stats is not None:
            row.update(
                sampled=stats.sampled,
                replies=stats.replies,
                failures=stats.failures,
                uplink_bytes=stats.uplink_bytes,
                uplink_update_bytes=stats.uplink_update_bytes,
                uplink_fp32_bytes=stats.uplink_fp32_bytes,
                uplink_by_record=dict(stats.uplink_records),
                downlink_by_record=dict(stats.downlink_records),
                messages_sent=stats.messages_sent,
                exchange_messages=stats.exchange_messages,
                grad_evals=stats.grad_evals,
                compression_ratio=stats.compression_ratio,
                downlink_bytes=stats.downlink_bytes + stats.eval_downlink_bytes,
                server_state_bytes=getattr(stats, "server_state_bytes", 0),
                train_loss=stats.train_metrics.get("train-loss", ""),
                fed_accuracy=stats.evaluate_metrics.get("accuracy", ""),
                fed_loss=stats.evaluate_metrics.get("loss", ""),
            )
            row.update({METHOD_PREFIX + name: copy.deepcopy(value) for name, value in stats.method.items()})
        return row


def resident_bytes() -> int | str:
    """The resident memory of the process running the ServerApp (Linux ``/proc``), or ``""`` elsewhere.

    In a simulation this process also holds Flower's per-node contexts, so it is the server side's whole
    footprint: what must stay flat as rounds go by and grow by no more than the per-client state with N.
    """
    pages = _statm()
    return pages[1] * os.sysconf("SC_PAGE_SIZE") if pages else ""


def anonymous_resident_bytes() -> int | str:
    """The part of :func:`resident_bytes` that is the process's own memory (``""`` elsewhere): the resident set
    less its shared pages, which are pages of files and shared memory.

    A memory-mapped table or book (FedAdaVR's ``table-path``, the lazy family's ``bookkeeping-dir``) is counted
    in the resident set as its file's pages, which the kernel drops under pressure; this leaves them out.
    """
    pages = _statm()
    return (pages[1] - pages[2]) * os.sysconf("SC_PAGE_SIZE") if pages else ""


def _statm() -> list[int] | None:
    """``/proc/self/statm`` in pages (size, resident, shared, ...), or ``None`` where there is none."""
    try:
        with open("/proc/self/statm", encoding="ascii") as statm:
            pages = [int(field) for field in statm.read().split()]
        return pages if len(pages) >= 3 else None
    except (OSError, ValueError):
        return None


def _records_in_words(uplink: dict[str, int] | None, downlink: dict[str, int] | None) -> str:
    """``up model 1.2 MB, v 1.2 MB | down ...`` when a round carried more than the model and metrics."""
    plain = {protocol.ARRAYS_RECORD, protocol.CONFIG_RECORD, protocol.METRICS_RECORD, protocol.CLIENT_INFO_RECORD}
    if not uplink or set(uplink) | set(downlink or {}) <= plain:
        return ""

    def words(records: dict[str, int]) -> str:
        shown = {
            name.removeprefix(protocol.extra_record("")): size
            for name, size in records.items()
            if name not in (protocol.CONFIG_RECORD, protocol.METRICS_RECORD, protocol.CLIENT_INFO_RECORD)
        }
        return ", ".join(f"{name} {human_bytes(size)}" for name, size in shown.items())

    return f"up {words(uplink)} | down {words(downlink or {})}"


def _method_in_words(counters: dict[str, Any]) -> str:
    """A round's method counters in words, whatever the method:
    ``relayed_bytes 1.20 MB | lazy_events up-send 3, up-skip 1``.

    A number named ``*_bytes`` reads as a size; a mapping lists its non-zero numbers, and its lists as
    ``count in [min, max]``; zeros and empty values are left out.
    """

    def one(name: str, value: Any) -> str:
        if isinstance(value, list):
            numbers = [v for v in value if isinstance(v, (int, float))]
            return f"{name} {len(numbers)} in [{min(numbers):.3g}, {max(numbers):.3g}]" if numbers else ""
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value:
            return ""
        if name.endswith("_bytes"):
            return f"{name} {human_bytes(value)}"
        return f"{name} {value}" if isinstance(value, int) else f"{name} {value:.4g}"

    parts = []
    for name, value in counters.items():
        if isinstance(value, dict):
            inner = ", ".join(words for key, item in value.items() if (words := one(str(key), item)))
            if inner:
                parts.append(f"{name} {inner}")
        elif words := one(name, value):
            parts.append(words)
    return " | ".join(parts)
