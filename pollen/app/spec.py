"""Run-config keys as data: what each key holds, its default and what is allowed (a ``ConfigSpec``).

The app's schema (:data:`pollen.app.config.SCHEMA`) is assembled from fragments: the keys every run
has (experiment, sampling, data, model, local training, resume) in :mod:`pollen.app.config`, and the
keys of each method family next to that family's builders (:mod:`pollen.app.methods`). A fragment is a
plain ``{key: Key}`` mapping; :func:`assemble` joins fragments and refuses a key declared twice, so a
key has one type, one default and one rule wherever it is used.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

#: A fragment of the schema: run-config key -> :class:`Key`.
ConfigSpec = Mapping[str, "Key"]


class ConfigError(ValueError):
    """A run-config value that cannot be used; the message is one line for the user."""


def _anything(value: Any) -> bool:
    return True


@dataclass(frozen=True)
class Key:
    """One run-config key: its Python type, its default, a check and the words that say what is allowed.

    ``default`` is the value ``pyproject.toml``'s ``[tool.flwr.app.config]`` gives the key (a test keeps
    the two equal). ``server_side`` marks a key only the ServerApp reads whose allowed values are owned
    by the server's strategy modules: a ClientApp (a fresh process per message on a SuperNode) checks
    its type but leaves the value to the ServerApp, which checks it before round 1, so the ClientApp
    never imports the strategies.
    """

    type: type
    default: Any
    check: Callable[[Any], bool] = _anything
    allowed: str | Callable[[], str] = ""
    server_side: bool = False

    @property
    def words(self) -> str:
        """What is allowed, in words (computed on demand where it names things another module owns)."""
        return self.allowed() if callable(self.allowed) else self.allowed


Options = tuple[str, ...] | Callable[[], tuple[str, ...]]


def _options(options: Options) -> tuple[str, ...]:
    return options() if callable(options) else options


def choice(options: Options, default: str, *, server_side: bool = False) -> Key:
    """A name from ``options`` (a tuple, or a function returning the owner's tuple, read when checked)."""
    return Key(
        str, default, lambda v: v in _options(options), lambda: "one of " + ", ".join(_options(options)), server_side
    )


def positive(default: float) -> Key:
    return Key(float, default, lambda v: v > 0, "a number > 0")


def non_negative(default: float) -> Key:
    return Key(float, default, lambda v: v >= 0, "a number >= 0")


def unit_open(default: float) -> Key:
    """A number in (0, 1]: a fraction, a ratio, a probability that must not be 0."""
    return Key(float, default, lambda v: 0 < v <= 1, "a number in (0, 1]")


def unit_closed(default: float) -> Key:
    return Key(float, default, lambda v: 0 <= v <= 1, "a number in [0, 1]")


def beta(default: float) -> Key:
    """A decay coefficient in [0, 1) (the moment decays beta-1 / beta-2, SGD momentum)."""
    return Key(float, default, lambda v: 0 <= v < 1, "a number in [0, 1)")


def pos_int(default: int) -> Key:
    return Key(int, default, lambda v: v >= 1, "an integer >= 1")


def non_neg_int(default: int) -> Key:
    return Key(int, default, lambda v: v >= 0, "an integer >= 0")


def flag(default: bool) -> Key:
    return Key(bool, default, allowed="true or false")


def text(default: str = "") -> Key:
    return Key(str, default)


def node_path(default: str = "") -> Key:
    """A path every ClientApp reads too (on other machines, from other working directories): absolute or ``~/...``."""
    from pollen.app.paths import is_absolute_or_home

    return Key(str, default, is_absolute_or_home, "empty, an absolute path or one starting with ~")


def nearest(name: str, allowed: Iterable[str]) -> str | None:
    """The allowed name closest to ``name`` (a misspelling's likely meaning), or None when none is close."""
    allowed = list(allowed)
    close = difflib.get_close_matches(name, allowed, n=1, cutoff=0.6)
    if close:
        return close[0]
    # a key typed with underscores or in another case (``server_lr``) is still that key
    normal = {option.replace("_", "-").lower(): option for option in allowed}
    return normal.get(name.replace("_", "-").lower())


def unknown_name(what: str, name: str, allowed: Iterable[str], note: str = "") -> str:
    """One line for an unknown name: the name, ``note``, the nearest allowed one (if any), then every allowed one."""
    allowed = sorted(allowed)
    near = nearest(name, allowed)
    hint = f"; nearest allowed: '{near}'" if near else ""
    return f"{what} '{name}' is unknown{note}{hint}; allowed: {', '.join(allowed)}"


def assemble(*fragments: ConfigSpec) -> dict[str, Key]:
    """One schema from fragments, in their order; ``ValueError`` for a key two fragments declare."""
    schema: dict[str, Key] = {}
    for fragment in fragments:
        for name, key in fragment.items():
            if name in schema:
                raise ValueError(f"run-config key {name!r} is declared twice")
            schema[name] = key
    return schema


def defaults_of(schema: ConfigSpec) -> dict[str, Any]:
    """Key -> default of a schema (what ``pyproject.toml``'s config table holds)."""
    return {name: key.default for name, key in schema.items()}
