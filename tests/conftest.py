"""Test-suite set-up: modules that need torch are skipped where torch is not installed.

CI runs the library tests (``-m flower_compat``) a second time against the newest
Flower in an environment without torch; there any test module that imports torch or
the task layer cannot be imported, so it is not collected.
"""

import importlib.util
import re
from pathlib import Path

_NEEDS_TORCH = re.compile(r"^\s*(import torch|from torch|from pollen\.task|import pollen\.task)", re.MULTILINE)
# Modules that need torch only through what they run (the app), not through an import.
_RUNS_THE_APP = {"test_flwr_run.py", "test_deploy_e2e.py"}

collect_ignore = []
if importlib.util.find_spec("torch") is None:
    here = Path(__file__).parent
    collect_ignore = sorted(
        str(path.relative_to(here))
        for path in here.rglob("test_*.py")
        if path.name in _RUNS_THE_APP or _NEEDS_TORCH.search(path.read_text())
    )
