"""Experiment trackers: a run's rounds in TensorBoard or MLflow, as it goes.

``tracker=tensorboard`` writes event files (``<tracker-dir>/<run-name>``), ``tracker=mlflow`` logs to an MLflow
tracking URI (a SQLite store under ``results-dir`` by default, or a tracking server); ``tracker=tensorboard,mlflow``
does both. Each round the ServerApp's round reporter hands the results row it writes to ``metrics.csv`` to
the trackers: accuracy, loss, bytes each way in all and per record kind, round seconds and every other
number of the row; the resolved run-config is logged once as hyper-parameters. A tracker that fails
(a server that cannot be reached, a directory that cannot be written) is reported once and left out for
the rest of the run; the run goes on.

- :mod:`~pollen.app.trackers.base`: the names, a results row as metrics, the :class:`Tracker` protocol;
- :mod:`~pollen.app.trackers.tensorboard`, :mod:`~pollen.app.trackers.mlflow`: the two trackers (their
  libraries are optional extras, imported only when chosen);
- :mod:`~pollen.app.trackers.guard`: a tracker's failure costs one warning, never the run;
- :mod:`~pollen.app.trackers.factory`: the run's trackers from its run-config.
"""

from pollen.app.trackers.base import TRACKERS, Tracker, round_metrics, tracker_names
from pollen.app.trackers.factory import TRACKER_KEYS, RunTrackers, open_trackers

__all__ = ["TRACKERS", "TRACKER_KEYS", "RunTrackers", "Tracker", "open_trackers", "round_metrics", "tracker_names"]
