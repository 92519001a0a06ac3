"""A run's checkpoint: the global model, the strategy's full state and the results so far, per round.

:class:`RunCheckpoint` is what :meth:`pollen.strategies.rounds.RoundLoop.start` writes after every round
and reads back to resume. The file (``<run dir>/checkpoint.npz``) is written atomically by
:mod:`pollen.core.checkpoint` (temporary file, fsync, rename), so a crash while writing leaves the previous
checkpoint usable, and it is read without pickle. A checkpoint is tied to what wrote it: the strategy
class and a fingerprint (the app passes its run-config); resuming with another strategy, model or
setting is refused with one line that says what differs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, MetricRecord
from flwr.serverapp.strategy import Result

from pollen.core.checkpoint import CheckpointError, describe_difference, load_checkpoint, save_checkpoint
from pollen.wire.records import arrays_to_record, record_to_arrays

CHECKPOINT_FILE = "checkpoint.npz"
_RESULT_FIELDS = ("train_metrics_clientapp", "evaluate_metrics_clientapp", "evaluate_metrics_serverapp")


@dataclass
class SavedRound:
    """What a checkpoint restores: the last complete round, its model and results, the app's own state."""

    server_round: int
    arrays: ArrayRecord
    result: Result
    app_state: dict[str, Any]


class RunCheckpoint:
    """Where a run checkpoints, and whether it resumes from there.

    Parameters
    ----------
    run_dir : str | Path
        Directory of the run; the checkpoint is ``run_dir/checkpoint.npz``.
    resume : bool (default: False)
        Continue from the checkpoint in ``run_dir`` (it must exist) instead of starting at round 1.
    fingerprint : mapping (default: empty)
        Settings that must be equal to resume (the app passes its run-config).
    ignore : iterable of str
        Fingerprint keys allowed to differ on resume (e.g. the number of rounds, the device).
    stop_after_round : int (default: 0)
        Stop the loop (``RunInterrupted``) after this round's checkpoint; 0 never stops. For tests and
        for splitting a long run into jobs.
    app_state : callable, optional
        Returns extra JSON-able/numpy state to keep with each checkpoint (the app's result rows).
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        resume: bool = False,
        fingerprint: Mapping[str, Any] | None = None,
        ignore: Iterable[str] = (),
        stop_after_round: int = 0,
        app_state: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.path = Path(run_dir) / CHECKPOINT_FILE
        self.resume = resume
        self.fingerprint = dict(fingerprint or {})
        self.ignore = tuple(ignore)
        self.stop_after_round = stop_after_round
        self.app_state = app_state
        self.last_bytes = 0
        self.last_seconds = 0.0

    # ------------------------------------------------------------------ write
    def save(self, server_round: int, arrays: ArrayRecord, strategy: Any, result: Result) -> None:
        """Write the checkpoint of a complete round (atomically)."""
        started = time.perf_counter()
        named = record_to_arrays(arrays)
        tree = {
            "round": int(server_round),
            "strategy_class": type(strategy).__name__,
            "fingerprint": self.fingerprint,
            "arrays": [[name, np.array(value)] for name, value in named.items()],
            "strategy": strategy.state_dict(),
            "result": {name: _metrics_to_tree(getattr(result, name)) for name in _RESULT_FIELDS},
            "app": self.app_state() if self.app_state is not None else {},
        }
        self.last_bytes = save_checkpoint(self.path, tree)
        self.last_seconds = time.perf_counter() - started

    # ------------------------------------------------------------------ read
    def validate(self, strategy_class: str) -> int:
        """Check that the checkpoint exists and fits this run; return its round. ``CheckpointError`` if not."""
        return int(self._read(strategy_class)["round"])

    def read_app_state(self, strategy_class: str) -> dict[str, Any]:
        """The app's own state kept with the checkpoint (after the same checks as :meth:`load`)."""
        return dict(self._read(strategy_class).get("app", {}))

    def load(self, strategy: Any) -> SavedRound:
        """Restore ``strategy`` from the checkpoint and return the round, model and results it holds."""
        tree = self._read(type(strategy).__name__)
        strategy.load_state_dict(tree["strategy"])
        arrays = arrays_to_record({name: np.asarray(value) for name, value in tree["arrays"]})
        result = Result(arrays=arrays)
        for name in _RESULT_FIELDS:
            setattr(result, name, _metrics_from_tree(tree["result"].get(name, {})))
        return SavedRound(int(tree["round"]), arrays, result, dict(tree.get("app", {})))

    def _read(self, strategy_class: str) -> dict[str, Any]:
        if not self.path.is_file():
            raise CheckpointError(f"nothing to resume: {self.path} does not exist")
        tree = load_checkpoint(self.path)
        for key in ("round", "strategy_class", "fingerprint", "arrays", "strategy", "result"):
            if key not in tree:
                raise CheckpointError(f"checkpoint {self.path.name} lacks '{key}'")
        if tree["strategy_class"] != strategy_class:
            raise CheckpointError(
                f"resume refused: the checkpoint was written by {tree['strategy_class']}, "
                f"this run uses {strategy_class}"
            )
        difference = describe_difference(tree["fingerprint"], self.fingerprint, ignore=self.ignore)
        if difference is not None:
            raise CheckpointError(f"resume refused: {difference}")
        return tree


def _metrics_to_tree(history: Mapping[int, MetricRecord]) -> dict[str, dict[str, Any]]:
    return {str(r): dict(record) for r, record in history.items()}


def _metrics_from_tree(tree: Mapping[str, Mapping[str, Any]]) -> dict[int, MetricRecord]:
    return {int(r): MetricRecord(dict(values)) for r, values in tree.items()}
