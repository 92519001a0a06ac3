"""A Ray cluster on 127.0.0.1 started and stopped by pollen: a head and worker raylets, stopped by process id.

Flower's simulation spreads over machines the Ray way: start a Ray head on one machine, ``ray start
--address=<head>`` on the others, and give the process that runs the simulation ``RAY_ADDRESS``
(``docs/ray-cluster.md``). :class:`LocalRayCluster` does the same on one machine with every process
bound to loopback: the tests run ``flwr run`` across two raylets with it, and ``pollen-sweep --warm`` keeps
one Ray head for all the runs of a sweep instead of a Ray start and stop per run.

    with LocalRayCluster(nodes=2, cpus_per_node=1) as cluster:
        flower = LocalFlower(home, extra_env=cluster.env)   # the SuperLink's simulation joins it
        ...

Everything Ray starts inherits a marker in its environment (``POLLEN_RAY_CLUSTER=<token>``), which is how
:meth:`LocalRayCluster.stop` finds the processes (``ray start`` daemonises them) and stops them by id. The
cluster keeps its files in a private temporary folder (``RAY_TMPDIR``), so the cluster address file Ray
writes (``ray_current_cluster``) never reaches the machine's default ``/tmp/ray`` where a stale one makes
the next local simulation wait for a dead cluster; the folder is removed on stop.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from pollen.core.processes import free_port, is_slow_start, stop_marked

#: The environment variable whose value marks the processes of one cluster.
MARKER = "POLLEN_RAY_CLUSTER"


def own_agent_ports() -> list[str]:
    """Free ports for a node's agents and metrics. Ray's defaults are fixed numbers (the dashboard agent's 52365,
    the client server's 10001), so a second head or node on the same machine cannot bind them."""
    names = ("dashboard-agent-listen-port", "dashboard-agent-grpc-port", "metrics-export-port")
    return [f"--{name}={free_port()}" for name in (*names, "runtime-env-agent-port")]


#: Each node's workers (and the drivers that join it) take ports from a block of its own, below the kernel's
#: ephemeral range (32768 up): with Ray's one default range (10002-19999) for every node, the drivers of two
#: clusters on one machine were handed the same port, and the second one's Ray core failed ("Failed to start the
#: grpc server. The specified port is 10002", a crash of the process joining the cluster).
PORT_BLOCK = 500
PORT_BLOCKS = range(10_002, 32_768 - PORT_BLOCK, PORT_BLOCK)
#: Where the claims on the blocks live: one file per held block, holding its owner's process id.
PORT_CLAIMS = Path(tempfile.gettempdir()) / "pollen-ray-worker-ports"


def claim_port_block(folder: Path = PORT_CLAIMS) -> tuple[int, Path]:
    """The first port of a block no live process on this machine holds, and the claim file that holds it now
    (created exclusively with this process's id; a claim whose owner is gone is taken over)."""
    folder.mkdir(parents=True, exist_ok=True)
    for first in PORT_BLOCKS:
        claim = folder / str(first)
        for _ in range(2):
            try:
                fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                if _claim_is_held(claim):
                    break
                claim.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w") as out:
                out.write(str(os.getpid()))
            return first, claim
    raise RuntimeError(
        f"every block of Ray worker ports ({len(PORT_BLOCKS)} of {PORT_BLOCK}) is held by a live process "
        f"(claims in {folder}); allowed: at most {len(PORT_BLOCKS)} local Ray nodes at once"
    )


def _claim_is_held(claim: Path) -> bool:
    """Whether the claim's owner is alive (a claim still being written, younger than a minute, counts as held)."""
    try:
        text = claim.read_text().strip()
        if not text:
            return time.time() - claim.stat().st_mtime < 60
        os.kill(int(text), 0)
    except ProcessLookupError:
        return False
    except (OSError, ValueError):
        return not claim.exists()  # gone meanwhile: free; unreadable: leave it alone
    return True


class LocalRayCluster:
    """``nodes`` raylets on 127.0.0.1 (the first is the head), ``cpus_per_node`` CPUs and ``gpus_per_node``
    GPUs each (``None``: what Ray detects on the machine)."""

    def __init__(
        self,
        nodes: int = 2,
        cpus_per_node: int = 1,
        gpus_per_node: int | None = 0,
        start_timeout: float = 90.0,
        start_attempts: int = 3,
    ) -> None:
        if nodes < 1 or cpus_per_node < 1 or (gpus_per_node is not None and gpus_per_node < 0):
            raise ValueError(
                f"nodes={nodes}, cpus_per_node={cpus_per_node}, gpus_per_node={gpus_per_node}; "
                "allowed: nodes and CPUs >= 1, GPUs >= 0 or None"
            )
        self.nodes, self.cpus_per_node, self.start_timeout = nodes, cpus_per_node, start_timeout
        #: Attempts at a start that fails for want of time (:func:`pollen.core.processes.is_slow_start`): on a
        #: loaded two-core machine a raylet sometimes does not register with the GCS in time.
        self.start_attempts = max(1, int(start_attempts))
        self.gpus_per_node = gpus_per_node
        self.token = uuid.uuid4().hex[:12]
        # Short: Ray puts unix sockets under it (at most 107 characters a path).
        self.tmp = Path(tempfile.mkdtemp(prefix="pray-", dir="/tmp"))
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self._claims: list[Path] = []
        bin_dir = str(Path(sys.executable).parent)
        self._ray = shutil.which("ray", path=bin_dir) or shutil.which("ray")
        if self._ray is None:
            raise RuntimeError("the 'ray' command is not installed; install flwr[simulation]")
        self._start_env = {
            **os.environ,
            MARKER: self.token,
            "RAY_TMPDIR": str(self.tmp),
            "RAY_USAGE_STATS_ENABLED": "0",
            "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
        }

    @property
    def env(self) -> dict[str, str]:
        """What a process joining this cluster needs in its environment (``RAY_ADDRESS`` and the temp folder)."""
        return {"RAY_ADDRESS": self.address, "RAY_TMPDIR": str(self.tmp)}

    def start(self) -> LocalRayCluster:
        """Start the head, then the workers; wait until every node is alive. Stops what it started on failure;
        a start that failed for want of time (a raylet late to register, an overloaded GCS) is tried again from
        scratch, on a fresh port and folder, up to ``start_attempts`` times (logged on stderr)."""
        for attempt in range(1, self.start_attempts + 1):
            try:
                return self._start_once()
            except RuntimeError as err:
                if attempt == self.start_attempts or not is_slow_start(str(err)):
                    raise
                print(
                    f"LocalRayCluster: start attempt {attempt} of {self.start_attempts} failed for want of time "
                    f"({str(err)[:200]}); starting again",
                    file=sys.stderr,
                )
                time.sleep(5.0 * attempt)
                self.tmp = Path(tempfile.mkdtemp(prefix="pray-", dir="/tmp"))
                self._start_env["RAY_TMPDIR"] = str(self.tmp)
                self.port = free_port()
                self.address = f"127.0.0.1:{self.port}"
        raise AssertionError("unreachable")  # pragma: no cover

    def _start_once(self) -> LocalRayCluster:
        loopback = ["--node-ip-address=127.0.0.1", f"--num-cpus={self.cpus_per_node}"]
        if self.gpus_per_node is not None:
            loopback.append(f"--num-gpus={self.gpus_per_node}")
        head = [self._ray, "start", "--head", f"--port={self.port}", "--include-dashboard=false"]
        head += ["--disable-usage-stats", f"--temp-dir={self.tmp}", f"--ray-client-server-port={free_port()}"]
        worker = [self._ray, "start", f"--address={self.address}"]
        try:
            self._run([*head, *loopback, *self._own_ports()])
            for _ in range(self.nodes - 1):
                self._run([*worker, *loopback, *self._own_ports()])
            self._wait_for_nodes()
        except BaseException:
            self.stop()
            raise
        return self

    def _own_ports(self) -> list[str]:
        """A node's own block of worker ports (claimed until :meth:`stop`) and free ports for its agents."""
        first, claim = claim_port_block()
        self._claims.append(claim)
        return [f"--min-worker-port={first}", f"--max-worker-port={first + PORT_BLOCK - 1}", *own_agent_ports()]

    def _run(self, command: list[str]) -> None:
        try:
            proc = subprocess.run(
                command, env=self._start_env, capture_output=True, text=True, timeout=self.start_timeout
            )
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"'{' '.join(command[1:3])}' did not finish within {self.start_timeout:.0f} s") from None
        if proc.returncode != 0:
            raise RuntimeError(f"'{' '.join(command[1:3])}' failed ({proc.returncode}): {proc.stderr[-2000:]}")

    def alive_nodes(self) -> list[str]:
        """The ids of the cluster's live nodes, as the head's GCS reports them (asked from a fresh process)."""
        code = "import ray, json; ray.init(); print(json.dumps([n['NodeID'] for n in ray.nodes() if n['Alive']]))"
        proc = subprocess.run(
            [sys.executable, "-c", code],
            env={**self._start_env, **self.env},
            capture_output=True,
            text=True,
            timeout=self.start_timeout,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"could not ask the Ray cluster at {self.address} for its nodes: {proc.stderr[-2000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])

    def _wait_for_nodes(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        while True:
            alive = self.alive_nodes()
            if len(alive) >= self.nodes:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{len(alive)} of {self.nodes} Ray nodes came up within {self.start_timeout:.0f} s")
            time.sleep(1.0)

    def stop(self) -> None:
        """Stop every process of this cluster by id (TERM, then KILL), then remove its temporary folder."""
        stop_marked(f"{MARKER}={self.token}".encode(), term_wait=10.0)
        shutil.rmtree(self.tmp, ignore_errors=True)
        for claim in self._claims:
            claim.unlink(missing_ok=True)
        self._claims.clear()

    def __enter__(self) -> LocalRayCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
