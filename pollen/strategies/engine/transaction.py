"""A round's changes as one transaction: staged while the round is judged, committed or dropped together.

Everything a round would change (the model and the optimiser's state, a method's moments, table rows, mirrors
and references, the ledger's entries, the screen's history) is either written by the server step into spare
arrays or staged here as a commit; :meth:`RoundTransaction.settle` runs the step and then every staged commit,
or, when the round has too few replies or the step fails, drops all of it. A skipped round, a failed step and a
rolled-back one take the same path: nothing staged for the round is kept, and the model is the one of before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from logging import WARNING
from typing import Any, TypeVar

from flwr.common import log

from pollen.strategies.engine.collector import reason_of
from pollen.strategies.engine.model import GlobalModel
from pollen.strategies.engine.step import ServerStep

Update = TypeVar("Update")


@dataclass
class Outcome:
    """What a round's transaction did: the updates it applied (empty unless it committed) and, if it did
    not commit, why (``skipped``: too few replies; ``failed``: the step's error, as ``error``)."""

    applied: list[Any]
    skipped: str | None = None
    failed: str | None = None
    error: BaseException | None = field(default=None, repr=False)

    def report(self, stats: Any, server_round: int, had_updates: bool) -> None:
        """Count a round that did not commit as failed (a skipped one only when it had usable replies) and log why."""
        if self.skipped is not None:
            if had_updates:
                stats.fail(f"round skipped: {self.skipped}")
            log(WARNING, "aggregate_train: round %d skipped (%s); the model is unchanged", server_round, self.skipped)
        if self.failed is not None:
            stats.fail(self.failed)
            log(WARNING, "aggregate_train: round %d: %s", server_round, self.failed)


class RoundTransaction:
    """All or nothing for one round at a time.

    Parameters
    ----------
    min_replies : int (default: 1)
        Fewer usable replies than this and the round is skipped (the model unchanged), with a reason.
    rollback : bool (default: True)
        Put the model and optimiser state of before the step back if the step fails or yields non-finite
        values (the round then counts as failed). Nothing is copied for it: the step writes into spare
        arrays, so going back is keeping the old references. ``False`` leaves whatever the step wrote.
    """

    def __init__(self, *, min_replies: int = 1, rollback: bool = True) -> None:
        if not isinstance(min_replies, int) or isinstance(min_replies, bool) or min_replies < 1:
            raise ValueError(f"min_replies={min_replies!r} is invalid; allowed: an integer >= 1")
        self.min_replies = min_replies
        self.rollback = bool(rollback)
        self._staged: dict[int, list[Callable[[], None]]] = {}

    def stage(self, server_round: int, commit: Callable[[], None]) -> None:
        """Keep ``commit`` to run after ``server_round``'s step succeeds (in the order staged), else drop it."""
        self._staged.setdefault(server_round, []).append(commit)

    def staged(self, server_round: int) -> int:
        """How many commits ``server_round`` holds (for tests and logs)."""
        return len(self._staged.get(server_round, ()))

    def drop(self, server_round: int) -> None:
        """Forget what ``server_round`` staged (its round was given up before reaching :meth:`settle`)."""
        self._staged.pop(server_round, None)

    def settle(
        self,
        server_round: int,
        updates: Sequence[Update],
        step: Callable[[], None],
        *,
        saved: Callable[[], Callable[[], None]],
    ) -> Outcome:
        """Run ``step`` on ``updates`` and commit what the round staged (commits staged while ``step`` runs
        are part of the round). ``saved()`` is called just before the step and returns what puts the state
        the step writes back (:func:`model_saved` for a flat-vector model and its optimiser). The step's
        error is not raised: the run goes on, and the outcome says why."""
        if len(updates) < self.min_replies:
            self.drop(server_round)
            return Outcome([], skipped=f"{len(updates)} usable replies, fewer than min_replies={self.min_replies}")
        put_back = saved()
        try:
            step()
        except Exception as err:  # noqa: BLE001 - the round fails, the run goes on with the old state
            if self.rollback:
                put_back()
            self.drop(server_round)
            undone = "failed and was rolled back" if self.rollback else "failed (not rolled back: rollback=False)"
            return Outcome([], failed=f"server step {undone}: {reason_of(err)}", error=err)
        for commit in self._staged.pop(server_round, []):
            commit()
        return Outcome(list(updates))

    def describe(self) -> dict[str, Any]:
        """Its settings, for a strategy's summary."""
        return {"min_replies": self.min_replies, "rollback": self.rollback}


def model_saved(model: GlobalModel, server_step: ServerStep) -> Callable[[], None]:
    """What puts the model and the optimiser's state of now back after a step. Nothing is copied: the step
    writes into spare arrays and a new buffers dict, so going back is keeping the references of now."""
    params, state, buffers = model.params, server_step.state, model.buffers
    model.buffers = dict(buffers)

    def put_back() -> None:
        server_step.keep(params, state, model.params)
        model.params, model.buffers = params, buffers

    return put_back
