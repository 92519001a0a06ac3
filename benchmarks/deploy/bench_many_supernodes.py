"""Many SuperNodes over TLS with node authentication: seconds per round and memory against the number of nodes.

    python benchmarks/deploy/bench_many_supernodes.py                                # 10, 20, 30 nodes; ~25 min
    python benchmarks/deploy/bench_many_supernodes.py --nodes 10 20 --per-round 5 --rounds 4 --kill-at 20

For each node count N: a TLS SuperLink with ``--enable-supernode-auth``, N registered ``flower-supernode``
processes (``--isolation subprocess``: a fresh ``flwr-clientapp`` per message; each node its own key,
partition and ``state-dir``), and ``flwr run`` of FedBNLACA (top-k 1/8 both ways, so every client keeps
state) with ``--per-round`` clients sampled each round (fixed participation: the clients' work per round is
the same at every N, so what grows with N is the control plane's). Reported per N: the time to register
and bring the nodes online, the median seconds per round from round 2 on (the app's ``round_seconds``),
the SuperLink's resident memory (sampled every second, peak and at the end), the ServerApp's
(``server_rss_bytes``), and the SuperNodes' resident memory (all of them, without their ClientApps).

``--kill-at N``: one more run at N with every node sampled each round (``fraction-train=1``); as soon as
round 1 is written a third of the nodes are SIGKILLed and started again (same key, node-config and
state-dir). Reported: each round's replies, failures, resync requests (a client that lost its state asks
for one) and seconds, and whether the run completed.

A node count the machine cannot carry is reported as collapsed (ClientApp processes piling up: see
:func:`clientapps`) and stops the scan. All on 127.0.0.1; every process is stopped by id at the end.
Two CPU cores run every ClientApp of a round at once, so seconds per round here measure this machine's
cores as much as pollen; compare the rows with each other, not with a real deployment's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from pollen.testing import local_federation as lf
from pollen.testing.secure_federation import SecureFederation, resident_bytes, rounds_written

RUN_NAME = "many"


def run_config(nodes: int, per_round: int, rounds: int, local_steps: int, results: Path) -> dict[str, Any]:
    return {
        "strategy": "fedbnlaca",
        "compressor": "topk",
        "topk-ratio": 0.125,
        "compressor-down": "topk",
        "topk-ratio-down": 0.125,
        "num-server-rounds": rounds,
        "local-steps": local_steps,
        "model": "cnn",
        "partitioner": "iid",
        "fraction-train": min(1.0, per_round / nodes),
        "min-train-nodes": min(per_round, nodes),
        "fraction-evaluate": 0.0,
        "min-evaluate-nodes": 0,
        "eval-every": rounds,
        "round-timeout": 90.0,
        "node-wait-seconds": 180.0,
        "run-name": RUN_NAME,
        "results-dir": str(results),
    }


class PeakMemory:
    """Samples a process's resident memory every ``interval`` seconds in a thread; keeps the peak."""

    def __init__(self, pid: int, interval: float = 1.0) -> None:
        self.pid, self.interval, self.peak = pid, interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, resident_bytes(self.pid))
            self._stop.wait(self.interval)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def supernodes_rss(fed: SecureFederation) -> int:
    """Resident bytes of the live ``flower-supernode`` processes (their ClientApps not counted)."""
    return sum(resident_bytes(proc.pid) for proc in fed.nodes.values() if proc.poll() is None)


class Collapsed(RuntimeError):
    """The machine could not carry the nodes: ClientApp processes piled up (see :func:`clientapps`)."""


def clientapps(fed: SecureFederation) -> int:
    """Live ``flwr-clientapp`` processes of the SuperNodes.

    Flower 1.39's SuperExec hands a message back to "pending" when its ClientApp has not started within
    30 s, and starts another one for it: on a machine too loaded to start a ClientApp in 30 s the processes
    pile up (500 of them at 40 SuperNodes on 2 cores) until memory runs out.
    """
    return sum(len(lf.find_in_tree(proc, "flwr-clientapp")) for proc in fed.nodes.values() if proc.poll() is None)


def wait_run(fed: SecureFederation, run: lf.Proc, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while run.poll() is None and time.monotonic() < deadline:
        fed.superlink.remember_tree()
        if (count := clientapps(fed)) > 2 * len(fed.nodes):
            raise Collapsed(f"{count} flwr-clientapp processes for {len(fed.nodes)} SuperNodes")
        time.sleep(1)
    if run.poll() != 0 or "[pollen] done" not in run.output():
        raise RuntimeError(f"flwr run did not complete (exit {run.poll()}):\n{lf.tail(run.output())}")


def bring_up(root: Path, procs: lf.Processes, nodes: int) -> tuple[SecureFederation, float]:
    start = time.perf_counter()
    fed = SecureFederation(root, procs, nodes)
    fed.register_all()
    for index in range(nodes):
        fed.start_node(index)
    fed.wait_online(nodes, timeout=120 + 10 * nodes)
    return fed, time.perf_counter() - start


def measure_scale(root: Path, nodes: int, per_round: int, rounds: int, local_steps: int) -> dict[str, Any]:
    procs = lf.Processes(root / "logs")
    with procs, lf.dump_logs_on_error(procs):
        fed, up_seconds = bring_up(root, procs, nodes)
        results = root / "results"
        idle_superlink = fed.superlink_rss()
        with PeakMemory(fed.superlink.pid) as peak:
            run = fed.start_run("flwr-run", run_config(nodes, per_round, rounds, local_steps, results))
            wait_run(fed, run, timeout=300 + 120 * rounds)
        rows = lf.load_metrics(results, RUN_NAME)["rows"][1:]
        return {
            "nodes": nodes,
            "per_round": min(per_round, nodes),
            "bring_up_seconds": up_seconds,
            "seconds_per_round": statistics.median(row["round_seconds"] for row in rows[1:]),
            "round_seconds": [row["round_seconds"] for row in rows],
            "replies": [row["replies"] for row in rows],
            "superlink_rss_idle": idle_superlink,
            "superlink_rss_peak": peak.peak,
            "superlink_rss_end": fed.superlink_rss(),
            "serverapp_rss_end": rows[-1].get("server_rss_bytes"),
            "supernodes_rss": supernodes_rss(fed),
        }


def measure_kill_restart(root: Path, nodes: int, rounds: int, local_steps: int) -> dict[str, Any]:
    procs = lf.Processes(root / "logs")
    with procs, lf.dump_logs_on_error(procs):
        fed, _ = bring_up(root, procs, nodes)
        results = root / "results"
        run = fed.start_run("flwr-run", run_config(nodes, nodes, rounds, local_steps, results))
        lf.wait_until(lambda: rounds_written(results / RUN_NAME) >= 1 or run.poll() is not None, 900, "round 1")
        killed = list(range(nodes // 3))
        for index in killed:
            fed.kill_node(index)
        killed_after = rounds_written(results / RUN_NAME)
        for index in killed:
            fed.restart_node(index)
        wait_run(fed, run, timeout=300 + 200 * rounds)
        rows = lf.load_metrics(results, RUN_NAME)["rows"][1:]
        return {
            "nodes": nodes,
            "killed": len(killed),
            "killed_after_round": killed_after,
            "completed": True,
            "rounds": [
                {
                    "round": row["round"],
                    "replies": row["replies"],
                    "failures": row["failures"],
                    "resyncs": (row.get("method.lazy_events") or {}).get("resync", 0),
                    "seconds": row["round_seconds"],
                }
                for row in rows
            ],
            "restarted_trained": {index: fed.trained_messages(index, since_start=1) for index in killed},
        }


def report(scale: list[dict[str, Any]], kill: dict[str, Any] | None, args: argparse.Namespace) -> str:
    mb = 1e6
    lines = [
        f"many SuperNodes (TLS + node auth, loopback): FedBNLACA top-k 1/8 both ways, CNN, {args.local_steps} "
        f"local steps, {args.rounds} rounds, {args.per_round} clients per round",
        "",
        f"{'nodes':>5} {'up (s)':>7} {'s/round (2+)':>12} {'SuperLink MB idle/peak/end':>27} "
        f"{'ServerApp MB':>12} {'SuperNodes MB':>13}  each round (s)",
    ]
    for r in scale:
        if "collapsed" in r:
            lines.append(f"{r['nodes']:>5} collapsed: {r['collapsed']} (Flower's SuperExec relaunch, see clientapps())")
            continue
        lines.append(
            f"{r['nodes']:>5} {r['bring_up_seconds']:>7.1f} {r['seconds_per_round']:>12.2f} "
            f"{r['superlink_rss_idle'] / mb:>9.0f}/{r['superlink_rss_peak'] / mb:.0f}/{r['superlink_rss_end'] / mb:.0f}"
            f"{'':>9} {(r['serverapp_rss_end'] or 0) / mb:>12.0f} {r['supernodes_rss'] / mb:>13.0f}  "
            + " ".join(f"{s:.1f}" for s in r["round_seconds"])
        )
    if kill:
        lines += [
            "",
            f"kill and restart: {kill['nodes']} nodes, all sampled each round; {kill['killed']} SIGKILLed after "
            f"round {kill['killed_after_round']} was written and started again; run completed: {kill['completed']}",
            f"{'round':>5} {'replies':>7} {'failures':>8} {'resyncs':>7} {'seconds':>8}",
        ]
        for r in kill["rounds"]:
            lines.append(f"{r['round']:>5} {r['replies']:>7} {r['failures']:>8} {r['resyncs']:>7} {r['seconds']:>8.1f}")
        lines.append(f"train messages answered by each restarted node after its restart: {kill['restarted_trained']}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, nargs="+", default=[10, 20, 30])
    parser.add_argument("--per-round", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--local-steps", type=int, default=2)
    parser.add_argument("--kill-at", type=int, default=20, help="node count of the kill-and-restart run (0: none)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if min(args.nodes) < 1 or args.per_round < 1 or args.rounds < 2:
        parser.error("--nodes and --per-round must be >= 1 and --rounds >= 2 (round 1 is not counted)")
    scale, kill = [], None
    with tempfile.TemporaryDirectory(prefix="pollen-many-") as tmp:
        for nodes in args.nodes:
            try:
                scale.append(
                    measure_scale(Path(tmp) / f"n{nodes}", nodes, args.per_round, args.rounds, args.local_steps)
                )
            except Collapsed as err:
                scale.append({"nodes": nodes, "collapsed": str(err)})
                print(f"[bench] {nodes} nodes: collapsed ({err}); larger counts skipped", file=sys.stderr, flush=True)
                break
            print(f"[bench] {nodes} nodes: {scale[-1]['seconds_per_round']:.2f} s/round", file=sys.stderr, flush=True)
        if args.kill_at:
            kill = measure_kill_restart(Path(tmp) / "kill", args.kill_at, args.rounds, args.local_steps)
    print(report(scale, kill, args))
    if args.json:
        args.json.write_text(json.dumps({"scale": scale, "kill_restart": kill}, indent=2) + "\n")


if __name__ == "__main__":
    main()
