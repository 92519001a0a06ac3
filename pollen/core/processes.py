"""Processes a helper starts and must stop by id: a free loopback port, and finding them by an environment marker.

Tools that start Flower's local SuperLink or a Ray cluster (``ray start`` daemonises its processes, Flower's
SuperLink starts a simulation process and Ray workers) cannot keep every child's id. They give everything
they start a marker in its environment (``NAME=token``), which every descendant inherits, and stop the
processes whose environment holds it (:func:`stop_marked`).
"""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on at ``host`` right now."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def pids_with_environ(marker: bytes) -> list[int]:
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


def stop_marked(marker: bytes, term_wait: float = 15.0, kill_wait: float = 5.0) -> None:
    """Stop every process whose environment holds ``marker``: SIGTERM, then SIGKILL for what is left."""
    for sig, wait in ((signal.SIGTERM, term_wait), (signal.SIGKILL, kill_wait)):
        for pid in pids_with_environ(marker):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while pids_with_environ(marker) and time.monotonic() < deadline:
            time.sleep(0.3)


#: What Ray or Flower print when a process did not come up in time on a loaded machine (the raylet's registration
#: with the GCS, the GCS itself): a start a later attempt can make, unlike a wrong setting. A local SuperLink that
#: failed to start is `flwr_cli`'s own case (it takes fresh ports before the next attempt).
SLOW_START_MARKERS = (
    "raylet failed to start",
    "GCS has become overloaded",
    "Failed to connect to GCS",
    "Timed out while waiting for GCS",
    "Failed to get the system config from raylet",
    "came up within",
    "did not finish within",
)


def is_slow_start(text: str) -> bool:
    """Whether ``text`` (an error, a process's output) says a start failed for want of time, not for a reason a
    second attempt cannot fix."""
    return any(marker in text for marker in SLOW_START_MARKERS)
