"""No module imports from its own package when that package's ``__init__`` imports its modules
(``from pollen.secagg import crypto`` inside ``pollen/secagg/``): under concurrent imports that is a deadlock
Python breaks by handing out a partially initialised module.

Flower's simulation imports the ServerApp and the ClientApps in different threads of one process. When the
server's thread was running ``pollen/secagg/__init__.py`` (which imports ``protocol``) while a client's thread
was running ``protocol.py`` (which imported ``crypto`` through the package, so it waited for the package's
lock), each held the lock the other wanted; Python gave one of them the partial module and the run stopped
with "cannot import name 'SecAggAbort' from partially initialized module" (a CI run of
``test_compositions_no_paper_ran_run_end_to_end``). A module imports its siblings by their own names
(``from pollen.secagg.crypto import ...`` or ``import pollen.secagg.crypto as crypto``), which takes no lock
of the package. A package whose ``__init__`` imports none of its modules (``pollen.app``) holds its lock for
no import, so importing through it is harmless.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "pollen"


def _imports(path: Path) -> list[ast.ImportFrom]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [node for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module]


def through_own_package(root: Path) -> list[str]:
    """``path:line`` of every import from its own package, in the packages under ``root`` whose ``__init__``
    imports one of their modules."""
    out = []
    for init in sorted(root.rglob("__init__.py")):
        package = ".".join(init.parent.relative_to(root.parent).parts)
        if not any(node.module.startswith(package + ".") for node in _imports(init)):
            continue  # an __init__ that imports none of its modules: no lock held over an import
        for path in sorted(init.parent.glob("*.py")):
            if path.name != "__init__.py":
                out += [
                    f"{path.relative_to(root.parent)}:{node.lineno}"
                    for node in _imports(path)
                    if node.module == package
                ]
    return out


def test_no_module_imports_through_a_package_whose_init_imports_it() -> None:
    assert not through_own_package(PACKAGE)


def test_the_check_finds_such_an_import_and_spares_an_empty_init(tmp_path: Path) -> None:
    eager, empty = tmp_path / "pkg" / "eager", tmp_path / "pkg" / "empty"
    for folder in (tmp_path / "pkg", eager, empty):
        folder.mkdir(exist_ok=True)
        (folder / "__init__.py").write_text("")
    (eager / "__init__.py").write_text("from pkg.eager.protocol import Client\n")
    body = "from pkg.{0} import crypto\nfrom pkg.{0}.graph import edges\n"
    (eager / "protocol.py").write_text(body.format("eager"))
    (empty / "protocol.py").write_text(body.format("empty"))
    assert through_own_package(tmp_path / "pkg") == ["pkg/eager/protocol.py:1"]


#: Packages a ClientApp imports while the server's thread may import them at run time (the secure-aggregation
#: and privacy parts are imported when a strategy builds them): their ``__init__`` imports none of their modules
#: (:mod:`pollen.core.lazy_exports`).
IMPORTED_FROM_BOTH_THREADS = ("secagg", "privacy")

RACE = """
import importlib, sys, threading
sys.setswitchinterval(1e-6)
barrier, errors = threading.Barrier(2), []
def run(names):
    barrier.wait()
    try:
        for name in names:
            importlib.import_module(name)
    except Exception as err:
        errors.append(repr(err))
threads = [threading.Thread(target=run, args=(names,)) for names in ({first}, {second})]
[t.start() for t in threads]
[t.join() for t in threads]
print(errors)
"""


@pytest.mark.parametrize("package", IMPORTED_FROM_BOTH_THREADS)
def test_a_package_both_threads_import_has_an_init_that_imports_none_of_its_modules(package: str) -> None:
    init = PACKAGE / package / "__init__.py"
    own = [node.module for node in _imports(init) if node.module.startswith(f"pollen.{package}.")]
    assert not own, own
    module = importlib.import_module(f"pollen.{package}")
    for name in module.__all__:
        assert getattr(module, name) is not None
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        module.nope  # noqa: B018


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (["pollen.secagg.codec"], ["pollen.secagg.crypto", "pollen.secagg.protocol"]),
        (["pollen.privacy.accountant"], ["pollen.privacy.mechanisms"]),
    ],
)
def test_two_threads_import_the_same_package_without_a_deadlock(first: list[str], second: list[str]) -> None:
    """With an ``__init__`` that imported its modules, these pairs failed in 26 of 30 fresh processes (privacy)
    and 6 of 40 (secagg) with ``_DeadlockError`` or a partially initialised module; now in none."""
    code = RACE.format(first=first, second=second)
    for _ in range(4):
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
        assert done.stdout.strip() == "[]", done.stdout
