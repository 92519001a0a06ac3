"""Where a run's files go: relative run-config paths resolve against pollen's home, never a process's cwd.

Flower 1.39 runs the ServerApp in a process its SuperLink starts, in the working directory of whichever
``flwr run`` first started that SuperLink (often another project's folder), and it does not tell the app
which directory ``flwr run`` was called from. A relative path resolved against the working directory
would land wherever that SuperLink happened to start. So the rule is:

- an absolute path, or one that starts with ``~``, is used as given (``~`` is the home of the user the
  ServerApp runs as);
- a relative path resolves against the **pollen home**: ``$POLLEN_HOME`` if the ServerApp's environment
  sets it (for Flower's local SuperLink: the environment of the ``flwr run`` that started it; for a
  deployed SuperLink: its service's environment), else ``~/.pollen``.

The default ``results-dir = "results"`` is therefore ``~/.pollen/results``, and ``resume='results/<name>'``
names ``~/.pollen/results/<name>``. The rule covers the keys only the ServerApp reads
(:data:`SERVER_PATH_KEYS`). ``data-dir`` and ``state-dir`` are read by every ClientApp too, on machines
with other homes and working directories, so the run-config check refuses a relative value for them
(:data:`NODE_PATH_KEYS`, :func:`is_absolute_or_home`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: The environment variable that moves the pollen home (default ``~/.pollen``).
HOME_ENV = "POLLEN_HOME"

#: Run-config keys that name a path only the ServerApp reads or writes; a relative value resolves against the home.
SERVER_PATH_KEYS = ("results-dir", "resume", "tracker-dir", "table-path", "bookkeeping-dir")

#: Run-config keys that name a path every ClientApp reads too: absolute (or ``~/...``) or empty.
NODE_PATH_KEYS = ("data-dir", "state-dir")


def pollen_home() -> Path:
    """``$POLLEN_HOME`` (made absolute), else ``~/.pollen``."""
    value = os.environ.get(HOME_ENV, "").strip()
    return Path(value).expanduser().resolve() if value else Path.home() / ".pollen"


def is_absolute_or_home(value: str) -> bool:
    """Whether ``value`` means the same directory whatever the working directory (empty counts: unset)."""
    return not value or value.startswith("~") or Path(value).is_absolute()


def resolve(value: str | os.PathLike[str]) -> Path:
    """The absolute path ``value`` names under the rule of this module."""
    path = Path(value).expanduser()
    return (path if path.is_absolute() else pollen_home() / path).resolve()


def resolved_server_paths(values: Mapping[str, Any]) -> dict[str, str]:
    """The :data:`SERVER_PATH_KEYS` of ``values`` that are set and relative, each made absolute."""
    return {
        key: str(resolve(values[key]))
        for key in SERVER_PATH_KEYS
        if isinstance(values.get(key), str) and values[key] and not Path(values[key]).expanduser().is_absolute()
    }
