"""The client steps pollen's ClientApp runs, in one explicit table.

The strategy names the local step of a train message in its config (``pollen.local-step``, default
``"sgd"``) and the handler of a mid-round message (``pollen.phase``); the ClientApp looks both up in
:data:`LOCAL_STEPS` and :data:`PHASES` instead of growing a branch per method. Each step is a plain
function ``run(work: LocalWork) -> StepOutcome`` in the module named like the method's strategy
(``strategies/fedlamb.py`` <-> ``steps/fedlamb.py``). Nothing registers itself on import: a table is
what its author writes down, as a DDP user registers a comm hook.

A ClientApp with steps of its own builds its tables from these::

    from pollen.clientside.steps import LOCAL_STEPS, PHASES, with_steps

    local_steps, phases = with_steps(local_steps={"my-step": my_step}, phases={"my-phase": my_phase})
    # or, to replace one of pollen's: local_steps = {**LOCAL_STEPS, "sgd": my_sgd}
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from pollen.clientside.steps import fedlamb, hafed, sgd
from pollen.clientside.steps.work import LocalWork, Step, StepOutcome, load_flat, model_arrays, run_sgd, train_metrics
from pollen.wire import protocol

__all__ = [
    "LOCAL_STEPS",
    "PHASES",
    "LocalWork",
    "Step",
    "StepOutcome",
    "load_flat",
    "lookup",
    "model_arrays",
    "run_sgd",
    "train_metrics",
    "with_steps",
]

#: The local step of a train message, by the name the strategy sends in ``pollen.local-step``.
LOCAL_STEPS: Mapping[str, Step] = MappingProxyType(
    {
        "sgd": sgd.run,
        protocol.ADAPTIVE_LOCAL_STEP: fedlamb.run,  # Fed-LAMB, Mime-LAMB, Fed-AMS, Mime
        protocol.GOSSIP_LOCAL_STEP: hafed.run_local,
    }
)

#: The handler of a mid-round message (``train.pollen_phase``), by the name in ``pollen.phase``.
PHASES: Mapping[str, Step] = MappingProxyType(
    {
        protocol.GOSSIP_PHASE: hafed.run_gossip,
    }
)


def with_steps(
    *, local_steps: Mapping[str, Step] | None = None, phases: Mapping[str, Step] | None = None
) -> tuple[Mapping[str, Step], Mapping[str, Step]]:
    """pollen's tables plus ``local_steps`` and ``phases``: new read-only tables ``(local_steps, phases)``.

    A name pollen's tables already hold is refused (``ValueError``); to replace one of pollen's steps,
    merge the dicts yourself (``{**LOCAL_STEPS, "sgd": my_sgd}``).
    """
    return _merged(LOCAL_STEPS, local_steps or {}, "local step"), _merged(PHASES, phases or {}, "phase")


def _merged(base: Mapping[str, Step], extra: Mapping[str, Step], what: str) -> Mapping[str, Step]:
    clash = sorted(set(base) & set(extra))
    if clash:
        raise ValueError(
            f"{what} {clash[0]!r} is one of pollen's; allowed: a new name, or merge the dicts to replace it"
        )
    return MappingProxyType({**base, **extra})


def lookup(table: Mapping[str, Step], name: str, what: str) -> Step:
    """The handler for ``name``; ``ValueError`` naming what is allowed."""
    if name not in table:
        raise ValueError(f"{what} {name!r} is unknown to this ClientApp; allowed: {', '.join(sorted(table))}")
    return table[name]
