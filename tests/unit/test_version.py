"""``pollen.__version__``: the installed package's version, which is ``pyproject.toml``'s."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata
from pathlib import Path

import tomllib

import pollen

ROOT = Path(__file__).resolve().parents[2]


def test_the_version_is_the_installed_packages_and_pyprojects() -> None:
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert pollen.__version__ == metadata.version("flwr-pollen") == declared


def test_without_package_metadata_the_version_is_the_fallback_which_equals_pyprojects() -> None:
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    code = (
        "from importlib import metadata\n"
        "def missing(name):\n"
        "    raise metadata.PackageNotFoundError(name)\n"
        "metadata.version = missing\n"
        "import pollen\n"
        "print(pollen.__version__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == declared
