"""A package's public names looked up on first use (PEP 562), so that its ``__init__`` imports none of its modules.

Flower's simulation imports the ServerApp and the ClientApps in threads of one process. A package whose
``__init__`` imports its own modules, imported by one thread while another imports one of those modules
directly, deadlocks on the import locks; Python 3.11 then hands a thread a partially initialised module
("cannot import name 'SecAggAbort' from partially initialized module 'pollen.secagg.protocol'", a CI run).
``tests/unit/test_import_order.py`` holds the packages both sides import to this.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """The module ``__getattr__`` of ``package``: each name of ``exports`` (name -> defining module) imported
    from its module on first use and kept in the package's namespace, so later look-ups skip this function;
    any other name an ``AttributeError``, as for a plain module.

    The value is written into the namespace directly, not by ``setattr``: a package may refuse some
    attributes (``pollen.task`` keeps its function ``train`` over the submodule of that name).
    """

    def __getattr__(name: str) -> Any:
        home = exports.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home), name)
        vars(sys.modules[package])[name] = value
        return value

    return __getattr__
