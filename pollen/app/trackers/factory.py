"""The run's trackers from its run-config: which ones, where each writes, and one object the ServerApp feeds.

:func:`open_trackers` reads ``tracker``, ``tracker-dir``, ``mlflow-tracking-uri`` and ``mlflow-experiment``;
a chosen tracker whose library is not installed stops the run before round 1 with the extra to install.
:class:`RunTrackers` is what the ServerApp starts with the resolved run-config, what the round reporter
hands each results row to, and what the ServerApp closes; every tracker in it is :class:`Guarded`.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping, Sequence
from logging import INFO
from pathlib import Path
from typing import Any

from flwr.common import log

from pollen.app.spec import ConfigError
from pollen.app.trackers.base import Tracker, install_hint, round_metrics, tracker_names
from pollen.app.trackers.guard import Guarded
from pollen.app.trackers.mlflow import MLflowTracker, default_tracking_uri
from pollen.app.trackers.tensorboard import TensorBoardTracker

#: The module each tracker needs (what its extra installs).
_NEEDS = {"tensorboard": "tensorboard", "mlflow": "mlflow"}

#: The run-config keys of the trackers: they change what is tracked, never the run's numbers.
TRACKER_KEYS = ("tracker", "tracker-dir", "mlflow-tracking-uri", "mlflow-experiment")


class RunTrackers:
    """A run's trackers as one; none at all is a valid (silent) set."""

    def __init__(self, trackers: list[Tracker]) -> None:
        self.trackers = [Guarded(tracker) for tracker in trackers]

    def __bool__(self) -> bool:
        return bool(self.trackers)

    def start(self, config: Mapping[str, Any], *, earlier_rows: Sequence[Mapping[str, Any]] = ()) -> None:
        """Open every tracker with the resolved run-config as hyper-parameters.

        ``earlier_rows``: a resumed run's rows up to its checkpoint; a tracker that has no record of them
        (one added on resume) gets them now, so it shows the whole run.
        """
        resume_at = int(earlier_rows[-1]["round"]) + 1 if earlier_rows else None
        for tracker in self.trackers:
            continued = tracker.start(config, resume_at=resume_at)
            if tracker.failed:
                continue
            log(INFO, "[pollen] tracking with %s: %s", tracker.name, tracker.tracker.where())
            if not continued:
                for row in earlier_rows:
                    tracker.log_round(int(row["round"]), round_metrics(row))

    def log_round(self, row: Mapping[str, Any]) -> None:
        """One results row, as written to ``metrics.csv``, at step = its round."""
        if not self.trackers:
            return
        step, metrics = int(row["round"]), round_metrics(row)
        for tracker in self.trackers:
            tracker.log_round(step, metrics)

    def finish(self, status: str) -> None:
        for tracker in self.trackers:
            tracker.finish(status)


def tensorboard_dir(tracker_dir: str, out_dir: Path) -> Path:
    """A run's event files: ``<tracker-dir>/<run-name>`` (``tracker-dir`` empty: ``<results-dir>/tensorboard``)."""
    root = Path(tracker_dir).expanduser().resolve() if tracker_dir else Path(out_dir).parent / "tensorboard"
    return root / Path(out_dir).name


def missing_library(names: tuple[str, ...]) -> str | None:
    """The first chosen tracker whose library is not installed, or None."""
    for name in names:
        if importlib.util.find_spec(_NEEDS[name]) is None:
            return name
    return None


def open_trackers(cfg: Mapping[str, Any], out_dir: Path) -> RunTrackers:
    """The trackers ``cfg["tracker"]`` names for the run whose results go to ``out_dir`` (not started yet).

    ``ConfigError`` (before round 1) when a chosen tracker's library is not installed.
    """
    names = tracker_names(cfg["tracker"])
    missing = missing_library(names)
    if missing is not None:
        raise ConfigError(
            f"run-config 'tracker' = {cfg['tracker']!r} but {missing} is not installed; "
            f"install it with: {install_hint(missing)}"
        )
    out_dir = Path(out_dir)
    trackers: list[Tracker] = []
    for name in names:
        if name == "tensorboard":
            trackers.append(TensorBoardTracker(tensorboard_dir(cfg["tracker-dir"], out_dir)))
        else:
            uri = cfg["mlflow-tracking-uri"] or default_tracking_uri(out_dir.parent)
            trackers.append(MLflowTracker(uri, cfg["mlflow-experiment"], out_dir.name, out_dir))
    return RunTrackers(trackers)
