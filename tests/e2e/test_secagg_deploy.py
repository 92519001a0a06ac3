"""Secure aggregation in a deployment: five SuperNodes over TLS with node authentication, one dropping mid-protocol.

The SuperLink runs TLS and SuperNode authentication (:class:`~pollen.testing.secure_federation.SecureFederation`);
each of five registered SuperNodes starts a fresh ``flwr-clientapp`` per message, so the protocol's client state
travels between the round's four messages in the node's ``context.state`` only. SuperNode 3 raises at the
masked-input phase every round, after its keys and shares are out (the testing app's fault keys, as its
node-config): the other four unmask it through its neighbours' shares and every round steps on their sum. The
replies carry no model: the masked integers are the only arrays that leave a node.
"""

from __future__ import annotations

import shutil
import sys

import pytest

from pollen.testing import local_federation as lf
from pollen.testing.secure_federation import SecureFederation

pytestmark = [
    pytest.mark.slow,
    pytest.mark.xdist_group("deploy-e2e"),  # one deployment at a time on CI's two cores
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the process helpers read /proc"),
    pytest.mark.skipif(shutil.which("openssl") is None, reason="make_certs.sh needs openssl"),
]

NUM_NODES = 5  # a fresh ClientApp process per message: 4 messages a round each, the suite's costliest test
DROPPING = 3
ROUNDS = 2
RUN_CONFIG = {
    "strategy": "fedams",
    "secagg": True,
    "secagg-bits": 8,
    "norm": "gn",
    "num-server-rounds": ROUNDS,
    "local-steps": 2,
    "model": "cnn",
    "partitioner": "iid",
    "fraction-train": 1.0,
    "min-train-nodes": NUM_NODES,
    "fraction-evaluate": 0.0,
    "min-evaluate-nodes": 0,
    "test-examples": 1000,
    "plots": False,
    "round-timeout": 600.0,
    "node-wait-seconds": 300.0,
    "run-name": "secagg-deploy",
}


def test_five_supernodes_aggregate_securely_over_tls_with_one_dropping_mid_protocol(tmp_path) -> None:
    procs = lf.Processes(tmp_path / "logs")
    try:
        with lf.dump_logs_on_error(procs):
            fed = SecureFederation(tmp_path, procs, NUM_NODES, variant="testing")
            fed.extra_node_config[DROPPING] = (
                f"fault-fraction=1.0 fault-kind='error' fault-phase='secagg-masked-input' fault-partitions='{DROPPING}'"
            )
            fed.register_all()
            for index in range(NUM_NODES):
                fed.start_node(index)
            fed.wait_online(NUM_NODES)
            results = tmp_path / "results"
            run = fed.start_run("flwr-run", dict(RUN_CONFIG, **{"results-dir": str(results)}))
            lf.wait_until(lambda: run.poll() is not None, 900, "the secure run to finish")
            assert run.poll() == 0 and "[pollen] done" in run.output(), run.output()

            rows = {row["round"]: row for row in lf.load_metrics(results, "secagg-deploy")["rows"]}
            assert sorted(rows) == list(range(ROUNDS + 1))
            for r in range(1, ROUNDS + 1):
                row = rows[r]
                assert row["sampled"] == NUM_NODES and row["replies"] == NUM_NODES - 1, row
                assert row["method.secagg_survivors"] == NUM_NODES - 1 and row["method.secagg_dropped"] == 1, row
                up = row["uplink_by_record"]
                assert "arrays" not in up and set(up) >= {"pollen.secagg", "secagg-masked-input/pollen.secagg"}, up
                dense = row["uplink_fp32_bytes"]  # 4 bytes a value for each survivor
                assert dense / 2 <= up["secagg-masked-input/pollen.secagg"] < dense / 2 + (NUM_NODES - 1) * 400, row
            assert rows[ROUNDS]["accuracy"] > rows[0]["accuracy"] + 0.1, rows
            assert f"partition-{DROPPING}" in run.output() and "secagg-masked-input" in run.output()
    finally:
        procs.stop_all()
        left = procs.leftovers()
        assert not left, f"processes still alive after teardown: {left}"
