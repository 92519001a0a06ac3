"""Run the app with the real ``flwr run`` CLI on a private local SuperLink, and clean up after.

Flower 1.39's ``flwr run .`` starts a detached local SuperLink (simulation mode)
the first time; this helper gives it a private ``FLWR_HOME`` and free ports, and
stops it (and its Ray workers) by process id when the session ends.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from pollen.app.local_superlink import LocalSuperLink
from pollen.core.processes import free_port, is_slow_start

REPO = Path(__file__).resolve().parents[2]

#: The apps :meth:`LocalFlower.app` snapshots: the product's, or the test harness's (:mod:`pollen.testing.apps`).
VARIANTS = ("product", "testing")


class LocalFlower(LocalSuperLink):
    """A private local SuperLink for ``flwr run`` in simulation mode, with the app snapshots the tests run."""

    def __init__(self, home: Path, extra_env: dict[str, str] | None = None) -> None:
        super().__init__(home, extra_env)
        self._apps: dict[str, Path] = {}

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
        client_gpus: float | None = None,
        ray_cpus: int | None = None,
    ) -> subprocess.CompletedProcess:
        """``flwr run`` of the app with ``run_config``; ``client_cpus`` sets the simulation's
        ``client-resources-num-cpus`` (1 on a two-core machine: two clients train at once), ``client_gpus``
        its ``client-resources-num-gpus`` (0.25: four clients share one GPU), ``ray_cpus`` the CPUs Ray is
        told it has (``init-args-num-cpus``; more than the cores: more clients at once, sharing them)."""
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
            + ("" if client_cpus is None else f" client-resources-num-cpus={client_cpus:g}")
            + ("" if client_gpus is None else f" client-resources-num-gpus={client_gpus:g}")
            + ("" if ray_cpus is None else f" init-args-num-cpus={ray_cpus:d}"),
            "--run-config",
            overrides,
        ]
        for attempt in range(1, START_ATTEMPTS + 1):
            proc = subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=timeout, cwd=REPO)
            superlink_failed = _superlink_failed_to_start(proc)
            if attempt == START_ATTEMPTS or not (superlink_failed or _started_too_slowly(proc)):
                return proc
            # the simulation's Ray or the SuperLink did not come up (a loaded machine): the run did nothing; again,
            # afresh, and a SuperLink that failed on fresh ports with nothing of the failed one left behind
            if superlink_failed:
                self.start_over_on_fresh_ports()
            print(f"LocalFlower: run attempt {attempt} failed to start; running it again", file=sys.stderr)
            _set_aside(run_config, attempt)
            time.sleep(5.0 * attempt)
        raise AssertionError("unreachable")  # pragma: no cover


#: Attempts at a ``flwr run`` whose simulation failed to start for want of time (:func:`is_slow_start`).
START_ATTEMPTS = 3


def _started_too_slowly(proc: subprocess.CompletedProcess) -> bool:
    """Whether a ``flwr run`` failed because the simulation's Ray did not come up in time.

    ``flwr run --stream`` exits 0 even when the simulation it streams crashed at start (Ray's "The current node
    timed out during startup" on a loaded machine), so the exit status alone cannot say: a failed exit or
    Flower's "Simulation Runtime crashed", together with one of the slow-start markers, does.
    """
    out = proc.stdout + proc.stderr
    failed = proc.returncode != 0 or "Simulation Runtime crashed" in out
    return failed and is_slow_start(out)


def _superlink_failed_to_start(proc: subprocess.CompletedProcess) -> bool:
    """Whether ``flwr run`` could not start its local SuperLink (late for Flower's 15 s, or exited: a port taken)."""
    return proc.returncode != 0 and "Failed to start local SuperLink" in proc.stdout + proc.stderr


def _set_aside(run_config: dict, attempt: int) -> None:
    """Move what a failed attempt wrote under ``results-dir/run-name`` aside (``<run-name>.failed-<n>``), so the
    next attempt is a fresh run."""
    results, name = run_config.get("results-dir"), run_config.get("run-name")
    if results and name and (Path(results) / name).exists():
        (Path(results) / name).rename(Path(results) / f"{name}.failed-{attempt}")


__all__ = ["VARIANTS", "LocalFlower", "free_port"]
