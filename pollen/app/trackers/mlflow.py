"""MLflow: one MLflow run per pollen run, a metric per results column at step = round, the run-config as params.

Logged through ``mlflow.tracking.MlflowClient`` (``pip install "flwr-pollen[mlflow]"``), imported only when this
tracker is chosen, to ``mlflow-tracking-uri``: by default a SQLite store next to the run's results
(``sqlite:///<results-dir>/mlflow.db``), or any URI MLflow takes (``http://host:5000`` for a tracking
server, ``file:///dir``, a database). The run goes into the experiment ``mlflow-experiment`` (created if
missing); a sweep names one experiment for all its runs (:mod:`pollen.app.sweep`).

The MLflow run's id is kept in the run's results directory (``mlflow-run.json``), so a resumed run
(``resume``) continues the same MLflow run at the next round rather than starting a second one.

MLflow's HTTP client retries a failed request for minutes by default (7 retries with exponential
back-off, 120 s time-out each); a run must not stall that long on a tracking server that is down, so
this tracker lowers those defaults for its process (:data:`QUICK_HTTP`) unless the environment already sets
them.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pollen.app.trackers.base import FAILED, FINISHED, STOPPED, hyperparameters

#: MLflow's HTTP settings for this tracker's process, where the environment does not set them already.
QUICK_HTTP = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
}

#: The URI schemes ``mlflow-tracking-uri`` may use (a database scheme may name its driver: ``postgresql+psycopg2``).
SCHEMES = ("http", "https", "file", "sqlite", "postgresql", "mysql", "mssql", "databricks")

#: What ``mlflow-tracking-uri`` allows, in words.
URI_WORDS = (
    "empty (a SQLite store: sqlite:///<results-dir>/mlflow.db), http(s)://host:port (a tracking server), "
    "sqlite:///path.db, file:///dir or a directory path, databricks, or a postgresql/mysql/mssql:// database URI"
)

#: MLflow's run status for each way a pollen run ends.
_STATUS = {FINISHED: "FINISHED", STOPPED: "KILLED", FAILED: "FAILED"}

#: The file in a run's results directory that remembers its MLflow run (for ``resume``).
RUN_FILE = "mlflow-run.json"


def is_tracking_uri(text: str) -> bool:
    """Whether ``text`` is a tracking URI this tracker can hand to MLflow (the run-config schema's check)."""
    if not text:
        return True
    parts = urlsplit(text)
    if not parts.scheme or len(parts.scheme) == 1:  # a path (``mlruns``, ``/data/mlruns``, ``C:\\mlruns``)
        return True
    scheme = parts.scheme.split("+", 1)[0]
    if scheme not in SCHEMES:
        return False
    if scheme in ("http", "https"):
        return bool(parts.hostname)
    if scheme == "sqlite":
        return text.startswith("sqlite:///") and len(text) > len("sqlite:///")
    return True


def default_tracking_uri(results_dir: Path) -> str:
    """A SQLite store beside the runs: ``sqlite:///<results-dir>/mlflow.db`` (``mlflow ui`` opens it)."""
    return f"sqlite:///{Path(results_dir).resolve() / 'mlflow.db'}"


def _local_artifact_location(tracking_uri: str) -> str | None:
    """For a SQLite store, artifacts beside the database (else MLflow picks ``./mlartifacts`` of the cwd)."""
    if tracking_uri.startswith("sqlite:///"):
        return (Path(tracking_uri[len("sqlite:///") :]).parent / "mlartifacts").resolve().as_uri()
    return None


class MLflowTracker:
    """One MLflow run in ``experiment`` at ``tracking_uri``, named after the pollen run."""

    name = "mlflow"

    def __init__(self, tracking_uri: str, experiment: str, run_name: str, run_dir: Path) -> None:
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self.run_name = run_name
        self.run_dir = Path(run_dir)
        self.client: Any = None
        self.run_id: str | None = None

    def where(self) -> str:
        run = f", run {self.run_id}" if self.run_id else ""
        return f"{self.tracking_uri}, experiment {self.experiment!r}{run}"

    def start(self, config: Mapping[str, Any], *, resume_at: int | None = None) -> bool:
        for name, value in QUICK_HTTP.items():
            os.environ.setdefault(name, value)
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        if self.tracking_uri.startswith("sqlite:///"):
            Path(self.tracking_uri[len("sqlite:///") :]).parent.mkdir(parents=True, exist_ok=True)
        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        experiment_id = self._experiment_id()
        self.run_id = self._previous_run(experiment_id) if resume_at is not None else None
        continued = self.run_id is not None
        if continued:
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            tags = {"pollen.run-dir": str(self.run_dir)}
            self.run_id = self.client.create_run(experiment_id, run_name=self.run_name, tags=tags).info.run_id
            params = [Param(key, str(value)) for key, value in hyperparameters(config).items()]
            self.client.log_batch(self.run_id, params=params)
        (self.run_dir / RUN_FILE).write_text(
            json.dumps({"tracking_uri": self.tracking_uri, "experiment_id": experiment_id, "run_id": self.run_id})
            + "\n"
        )
        return continued

    def _experiment_id(self) -> str:
        """The id of ``experiment``, created (or restored from MLflow's bin) if needed."""
        found = self.client.get_experiment_by_name(self.experiment)
        if found is None:
            try:
                return self.client.create_experiment(
                    self.experiment, artifact_location=_local_artifact_location(self.tracking_uri)
                )
            except Exception:  # noqa: BLE001 - another run created it meanwhile: use that one
                found = self.client.get_experiment_by_name(self.experiment)
                if found is None:
                    raise
        if found.lifecycle_stage == "deleted":
            self.client.restore_experiment(found.experiment_id)
        return found.experiment_id

    def _previous_run(self, experiment_id: str) -> str | None:
        """The MLflow run this run directory logged to before, if it is in the same store and experiment."""
        try:
            kept = json.loads((self.run_dir / RUN_FILE).read_text())
        except (OSError, ValueError):
            return None
        if kept.get("tracking_uri") != self.tracking_uri or kept.get("experiment_id") != experiment_id:
            return None
        try:
            run = self.client.get_run(str(kept["run_id"]))
        except Exception:  # noqa: BLE001 - the store no longer has it (deleted, another database): a new run
            return None
        return run.info.run_id if run.info.lifecycle_stage == "active" else None

    def log_round(self, step: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        stamp = int(time.time() * 1000)
        batch = [Metric(key, value, stamp, step) for key, value in metrics.items()]
        self.client.log_batch(self.run_id, metrics=batch)

    def finish(self, status: str) -> None:
        if self.client is None or self.run_id is None:
            return
        client, self.client = self.client, None
        client.set_terminated(self.run_id, status=_STATUS[status])
