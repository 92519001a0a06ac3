"""Flower's local SuperLink (the one ``flwr run`` starts for a simulation) with a private home and ports.

Flower 1.39's ``flwr run <app>`` starts a detached local SuperLink the first time it is called and keeps it
for later runs. :class:`LocalSuperLink` is the environment that makes that SuperLink this caller's own: a
private ``FLWR_HOME``, free ports for its HTTP and control APIs, Flower's per-run dependency install turned
off (the packages are installed already), this Python's ``bin`` first on ``PATH`` (so the SuperLink is this
environment's Flower) and, with ``extra_env``, e.g. ``RAY_ADDRESS`` to join a running Ray cluster. Every
process the SuperLink starts inherits the private control port, which is how :meth:`LocalSuperLink.stop`
finds them all (the simulation, Ray's workers and agents) and stops them by id.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from pollen.core.processes import free_port, stop_marked


class LocalSuperLink:
    """The environment of a private local SuperLink; run ``flwr run`` with :attr:`env`, then :meth:`stop`."""

    def __init__(self, home: Path, extra_env: dict[str, str] | None = None) -> None:
        """``extra_env``: more environment for the SuperLink and what it starts (``RAY_ADDRESS`` joins a
        running Ray cluster instead of starting a local Ray for each run)."""
        self.home = Path(home)
        bin_dir = str(Path(sys.executable).parent)
        self.env = {
            **os.environ,
            "FLWR_HOME": str(self.home),
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
            "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
            **(extra_env or {}),
        }
        self._take_free_ports()

    def _take_free_ports(self) -> None:
        self.http_port = str(free_port())
        self.control_port = str(free_port())
        self.env["FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"] = self.http_port
        self.env["FLWR_LOCAL_CONTROL_API_PORT"] = self.control_port

    def stop(self) -> None:
        """Stop the SuperLink and everything it started (simulation, Ray workers and agents)."""
        stop_marked(f"FLWR_LOCAL_CONTROL_API_PORT={self.control_port}".encode())

    def start_over_on_fresh_ports(self) -> None:
        """Stop whatever a failed start left behind and take new ports, for the next ``flwr run`` to start afresh.

        Free ports are chosen when this object is made and bound only when the first ``flwr run`` starts the
        SuperLink; by then another process may hold one, or a SuperLink too slow for Flower's 15 s may still
        sit on them: every later start then fails ("`flower-superlink` exited with code 1", seen on CI).
        """
        self.stop()
        self._take_free_ports()

    @classmethod
    @contextlib.contextmanager
    def warm(cls, home: Path, say: Callable[[str], None] | None = None, **kwargs: object) -> Iterator[LocalSuperLink]:
        """One Ray head started once, and a SuperLink of this class joined to it, for many ``flwr run`` calls.

        Each simulation then attaches to the warm head instead of starting and stopping a local Ray (the
        part of a short run that costs most and fails most under load). Both are stopped by process id
        when the block ends; ``say`` gets one line when the head is up; ``kwargs`` go to the class.
        """
        from pollen.app.ray_cluster import LocalRayCluster

        started = time.perf_counter()
        with LocalRayCluster(nodes=1, cpus_per_node=os.cpu_count() or 1, gpus_per_node=None) as cluster:
            if say is not None:
                took = time.perf_counter() - started
                say(f"warm Ray head at {cluster.address} ({took:.0f} s); one SuperLink for all runs")
            with cls(home, extra_env=cluster.env, **kwargs) as link:
                yield link

    def __enter__(self) -> LocalSuperLink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
