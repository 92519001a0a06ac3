"""The documentation's generated reference covers every run-config key and every registered method.

The site's hook (``tools/mkdocs_hooks.py``) fills each page's ``pollen:`` markers with
:func:`pollen.app.reference.expand`; these tests expand the same pages with the same function, so they
need no MkDocs. ``mkdocs build --strict`` (in ``.ci/run``) checks the links and the API reference.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from pollen.app.config import SCHEMA
from pollen.app.methods import FAMILIES, METHODS
from pollen.app.reference import (
    CONFIG_PAGE,
    FAMILY_PAGES,
    config_reference,
    expand,
    key_comments,
    methods_table,
    schema_sections,
)

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PYPROJECT = ROOT / "pyproject.toml"


def _page(path: str) -> str:
    """A docs page as the site renders it (markers expanded)."""
    return expand((DOCS / path).read_text(), path, PYPROJECT)


def _table_names(markdown: str) -> set[str]:
    """The code-spanned names in the first column of every table row."""
    return set(re.findall(r"^\| `([^`]+)` \|", markdown, flags=re.M))


def test_every_run_config_key_is_in_the_configuration_reference_once() -> None:
    page = _page(CONFIG_PAGE)
    rows = re.findall(r"^\| `([^`]+)` \|", page, flags=re.M)
    assert sorted(rows) == sorted(SCHEMA), "the configuration reference lists each schema key once"
    assert config_reference(CONFIG_PAGE, PYPROJECT) in page


def test_every_key_falls_in_exactly_one_section() -> None:
    placed = [key for _, _, keys in schema_sections() for key in keys]
    assert sorted(placed) == sorted(SCHEMA)
    assert "Other keys" not in [title for title, _, _ in schema_sections()], (
        "a key no fragment of pollen.app.config or pollen.app.methods declares"
    )


def test_the_reference_shows_each_keys_default_and_the_pyprojects_comment() -> None:
    page = config_reference(CONFIG_PAGE, PYPROJECT)
    comments = key_comments(PYPROJECT)
    assert comments, "pyproject.toml's config table has comments"
    for key, spec in SCHEMA.items():
        row = next(line for line in page.splitlines() if line.startswith(f"| `{key}` |"))
        shown = str(spec.default).lower() if isinstance(spec.default, bool) else str(spec.default)
        assert shown in row, (key, row)
        if key in comments:
            first_word = comments[key].split()[0]
            escaped = first_word.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")
            assert escaped in row, (key, row)


def test_every_key_has_a_description_in_the_reference() -> None:
    """Each row's "what it does" cell holds words: a key without a comment in pyproject.toml fails here."""
    missing = sorted(key for key in SCHEMA if not key_comments(PYPROJECT).get(key, "").strip())
    assert not missing, f"keys without a comment in pyproject.toml's [tool.flwr.app.config]: {', '.join(missing)}"
    for line in config_reference(CONFIG_PAGE, PYPROJECT).splitlines():
        if line.startswith("| `"):
            cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]]
            assert len(cells) == 5 and len(cells[4].split()) >= 2, line


def test_every_family_has_a_page_in_the_nav() -> None:
    families = {module.__name__.rpartition(".")[2] for module in FAMILIES}
    assert families == set(FAMILY_PAGES), "a method family without a docs page (pollen.app.reference.FAMILY_PAGES)"
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    listed = set(re.findall(r"[\w./-]+\.md", str(nav)))
    for page in [*FAMILY_PAGES.values(), CONFIG_PAGE, "methods/index.md"]:
        assert (DOCS / page).is_file(), page
        assert page in listed, f"{page} is not in mkdocs.yml's nav"


@pytest.mark.parametrize("name", list(METHODS))
def test_every_registered_method_is_on_its_familys_page_and_in_the_methods_index(name: str) -> None:
    family = METHODS[name].family
    assert name in _table_names(_page(FAMILY_PAGES[family])), f"{name} is not on {FAMILY_PAGES[family]}"
    assert name in _table_names(_page("methods/index.md"))


@pytest.mark.parametrize("family", sorted(FAMILY_PAGES))
def test_each_family_page_shows_its_keys_and_recommended_values(family: str) -> None:
    module = next(m for m in FAMILIES if m.__name__.endswith("." + family))
    page = _page(FAMILY_PAGES[family])
    assert set(module.KEYS) <= _table_names(page), f"keys of {family} missing on its page"
    recommended = {key for name, m in METHODS.items() if m.family == family for key in m.defaults}
    assert recommended <= _table_names(page), f"recommended values of {family} missing on its page"


def test_every_marker_on_every_page_expands() -> None:
    pages = sorted(DOCS.rglob("*.md"))
    assert pages
    for path in pages:
        rel = path.relative_to(DOCS).as_posix()
        assert "<!-- pollen:" not in expand(path.read_text(), rel, PYPROJECT), rel


def test_an_unknown_marker_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown docs marker"):
        expand("<!-- pollen:nothing -->", "index.md")
    with pytest.raises(ValueError, match="unknown method family"):
        expand("<!-- pollen:keys family=nothing -->", "index.md")


def test_links_are_relative_to_the_page() -> None:
    assert "](fedcams.md)" in methods_table("methods/index.md", "fedams")
    assert "](methods/fedcams.md)" in methods_table("index.md", "fedams")


def test_the_home_page_shows_the_install_line_and_the_readmes_two_commands() -> None:
    """The site's home page runs the same main job and test suite as the README, word for word."""
    readme, home = (ROOT / "README.md").read_text(), (DOCS / "index.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)\n```", readme, flags=re.S)
    run = [b for b in blocks if "flwr run ." in b]
    test = [b for b in blocks if b.endswith("&& pytest")]
    assert run and test, "the README lost its main-job or test command"
    assert f"```bash\n{run[0]}\n```" in home and f"```bash\n{test[0]}\n```" in home
    assert "```bash\npip install flwr-pollen\n```" in home


def test_the_readme_states_the_test_command_ci_runs_and_links_every_method() -> None:
    readme = (ROOT / "README.md").read_text()
    command = 'python3 -m venv .venv && . .venv/bin/activate && pip install -e ".[app,grpc,test]" && pytest'
    assert command in readme
    assert 'pip install -e ".[app,grpc,test]" && pytest' in (ROOT / ".ci" / "run").read_text()
    assert "mkdocs serve" in readme
    for name in METHODS:
        row = next((line for line in readme.splitlines() if line.startswith("|") and f"`{name}`" in line), None)
        assert row is not None, f"{name} is not in the README's methods table"
        assert f"docs/{FAMILY_PAGES[METHODS[name].family]}" in row, f"{name}'s row does not link its page"
