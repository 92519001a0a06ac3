"""A federation moving from Flower 1.39 to 1.42: its SuperLink database upgraded, its 1.39 SuperNodes kept.

Runs in an environment of the newest Flower (1.42) with a 1.39 environment beside it (its ``bin`` folder in
``POLLEN_FLOWER_139_BIN``; ``.ci/run`` passes the main ``.venv``), all on 127.0.0.1:

1. a 1.39 SuperLink (TLS, SuperNode authentication, gRPC Fleet) with a database file; two SuperNode keys
   registered through it with the 1.39 ``flwr`` CLI (``deploy/scripts/register_supernodes.sh``); stopped;
2. a 1.42 SuperLink on the same database (Flower migrates it at start), serving the gRPC Fleet behind Flower's
   switch ``FLWR_INTERNAL_GRPC_FLEET_API=1`` beside its HTTP API; the keys registered under 1.39 still admit;
3. two 1.39 SuperNodes over gRPC with their keys; ``flwr run`` (1.42 CLI, 1.42 ServerApp, 1.39 ClientApps):
   FedCAMS with scaled-sign uploads, two rounds, every reply in, the run completed, the SuperLink's traffic
   counters above pollen's record bytes, and Flower's deprecation notice in each 1.39 SuperNode's log.

What this gives is written up in ``deploy/README.md`` ("Flower 1.42").
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pollen.testing import local_federation as lf

OLD_BIN = os.environ.get("POLLEN_FLOWER_139_BIN")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.app_compat,
    pytest.mark.xdist_group("flower-lines"),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the process helpers read /proc"),
    pytest.mark.skipif(shutil.which("openssl") is None, reason="make_certs.sh needs openssl"),
    pytest.mark.skipif(not lf.http_fleet(), reason="runs in an environment of Flower 1.40 or later (this is 1.39)"),
    pytest.mark.skipif(not OLD_BIN, reason="POLLEN_FLOWER_139_BIN (the bin folder of a Flower 1.39 environment) unset"),
]

CONNECTION = "pollen-lines"
NUM_NODES = 2
RUN_CONFIG = {
    "strategy": "fedcams",
    "compressor": "sign",
    "num-server-rounds": 2,
    "local-steps": 3,
    "model": "cnn",
    "run-name": "mixed",
    "fraction-train": 1.0,
    "min-train-nodes": NUM_NODES,
    "fraction-evaluate": 0.0,
    "min-evaluate-nodes": 0,
    "test-examples": 1000,
    "plots": False,
}


#: What would make another environment's Python import this one's packages: Ray's in-process start (Flower's
#: simulation in an earlier test of this worker) writes this environment's site-packages into PYTHONPATH.
_FOREIGN_PATHS = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")


def _clean_environ() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in _FOREIGN_PATHS}


def _line_of(bin_dir: Path) -> tuple[tuple[int, int], str]:
    """The Flower line of the environment of ``bin_dir``, and where its Flower is."""
    out = subprocess.run(
        [str(bin_dir / "python"), "-c", "import flwr; print(flwr.__version__, flwr.__file__)"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
        env=_clean_environ(),
    ).stdout.split()
    return lf.flower_line(out[0]), out[1]


def _env_with(home: Path, bin_dir: Path) -> dict[str, str]:
    """Flower's environment with ``bin_dir`` first on PATH (its processes start their helpers by name), and
    nothing that would point its Python at this environment's packages."""
    env = {k: v for k, v in lf.flower_env(home).items() if k not in _FOREIGN_PATHS}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    return env


def test_a_139_federation_moves_to_a_142_superlink_keeping_its_database_and_supernodes(tmp_path: Path) -> None:
    old_bin = Path(OLD_BIN)
    old_line, where = _line_of(old_bin)
    if old_line != (1, 39):  # set on purpose and wrong: a failure, not a skip that would hide the check
        pytest.fail(f"POLLEN_FLOWER_139_BIN={old_bin} runs Flower {old_line} ({where}), not 1.39")
    procs = lf.Processes(tmp_path / "logs", env=_clean_environ())  # the base of every process's environment
    try:
        with lf.dump_logs_on_error(procs):
            certs = lf.make_certs(tmp_path / "certs")
            names = [f"supernode-{i}" for i in range(NUM_NODES)]
            keys = lf.make_supernode_keys(tmp_path / "keys", *names)
            app = lf.snapshot_app(tmp_path / "app")
            database = tmp_path / "superlink" / "state.db"
            database.parent.mkdir()
            http_port, fleet_port = lf.free_ports(2)
            link_args = dict(http_port=http_port, fleet_port=fleet_port, certs=certs, supernode_auth=True)

            # 1. the 1.39 SuperLink and its registrations
            old_user = _env_with(tmp_path / "home-user-139", old_bin)
            lf.write_connection(tmp_path / "home-user-139", CONNECTION, f"127.0.0.1:{http_port}", certs["ca.crt"])
            old_link = procs.start(
                "superlink-139",
                lf.superlink_argv(**link_args, database=database, bin_dir=old_bin, line=old_line),
                env=_env_with(tmp_path / "home-superlink", old_bin),
            )
            lf.wait_for_superlink(old_link, http_port, fleet_port, timeout=120)
            code, out = procs.run(
                "register-139",
                ["bash", str(lf.SCRIPTS_DIR / "register_supernodes.sh"), CONNECTION, *(f"{keys[n]}.pub" for n in keys)],
                timeout=120,
                env=old_user,
            )
            assert code == 0 and out.count("registered successfully") == NUM_NODES, out
            assert procs.stop(old_link) is not None

            # 2. the 1.42 SuperLink on the same database, the gRPC Fleet behind Flower's switch
            user = lf.flower_env(tmp_path / "home-user")
            lf.write_connection(tmp_path / "home-user", CONNECTION, f"127.0.0.1:{http_port}", certs["ca.crt"])
            argv = lf.superlink_argv(**link_args, database=database, fleet="grpc")
            assert argv[:2] == ["env", f"{lf.GRPC_FLEET_SWITCH}=1"], argv
            link = procs.start("superlink-new", argv, env=lf.flower_env(tmp_path / "home-superlink"))
            lf.wait_for_superlink(link, http_port, fleet_port, timeout=120)
            registered = lf.list_nodes(procs, CONNECTION, user)
            assert len(registered) == NUM_NODES, registered  # the 1.39 registrations survived the migration

            # 3. the 1.39 SuperNodes, over gRPC with their keys, and a run of the 1.42 ServerApp
            nodes = []
            for i, name in enumerate(names):
                node = procs.start(
                    name,
                    lf.supernode_argv(
                        superlink=f"127.0.0.1:{fleet_port}",
                        runtime_port=lf.free_ports(1)[0],
                        node_config=f"partition-id={i} num-partitions={NUM_NODES} device='cpu'",
                        root_certificates=certs["ca.crt"],
                        private_key=keys[name],
                        bin_dir=old_bin,
                        line=old_line,
                    ),
                    env=_env_with(tmp_path / f"home-{name}", old_bin),
                )
                nodes.append(node)
            lf.wait_until(
                lambda: lf.online_nodes(procs, CONNECTION, user) >= NUM_NODES, 180, "the 1.39 SuperNodes online", 1.0
            )
            results = tmp_path / "results"
            config = dict(RUN_CONFIG, **{"results-dir": str(results)})
            code, out = procs.run(
                "flwr-run",
                [lf.exe("flwr"), "run", str(app), CONNECTION, "--stream", "--run-config", lf.run_config_arg(config)],
                timeout=600,
                env=user,
                cwd=lf.REPO_ROOT,
            )
            assert code == 0 and "[pollen] done" in out, out
            started = re.search(r"Successfully started run (\d+)", out)
            assert started, out
            run_id = started.group(1)
            assert lf.run_status(procs, CONNECTION, user, run_id=run_id)["status"] == "finished:completed"
            rows = lf.load_metrics(results, "mixed")["rows"]
            for row in rows[1:]:
                assert row["replies"] == NUM_NODES and row["failures"] == 0, row
                assert row["uplink_fp32_bytes"] / row["uplink_update_bytes"] > 25, row  # 1-bit uploads
            traffic = lf.run_traffic(procs, CONNECTION, user, run_id)
            assert traffic["inbound"] > rows[-1]["cum_uplink_bytes"], traffic  # the SuperLink saw every upload
            assert traffic["outbound"] > rows[-1]["cum_downlink_bytes"], traffic
            # what Flower tells a 1.39 SuperNode on its heartbeats, in its own log
            assert all("The gRPC Fleet API is deprecated" in node.output() for node in nodes)
    finally:
        procs.stop_all()
        left = procs.leftovers()
        assert not left, f"processes still alive after teardown: {left}"
