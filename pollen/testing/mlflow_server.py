"""A real MLflow tracking server on 127.0.0.1 for tests, stopped by its process group id.

``mlflow server`` starts uvicorn (and, unless told not to, a job runner) as child processes; it is started
in a session of its own (``start_new_session``), so its process group id is its own process id, and
:meth:`MlflowServer.stop` ends exactly that group: SIGTERM, then SIGKILL for what is left. The server keeps
its runs in a SQLite file and its artifacts in a folder under the directory it is given.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from pollen.core.processes import free_port


def _mlflow_executable() -> str:
    """The ``mlflow`` of this Python environment (next to its interpreter), else the one on PATH."""
    beside = Path(sys.executable).with_name("mlflow")
    return str(beside) if beside.is_file() else "mlflow"


class MlflowServer:
    """``with MlflowServer(tmp_path) as server:`` -> ``server.uri`` is ``http://127.0.0.1:<port>``."""

    def __init__(self, root: Path, *, start_timeout: float = 180.0) -> None:
        self.root = Path(root)
        self.start_timeout = start_timeout
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.log_path = self.root / "mlflow-server.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> MlflowServer:
        self.root.mkdir(parents=True, exist_ok=True)
        command = [
            _mlflow_executable(),
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--workers",
            "1",
            "--backend-store-uri",
            f"sqlite:///{self.root / 'mlflow.db'}",
            "--default-artifact-root",
            str(self.root / "artifacts"),
        ]
        # the job runner (a second process) serves MLflow's GenAI jobs, which no test here uses
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self._wait_until_it_answers()
        return self

    def _wait_until_it_answers(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                self.stop()
                raise RuntimeError(f"mlflow server exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"mlflow server did not answer within {self.start_timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, wait: float = 15.0) -> None:
        """End the server's process group (the server, uvicorn and anything they started); idempotent."""
        if self.process is None:
            return
        group = self.process.pid  # its own session: the group id is the server's process id
        for sig, patience in ((signal.SIGTERM, wait), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(group, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + patience
            while time.monotonic() < deadline and _group_alive(group):
                self.process.poll()  # reap the server itself so it does not linger as a zombie
                time.sleep(0.2)
            if not _group_alive(group):
                break
        self.process.wait(timeout=5)
        self.process = None

    def __enter__(self) -> MlflowServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _group_alive(group: int) -> bool:
    """Whether any process of the group is still alive (zombies count as gone)."""
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) == group:
            return True
    return False
