"""Run the app with the real ``flwr run`` CLI on a private local SuperLink, and clean up after.

Flower 1.39's ``flwr run .`` starts a detached local SuperLink (simulation mode)
the first time; this helper gives it a private ``FLWR_HOME`` and free ports, and
stops it (and its Ray workers) by process id when the session ends.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

#: The apps :meth:`LocalFlower.app` snapshots: the product's, or the test harness's (:mod:`pollen.testing.apps`).
VARIANTS = ("product", "testing")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LocalFlower:
    """A private local SuperLink for ``flwr run`` in simulation mode."""

    def __init__(self, home: Path, extra_env: dict[str, str] | None = None) -> None:
        """``extra_env``: more environment for the SuperLink and what it starts (``RAY_ADDRESS`` joins a
        running Ray cluster instead of starting a local Ray)."""
        self.home = home
        self._apps: dict[str, Path] = {}
        self.http_port = str(free_port())
        self.control_port = str(free_port())
        bin_dir = str(Path(sys.executable).parent)
        self.env = {
            **os.environ,
            "FLWR_HOME": str(home),
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": self.http_port,
            "FLWR_LOCAL_CONTROL_API_PORT": self.control_port,
            "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
            "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
            **(extra_env or {}),
        }

    def app(self, variant: str = "product") -> Path:
        """A snapshot of the files ``flwr run`` packs, made once per variant.

        ``flwr run <dir>`` walks every file under ``<dir>`` before it filters them, so a checkout with
        virtual environments inside (as CI makes them) costs several seconds per run; the snapshot holds
        only what goes into the FAB. ``variant="testing"``: the same files, with a ``pyproject.toml`` that
        runs the test harness's apps (fault injection, the relay demo; :mod:`pollen.testing.apps`).
        """
        if variant not in VARIANTS:
            raise ValueError(f"app variant {variant!r} is unknown; allowed: {', '.join(VARIANTS)}")
        if variant not in self._apps:
            from pollen.testing import local_federation as lf

            app = lf.snapshot_app(self.home / f"app-{variant}")
            if variant == "testing":
                from pollen.testing.apps import testing_pyproject

                pyproject = app / "pyproject.toml"
                pyproject.write_text(testing_pyproject(pyproject.read_text()))
            self._apps[variant] = app
        return self._apps[variant]

    def run(
        self,
        run_config: dict,
        num_supernodes: int = 4,
        timeout: float = 400,
        variant: str = "product",
        client_cpus: float | None = None,
    ) -> subprocess.CompletedProcess:
        """``flwr run`` of the app with ``run_config``; ``client_cpus`` sets the simulation's
        ``client-resources-num-cpus`` (1 on a two-core machine: two clients train at once)."""
        overrides = " ".join(
            f"{k}={json.dumps(v) if isinstance(v, str) else str(v).lower() if isinstance(v, bool) else v}"
            for k, v in run_config.items()
        )
        flwr = shutil.which("flwr", path=self.env["PATH"])
        command = [
            flwr,
            "run",
            str(self.app(variant)),
            "--stream",
            "--federation-config",
            f"num-supernodes={num_supernodes}"
            + ("" if client_cpus is None else f" client-resources-num-cpus={client_cpus:g}"),
            "--run-config",
            overrides,
        ]
        return subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=timeout, cwd=REPO)

    def stop(self) -> None:
        """Stop the SuperLink and everything it started (simulation, Ray workers and agents).

        Every process started through this helper inherits ``FLWR_LOCAL_CONTROL_API_PORT``
        with this instance's private port, also Ray's agents that outlive their parent, so
        the environment is what finds them all.
        """
        marker = f"FLWR_LOCAL_CONTROL_API_PORT={self.control_port}".encode()
        for sig, wait in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
            for pid in _pids_with_environ(marker):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + wait
            while _pids_with_environ(marker) and time.monotonic() < deadline:
                time.sleep(0.3)


def _pids_with_environ(marker: bytes) -> list[int]:
    """Processes (not this one) whose environment holds ``marker`` (``NAME=value``)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found
