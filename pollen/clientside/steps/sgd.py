"""Plain local SGD, the local step of every method that names none (``pollen.local-step`` ``"sgd"``)."""

from __future__ import annotations

from pollen.clientside.steps.work import LocalWork, StepOutcome, run_sgd, train_metrics


def run(work: LocalWork) -> StepOutcome:
    """Plain local SGD: K steps (``local-steps``) or E epochs (``local-epochs``)."""
    return StepOutcome(train_metrics(run_sgd(work, None)))
