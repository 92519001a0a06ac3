"""The run-config reference and the method tables in Markdown, generated from the schema and the method table.

The documentation site (``mkdocs.yml``; its hook ``tools/mkdocs_hooks.py`` calls :func:`expand` on every
page) replaces these markers with tables at build time, so the reference cannot drift from the code:

- ``<!-- pollen:config-reference -->``: every key of :data:`pollen.app.config.SCHEMA`, grouped by the
  fragment that declares it, with its type, default, what is allowed and what it does (the comment next
  to the key in ``pyproject.toml``'s ``[tool.flwr.app.config]``, when there is one);
- ``<!-- pollen:methods -->``: every method of :data:`pollen.app.methods.METHODS`, with its family's page;
- ``<!-- pollen:methods family=NAME -->``: the methods of one family;
- ``<!-- pollen:keys family=NAME -->``: the keys one family declares;
- ``<!-- pollen:defaults family=NAME -->``: each of the family's methods' recommended values.

Links are written relative to the page they land on (``page``: its path under ``docs/``).
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from pollen.app import config
from pollen.app.methods import FAMILIES, METHODS
from pollen.app.registry import Table
from pollen.app.spec import Key

__all__ = [
    "CONFIG_PAGE",
    "FAMILY_PAGES",
    "config_reference",
    "expand",
    "family_defaults",
    "family_keys",
    "key_comments",
    "methods_table",
    "schema_sections",
]

#: The page of each method family (paths under ``docs/``); a family without a page fails the docs test.
FAMILY_PAGES = {
    "baselines": "methods/baselines.md",
    "fedams": "methods/fedcams.md",
    "fedopt": "methods/fedopt.md",
    "fedadavr": "methods/fedadavr.md",
    "fedlamb": "methods/fedlamb.md",
    "hafed": "methods/hafed.md",
    "lazy": "methods/lazy.md",
}
#: The page that holds the generated run-config reference.
CONFIG_PAGE = "reference/configuration.md"

#: Titles of the common fragments of :mod:`pollen.app.config` (a fragment not named here is titled from its name).
_COMMON_TITLES = {
    "EXPERIMENT": "Experiment",
    "SAMPLING": "Sampling and aggregation",
    "SERVER_OPTIMIZER": "Server optimiser (shared by the adaptive methods)",
    "DATA": "Data",
    "LOCAL_TRAINING": "Model and local training",
    "RESUME": "Resume after a crash",
    "BAD_CLIENTS": "Bad clients",
}
_MARKER = re.compile(r"<!--\s*pollen:(?P<what>[a-z-]+)(?:\s+family=(?P<family>[a-z0-9_-]+))?\s*-->")
_PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def _family_name(module: ModuleType) -> str:
    return module.__name__.rpartition(".")[2]


def _family(name: str) -> ModuleType:
    for module in FAMILIES:
        if _family_name(module) == name:
            return module
    raise ValueError(f"unknown method family {name!r}; known: {', '.join(_family_name(m) for m in FAMILIES)}")


def _family_title(module: ModuleType) -> str:
    """The family's name from its module docstring's first line (the part before the colon)."""
    first = (module.__doc__ or _family_name(module)).strip().splitlines()[0]
    return first.split(":")[0].strip().rstrip(".")


def _link(target: str, page: str) -> str:
    return posixpath.relpath(target, posixpath.dirname(page) or ".")


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell (no column breaks, no stray HTML)."""
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def _value(value: Any) -> str:
    """A run-config value as TOML writes it, in a code span."""
    if isinstance(value, bool):
        shown = "true" if value else "false"
    elif isinstance(value, str):
        shown = f'"{value}"'
    else:
        shown = repr(value)
    return f"`{shown}`"


def key_comments(pyproject: str | Path | None = None) -> dict[str, str]:
    """Key -> the comment on its line in ``[tool.flwr.app.config]`` (empty dict without a pyproject file)."""
    import tomllib  # Python 3.11+ (the app's Flower needs it); read only when the reference is built

    path = Path(pyproject) if pyproject is not None else _PYPROJECT
    if not path.is_file():
        return {}
    keys = set(tomllib.loads(path.read_text())["tool"]["flwr"]["app"].get("config", {}))
    comments: dict[str, str] = {}
    inside = False
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("["):
            inside = stripped == "[tool.flwr.app.config]"
            continue
        match = re.match(r"([A-Za-z0-9_-]+)\s*=", stripped) if inside else None
        if match is None or match.group(1) not in keys:
            continue
        comment = _comment_of(stripped[match.end() :])
        if comment:
            comments[match.group(1)] = comment
    return comments


def _comment_of(rest: str) -> str:
    """The comment after a TOML value on one line (a ``#`` outside quotes), or ``""``."""
    quote = ""
    for i, char in enumerate(rest):
        if quote:
            if char == quote:
                quote = ""
        elif char in "\"'":
            quote = char
        elif char == "#":
            return rest[i + 1 :].strip()
    return ""


def schema_sections(schema: Mapping[str, Key] | None = None) -> list[tuple[str, str | None, list[str]]]:
    """The schema's keys grouped by the fragment that declares them: ``(title, family or None, keys)``.

    The common fragments of :mod:`pollen.app.config` come first, then each family's, in the schema's
    order; a key no known fragment declares ends in a last section, "Other keys", so nothing is left out.
    """
    schema = config.SCHEMA if schema is None else schema
    sections: list[tuple[str, str | None, list[str]]] = []
    placed: set[str] = set()
    fragments: list[tuple[str, str | None, Mapping[str, Any]]] = []
    for name, value in vars(config).items():
        if name == "SCHEMA" or not name.isupper() or not isinstance(value, Mapping) or not value:
            continue
        if all(isinstance(key, Key) for key in value.values()):
            fragments.append((_COMMON_TITLES.get(name, name.replace("_", " ").capitalize()), None, value))
    for module in FAMILIES:
        fragments.append((_family_title(module), _family_name(module), getattr(module, "KEYS", {})))
    for title, family, fragment in fragments:
        keys = [key for key in fragment if key in schema and key not in placed]
        if keys:
            sections.append((title, family, keys))
            placed.update(keys)
    rest = [key for key in schema if key not in placed]
    if rest:
        sections.append(("Other keys", None, rest))
    return sections


def _keys_table(keys: list[str], schema: Mapping[str, Key], comments: Mapping[str, str]) -> list[str]:
    lines = ["| key | type | default | allowed | what it does |", "|---|---|---|---|---|"]
    for key in keys:
        spec = schema[key]
        allowed = _cell(spec.words) if spec.words else "any text" if spec.type is str else ""
        lines.append(
            f"| `{key}` | {spec.type.__name__} | {_value(spec.default)} | {allowed} | {_cell(comments.get(key, ''))} |"
        )
    return lines


def config_reference(page: str = CONFIG_PAGE, pyproject: str | Path | None = None) -> str:
    """Every run-config key, grouped by fragment, as Markdown sections with one table each."""
    schema, comments = config.SCHEMA, key_comments(pyproject)
    out = [
        f"{len(schema)} keys. Defaults are `pyproject.toml`'s (`[tool.flwr.app.config]`); naming a method "
        "brings its recommended values for the keys you leave alone (its page lists them).",
        "",
    ]
    for title, family, keys in schema_sections(schema):
        out.append(f"## {title}")
        out.append("")
        if family is not None and family in FAMILY_PAGES:
            out.append(f"Declared by the family `{family}`: [its page]({_link(FAMILY_PAGES[family], page)}).")
            out.append("")
        out += _keys_table(keys, schema, comments)
        out.append("")
    return "\n".join(out)


def family_keys(family: str, page: str, pyproject: str | Path | None = None) -> str:
    """The keys one family declares, as a table (or a sentence when it declares none)."""
    keys = [key for key in getattr(_family(family), "KEYS", {}) if key in config.SCHEMA]
    if not keys:
        return (
            f"The family `{family}` declares no keys of its own; it reads the common ones "
            f"([configuration reference]({_link(CONFIG_PAGE, page)}))."
        )
    return "\n".join(_keys_table(keys, config.SCHEMA, key_comments(pyproject)))


def methods_table(page: str, family: str | None = None, methods: Table | None = None) -> str:
    """The methods of the table (or of one family): run-config name, what it builds, its page."""
    methods = METHODS if methods is None else methods
    lines = ["| `strategy=` | what it builds | family |", "|---|---|---|"]
    for name, method in methods.items():
        if family is not None and method.family != family:
            continue
        where = f"`{method.family}`"
        if method.family in FAMILY_PAGES:
            where = f"[{method.family}]({_link(FAMILY_PAGES[method.family], page)})"
        lines.append(f"| `{name}` | {_cell(method.implementation)} | {where} |")
    return "\n".join(lines)


def family_defaults(family: str) -> str:
    """Each method of a family against the run-config values it recommends (blank: the pyproject default)."""
    names = [name for name, method in METHODS.items() if method.family == family]
    keys: list[str] = []
    for name in names:
        keys += [key for key in METHODS[name].defaults if key not in keys]
    if not keys:
        return "No recommended values of their own: " + ", ".join(f"`{n}`" for n in names) + " run with the defaults."
    lines = ["| key | " + " | ".join(f"`{n}`" for n in names) + " |", "|---|" + "---|" * len(names)]
    for key in keys:
        row = [_value(METHODS[n].defaults[key]) if key in METHODS[n].defaults else "" for n in names]
        lines.append(f"| `{key}` | " + " | ".join(row) + " |")
    return "\n".join(lines)


def expand(markdown: str, page: str, pyproject: str | Path | None = None) -> str:
    """``markdown`` with every ``pollen:`` marker replaced by its table (``ValueError`` for an unknown marker)."""

    def render(match: re.Match[str]) -> str:
        what, family = match.group("what"), match.group("family")
        if what == "config-reference" and family is None:
            return config_reference(page, pyproject)
        if what == "methods":
            return methods_table(page, family)
        if what == "keys" and family is not None:
            return family_keys(family, page, pyproject)
        if what == "defaults" and family is not None:
            return family_defaults(family)
        raise ValueError(f"unknown docs marker {match.group(0)!r} in {page}")

    return _MARKER.sub(render, markdown)
