"""What one relayed gossip step costs HA-Fed in deployment (loopback) and in simulation.

    python benchmarks/deploy/bench_hafed_deploy.py [--rounds 4] [--tau 4]      # about 5 minutes on 2 CPU cores

Two clients in one cluster (node-config ``cluster-id`` in deployment, ``cluster-size=2`` in
simulation), ``topology=full``, both upload, ``tau`` local steps of batch 32 on the CNN: once with a
gossip step after every local step (``gossip-every=1``: ``tau - 1`` relayed exchanges per round) and
once with only the round's last one (``gossip-every=tau``: no relayed exchange, the same training).
The difference of the steady seconds per round, divided by ``tau - 1``, is what one relayed gossip
step costs (both clients, one model up and one down each). Deployment is ``flower-superlink`` +
SuperNodes with ``--isolation subprocess`` (a fresh ``flwr-clientapp`` process per message), as in
``benchmarks/deploy/bench_deploy_vs_sim.py``, whose helpers this script reuses.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from bench_deploy_vs_sim import CONNECTION, NUM_CLIENTS, app_config, federation, flwr_run  # noqa: E402

from pollen.testing import local_federation as lf  # noqa: E402


def hafed_config(rounds: int, tau: int, every: int, results: Path, name: str, **extra: object) -> dict:
    config = app_config(
        rounds,
        tau,
        name,
        results,
        strategy="hafed",
        topology="full",
        **{
            "gossip-every": every,
            "uploaders-per-cluster": NUM_CLIENTS,
            "batch-size": 32,
            "eval-every": rounds,
            **extra,
        },
    )
    config.pop("compressor")
    return config


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tau", type=int, default=4)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="pollen-hafed-deploy-"))
    rows = []
    with federation(root / "deploy", node_config_extra="cluster-id='c'") as (procs, env, _):
        for every in (1, args.tau):
            run = flwr_run(procs, env, hafed_config(args.rounds, args.tau, every, root / "results", f"deploy-g{every}"))
            rows.append(("deployment (loopback, a process per message)", every, run["steady_round_seconds"]))
    with lf.Processes(root / "sim" / "logs") as procs, lf.dump_logs_on_error(procs, lines=40):
        (http_port,) = lf.free_ports(1)
        env = lf.flower_env(root / "sim" / "home", RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO="0")
        superlink = procs.start(
            "superlink-sim", lf.superlink_argv(http_port=http_port, fleet_port=0, simulation=True), env=env
        )
        lf.wait_until(lambda: superlink.poll() is None and lf.port_is_open(http_port), 90, "the simulation SuperLink")
        lf.write_connection(root / "sim" / "home", CONNECTION, f"127.0.0.1:{http_port}", insecure=True)
        for every in (1, args.tau):
            config = hafed_config(
                args.rounds, args.tau, every, root / "results", f"sim-g{every}", **{"cluster-size": NUM_CLIENTS}
            )
            run = flwr_run(
                procs, env, config, federation_config=f"num-supernodes={NUM_CLIENTS} client-resources-num-cpus=1"
            )
            rows.append(("simulation (Ray)", every, run["steady_round_seconds"]))
    print(
        f"HA-Fed, {NUM_CLIENTS} clients in one cluster, tau = {args.tau}, {args.rounds} rounds (steady: rounds 2 on)\n"
    )
    print("| where | gossip-every | relayed exchanges / round | s / round | s per relayed gossip step |")
    print("|---|---|---|---|---|")
    by_where: dict[str, dict[int, float]] = {}
    for where, every, seconds in rows:
        by_where.setdefault(where, {})[every] = seconds
    for where, times in by_where.items():
        per_step = (times[1] - times[args.tau]) / (args.tau - 1)
        for every, seconds in times.items():
            steps = args.tau - 1 if every == 1 else 0
            print(
                f"| {where} | {every} | {steps} | {seconds:.2f} | {per_step:.2f} |"
                if every == 1
                else f"| {where} | {every} | {steps} | {seconds:.2f} | |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
