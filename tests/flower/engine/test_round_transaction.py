"""The contract of :class:`~pollen.strategies.engine.transaction.RoundTransaction`: a round all or nothing.

Whatever a round would change beyond the model is staged (``stage(round, commit)``) while the round is judged;
``settle(round, updates, step, saved=...)`` runs the server step and then every commit the round staged, in the
order staged (commits staged while the step runs belong to the round). It commits nothing when the round has
fewer than ``min_replies`` updates (``Outcome.skipped``: the step is not even called) or when the step raises
(``Outcome.failed`` says why; the error is not raised, the run goes on). With ``rollback=True`` a failed step
leaves the model and the optimiser's state as they were: ``saved()`` (here :func:`model_saved`) is called just
before the step and what it returns puts back the very objects of before; ``rollback=False`` keeps what the
step wrote. ``drop(round)`` forgets a round given up before it was settled, ``staged(round)`` counts what a
round holds. ``min_replies`` is a whole number >= 1 (anything else is a ``ValueError`` naming it).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import pytest

from pollen.optim import sgd
from pollen.strategies.engine.model import GlobalModel
from pollen.strategies.engine.step import ServerStep
from pollen.strategies.engine.transaction import Outcome, RoundTransaction, model_saved
from pollen.testing.fakes import model_record

pytestmark = pytest.mark.flower_compat

UPDATES = ("u1", "u2", "u3")


def model_and_step() -> tuple[GlobalModel, ServerStep]:
    """A model with a float and an integer buffer, and FedAvgM's step on it (eta = momentum = 0.5: exact)."""
    model = GlobalModel()
    model.adopt(
        model_record(
            OrderedDict(
                [
                    ("fc.weight", np.array([1.0, 2.0, 3.0], dtype=np.float32)),
                    ("bn.running_mean", np.array([0.5, -0.5], dtype=np.float32)),
                    ("bn.num_batches_tracked", np.array(4, dtype=np.int64)),
                ]
            )
        )
    )
    step = ServerStep()
    step.start(sgd(eta=0.5, momentum=0.5), model.layout.dim)
    return model, step


def stepping(model: GlobalModel, step: ServerStep, *, then: Exception | None = None) -> Callable[[], None]:
    """A server step as a strategy's: new params, a new buffer value, the optimiser advanced; then ``then``."""

    def run() -> None:
        model.params = step.apply(model.params, np.array([2.0, -4.0, 8.0], dtype=np.float32))
        model.buffers["bn.running_mean"] = np.array([9.0, 9.0], dtype=np.float32)
        model.buffers["bn.num_batches_tracked"] = np.array(99, dtype=np.int64)
        if then is not None:
            raise then

    return run


def noting(events: list[str], name: str) -> Callable[[], None]:
    return lambda: events.append(name)


def no_saved_state() -> Callable[[], None]:
    """``saved`` for a step that writes nothing the transaction must put back."""
    return lambda: None


# ---------------------------------------------------------------------------- commit
def test_the_staged_commits_run_after_the_step_in_the_order_staged() -> None:
    events: list[str] = []
    transaction = RoundTransaction()
    for name in ("ledger", "screen", "rows"):
        transaction.stage(3, noting(events, name))
    assert transaction.staged(3) == 3 and events == []  # staging runs nothing
    outcome = transaction.settle(3, UPDATES, noting(events, "step"), saved=no_saved_state)
    assert events == ["step", "ledger", "screen", "rows"]
    assert outcome == Outcome(list(UPDATES))
    assert outcome.skipped is None and outcome.failed is None and outcome.error is None
    assert transaction.staged(3) == 0  # a commit runs once


def test_a_commit_staged_while_the_step_runs_belongs_to_the_round() -> None:
    events: list[str] = []
    transaction = RoundTransaction()
    transaction.stage(1, noting(events, "before"))

    def step() -> None:
        events.append("step")
        transaction.stage(1, noting(events, "during"))

    transaction.settle(1, UPDATES, step, saved=no_saved_state)
    assert events == ["step", "before", "during"]
    assert transaction.staged(1) == 0


def test_only_the_settled_rounds_commits_run() -> None:
    events: list[str] = []
    transaction = RoundTransaction()
    transaction.stage(1, noting(events, "round 1"))
    transaction.stage(2, noting(events, "round 2"))
    transaction.settle(1, UPDATES, no_saved_state, saved=no_saved_state)
    assert events == ["round 1"]
    assert transaction.staged(2) == 1


def test_a_committed_step_keeps_what_it_wrote() -> None:
    model, step = model_and_step()
    state_before = step.state
    outcome = RoundTransaction().settle(1, UPDATES, stepping(model, step), saved=lambda: model_saved(model, step))
    assert outcome.applied == list(UPDATES)
    np.testing.assert_array_equal(model.params, [2.0, 0.0, 7.0])
    assert step.state is not state_before and step.state.step == 1
    np.testing.assert_array_equal(model.buffers["bn.running_mean"], [9.0, 9.0])


# ---------------------------------------------------------------------------- a failed step
def test_a_step_that_raises_commits_nothing_and_the_outcome_says_why() -> None:
    events: list[str] = []
    transaction = RoundTransaction()
    transaction.stage(2, noting(events, "ledger"))
    error = FloatingPointError("the server step produced NaN or Inf parameters")

    def step() -> None:
        transaction.stage(2, noting(events, "staged by the step"))
        raise error

    outcome = transaction.settle(2, UPDATES, step, saved=no_saved_state)  # does not raise
    assert events == []
    assert outcome.applied == [] and outcome.skipped is None
    assert outcome.failed == (
        "server step failed and was rolled back: FloatingPointError: the server step produced NaN or Inf parameters"
    )
    assert outcome.error is error
    assert transaction.staged(2) == 0
    transaction.settle(2, UPDATES, no_saved_state, saved=no_saved_state)  # the round settled again: nothing left
    assert events == []


def test_a_rolled_back_step_leaves_the_very_objects_of_before_with_their_values() -> None:
    model, step = model_and_step()
    params, buffers, state = model.params, model.buffers, step.state
    buffer_arrays = dict(buffers)
    values = (
        params.copy(),
        {k: v.copy() for k, v in buffers.items()},
        state.step,
        state.slots["momentum_buffer"].copy(),
    )
    outcome = RoundTransaction(rollback=True).settle(
        1, UPDATES, stepping(model, step, then=ValueError("boom")), saved=lambda: model_saved(model, step)
    )
    assert "rolled back" in outcome.failed and "boom" in outcome.failed
    assert model.params is params and model.buffers is buffers and step.state is state
    assert all(model.buffers[name] is array for name, array in buffer_arrays.items())
    np.testing.assert_array_equal(model.params, values[0])
    for name, value in values[1].items():
        np.testing.assert_array_equal(model.buffers[name], value)
    assert step.state.step == values[2]
    np.testing.assert_array_equal(step.state.slots["momentum_buffer"], values[3])
    # the round retried from there gives what a first try gives
    RoundTransaction().settle(1, UPDATES, stepping(model, step), saved=lambda: model_saved(model, step))
    np.testing.assert_array_equal(model.params, [2.0, 0.0, 7.0])
    assert step.state.step == 1


def test_without_rollback_what_the_failed_step_wrote_stays() -> None:
    model, step = model_and_step()
    params, buffers, state = model.params, model.buffers, step.state
    outcome = RoundTransaction(rollback=False).settle(
        1, UPDATES, stepping(model, step, then=ValueError("boom")), saved=lambda: model_saved(model, step)
    )
    assert outcome.failed == "server step failed (not rolled back: rollback=False): boom"
    assert outcome.applied == []
    assert model.params is not params and step.state is not state and model.buffers is not buffers
    np.testing.assert_array_equal(model.params, [2.0, 0.0, 7.0])
    assert step.state.step == 1
    np.testing.assert_array_equal(model.buffers["bn.running_mean"], [9.0, 9.0])
    np.testing.assert_array_equal(buffers["bn.running_mean"], [0.5, -0.5])  # the dict of before was not written


# ---------------------------------------------------------------------------- a skipped round
def test_too_few_replies_skip_the_round_without_calling_the_step_and_drop_its_commits() -> None:
    events: list[str] = []
    transaction = RoundTransaction(min_replies=3)
    transaction.stage(4, noting(events, "ledger"))
    outcome = transaction.settle(4, UPDATES[:2], noting(events, "step"), saved=lambda: events.append("saved"))
    assert outcome == Outcome([], skipped="2 usable replies, fewer than min_replies=3")
    assert outcome.failed is None and outcome.error is None
    assert events == []  # neither the step nor saved() nor a commit ran
    assert transaction.staged(4) == 0


def test_exactly_min_replies_commit() -> None:
    events: list[str] = []
    transaction = RoundTransaction(min_replies=3)
    transaction.stage(1, noting(events, "ledger"))
    outcome = transaction.settle(1, UPDATES, noting(events, "step"), saved=no_saved_state)
    assert outcome.applied == list(UPDATES) and events == ["step", "ledger"]


# ---------------------------------------------------------------------------- drop
def test_a_dropped_round_leaves_nothing_staged_and_the_other_rounds_as_they_were() -> None:
    events: list[str] = []
    transaction = RoundTransaction()
    transaction.stage(5, noting(events, "round 5"))
    transaction.stage(5, noting(events, "round 5 again"))
    transaction.stage(6, noting(events, "round 6"))
    transaction.drop(5)
    transaction.drop(7)  # a round that staged nothing
    assert transaction.staged(5) == 0 and transaction.staged(6) == 1
    transaction.settle(5, UPDATES, no_saved_state, saved=no_saved_state)
    assert events == []


# ---------------------------------------------------------------------------- settings
@pytest.mark.parametrize("min_replies", [0, -1, True, 1.5, "1", None])
def test_a_min_replies_that_is_not_a_whole_number_from_1_is_refused(min_replies: object) -> None:
    with pytest.raises(ValueError, match=rf"^min_replies={min_replies!r} is invalid; allowed: an integer >= 1$"):
        RoundTransaction(min_replies=min_replies)


def test_describe_gives_its_settings() -> None:
    assert RoundTransaction().describe() == {"min_replies": 1, "rollback": True}
    assert RoundTransaction(min_replies=4, rollback=False).describe() == {"min_replies": 4, "rollback": False}
