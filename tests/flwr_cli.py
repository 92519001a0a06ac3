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

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _pids_with_args(*needles: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        text = [a.decode(errors="replace") for a in args]
        if all(needle in text for needle in needles):
            pids.append(int(entry.name))
    return pids


class LocalFlower:
    """A private local SuperLink for ``flwr run`` in simulation mode."""

    def __init__(self, home: Path) -> None:
        self.home = home
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
        }

    def run(self, run_config: dict, num_supernodes: int = 4, timeout: float = 400) -> subprocess.CompletedProcess:
        overrides = " ".join(f"{k}={json.dumps(v) if isinstance(v, str) else str(v).lower() if isinstance(v, bool) else v}" for k, v in run_config.items())
        flwr = shutil.which("flwr", path=self.env["PATH"])
        command = [
            flwr, "run", str(REPO), "--stream",
            "--federation-config", f"num-supernodes={num_supernodes}",
            "--run-config", overrides,
        ]
        return subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=timeout, cwd=REPO)

    def stop(self) -> None:
        for pid in _pids_with_args("--port", self.http_port):
            try:
                os.killpg(os.getpgid(pid), signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                try:
                    os.kill(pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 15
        while _pids_with_args("--port", self.http_port) and time.monotonic() < deadline:
            time.sleep(0.3)
        for pid in _pids_with_args("--port", self.http_port):
            os.kill(pid, signal.SIGKILL)
