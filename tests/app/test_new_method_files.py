"""docs/extending.md lists every file a new method touches, and every method pollen has touches each of them.

The page's table (between the ``new-method-files`` markers) is read here; each row has a check below, run for
every method family of the method table (and every exported strategy). A row the page adds without a check,
or a check whose row the page drops, fails the first test: the list and what the suite holds methods to stay
one list.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
import tomllib
import yaml

import pollen.strategies as strategies
from pollen.app.methods import FAMILIES, METHODS
from pollen.app.reference import FAMILY_PAGES

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "extending.md"
STEMS = [module.__name__.rpartition(".")[2] for module in FAMILIES]
EXPORTED = [
    name
    for name in strategies.__all__
    if isinstance(getattr(strategies, name), type) and hasattr(getattr(strategies, name), "configure_train")
]


def page_rows() -> list[str]:
    """The files the page lists, in its order."""
    text = PAGE.read_text()
    table = text[text.index("<!-- new-method-files -->") : text.index("<!-- /new-method-files -->")]
    return re.findall(r"^\| \d+ \| `([^`]+)` \|", table, flags=re.M)


def _strategy(stem: str) -> None:
    assert (ROOT / "pollen" / "strategies" / f"{stem}.py").is_file()


def _client_step(stem: str) -> None:
    step = ROOT / "pollen" / "clientside" / "steps" / f"{stem}.py"
    table = (ROOT / "pollen" / "clientside" / "steps" / "__init__.py").read_text()
    assert not step.is_file() or f"{stem}.run" in table, f"{stem}'s client step is in no table"


def _method_module(stem: str) -> None:
    assert (ROOT / "pollen" / "app" / "methods" / f"{stem}.py").is_file()


def _families(stem: str) -> None:
    assert stem in STEMS and any(m.family == stem for m in METHODS.values()), stem


def _family_page(stem: str) -> None:
    assert stem in FAMILY_PAGES and (ROOT / "docs" / FAMILY_PAGES[stem]).is_file(), stem


def _nav(stem: str) -> None:
    nav = str(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    assert FAMILY_PAGES[stem] in nav, stem


def _readme(stem: str) -> None:
    rows = [line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("|")]
    for name, method in METHODS.items():
        if method.family == stem:
            assert any(f"`{name}`" in row and FAMILY_PAGES[stem] in row for row in rows), name


def _pyproject(stem: str) -> None:
    module = next(m for m in FAMILIES if m.__name__.endswith("." + stem))
    defaults = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    assert set(module.KEYS) <= set(defaults), f"{stem}: {sorted(set(module.KEYS) - set(defaults))}"


def _exported(name: str) -> None:
    assert name in strategies.__all__


def _public_api_test(name: str) -> None:
    assert f'"{name}"' in (ROOT / "tests" / "flower" / "test_public_api.py").read_text() or name.startswith(
        "Metered"
    ), name


def _api_reference(name: str) -> None:
    assert f"::: pollen.strategies.{name}" in (ROOT / "docs" / "reference" / "api" / "strategies.md").read_text()


#: The page's rows and what each is checked against: per method family, or per exported strategy.
CHECKS: dict[str, tuple[str, Callable[[str], None]]] = {
    "pollen/strategies/<stem>.py": ("family", _strategy),
    "pollen/clientside/steps/<stem>.py": ("family", _client_step),
    "pollen/clientside/steps/__init__.py": ("family", _client_step),
    "pollen/app/methods/<stem>.py": ("family", _method_module),
    "pollen/app/methods/__init__.py": ("family", _families),
    "pollen/app/reference.py": ("family", _family_page),
    "docs/methods/<stem>.md": ("family", _family_page),
    "mkdocs.yml": ("family", _nav),
    "README.md": ("family", _readme),
    "pyproject.toml": ("family", _pyproject),
    "pollen/strategies/__init__.py": ("exported", _exported),
    "tests/flower/test_public_api.py": ("exported", _public_api_test),
    "docs/reference/api/strategies.md": ("exported", _api_reference),
}


def test_the_page_lists_what_the_suite_checks_and_nothing_else() -> None:
    assert page_rows() == list(CHECKS)


@pytest.mark.parametrize("row", list(CHECKS))
def test_every_method_touches_every_file_the_page_lists(row: str) -> None:
    scope, check = CHECKS[row]
    for item in STEMS if scope == "family" else EXPORTED:
        check(item)


def test_a_method_missing_a_file_fails_its_row(tmp_path: Path) -> None:
    """The checks can fail: a family with no page, no strategy module and no README row is caught by each."""
    with pytest.raises(AssertionError):
        _family_page("no-such-family")
    with pytest.raises(AssertionError):
        _strategy("no-such-family")
    with pytest.raises(AssertionError):
        _api_reference("NoSuchStrategy")
