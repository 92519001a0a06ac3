"""MkDocs hooks of pollen's documentation site (``mkdocs.yml``, ``hooks:``).

Every page goes through :func:`pollen.app.reference.expand` before it is rendered: its ``pollen:``
markers become tables generated from the run-config schema and the method table, so the configuration
reference and the method pages cannot drift from the code. ``tests/app/test_docs_reference.py`` checks
the same expansion without MkDocs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pollen.app.reference import expand

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def on_page_markdown(markdown: str, *, page: Any, config: Any, files: Any) -> str:
    """The page's Markdown with its generated tables filled in."""
    return expand(markdown, page.file.src_uri, PYPROJECT)
