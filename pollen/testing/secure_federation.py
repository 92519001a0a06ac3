"""A TLS SuperLink with SuperNode authentication and many SuperNodes on this machine, for tests and benchmarks.

:class:`SecureFederation` makes the CA, the SuperLink certificate and one key pair per SuperNode with the
deployment kit's scripts (``deploy/scripts``), starts ``flower-superlink`` with TLS and
``--enable-supernode-auth``, registers the keys (``flwr supernode register``), and starts, kills and
restarts SuperNodes by index. Each SuperNode ``i`` gets node-config ``partition-id=i num-partitions=N
device='cpu'`` and its own ``state-dir`` (``<root>/state/node-<i>``, node-local as on a real machine), so a
restarted node finds its client state again. Everything listens on 127.0.0.1 only; every process belongs
to the :class:`~pollen.testing.local_federation.Processes` given, which stops it.

Used by ``tests/e2e/test_many_supernodes.py`` and ``benchmarks/deploy/bench_many_supernodes.py``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

from pollen.testing import local_federation as lf

CONNECTION = "pollen-many"
_PORT_TAKEN = re.compile(r"address .* is already in use|address already in use|failed to bind", re.IGNORECASE)


def resident_bytes(pid: int) -> int:
    """Resident memory of ``pid`` (``VmRSS``), 0 once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class SecureFederation:
    """A TLS + node-auth SuperLink and ``num_nodes`` registered SuperNodes (started on demand)."""

    def __init__(
        self, root: Path, procs: lf.Processes, num_nodes: int, key_bits: int = 2048, *, variant: str = "product"
    ) -> None:
        self.root = Path(root)
        self.procs = procs
        self.num_nodes = num_nodes
        self.certs = lf.make_certs(self.root / "certs", bits=key_bits)
        self.app = lf.snapshot_app(self.root / "app")
        if variant == "testing":  # the harness's apps (fault injection: a node that sleeps, pollen.testing.faults)
            from pollen.testing.apps import testing_pyproject

            pyproject = self.app / "pyproject.toml"
            pyproject.write_text(testing_pyproject(pyproject.read_text()))
        #: Node-config added to a node's own (index -> "key=value ..."), e.g. a testing app's fault settings.
        self.extra_node_config: dict[int, str] = {}
        self.keys = lf.make_supernode_keys(self.root / "keys", *self.node_names())
        self.http_port, self.fleet_port = lf.free_ports(2)
        self.user_env = lf.flower_env(self.root / "home-user")
        lf.write_connection(
            self.root / "home-user", CONNECTION, f"127.0.0.1:{self.http_port}", root_certificates=self.certs["ca.crt"]
        )
        self.superlink = procs.start(
            "superlink",
            lf.superlink_argv(
                http_port=self.http_port, fleet_port=self.fleet_port, certs=self.certs, supernode_auth=True
            ),
            env=lf.flower_env(self.root / "home-superlink"),
        )
        lf.wait_for_superlink(self.superlink, *lf.superlink_ports(self.http_port, self.fleet_port), timeout=120)
        self.nodes: dict[int, lf.Proc] = {}

    def node_names(self) -> list[str]:
        return [f"supernode-{i}" for i in range(self.num_nodes)]

    def register_all(self) -> None:
        """``deploy/scripts/register_supernodes.sh`` with every node's public key."""
        pubs = [f"{self.keys[name]}.pub" for name in self.node_names()]
        code, out = self.procs.run(
            "register",
            ["bash", str(lf.SCRIPTS_DIR / "register_supernodes.sh"), CONNECTION, *pubs],
            timeout=30 + 20 * len(pubs),
            env=self.user_env,
        )
        if code != 0 or out.count("registered successfully") != len(pubs):
            raise RuntimeError(f"registering {len(pubs)} SuperNode keys failed (exit {code}):\n{lf.tail(out)}")

    def state_dir(self, index: int) -> Path:
        return self.root / "state" / f"node-{index}"

    def start_node(self, index: int) -> lf.Proc:
        """Start SuperNode ``index`` (again, after :meth:`kill_node`): same key, node-config and state-dir."""
        name = self.node_names()[index]
        node_config = (
            f"partition-id={index} num-partitions={self.num_nodes} device='cpu' state-dir='{self.state_dir(index)}'"
        )
        if index in self.extra_node_config:
            node_config += " " + self.extra_node_config[index]
        env = lf.flower_env(self.root / f"home-{name}", OMP_NUM_THREADS="1")
        self.nodes[index] = self.procs.start(
            name,
            lf.supernode_argv(
                superlink=lf.fleet_address(self.http_port, self.fleet_port),
                runtime_port=lf.free_ports(1)[0],
                node_config=node_config,
                root_certificates=self.certs["ca.crt"],
                private_key=self.keys[name],
            ),
            env=env,
        )
        return self.nodes[index]

    def restart_node(self, index: int, retry_every: float = 5.0, timeout: float = 180.0) -> lf.Proc:
        """Start SuperNode ``index`` again until the SuperLink takes it, as ``deploy/systemd``'s
        ``Restart=on-failure`` does.

        A SuperNode that crashed stays "online" at the SuperLink until its heartbeat window ends (Flower
        1.39: twice the 30 s heartbeat interval), and a new process with the same key is refused
        ("Failed to activate SuperNode", exit code 305) until then.
        """
        deadline = time.monotonic() + timeout
        while True:
            proc = self.start_node(index)
            lf.wait_until(lambda p=proc: _ACTIVATED in p.output() or p.poll() is not None, 120, "activation")
            if _ACTIVATED in proc.output():
                return proc
            if time.monotonic() > deadline:
                raise TimeoutError(f"SuperNode {index} was not taken back within {timeout:.0f}s:\n{proc.output()}")
            time.sleep(retry_every)

    def kill_node(self, index: int) -> None:
        """SIGKILL SuperNode ``index`` and the ClientApp it may be running (a machine losing power)."""
        proc = self.nodes[index]
        proc.remember_tree()
        for pid in lf.process_tree(proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.popen.wait(timeout=30)

    def wait_online(self, count: int, timeout: float = 300) -> None:
        """Until ``count`` SuperNodes are online; a node that exits first is named with its log's tail.

        A node whose port was taken between :func:`~pollen.testing.local_federation.free_ports` and its start
        (another test's process on a busy machine) is started again on a new port, as a supervisor would.
        """
        deadline = time.monotonic() + timeout
        while True:
            online = lf.online_nodes(self.procs, CONNECTION, self.user_env)
            if online >= count:
                return
            for index, proc in list(self.nodes.items()):
                if proc.poll() is None:
                    continue
                if _PORT_TAKEN.search(proc.output()):
                    self.start_node(index)
                    continue
                raise RuntimeError(
                    f"SuperNode {index} exited (code {proc.poll()}) before {count} nodes were online:\n"
                    f"{lf.tail(proc.output(), 30)}"
                )
            if time.monotonic() > deadline:
                tails = "\n".join(f"--- supernode {i} ---\n{lf.tail(p.output(), 8)}" for i, p in self.nodes.items())
                raise TimeoutError(f"{online} of {count} SuperNodes online after {timeout:.0f}s:\n{tails}")
            time.sleep(2.0)

    def superlink_rss(self) -> int:
        """Resident bytes of the ``flower-superlink`` process itself (its ServerApp is counted apart)."""
        return resident_bytes(self.superlink.pid)

    def serverapp_pids(self) -> list[int]:
        return lf.find_in_tree(self.superlink, "flwr-serverapp")

    def start_run(self, name: str, config: dict[str, Any]) -> lf.Proc:
        """``flwr run <app> <connection> --stream --run-config ...`` in the background."""
        return self.procs.start(
            name,
            [lf.exe("flwr"), "run", str(self.app), CONNECTION, "--stream", "--run-config", lf.run_config_arg(config)],
            env=self.user_env,
            cwd=lf.REPO_ROOT,
        )

    def trained_messages(self, index: int, since_start: int = 0) -> int:
        """Train messages SuperNode ``index`` answered (its ``[pollen] ... trained`` log lines).

        Counts over its starts from the ``since_start``-th on (0: all; each start writes its own log).
        """
        name = self.node_names()[index]
        starts = [p for p in self.procs.procs if p.name == name][since_start:]
        return sum(len(_TRAINED.findall(p.output())) for p in starts)

    def replies_sent(self, index: int) -> int:
        """Train replies the current process of SuperNode ``index`` has sent (``Sending: train`` then
        ``Sent successfully`` in its log)."""
        return len(_TRAIN_SENT.findall(self.nodes[index].output()))


_ACTIVATED = "SuperNode ID:"  # a SuperNode logs its node id once the SuperLink has taken it
_TRAINED = re.compile(r"\[pollen\] partition-\d+ trained \d+ steps")
_TRAIN_SENT = re.compile(r"Sending: train message[^\n]*\n(?:[^\n]*\n)*?[^\n]*Sent successfully")


def rounds_written(run_dir: Path) -> int:
    """The last round in ``<run_dir>/metrics.json`` (0 while there is none or it is being written)."""
    try:
        rows = json.loads((Path(run_dir) / "metrics.json").read_text())["rows"]
    except (OSError, ValueError, KeyError):
        return 0
    return max((int(row["round"]) for row in rows), default=0)
