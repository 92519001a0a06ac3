"""A server optimiser picked by name: which settings it takes, and one built from them.

This is the one way a strategy (or the run-config) gets an optimiser by name: :func:`settings_of` says
what a name takes, :func:`refuse_unused` stops a setting it has no use for, :func:`make_server_optimizer`
builds it. The names are those of :mod:`pollen.optim.aliases`, registered here by :func:`register` as
each alias is defined; what a name takes is its alias's keyword arguments, read once, at registration.

Settings have one spelling from the strategies down to the pieces, Flower's ``FedAdam``'s: ``eta`` (the
server learning rate), ``beta_1``, ``beta_2`` (the moment decays). The stabilising constant stays
``eps`` (Flower says ``tau``): the papers and every pollen strategy write ε, and ``eps_mode`` (where
AMSGrad puts it) and Adp-Fed's ``v0`` are named from it.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .transforms import Chain

__all__ = ["BY_NAME", "SETTINGS", "make_server_optimizer", "refuse_unused", "register", "settings_of"]

#: name -> alias (a function of keyword settings returning the optimiser), in the order they are defined
BY_NAME: dict[str, Callable[..., Chain]] = {}
#: name -> the settings its alias takes, in the alias's order
SETTINGS: dict[str, tuple[str, ...]] = {}


def register(fn: Callable[..., Chain]) -> Callable[..., Chain]:
    """Register the alias ``fn`` under its name: what it builds carries that name and lists its settings
    in ``fn``'s order; its errors are prefixed with the name."""
    name = fn.__name__
    settings = tuple(inspect.signature(fn).parameters)

    @functools.wraps(fn)
    def build(**given: Any) -> Chain:
        try:
            built = fn(**given)
        except ValueError as err:
            raise ValueError(f"{name}: {err}") from None
        return built.named(name, settings)

    BY_NAME[name] = build
    SETTINGS[name] = settings
    return build


def settings_of(name: str) -> tuple[str, ...]:
    """The settings the optimiser called ``name`` takes; ``ValueError`` naming the allowed names if unknown."""
    settings = SETTINGS.get(name) if isinstance(name, str) else None
    if settings is None:
        raise ValueError(f"server optimizer {name!r} is unknown; allowed: {', '.join(SETTINGS)}")
    return settings


def refuse_unused(name: str, given: Mapping[str, Any], offered: Iterable[str] | None = None) -> None:
    """``ValueError`` for the first setting in ``given`` that the optimiser ``name`` has no use for.

    The line names the optimiser, the setting and its value, and what is allowed: the settings it
    takes, or only those among ``offered`` (what the caller lets a user set, e.g. a strategy's
    arguments), so the list never names a setting the user has no way to give.
    """
    takes = settings_of(name)
    unused = [key for key in given if key not in takes]
    if unused:
        allowed = takes if offered is None else tuple(key for key in takes if key in set(offered))
        raise ValueError(
            f"{name} takes no setting {unused[0]}={given[unused[0]]!r}; allowed: {', '.join(allowed) or 'none'}"
        )


def make_server_optimizer(name: str, **settings: Any) -> Chain:
    """Build the server optimiser called ``name`` from ``settings``; unset ones keep its defaults.

    Parameters
    ----------
    name : str
        One of :data:`pollen.optim.SERVER_OPTIMIZERS`.
    **settings
        Its settings (:func:`settings_of`), in the one spelling (``eta``, ``beta_1``, ``beta_2``, ``eps``, ...).

    Raises
    ------
    ValueError
        For an unknown name, a setting it has no use for, or a value out of range; the message names
        the key, the value and what is allowed.
    """
    refuse_unused(name, settings)
    return BY_NAME[name](**settings)
