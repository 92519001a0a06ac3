"""A tracker that cannot stop the run: its first failure is logged once, then it is left alone.

Tracking is a view of the run, not the run: an MLflow server that is down or goes away, a TensorBoard
directory that cannot be written, any error from the tracker's library, costs one warning line and the
rest of that tracker's records, never a round. The run's own results (``metrics.csv``, ``metrics.json``)
are written either way.
"""

from __future__ import annotations

from collections.abc import Mapping
from logging import WARNING
from typing import Any

from flwr.common import log

from pollen.app.trackers.base import FAILED, Tracker


def _one_line(err: BaseException, limit: int = 300) -> str:
    """An error in one short line (MLflow's HTTP errors span lines and carry a retry history)."""
    text = " ".join(str(err).split()) or type(err).__name__
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return f"{type(err).__name__}: {text}"


class Guarded:
    """Calls a :class:`~pollen.app.trackers.base.Tracker` and swallows its failures, saying so once.

    After the first failure the tracker is closed (as failed, quietly) and no further call reaches it, so an
    unreachable server costs one time-out, not one per round, and the log holds one line, not one per round.
    """

    def __init__(self, tracker: Tracker) -> None:
        self.tracker = tracker
        self.failed = False

    @property
    def name(self) -> str:
        return self.tracker.name

    def _guard(self, what: str, call: Any, *args: Any, **kwargs: Any) -> None:
        if self.failed:
            return
        try:
            call(*args, **kwargs)
        except Exception as err:  # noqa: BLE001 - any failure of a tracker's library: report once, go on
            self.failed = True
            log(
                WARNING,
                "[pollen] tracker %s (%s) failed to %s and is off for the rest of this run; the run goes on "
                "and its results are still written: %s",
                self.tracker.name,
                self._where(),
                what,
                _one_line(err),
            )
            try:
                self.tracker.finish(FAILED)
            except Exception:  # noqa: BLE001, S110 - it already failed once; the warning above says so
                pass

    def _where(self) -> str:
        try:
            return self.tracker.where()
        except Exception:  # noqa: BLE001 - only words for the warning
            return "?"

    def start(self, config: Mapping[str, Any], *, resume_at: int | None = None) -> bool:
        """The tracker's answer (whether it continues an earlier record); False if it failed."""
        answer: list[bool] = []
        self._guard("start", lambda: answer.append(bool(self.tracker.start(config, resume_at=resume_at))))
        return bool(answer and answer[0])

    def log_round(self, step: int, metrics: Mapping[str, float]) -> None:
        self._guard(f"log round {step}", self.tracker.log_round, step, metrics)

    def finish(self, status: str) -> None:
        self._guard("close", self.tracker.finish, status)
