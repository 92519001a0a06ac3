"""What every experiment tracker shares: the tracker names, the run statuses, a results row as metrics.

A tracker receives exactly what the run writes to ``metrics.csv``: :func:`round_metrics` turns one results
row (:mod:`pollen.app.results`) into named numbers, the per-record byte columns (``uplink_by_record``, a
dict) and a method's own counters (``method.lazy_events``, a dict) flattened as ``column/key``, and
:func:`hyperparameters` turns the resolved run-config into the values a tracker records once. Both trackers
log these same names, so TensorBoard, MLflow and the CSV agree column for column.

This module imports neither TensorBoard nor MLflow: the run-config schema reads the names from here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Protocol

#: The trackers ``tracker`` may name (a comma-separated list of these, or empty for none).
TRACKERS = ("tensorboard", "mlflow")

#: The package extra that installs each tracker's library.
EXTRAS = {"tensorboard": "tensorboard", "mlflow": "mlflow"}

#: How a run ended, as a tracker is told at its end.
FINISHED, STOPPED, FAILED = "finished", "stopped", "failed"

_UNSAFE = re.compile(r"[^A-Za-z0-9_\-./ ]")


def install_hint(name: str) -> str:
    """The command that installs tracker ``name``'s library."""
    return f'pip install "flwr-pollen[{EXTRAS[name]}]"'


def tracker_names(text: str) -> tuple[str, ...]:
    """``"tensorboard, mlflow"`` -> ``("tensorboard", "mlflow")``; ``ValueError`` for an unknown or repeated name."""
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    for name in names:
        if name not in TRACKERS:
            raise ValueError(f"unknown tracker {name!r}")
    if len(set(names)) != len(names):
        raise ValueError("a tracker is named twice")
    return names


def is_tracker_list(text: str) -> bool:
    """Whether ``text`` is a valid ``tracker`` value (the run-config schema's check)."""
    try:
        tracker_names(text)
    except ValueError:
        return False
    return True


def metric_name(name: str) -> str:
    """A column name as a metric key both trackers accept (MLflow allows letters, digits, ``_-./`` and spaces)."""
    return _UNSAFE.sub("_", name)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def round_metrics(row: Mapping[str, Any]) -> dict[str, float]:
    """Every number of a results row, by column; a dict column's numbers as ``column/key``.

    ``round`` is the step, not a metric. Empty cells (a round without evaluation has ``accuracy`` None,
    a method that has no such counter leaves ``""``), text and lists are left out; NaN stays (a diverged
    loss is worth seeing).
    """
    metrics: dict[str, float] = {}
    for column, value in row.items():
        if column == "round":
            continue
        if isinstance(value, Mapping):
            for key, item in value.items():
                if _is_number(item):
                    metrics[metric_name(f"{column}/{key}")] = float(item)
        elif _is_number(value):
            metrics[metric_name(column)] = float(value)
    return metrics


def hyperparameters(config: Mapping[str, Any]) -> dict[str, str | int | float]:
    """The resolved run-config as hyper-parameters: every key with the value the run used.

    A boolean reads ``true`` / ``false`` (as on the command line; TensorBoard would show 1.0 / 0.0).
    """
    params: dict[str, str | int | float] = {}
    for key, value in config.items():
        if isinstance(value, bool):
            params[key] = "true" if value else "false"
        elif isinstance(value, (str, int, float)):
            params[key] = value
        else:
            params[key] = str(value)
    return params


class Tracker(Protocol):
    """One experiment tracker for one run: opened before round 1, told each round's numbers, closed at the end.

    A tracker may raise from any call (a server that went away, a disk that filled); the run guards it
    (:class:`pollen.app.trackers.guard.Guarded`), so a tracker never handles its own failures.
    """

    #: The tracker's name in ``tracker`` (``tensorboard``, ``mlflow``).
    name: str

    def start(self, config: Mapping[str, Any], *, resume_at: int | None = None) -> bool:
        """Open the run and record ``config`` as its hyper-parameters; whether it continues an earlier record.

        ``resume_at``: a resumed run's next round. The tracker continues what this run logged before its
        checkpoint (what was logged from ``resume_at`` on, by a run that crashed later, is superseded) and
        returns True; it returns False where it has no earlier record (a tracker added on resume), and the
        rounds before the checkpoint are then logged again.
        """

    def log_round(self, step: int, metrics: Mapping[str, float]) -> None:
        """Record one round's metrics at ``step`` (the round number; 0 is the initial model)."""

    def finish(self, status: str) -> None:
        """Close the run: ``status`` is :data:`FINISHED`, :data:`STOPPED` (stop-after-round) or :data:`FAILED`."""

    def where(self) -> str:
        """Where this tracker writes, in words for the log (a directory, a tracking URI and run)."""
