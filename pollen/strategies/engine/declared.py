"""State by declaration: a strategy names what it keeps; the base writes, reads and checks it.

A strategy class sets ``state_fields = {"v_hat": VECTOR, "client_versions": COUNTS, "book": PART}``
(attribute name -> kind). :class:`~pollen.strategies.engine.strategy.AdaptiveStrategy` writes each declared
attribute into ``state_dict()`` and restores it in ``load_state_dict()`` with the kind's checks,
the way torch's ``Optimizer.state_dict`` serialises ``self.state`` for every optimiser: no strategy
writes its own serialisation.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from pollen.core import state_fields as fields
from pollen.strategies.engine.model import GlobalModel
from pollen.strategies.engine.screening import DEFAULT_MAX_ABS
from pollen.strategies.engine.step import ServerStep

#: A flat float32 vector of the model's trainable dimension, finite (or ``None`` before the model is known).
VECTOR = "vector"
#: A VECTOR of second moments: finite, >= 0 and at most the updates' hard limit (``max_abs``; see
#: :data:`pollen.strategies.engine.step.SECOND_MOMENTS` for why that bound).
MOMENT = "moment"
#: A whole number >= 0.
COUNT = "count"
#: Client id -> a whole number >= 0 (per-client bookkeeping).
COUNTS = "counts"
#: Client id -> a round of this run (0 to the checkpoint's round).
ROUNDS = "rounds"
#: Named numeric arrays of any shapes, finite (a model or its moments as Flower's strategies keep them).
ARRAYS = "arrays"
#: A collaborator with its own ``state_dict()`` / ``prepare_load()`` (or ``load_state_dict()``).
PART = "part"
KINDS = (VECTOR, MOMENT, COUNT, COUNTS, ROUNDS, ARRAYS, PART)
#: The longest client id a saved state may hold (as the sampler accepts).
MAX_CLIENT_ID_LENGTH = 256


def save_field(kind: str, value: Any) -> Any:
    """The plain form of ``value`` (numpy arrays copied, a part through its ``state_dict``)."""
    if kind in (VECTOR, MOMENT):
        return np.array(value, dtype=np.float32, copy=True)
    if kind == COUNT:
        return int(value)
    if kind in (COUNTS, ROUNDS):
        return {str(k): int(v) for k, v in value.items()}
    if kind == ARRAYS:
        return [[str(key), np.array(array)] for key, array in value.items()]
    if kind == PART:
        return value.state_dict()
    raise ValueError(f"state kind {kind!r} is unknown; allowed: {', '.join(KINDS)}")


def load_field(
    kind: str,
    name: str,
    plain: Any,
    *,
    dim: int | None,
    where: str = "",
    max_moment: float = DEFAULT_MAX_ABS,
    last_round: int | None = None,
) -> Any:
    """The value of a declared field from its plain form; :class:`~pollen.core.state_fields.StateError`
    (a ``ValueError`` naming the field ``where/name``) when it cannot be used."""
    at = fields.join(where, name)
    if kind in (VECTOR, MOMENT):
        if dim is None:
            raise fields.StateError(at, "is saved but the state has no model; expected no such field")
        moment = kind == MOMENT
        return np.array(
            fields.float_vector(
                plain,
                at,
                dim,
                low=0.0 if moment else None,
                high=max_moment if moment else None,
                what="(a second moment)" if moment else "",
            )
        )
    if kind == COUNT:
        return fields.whole(plain, at)
    if kind in (COUNTS, ROUNDS):
        high = last_round if kind == ROUNDS and last_round is not None else fields.MAX_COUNT
        out = {}
        for key, value in fields.mapping(plain, at).items():
            if not key or len(key) > MAX_CLIENT_ID_LENGTH:
                raise fields.StateError(fields.join(at, key), "is keyed by an empty or over-long client id")
            out[key] = fields.whole(value, fields.join(at, key), high=high)
        return out
    if kind == ARRAYS:
        named = {}
        for key, array in fields.pairs(plain, at):
            named[key] = np.array(fields.numeric_array(array, fields.join(at, key)))
        return named
    raise ValueError(f"state kind {kind!r} cannot be loaded as a value; allowed: {', '.join(KINDS[:-1])}")


def save_declared(owner: Any) -> dict[str, Any]:
    """The plain form of every field ``owner.state_fields`` declares (fields that are ``None`` are left out)."""
    return {
        name: save_field(kind, getattr(owner, name))
        for name, kind in owner.state_fields.items()
        if getattr(owner, name, None) is not None
    }


def load_declared(owner: Any, state: Mapping[str, Any], *, dim: int | None = None, where: str = "") -> None:
    """Check every declared value field of ``state`` first, then set them all on ``owner`` (parts excluded)."""
    values = {
        name: load_field(kind, name, state[name], dim=dim, where=where)
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
        **{name: getattr(strategy, name).state_dict() for name in ENGINE_PARTS},
        **strategy.model.state_dict(),
    }
    if strategy.layout is not None:
        state["optimizer"] = strategy.server_step.state_dict()
    if getattr(strategy, "privacy", None) is not None:
        state["privacy"] = strategy.privacy.state_dict()
    for name, kind in strategy.state_fields.items():
        value = getattr(strategy, name)
        if value is not None:
            state[name] = save_field(kind, value)
    return state


#: The engine's parts saved under their own names, each with ``state_dict()`` and ``prepare_load(state, ...)``
#: (checked, then committed into the strategy's own part); the model and the optimiser's state are saved flat.
ENGINE_PARTS = ("sampler", "screen", "ledger", "accounting")
#: What every saved ``AdaptiveStrategy`` holds, and what it holds once its model is known.
_ALWAYS = ("strategy", "seed", *ENGINE_PARTS)
_WITH_MODEL = ("key_order", "buffer_keys", "shapes", "dtypes", "params", "buffers", "optimizer")
WHERE = "strategy"


def restore_strategy_state(strategy: Any, state: Any, *, server_round: int | None = None) -> None:
    """Load what :func:`strategy_state` wrote into ``strategy`` (same class and model), all or nothing.

    Every field is checked before anything of the strategy changes (a refusal is a
    :class:`~pollen.core.state_fields.StateError`, a ``ValueError`` naming the field): the class and
    seed; the model (names, shapes, dtypes, finite values); the optimiser state against the optimiser
    the strategy builds for that model (its slots, second moments in ``[0, max_abs]``); the sampler,
    screen and accounting; the declared values and parts (``server_round``, the checkpoint's round,
    bounds the rounds they hold); then the class's :meth:`check_loaded` hook sees the checked values.
    Only then is everything set. No field outside the ones written is accepted.
    """
    fields.mapping(state, WHERE)
    name = fields.text(fields.at(state, "strategy", WHERE), fields.join(WHERE, "strategy"), most=200)
    if name != type(strategy).__name__:
        raise fields.StateError(fields.join(WHERE, "strategy"), f"is {name!r}; expected {type(strategy).__name__!r}")
    has_model = "params" in state
    private = getattr(strategy, "privacy", None) is not None
    allowed = set(_ALWAYS) | (set(_WITH_MODEL) if has_model else set()) | set(strategy.state_fields)
    allowed |= {"privacy"} if private else set()
    for key in _ALWAYS + (_WITH_MODEL if has_model else ()) + (("privacy",) if private else ()):
        fields.at(state, key, WHERE)
    unknown = sorted(set(state) - allowed)
    if unknown:
        raise fields.StateError(fields.join(WHERE, unknown[0]), f"is not a field of {type(strategy).__name__}'s state")
    seed = fields.whole(state["seed"], fields.join(WHERE, "seed"), high=2**64 - 1)
    if seed != strategy.seed:
        raise fields.StateError(fields.join(WHERE, "seed"), f"is {seed}; expected {strategy.seed} (the run's seed)")
    model, step = GlobalModel(strategy.model.buffer_keys), ServerStep()
    model.prepare_load(state, WHERE)()  # a new object: nothing of the strategy changes yet
    layout = model.layout
    dim = layout.dim if layout is not None else None
    max_moment = strategy.screen.max_abs
    commits = []
    if layout is not None:
        commits.append(
            step.prepare_load(
                state["optimizer"],
                strategy.build_optimizer(layout),
                layout.dim,
                max_moment=max_moment,
                where=fields.join(WHERE, "optimizer"),
                max_step=fields.MAX_COUNT if server_round is None else server_round,
            )
        )
    values = {
        name: load_field(kind, name, state[name], dim=dim, where=WHERE, max_moment=max_moment, last_round=server_round)
        for name, kind in strategy.state_fields.items()
        if kind != PART and name in state
    }
    at = {name: fields.join(WHERE, name) for name in ENGINE_PARTS}
    commits.append(strategy.sampler.prepare_load(state["sampler"], at["sampler"]))
    commits.append(strategy.screen.prepare_load(state["screen"], at["screen"]))
    commits.append(strategy.ledger.prepare_load(state["ledger"], last_round=server_round, where=at["ledger"]))
    commits.append(
        strategy.accounting.prepare_load(state["accounting"], last_round=server_round, where=at["accounting"])
    )
    if private:  # the budget spent so far, under the same settings (a run without DP saved none: refused above)
        commits.append(strategy.privacy.prepare_load(state["privacy"], fields.join(WHERE, "privacy"), server_round))
    commits.extend(_prepare_parts(strategy, state, layout, server_round))
    strategy.check_loaded(values, layout, server_round)

    for commit in commits:  # into the strategy's own parts: a part a caller handed in stays the one in use
        commit()
    strategy.model.take(model)
    strategy.server_step = step
    for name, value in values.items():
        setattr(strategy, name, value)


def _prepare_parts(strategy: Any, state: Mapping[str, Any], layout: Any, server_round: int | None) -> list:
    """The commits of the declared parts; a part the strategy has not built yet is built for ``layout``
    first (put back as it was if any part's state is refused)."""
    parts = [name for name, kind in strategy.state_fields.items() if kind == PART]
    before = {name: getattr(strategy, name) for name in parts}
    try:
        commits = []
        for name in parts:
            where = fields.join(WHERE, name)
            if name not in state:
                if layout is not None and getattr(strategy, name) is None:
                    strategy.on_layout(layout)  # does this strategy keep the part for a model?
                if layout is not None and getattr(strategy, name) is not None:
                    raise fields.StateError(where, "is missing")
                continue
            if getattr(strategy, name) is None:
                if layout is None:
                    raise fields.StateError(where, "is saved but the state has no model; expected no such field")
                strategy.on_layout(layout)
            part = getattr(strategy, name)
            commits.append(part.prepare_load(state[name], layout=layout, where=where, last_round=server_round))
        return commits
    except BaseException:
        for name, value in before.items():
            setattr(strategy, name, value)
        raise
