"""Test-suite set-up: modules that need torch are skipped where torch is not installed, and xdist groups hold.

CI runs the library tests (``-m flower_compat``) a second time on the newest Flower release the app supports
(with torch, beside the app's ``app_compat`` tests), and, when a newer release is out, against it in an
environment without torch; there any test module that imports torch or the task layer cannot be imported,
so it is not collected.

``xdist_group`` keeps tests that share an expensive session fixture (a Ray cluster, a federation) on one
worker. pytest-xdist marks a grouped test by appending ``@group`` to its node id; pytest 9.2 keeps node ids
elsewhere, so that append silently does nothing and every group was split over both workers (each building
its fixtures again). The check below stops such a run at collection instead.

Bytecode: where the environment sets ``PYTHONDONTWRITEBYTECODE`` (this project's machines do), every xdist worker
and every Flower process a test starts would compile pollen's modules and rewrite the tests' asserts from source
again, each time. The suite writes the caches (``__pycache__``, which git ignores) and passes that on to the
processes it starts: collecting the layer without Flower processes took 30 s in one process without them, 17 s
with them.
"""

import importlib.util
import os
import re
import sys
from pathlib import Path

import pytest

os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

_NEEDS_TORCH = re.compile(
    r"^\s*(import torch|from torch|from pollen\.(task|testing\.foreign)|import pollen\.(task|testing\.foreign))",
    re.MULTILINE,
)
# Modules that need torch only through what they run (the app), not through an import.
_RUNS_THE_APP = {"test_flwr_run.py", "test_deploy_e2e.py", "test_flower_lines.py"}

collect_ignore = []
if importlib.util.find_spec("torch") is None:
    here = Path(__file__).parent
    collect_ignore = sorted(
        str(path.relative_to(here))
        for path in here.rglob("test_*.py")
        if path.name in _RUNS_THE_APP or _NEEDS_TORCH.search(path.read_text())
    )


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """On an xdist worker with ``--dist loadgroup``: every ``xdist_group`` test must carry its group in its id."""
    if not getattr(config.option, "loadgroup", False):
        return
    lost = [item.nodeid for item in items if item.get_closest_marker("xdist_group") and "@" not in item.nodeid]
    if lost:
        raise pytest.UsageError(
            f"xdist_group is not honoured by this pytest / pytest-xdist pair ({lost[0]} has no '@group' in its "
            f"node id; pytest {pytest.__version__}): install the test extra's pins (pytest < 9.2)"
        )


@pytest.fixture(autouse=True, scope="session")
def _pollen_home(tmp_path_factory):
    """Relative run-config paths resolve against the pollen home: a stray relative path lands here, not in ~/.pollen."""
    previous = os.environ.get("POLLEN_HOME")
    os.environ["POLLEN_HOME"] = str(tmp_path_factory.mktemp("pollen-home"))
    yield
    if previous is None:
        os.environ.pop("POLLEN_HOME", None)
    else:
        os.environ["POLLEN_HOME"] = previous
