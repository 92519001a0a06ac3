"""The local learning-rate schedule of run-config ``lr-schedule`` (constant, or step decay).

The message's ``local-lr`` is the base rate; ``step`` multiplies ``local-lr`` by ``lr-decay-factor`` at each round
listed in ``lr-decay-rounds``: with ``"30,70"`` and factor 0.1, rounds 1-29 use ``local-lr``, rounds 30-69
use a tenth of it and rounds 70 on a hundredth (the Fed-LAMB paper's ResNet-18 runs, spec
``papers/fedlamb.md`` §6). Every ClientApp computes the rate of a round from the run-config and
the round number the message carries, so the schedule needs no extra bytes on the wire and
applies to every strategy's local step alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

SCHEDULES = ("constant", "step")


def parse_decay_rounds(text: str) -> tuple[int, ...]:
    """``"30,70"`` -> ``(30, 70)``; ``ValueError`` unless strictly increasing integers >= 2 (or empty)."""
    text = text.strip()
    if not text:
        return ()
    try:
        rounds = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"lr-decay-rounds {text!r} is not a comma-separated list of integers") from None
    if any(r < 2 for r in rounds) or list(rounds) != sorted(set(rounds)):
        raise ValueError(f"lr-decay-rounds {text!r} must be strictly increasing rounds >= 2")
    return rounds


def lr_factor(schedule: str, decay_rounds: tuple[int, ...], factor: float, server_round: int) -> float:
    """What ``local-lr`` is multiplied by in ``server_round`` (1 for ``constant``)."""
    if schedule == "constant":
        return 1.0
    if schedule != "step":
        raise ValueError(f"lr-schedule {schedule!r} is unknown; allowed: {', '.join(SCHEDULES)}")
    return float(factor) ** sum(1 for r in decay_rounds if server_round >= r)


def schedule_factor(cfg: Mapping[str, Any], server_round: int) -> float:
    """What the run-config's schedule multiplies ``local-lr`` by in ``server_round``."""
    rounds = parse_decay_rounds(str(cfg["lr-decay-rounds"]))
    return lr_factor(str(cfg["lr-schedule"]), rounds, float(cfg["lr-decay-factor"]), server_round)


def local_lr(cfg: Mapping[str, Any], server_round: int) -> float:
    """The local learning rate of ``server_round`` under the run-config's schedule."""
    return float(cfg["local-lr"]) * schedule_factor(cfg, server_round)
