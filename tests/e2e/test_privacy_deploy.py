"""Differential privacy on real SuperNodes (issue 39): central and local DP over TLS with node authentication.

Three ``flower-supernode`` processes and a SuperLink with TLS and SuperNode authentication
(:class:`SecureFederation`, pollen's own app). Node 2's operator does not trust the server: its node-config
sets ``dp-min-noise-multiplier=1.0``, so its ClientApp refuses any train message that asks for less than local
DP with that much noise.

- ``dp=local`` (z = 1.0): every node trains, the run completes, each row carries the largest client epsilon
  (``method.dp_epsilon``, the no-amplification composition of that client's uploads at ``z / 2``) and it grows
  with the uploads.
- ``dp=central`` with FedCAMS (scaled sign + error feedback): the two other nodes clip before their sign and the
  server noises the sum before AMSGrad; node 2 refuses every message with its reason, which the server counts as
  a failure in each round and logs in full, and the run still completes on the others' replies with epsilon in
  its rows.
"""

from __future__ import annotations

import shutil
import sys

import pytest

from pollen.testing import local_federation as lf
from pollen.testing.secure_federation import SecureFederation

pytest.importorskip("dp_accounting")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.xdist_group("deploy-e2e"),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the process helpers read /proc"),
    pytest.mark.skipif(shutil.which("openssl") is None, reason="make_certs.sh needs openssl"),
]

NUM_NODES = 3
GUARDED = 2
ROUNDS = 3
BASE = {
    "num-server-rounds": ROUNDS,
    "local-steps": 2,
    "model": "mlp",
    "partitioner": "iid",
    "fraction-train": 1.0,
    "min-train-nodes": NUM_NODES,
    "fraction-evaluate": 0.0,
    "min-evaluate-nodes": 0,
    "eval-every": ROUNDS,
    "test-examples": 500,
    "plots": False,
    "round-timeout": 300.0,
    "node-wait-seconds": 300.0,
    "dp-clip": 0.5,
}


def _finish(run: lf.Proc) -> str:
    lf.wait_until(lambda: run.poll() is not None, 600, "the run to end")
    assert run.poll() == 0, run.output()
    assert "[pollen] done" in run.output(), run.output()
    return run.output()


def test_local_and_central_dp_run_on_supernodes_and_a_node_holds_its_own_floor(tmp_path):  # noqa: ANN001
    procs = lf.Processes(tmp_path / "logs")
    try:
        with lf.dump_logs_on_error(procs):
            fed = SecureFederation(tmp_path, procs, NUM_NODES)
            fed.extra_node_config[GUARDED] = "dp-min-noise-multiplier=1.0"
            fed.register_all()
            for index in range(NUM_NODES):
                fed.start_node(index)
            fed.wait_online(NUM_NODES)
            results = tmp_path / "results"

            local = {**BASE, "strategy": "fedams", "dp": "local", "dp-noise-multiplier": 1.0, "run-name": "local"}
            _finish(fed.start_run("local", {**local, "results-dir": str(results)}))
            rows = {row["round"]: row for row in lf.load_metrics(results, "local")["rows"]}
            assert sorted(rows) == list(range(ROUNDS + 1))
            assert all(rows[r]["replies"] == NUM_NODES and rows[r]["failures"] == 0 for r in range(1, ROUNDS + 1))
            epsilons = [rows[r]["method.dp_epsilon"] for r in range(1, ROUNDS + 1)]
            assert all(b > a > 0 for a, b in zip(epsilons, epsilons[1:])), epsilons
            assert [rows[r]["method.dp_uploads_max"] for r in range(1, ROUNDS + 1)] == [1, 2, 3]

            central = {
                **BASE,
                "strategy": "fedcams",
                "compressor": "sign",
                "dp": "central",
                "dp-noise-multiplier": 0.8,
                "run-name": "central",
            }
            output = _finish(fed.start_run("central", {**central, "results-dir": str(results)}))
            rows = {row["round"]: row for row in lf.load_metrics(results, "central")["rows"]}
            steps = [rows[r] for r in range(1, ROUNDS + 1)]
            assert all(row["replies"] == NUM_NODES - 1 and row["failures"] == 1 for row in steps), steps
            assert "dp-min-noise-multiplier" in output, output  # the node's reason, logged in full by the server
            epsilons = [row["method.dp_epsilon"] for row in steps]
            assert all(b > a > 0 for a, b in zip(epsilons, epsilons[1:])), epsilons
    finally:
        procs.stop_all()
        left = procs.leftovers()
        assert not left, f"processes still alive after teardown: {left}"
