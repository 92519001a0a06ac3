"""The contract of :class:`~pollen.strategies.engine.step.ServerStep`, the server optimiser stepped as a transaction.

``start(optimizer, d)`` puts a :mod:`pollen.optim` transform in its initial state; ``apply(x, delta)`` returns
``x + step(delta)`` in a spare vector and advances the state, writing neither ``x`` nor the state before
(double-buffered: from the second step on, no ``d``-sized array is allocated). A failed round goes back with
``keep`` (the state of before; what was computed becomes the spares). A step whose new state holds NaN or
Inf raises ``FloatingPointError`` and changes nothing. The state is saved as the optimiser's plain dict and
restored only when it fits the optimiser and ``d`` (else a ``StateError`` naming the field, nothing changed).
"""

from __future__ import annotations

import numpy as np
import pytest

from pollen.core.state_fields import StateError
from pollen.optim import adagrad, sgd
from pollen.strategies.engine.step import ServerStep

pytestmark = pytest.mark.flower_compat

X0 = (1.0, 2.0, 3.0)
DELTA = (2.0, -4.0, 8.0)


def x0() -> np.ndarray:
    """A fresh model vector (a step reuses the vector it was given two rounds ago: never share one)."""
    return np.array(X0, dtype=np.float32)


def delta() -> np.ndarray:
    return np.array(DELTA, dtype=np.float32)


def momentum_step() -> ServerStep:
    """FedAvgM with eta = momentum = 0.5: every number below is exact in float32."""
    step = ServerStep()
    step.start(sgd(eta=0.5, momentum=0.5), 3)
    return step


# ---------------------------------------------------------------------------- start and apply
def test_start_puts_the_optimizer_in_its_initial_state() -> None:
    step = momentum_step()
    assert step.state.step == 0
    assert list(step.state.slots) == ["momentum_buffer"]
    np.testing.assert_array_equal(step.state.slots["momentum_buffer"], np.zeros(3, np.float32))


def test_apply_with_plain_averaging_adds_the_delta_exactly() -> None:
    step = ServerStep()
    step.start(sgd(eta=1.0), 3)
    np.testing.assert_array_equal(step.apply(x0(), delta()), [3.0, -2.0, 11.0])
    assert step.state.step == 1


def test_apply_is_x_plus_the_optimizer_step_round_after_round() -> None:
    step = momentum_step()
    x1 = step.apply(x0(), delta())  # buf = delta; x + 0.5 * buf
    np.testing.assert_array_equal(x1, [2.0, 0.0, 7.0])
    np.testing.assert_array_equal(step.state.slots["momentum_buffer"], delta())
    x2 = step.apply(x1, delta())  # buf = 0.5 * delta + delta
    np.testing.assert_array_equal(x2, [3.5, -3.0, 13.0])
    np.testing.assert_array_equal(step.state.slots["momentum_buffer"], [3.0, -6.0, 12.0])
    assert step.state.step == 2


def test_apply_writes_neither_the_old_params_nor_the_old_state() -> None:
    step = momentum_step()
    start, before = x0(), step.state
    x1 = step.apply(start, delta())
    assert x1 is not start and not np.shares_memory(x1, start)
    np.testing.assert_array_equal(start, X0)
    assert before.step == 0
    np.testing.assert_array_equal(before.slots["momentum_buffer"], np.zeros(3, np.float32))
    state1 = step.state
    x2 = step.apply(x1, delta())
    np.testing.assert_array_equal(x1, [2.0, 0.0, 7.0])  # the model of the round before stays readable
    np.testing.assert_array_equal(state1.slots["momentum_buffer"], delta())
    assert not np.shares_memory(x2, x1)


def test_from_the_second_step_on_the_new_params_go_into_the_spare_vector() -> None:
    step = momentum_step()
    start = x0()
    x1 = step.apply(start, delta())
    x2 = step.apply(x1, delta())
    assert x2 is start  # the vector discarded a round ago: no d-sized allocation per round
    np.testing.assert_array_equal(x2, [3.5, -3.0, 13.0])


# ---------------------------------------------------------------------------- keep (roll back)
def test_keep_goes_back_to_the_state_before_a_failed_step() -> None:
    step = momentum_step()
    x1 = step.apply(x0(), delta())
    state1 = step.state
    failed = step.apply(x1, delta())
    step.keep(x1, state1, failed)
    assert step.state is state1
    np.testing.assert_array_equal(x1, [2.0, 0.0, 7.0])
    # the round is retried from where it was: the same numbers as if the failed step never happened
    retried = step.apply(x1, np.array([4.0, 4.0, 4.0], dtype=np.float32))
    np.testing.assert_array_equal(retried, [2.0 + 0.5 * 5.0, 0.0 + 0.5 * 2.0, 7.0 + 0.5 * 8.0])
    assert step.state.step == 2


def test_keep_with_nothing_applied_changes_nothing() -> None:
    step = momentum_step()
    start, before = x0(), step.state
    step.keep(start, before, start)
    assert step.state is before
    np.testing.assert_array_equal(step.apply(start, delta()), [2.0, 0.0, 7.0])


def test_a_step_that_makes_the_state_non_finite_raises_and_changes_nothing() -> None:
    step = ServerStep()
    step.start(adagrad(eta=1.0, eps=1e-3), 2)
    start, before = np.zeros(2, np.float32), step.state
    with (
        np.errstate(over="ignore"),
        pytest.raises(FloatingPointError, match="NaN or Inf in the optimiser's 'z'"),
    ):
        step.apply(start, np.array([1e30, 1.0], dtype=np.float32))  # 1e60 overflows float32
    assert step.state is before and before.step == 0
    np.testing.assert_array_equal(start, [0.0, 0.0])
    np.testing.assert_array_equal(before.slots["z"], [0.0, 0.0])


# ---------------------------------------------------------------------------- scratch
def test_scratch_is_one_float32_vector_kept_across_rounds() -> None:
    step = ServerStep()
    first = step.scratch(5)
    assert first.dtype == np.float32 and first.shape == (5,)
    assert step.scratch(5) is first
    other = step.scratch(6)
    assert other is not first and other.shape == (6,)


# ---------------------------------------------------------------------------- state
def test_state_dict_is_empty_before_start() -> None:
    assert ServerStep().state_dict() == {}


def test_a_restored_step_continues_exactly_as_the_uninterrupted_one() -> None:
    step = momentum_step()
    x1 = step.apply(x0(), delta())
    saved = step.state_dict()
    assert saved["step"] == 1
    np.testing.assert_array_equal(saved["slots"]["momentum_buffer"], delta())
    resumed = ServerStep()
    resumed.load_state_dict(saved, sgd(eta=0.5, momentum=0.5), 3)
    assert resumed.state.step == 1
    np.testing.assert_array_equal(resumed.apply(x1.copy(), delta()), step.apply(x1.copy(), delta()))
    np.testing.assert_array_equal(resumed.state.slots["momentum_buffer"], [3.0, -6.0, 12.0])


def saved_momentum(**change) -> dict:  # noqa: ANN003
    state = {"step": 1, "slots": {"momentum_buffer": np.array([2.0, -4.0, 8.0], dtype=np.float32)}}
    state.update(change)
    return state


@pytest.mark.parametrize(
    ("state", "field", "expected"),
    [
        (
            saved_momentum(slots={"momentum_buffer": np.ones(2, np.float32)}),
            "optimizer/slots/momentum_buffer",
            r"has shape \(2,\); expected \(3,\)",
        ),
        (saved_momentum(slots={}), "optimizer/slots/momentum_buffer", "is missing"),
        (
            saved_momentum(slots={"momentum_buffer": np.ones(3, np.float32), "v": np.ones(3, np.float32)}),
            "optimizer/slots/v",
            "is not a field",
        ),
        (
            saved_momentum(slots={"momentum_buffer": np.array([1.0, np.nan, 3.0], np.float32)}),
            "optimizer/slots/momentum_buffer",
            "expected finite values",
        ),
        (saved_momentum(step=-1), "optimizer/step", "is -1; expected an integer in"),
        (
            saved_momentum(slots={"momentum_buffer": np.array([0.0, 2e6, 0.0], np.float32)}),
            "optimizer/slots/momentum_buffer",
            "expected values <=",
        ),
        ({"step": 1}, "optimizer/slots", "is missing"),
    ],
    ids=["short-slot", "missing-slot", "unknown-slot", "nan", "negative-step", "beyond-bound", "no-slots"],
)
def test_a_bad_saved_state_is_refused_naming_the_field_and_the_step_is_unchanged(state, field, expected) -> None:  # noqa: ANN001
    step = momentum_step()
    x1 = step.apply(x0(), delta())
    before = step.state
    with pytest.raises(StateError, match=expected) as refused:
        step.load_state_dict(state, sgd(eta=0.5, momentum=0.5), 3, max_moment=1.0)  # other slots: within 1e6
    assert refused.value.field == field
    assert step.state is before
    np.testing.assert_array_equal(step.apply(x1, delta()), [3.5, -3.0, 13.0])


def test_a_second_moment_must_not_be_negative() -> None:
    with pytest.raises(StateError, match="expected values >= 0 \\(a second moment\\)") as refused:
        ServerStep().load_state_dict(
            {"step": 1, "slots": {"z": np.array([-1.0, 2.0], np.float32)}}, adagrad(eta=1.0), 2
        )
    assert refused.value.field == "optimizer/slots/z"
