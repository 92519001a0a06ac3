"""Import ``deploy/local_federation.py`` (the deploy folder is not a package) for the deploy tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parent.parent / "deploy" / "local_federation.py"


def _load():
    name = "pollen_deploy_local_federation"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look the module up while the class body runs
    spec.loader.exec_module(module)
    return module


lf = _load()
