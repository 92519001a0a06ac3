"""End to end on real processes: TLS SuperLink with SuperNode authentication, three SuperNodes, ``flwr run``.

What runs (all on 127.0.0.1, ports picked free at run time, files under ``tmp_path``):

- ``deploy/scripts/make_certs.sh`` and ``deploy/scripts/make_supernode_keys.sh`` make the CA, the
  SuperLink certificate and four SuperNode key pairs;
- ``flower-superlink`` with TLS, ``--enable-supernode-auth`` and the Fleet API on gRPC-rere;
- ``deploy/scripts/register_supernodes.sh`` (``flwr supernode register``) for three of the keys,
  through a SuperLink connection in ``$FLWR_HOME/config.toml`` (address + root-certificates);
- three ``flower-supernode`` processes with their keys and ``partition-id=i num-partitions=3 device='cpu'``;
- ``flwr run . <connection> --stream`` with FedCAMS and scaled-sign uplink compression.

Then: a SuperNode whose key is not registered is refused, and a SuperNode without TLS cannot
connect. Every process is stopped by the fixture (whole process trees), also when a check fails;
the logs are printed with the failure.
"""

from __future__ import annotations

import re
import shutil
import sys

import pytest

from tests.deploy_support import lf

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the process helpers read /proc"),
    pytest.mark.skipif(shutil.which("openssl") is None, reason="make_certs.sh needs openssl"),
]

CONNECTION = "pollen-e2e"
NUM_NODES = 3
RUN_CONFIG = {
    "strategy": "fedcams",
    "compressor": "sign",
    "num-server-rounds": 2,
    "local-steps": 5,
    "model": "cnn",
    "run-name": "e2e",
    "fraction-train": 1.0,
    "min-train-nodes": 3,
    "fraction-evaluate": 0.0,
    "min-evaluate-nodes": 0,
}
FLWR_RUN_TIMEOUT_S = 600
BOUNDED_EXIT_S = 90  # a refused SuperNode must give up within this


class Federation:
    """The running SuperLink and what a test needs to talk to it."""

    def __init__(self, root, procs):
        self.root = root
        self.procs = procs
        self.certs = lf.make_certs(root / "certs")
        names = [f"supernode-{i}" for i in range(1, NUM_NODES + 1)] + ["unregistered"]
        self.keys = lf.make_supernode_keys(root / "keys", *names)
        self.http_port, self.fleet_port, *self.spare_ports = lf.free_ports(2 + NUM_NODES + 2)
        self.fleet_address = f"127.0.0.1:{self.fleet_port}"
        self.user_env = lf.flower_env(root / "home-user")
        lf.write_connection(root / "home-user", CONNECTION, f"127.0.0.1:{self.http_port}", root_certificates=self.certs["ca.crt"])
        self.superlink = procs.start(
            "superlink",
            lf.superlink_argv(http_port=self.http_port, fleet_port=self.fleet_port, certs=self.certs, supernode_auth=True),
            env=lf.flower_env(root / "home-superlink"),
        )
        lf.wait_until(self._superlink_up, 90, "the SuperLink to listen on its HTTP and Fleet ports")

    def _superlink_up(self) -> bool:
        if self.superlink.poll() is not None:
            raise RuntimeError(f"flower-superlink exited with {self.superlink.poll()}:\n{lf.tail(self.superlink.output())}")
        self.superlink.remember_tree()
        return lf.port_is_open(self.http_port) and lf.port_is_open(self.fleet_port)

    def port(self) -> int:
        return self.spare_ports.pop(0)

    def register(self, *names: str) -> str:
        """``deploy/scripts/register_supernodes.sh`` = ``flwr supernode register <key>.pub <connection>`` per key."""
        pubs = [f"{self.keys[name]}.pub" for name in names]
        code, out = self.procs.run("register", ["bash", str(lf.SCRIPTS_DIR / "register_supernodes.sh"), CONNECTION, *pubs], timeout=60 * len(names), env=self.user_env)
        assert code == 0 and out.count("registered successfully") == len(names), out
        return out

    def supernode(self, name: str, node_config: str | None = None, **kwargs):
        return self.procs.start(
            name,
            lf.supernode_argv(superlink=self.fleet_address, runtime_port=self.port(), node_config=node_config, **kwargs),
            env=lf.flower_env(self.root / f"home-{name}"),
        )


@pytest.fixture(scope="module")
def federation(tmp_path_factory):
    root = tmp_path_factory.mktemp("deploy-e2e")
    procs = lf.Processes(root / "logs")
    try:
        with lf.dump_logs_on_error(procs):
            fed = Federation(root, procs)
            fed.register(*(f"supernode-{i}" for i in range(1, NUM_NODES + 1)))
        yield fed
    finally:
        procs.stop_all()
        left = procs.leftovers()
        assert not left, f"processes still alive after teardown: {left}"


def test_federated_run_over_tls_with_node_auth(federation):
    fed = federation
    procs = fed.procs
    nodes = []
    with lf.dump_logs_on_error(procs):
        try:
            for i in range(1, NUM_NODES + 1):
                nodes.append(
                    fed.supernode(
                        f"supernode-{i}",
                        node_config=f"partition-id={i - 1} num-partitions={NUM_NODES} device='cpu'",
                        root_certificates=fed.certs["ca.crt"],
                        private_key=fed.keys[f"supernode-{i}"],
                    )
                )
            lf.wait_until(lambda: lf.online_nodes(procs, CONNECTION, fed.user_env) >= NUM_NODES, 120, f"{NUM_NODES} SuperNodes online", interval=1.0)

            results = fed.root / "results"
            config = dict(RUN_CONFIG, **{"results-dir": str(results)})
            code, out = procs.run(
                "flwr-run",
                [lf.exe("flwr"), "run", ".", CONNECTION, "--stream", "--run-config", lf.run_config_arg(config)],
                timeout=FLWR_RUN_TIMEOUT_S,
                env=fed.user_env,
                cwd=lf.REPO_ROOT,
            )
            assert code == 0, out
            match = re.search(r"Successfully started run (\d+)", out)
            assert match, out
            assert "[pollen] done" in out, out

            status = lf.run_status(procs, CONNECTION, fed.user_env, run_id=match.group(1))
            assert status["status"] == "finished:completed", status

            metrics = lf.load_metrics(results, "e2e")
            rows = {row["round"]: row for row in metrics["rows"]}
            assert sorted(rows) == [0, 1, 2]
            assert metrics["summary"]["final_accuracy"] is not None
            for rnd in (1, 2):
                row = rows[rnd]
                assert row["replies"] == NUM_NODES and row["failures"] == 0, row
                per_reply = row["uplink_update_bytes"] / row["replies"]
                fp32_per_reply = row["uplink_fp32_bytes"] / row["replies"]
                # scaled sign: ceil(d/8) bytes of bits + one float (+ record framing) vs 4d bytes
                assert fp32_per_reply / per_reply > 25, row
                assert row["uplink_bytes"] >= row["uplink_update_bytes"], row

            # Each SuperNode's own node-config reached its ClientApp: partition and device.
            for i, node in enumerate(nodes):
                assert f"[pollen] partition-{i} trained 5 steps on cpu" in node.output(), node.output()
        finally:
            for node in nodes:
                procs.stop(node)


def test_supernode_with_unregistered_key_is_refused(federation):
    fed = federation
    with lf.dump_logs_on_error(fed.procs):
        node = fed.supernode(
            "unregistered",
            root_certificates=fed.certs["ca.crt"],
            private_key=fed.keys["unregistered"],
            max_retries=2,
            max_wait_time=30,
        )
        lf.wait_until(lambda: node.poll() is not None, BOUNDED_EXIT_S, "the unregistered SuperNode to give up")
        out = node.output()
        assert node.poll() != 0, out
        assert "Failed to activate SuperNode" in out, out
        assert "No SuperNode found with the given public key" in fed.superlink.output()
        assert lf.node_count(fed.procs, CONNECTION, fed.user_env) == NUM_NODES  # only the registered ones


def test_supernode_without_tls_cannot_connect(federation):
    fed = federation
    with lf.dump_logs_on_error(fed.procs):
        node = fed.supernode("no-tls", insecure=True, max_retries=2, max_wait_time=30)
        lf.wait_until(lambda: node.poll() is not None, BOUNDED_EXIT_S, "the SuperNode without TLS to give up")
        out = node.output()
        assert node.poll() != 0, out
        assert "could not establish a connection to the SuperLink" in out, out
        assert "UNAVAILABLE" in out, out
