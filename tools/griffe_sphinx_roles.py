"""A Griffe extension for pollen's API reference (``mkdocs.yml``): Sphinx roles in docstrings become code.

pollen's docstrings name other objects the Sphinx way (``:class:`~pollen.strategies.engine.model.GlobalModel```,
``:func:`make_codec```); mkdocstrings renders Markdown, where a role would show as literal text. Each
role becomes a code span of the name (the last component where Sphinx's ``~`` asks for it).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|exc|obj|const|ref):`(~?)([^`]+)`")


def plain(text: str) -> str:
    """``text`` with every Sphinx role replaced by a code span of its target."""
    return ROLE.sub(lambda m: f"`{m.group(2).rsplit('.', 1)[-1] if m.group(1) else m.group(2)}`", text)


class SphinxRoles(griffe.Extension):
    """Rewrites each object's docstring as it is loaded."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = plain(obj.docstring.value)
