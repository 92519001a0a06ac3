"""State by declaration: a strategy names what it keeps; the base writes, reads and checks it.

A strategy class sets ``state_fields = {"v_hat": VECTOR, "client_versions": COUNTS, "book": PART}``
(attribute name -> kind). :class:`~pollen.strategies.base.AdaptiveStrategy` writes each declared
attribute into ``state_dict()`` and restores it in ``load_state_dict()`` with the kind's checks,
the way torch's ``Optimizer.state_dict`` serialises ``self.state`` for every optimiser: no strategy
writes its own serialisation.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from pollen.strategies.accounting import Accounting
from pollen.strategies.ledger import AppliedLedger
from pollen.strategies.model import GlobalModel
from pollen.strategies.screening import all_finite
from pollen.strategies.step import ServerStep

#: A flat float32 vector of the model's trainable dimension, finite (or ``None`` before the model is known).
VECTOR = "vector"
#: A whole number >= 0.
COUNT = "count"
#: Client id -> a whole number >= 0 (per-client bookkeeping).
COUNTS = "counts"
#: Named numeric arrays of any shapes, finite (a model or its moments as Flower's strategies keep them).
ARRAYS = "arrays"
#: A collaborator with its own ``state_dict()`` / ``load_state_dict()``.
PART = "part"
KINDS = (VECTOR, COUNT, COUNTS, ARRAYS, PART)


def save_field(kind: str, value: Any) -> Any:
    """The plain form of ``value`` (numpy arrays copied, a part through its ``state_dict``)."""
    if kind == VECTOR:
        return np.array(value, dtype=np.float32, copy=True)
    if kind == COUNT:
        return int(value)
    if kind == COUNTS:
        return {str(k): int(v) for k, v in value.items()}
    if kind == ARRAYS:
        return [[str(key), np.array(array)] for key, array in value.items()]
    if kind == PART:
        return value.state_dict()
    raise ValueError(f"state kind {kind!r} is unknown; allowed: {', '.join(KINDS)}")


def _whole(name: str, value: Any) -> int:
    number = np.asarray(value)
    if number.shape != () or number.dtype.kind not in "iu" or int(number) < 0:
        raise ValueError(f"state '{name}' = {value!r} is not a whole number >= 0")
    return int(number)


def load_field(kind: str, name: str, plain: Any, *, dim: int | None) -> Any:
    """The value of a declared field from its plain form; ``ValueError`` when it cannot be used."""
    if kind == VECTOR:
        vector = np.asarray(plain)
        if vector.dtype != np.float32 or vector.shape != (dim,) or not all_finite(vector):
            raise ValueError(f"state '{name}' must be {dim} finite float32 values, got {vector.shape} {vector.dtype}")
        return np.array(vector)
    if kind == COUNT:
        return _whole(name, plain)
    if kind == COUNTS:
        if not isinstance(plain, Mapping):
            raise ValueError(f"state '{name}' must map client ids to whole numbers")
        return {str(k): _whole(f"{name}[{k}]", v) for k, v in plain.items()}
    if kind == ARRAYS:
        try:
            named = {str(key): np.array(array) for key, array in plain}
        except (TypeError, ValueError):
            raise ValueError(f"state '{name}' must be a list of [name, array] pairs") from None
        for key, array in named.items():
            if array.dtype.kind not in "fiub" or (array.dtype.kind == "f" and not np.isfinite(array).all()):
                raise ValueError(f"state '{name}[{key}]' must hold finite numbers (integer or floating point)")
        return named
    raise ValueError(f"state kind {kind!r} cannot be loaded as a value; allowed: {', '.join(KINDS[:4])}")


def save_declared(owner: Any) -> dict[str, Any]:
    """The plain form of every field ``owner.state_fields`` declares (fields that are ``None`` are left out)."""
    return {
        name: save_field(kind, getattr(owner, name))
        for name, kind in owner.state_fields.items()
        if getattr(owner, name, None) is not None
    }


def load_declared(owner: Any, state: Mapping[str, Any], *, dim: int | None = None) -> None:
    """Check every declared value field of ``state`` first, then set them all on ``owner`` (parts excluded)."""
    values = {
        name: load_field(kind, name, state[name], dim=dim)
        for name, kind in owner.state_fields.items()
        if kind != PART and name in state
    }
    for name, value in values.items():
        setattr(owner, name, value)


def strategy_state(strategy: Any) -> dict[str, Any]:
    """An ``AdaptiveStrategy``'s whole state: its parts (sampler, screen, accounting, model, server step)
    and the fields its class declares in ``state_fields``."""
    state: dict[str, Any] = {
        "strategy": type(strategy).__name__,
        "seed": strategy.seed,
        "sampler": strategy.sampler.state_dict(),
        "screen": strategy.screen.state_dict(),
        "ledger": strategy.ledger.state_dict(),
        "accounting": strategy.accounting.to_dict(),
        **strategy.model.state_dict(),
    }
    if strategy.layout is not None:
        state["optimizer"] = strategy.server_step.state_dict()
    for name, kind in strategy.state_fields.items():
        value = getattr(strategy, name)
        if value is not None:
            state[name] = save_field(kind, value)
    return state


def restore_strategy_state(strategy: Any, state: Mapping[str, Any]) -> None:
    """Load what :func:`strategy_state` wrote into ``strategy`` (same class and model).

    The model, the optimiser state and the declared values are read and checked into new objects
    before anything of the strategy changes; a state that does not fit raises ``ValueError``. Parts
    (``PART``) load themselves, built from the layout first when the strategy has none yet; then
    the class's ``check_state`` hook checks its invariants.
    """
    if state.get("strategy") != type(strategy).__name__:
        raise ValueError(f"state was written by {state.get('strategy')!r}, not {type(strategy).__name__}")
    model, step = GlobalModel(strategy.model.buffer_keys), ServerStep()
    model.load_state_dict(state)
    dim = model.layout.dim if model.layout is not None else None
    if model.layout is not None:
        step.load_state_dict(state["optimizer"], strategy.build_optimizer(model.layout), dim)
    values = {
        name: load_field(kind, name, state[name], dim=dim)
        for name, kind in strategy.state_fields.items()
        if kind != PART and name in state
    }
    ledger = AppliedLedger()
    ledger.load_state_dict(state.get("ledger", {}))
    strategy.seed = state["seed"]
    strategy.sampler.load_state_dict(state["sampler"])
    strategy.screen.load_state_dict(state.get("screen", {}))
    strategy.accounting = Accounting.from_dict(state["accounting"])
    strategy.model, strategy.server_step, strategy.ledger = model, step, ledger
    for name, value in values.items():
        setattr(strategy, name, value)
    for name, kind in strategy.state_fields.items():
        if kind == PART and name in state:
            if getattr(strategy, name) is None and strategy.layout is not None:
                strategy.on_layout(strategy.layout)
            getattr(strategy, name).load_state_dict(state[name])
    strategy.check_state()
