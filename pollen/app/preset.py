"""Named experiment presets: one small TOML file per paper experiment (``pollen/app/presets/<name>.toml``).

A preset file has three tables::

    [preset]                      # what it is
    title = "..."                 # which paper, table or figure it follows
    scaled = "..."                # what was scaled down (CPU size) or what it needs (full size)
    size = "cpu" | "full"
    supernodes = 100              # simulated SuperNodes (clients) the experiment needs
    needs = "fashion-mnist"       # the dataset; the run stops before round 1 with one line if it is missing

    [config]                      # run-config values (keys of pyproject.toml's [tool.flwr.app.config])
    dataset = "fashion-mnist"
    ...

    [methods]                     # what a sweep compares: label = run-config values of that method
    fedams = { strategy = "fedams" }
    "fedcams-sign" = { strategy = "fedcams", compressor = "sign" }

A run picks a preset with run-config ``preset='<name>'``: its ``[config]`` replaces the pyproject defaults,
and every key given on the command line wins over the preset. The ServerApp knows which keys were given
(Flower's run record keeps the overrides) and tells the ClientApps in each message; where that is not known
(a client before its first message), a key whose value differs from its pyproject default counts as given.
``pollen-sweep`` (:mod:`pollen.app.sweep`) runs its methods x seeds.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from pollen.app.spec import unknown_name

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: Flower depends on tomli
    import tomli as tomllib

SIZES = ("cpu", "full")


class PresetError(ValueError):
    """A preset that does not exist or cannot be read; the message is one line."""


@dataclass(frozen=True)
class Preset:
    """One experiment preset (see the module docstring)."""

    name: str
    title: str
    scaled: str
    size: str
    supernodes: int
    needs: str
    config: Mapping[str, Any]
    methods: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def method_config(self, label: str) -> dict[str, Any]:
        """The run-config of one method: the preset's values, then the method's."""
        if label not in self.methods:
            raise PresetError(f"preset '{self.name}' has no method '{label}'; it has: {', '.join(self.methods)}")
        return {**self.config, **self.methods[label]}


@functools.lru_cache(maxsize=32)
def _preset_text(name: str) -> tuple[str, str]:
    """``(text, label)`` of a preset, read once per process (a ClientApp resolves it for every message)."""
    if name.endswith(".toml"):
        path = Path(name).expanduser()
        if not path.is_file():
            raise PresetError(f"preset file {name!r} does not exist")
        return path.read_text(), path.stem
    entry = resources.files("pollen.app") / "presets" / f"{name}.toml"
    if not entry.is_file():
        raise PresetError(f"preset {name!r} is unknown; allowed: {', '.join(preset_names())} or a path to a .toml file")
    return entry.read_text(), name


def preset_names() -> tuple[str, ...]:
    """The names of the presets the package ships, sorted."""
    folder = resources.files("pollen.app") / "presets"
    return tuple(sorted(entry.name[: -len(".toml")] for entry in folder.iterdir() if entry.name.endswith(".toml")))


def load_preset(name: str) -> Preset:
    """The preset ``name`` (a shipped name, or a path to a ``.toml`` file of the same form)."""
    text, label = _preset_text(name)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise PresetError(f"preset {name!r} is not valid TOML: {err}") from None
    head = data.get("preset", {})
    missing = [key for key in ("title", "scaled", "size", "supernodes", "needs") if key not in head]
    if missing or "config" not in data:
        raise PresetError(f"preset {name!r} lacks {', '.join(missing) or '[config]'}")
    if head["size"] not in SIZES:
        raise PresetError(f"preset {name!r}: size {head['size']!r} is unknown; allowed: {', '.join(SIZES)}")
    return Preset(
        name=label,
        title=str(head["title"]),
        scaled=str(head["scaled"]),
        size=str(head["size"]),
        supernodes=int(head["supernodes"]),
        needs=str(head["needs"]),
        config=dict(data["config"]),
        methods={str(k): dict(v) for k, v in data.get("methods", {}).items()},
    )


#: Keys a ClientApp mod reads straight from the run-config or node-config (a preset cannot set them).
NODE_LOCAL_KEYS = frozenset({"state-dir"})


def fill_unset(
    run_config: Mapping[str, Any], values: Mapping[str, Any], defaults: Mapping[str, Any], given: Collection[str] = ()
) -> dict[str, Any]:
    """``run_config`` with ``values`` in place of the keys nobody set; the keys somebody set keep theirs.

    A key counts as set when it is in ``given`` (the keys the user gave: Flower's override config, or
    those a preset set) or when its value differs from its pyproject default (``defaults``). Keys of
    ``values`` that ``run_config`` lacks are left out (the schema reports a missing key).
    """
    merged = dict(run_config)
    for key, value in values.items():
        if key in merged and key not in given and (key not in defaults or run_config[key] == defaults[key]):
            merged[key] = value
    return merged


def apply_preset(
    run_config: Mapping[str, Any], defaults: Mapping[str, Any], given: Collection[str] = ()
) -> dict[str, Any]:
    """``run_config`` with its ``preset`` applied: preset values replace defaults, given values win.

    ``given`` are the keys the user set (Flower's override config); a key of ``run_config`` that differs
    from its pyproject default (``defaults``) counts as given too. Without a preset the run-config comes
    back unchanged.
    """
    name = str(run_config.get("preset", "") or "")
    if not name:
        return dict(run_config)
    preset = load_preset(name)
    unknown = sorted(set(preset.config) - set(run_config))
    if unknown:
        raise PresetError(f"preset {name!r}: " + unknown_name("run-config key", unknown[0], run_config))
    node_local = sorted(set(preset.config) & NODE_LOCAL_KEYS)
    if node_local:
        raise PresetError(f"preset {name!r} sets {node_local}; allowed: set them in node-config or on the command line")
    return fill_unset(run_config, preset.config, defaults, given)


@functools.lru_cache(maxsize=1)
def _pyproject_defaults() -> tuple[tuple[str, Any], ...]:
    path = Path(__file__).resolve().parents[2] / "pyproject.toml"
    if not path.is_file():
        return ()
    with path.open("rb") as handle:
        return tuple(tomllib.load(handle).get("tool", {}).get("flwr", {}).get("app", {}).get("config", {}).items())


def pyproject_defaults() -> dict[str, Any]:
    """The app's run-config defaults, read from the pyproject.toml next to the package (source tree or FAB)."""
    return dict(_pyproject_defaults())
