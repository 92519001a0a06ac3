"""Results a person can read: per-round CSV/JSON written as the run goes, plots at the end.

Layout of ``results/<run-name>/``::

    config.json      the validated run-config used
    metrics.csv      one row per round (0 = the initial model): COLUMNS, then the method's own counters
    metrics.json     the same rows plus the run's summary
    final_model.npz  the final global model, one array per name
    accuracy_vs_round.png, accuracy_vs_uplink.png, accuracy_vs_downlink.png, accuracy_vs_total_bytes.png
    run.json         how the last ``flwr run`` that used this folder ended (:class:`RunState`)

``results/`` is ``results-dir``; a relative one resolves against the pollen home (:mod:`pollen.app.paths`).
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from pollen.app.trackers.base import FAILED, FINISHED, STOPPED
from pollen.core.files import write_bytes_atomically, write_npz_atomic

COLUMNS = (
    "round",
    "accuracy",
    "loss",
    "fed_accuracy",
    "fed_loss",
    "train_loss",
    "sampled",
    "replies",
    "failures",
    "uplink_bytes",
    "uplink_update_bytes",
    "uplink_fp32_bytes",
    "compression_ratio",
    "downlink_bytes",
    "messages_sent",
    "exchange_messages",
    "grad_evals",
    "uplink_by_record",
    "downlink_by_record",
    "server_state_bytes",
    "server_rss_bytes",
    "server_anon_rss_bytes",
    "cum_uplink_bytes",
    "cum_downlink_bytes",
    "round_seconds",
    "elapsed_seconds",
)
"""The columns every run has; a method's own counters (``RoundStats.method``) follow as ``method.<name>``."""

#: Prefix of the columns that hold a method's own counters (``method.relayed_bytes``, ``method.lazy_events``, ...).
METHOD_PREFIX = "method."


def method_columns(names: Iterable[str]) -> dict[str, None]:
    """The ``method.<name>`` columns among ``names``, in their order (a dict: ordered, no repeats)."""
    return {name: None for name in names if name.startswith(METHOD_PREFIX)}


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"


class RunRecorder:
    """Writes rows as they come, so a crashed or running job still has its numbers on disk.

    ``plots``: :meth:`finish` also draws the accuracy plots (PNG, :func:`plot_runs`); without them a run
    ends with its metrics files only, which ``pollen-compare`` plots later.
    """

    def __init__(self, out_dir: Path, config: Mapping[str, Any], *, fresh: bool = True, plots: bool = True) -> None:
        self.out_dir = Path(out_dir)
        self.plots = plots
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.rows: list[dict[str, Any]] = []
        self.columns: list[str] = list(COLUMNS)
        self.summary: dict[str, Any] = {}
        name = "config.json" if fresh else "config-resumed.json"
        (self.out_dir / name).write_text(json.dumps(dict(config), indent=2, sort_keys=True) + "\n")
        if fresh:
            self._rewrite_csv()

    def restore(self, rows: list[Mapping[str, Any]]) -> None:
        """Start from the rows a checkpoint kept (rows written after it, before a crash, are dropped)."""
        self.columns = list(COLUMNS) + list(method_columns(name for row in rows for name in row))
        self.rows = [{column: row.get(column, "") for column in self.columns} for row in rows]
        self._rewrite_csv()
        self._write_json()

    def _rewrite_csv(self) -> None:
        with open(self.out_dir / "metrics.csv", "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(self.columns)
            for row in self.rows:
                writer.writerow([_fmt(row[c]) for c in self.columns])

    def record(self, row: Mapping[str, Any]) -> None:
        """Add one round's row; a method counter seen for the first time adds its column to every row."""
        new = [name for name in method_columns(row) if name not in self.columns]
        if new:
            self.columns += new
            for earlier in self.rows:
                earlier.update({name: "" for name in new})
        full = {column: row.get(column, "") for column in self.columns}
        self.rows.append(full)
        if new:  # the header grew: write the file again
            self._rewrite_csv()
        else:
            with open(self.out_dir / "metrics.csv", "a", newline="") as handle:
                csv.writer(handle).writerow([_fmt(full[c]) for c in self.columns])
        self._write_json()

    def finish(self, final_arrays: Mapping[str, np.ndarray], summary: Mapping[str, Any]) -> None:
        self.summary = dict(summary)
        write_npz_atomic(self.out_dir / "final_model.npz", {k: np.asarray(v) for k, v in final_arrays.items()})
        self._write_json()
        if self.plots:
            plot_runs({self.out_dir.name: self.rows}, self.out_dir, title=self.out_dir.name)

    def _write_json(self) -> None:
        payload = {"rows": self.rows, "summary": self.summary}
        (self.out_dir / "metrics.json").write_text(json.dumps(payload, indent=2, default=_json_default) + "\n")


#: The run state file of a run folder.
RUN_STATE = "run.json"
#: A run's status while its rounds go; it ends ``finished``, ``stopped`` or ``failed`` (:data:`RUN_STATUSES`).
RUNNING = "running"
RUN_STATUSES = (RUNNING, FINISHED, STOPPED, FAILED)


class RunState:
    """``run.json``: how the run ended, and why, for a script to read (``flwr run`` exits 0 whatever happened).

    Flower 1.39's ``flwr run --stream`` exits 0 once the run's logs end, however the run ended, so the
    ServerApp says it here. The file is replaced atomically at each change and holds::

        status         running | finished | stopped | failed
        reason         empty when finished; else the one line the log printed (why it stopped or failed)
        last_round     the last round that completed (0: stopped before round 1)
        num_rounds     the rounds asked for (num-server-rounds)
        results        the run folder, absolute
        flower_run_id  Flower's run id (``flwr ls --run-id <id>``, ``flwr log <id>``)
        started_at, ended_at   UTC, ISO 8601 (ended_at empty while running)

    ``stopped``: pollen stopped the run on purpose: a refusal before round 1 (a bad value, a setup a method
    refuses, a resume that cannot resume), or ``stop-after-round``. ``failed``: an exception the app did not
    expect (Flower logs its traceback). The file describes the last run that used the folder: a refused run
    with the run-name of a finished one replaces that run's file (its metrics and model stay).
    """

    def __init__(self, out_dir: Path, *, flower_run_id: int | None, num_rounds: int | None) -> None:
        self.path = Path(out_dir) / RUN_STATE
        self.fields: dict[str, Any] = {
            "status": RUNNING,
            "reason": "",
            "last_round": 0,
            "num_rounds": num_rounds,
            "results": str(Path(out_dir)),
            "flower_run_id": flower_run_id,
            "started_at": _now(),
            "ended_at": "",
        }

    def start(self) -> None:
        """Say the run is going (written before anything else of the run)."""
        self._write()

    def end(self, status: str, *, reason: str = "", last_round: int = 0) -> None:
        """Say how the run ended: :data:`FINISHED`, :data:`STOPPED` or :data:`FAILED`, with the reason."""
        if status not in RUN_STATUSES[1:]:
            raise ValueError(f"run status {status!r} is unknown; allowed: {', '.join(RUN_STATUSES[1:])}")
        self.fields.update(status=status, reason=reason, last_round=int(last_round), ended_at=_now())
        self._write()

    def _write(self) -> None:
        write_bytes_atomically(self.path, (json.dumps(self.fields, indent=2) + "\n").encode())


def read_run_state(run_dir: Path) -> dict[str, Any]:
    """The ``run.json`` of a run folder."""
    return json.loads((Path(run_dir) / RUN_STATE).read_text())


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _fmt(value: Any) -> Any:
    if isinstance(value, dict):
        return json.dumps(value, sort_keys=True)
    return f"{value:.6g}" if isinstance(value, float) else value


def _json_default(value: Any) -> Any:
    if isinstance(value, (np.floating, np.integer)):
        return value.item()
    raise TypeError(f"cannot write {type(value).__name__} to JSON")


def load_rows(run_dir: Path) -> list[dict[str, Any]]:
    """Rows of a finished (or running) run, from its metrics.json."""
    data = json.loads((Path(run_dir) / "metrics.json").read_text())
    return data["rows"]


def _numeric(rows: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """(x, accuracy) of the rows with an accuracy; ``cum_total_bytes`` is uplink + downlink."""
    xs, ys = [], []
    for row in rows:
        value = row.get("accuracy")
        if isinstance(value, (int, float)) and not math.isnan(value):
            if key == "cum_total_bytes":
                x = float(row.get("cum_uplink_bytes") or 0.0) + float(row.get("cum_downlink_bytes") or 0.0)
            else:
                x = float(row.get(key) or 0.0)
            xs.append(x)
            ys.append(float(value))
    return xs, ys


def plot_runs(runs: Mapping[str, list[dict[str, Any]]], out_dir: Path, *, title: str = "") -> list[Path]:
    """Accuracy vs round and vs cumulative uplink, downlink and total bytes, one line per run.

    Each figure is titled with what it plots (and ``title``, e.g. the run's name), tells its runs apart by
    colour and marker (:mod:`pollen.app.plotstyle`), keeps its legend beside the axes, shows whole rounds
    and bytes in kB / MB / GB.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pollen.app import plotstyle

    paths = []
    for x_key, x_label, name, log_x in (
        ("round", "round", "accuracy_vs_round.png", False),
        ("cum_uplink_bytes", "cumulative uplink bytes (all clients)", "accuracy_vs_uplink.png", True),
        ("cum_downlink_bytes", "cumulative downlink bytes (all clients)", "accuracy_vs_downlink.png", True),
        ("cum_total_bytes", "cumulative bytes, both directions", "accuracy_vs_total_bytes.png", True),
    ):
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for index, (label, rows) in enumerate(runs.items()):
            xs, ys = _numeric(rows, x_key)
            if log_x:
                pairs = [(x, y) for x, y in zip(xs, ys) if x > 0]
                xs, ys = [p[0] for p in pairs], [p[1] for p in pairs]
            ax.plot(xs, ys, markersize=4, linewidth=1.4, label=label, **plotstyle.series_style(index))
        if log_x:
            plotstyle.bytes_axis(ax.xaxis)
        else:
            plotstyle.integer_axis(ax.xaxis)
        what = f"Test accuracy vs {x_label.split(' (')[0]}"
        ax.set_title(f"{what}\n{title}" if title else what, fontsize=10)
        ax.set_xlabel(x_label)
        ax.set_ylabel("centralised test accuracy")
        ax.grid(True, alpha=0.3)
        plotstyle.legend_outside(ax)
        paths.append(plotstyle.save(fig, Path(out_dir) / name))
    return paths
