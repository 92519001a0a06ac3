"""Deployed, one SuperNode 5x slower: synchronous rounds against buffered asynchronous steps, same updates.

    python benchmarks/deploy/bench_async_deploy.py                     # about 6 minutes on 2 cores
    python benchmarks/deploy/bench_async_deploy.py --updates 24 --slow-delay 16
    python benchmarks/deploy/bench_async_deploy.py --rules --slow-delay 12   # FADAS, FedBuff, FedAsync, 6 steps each

Four ``flower-supernode`` processes over TLS with node authentication on 127.0.0.1
(:class:`pollen.testing.secure_federation.SecureFederation`, the test harness's app), a fresh
``flwr-clientapp`` process per message. One node is made slow: each of its train messages sleeps
``--slow-delay`` seconds first (``pollen.testing.faults``, node-config ``fault-kind=timeout``), about 5x a
fast node's job on this machine. FedCAMS (scaled sign, error feedback) runs twice on the same federation:

- **sync**: every node each round, ``--updates / 4`` rounds;
- **async**: ``driver=async``, the real clock, 4 jobs in flight, a step every ``--buffer`` replies,
  ``--updates / --buffer`` steps.

Both apply the same number of client updates. ``--rules`` instead runs each asynchronous rule on real
SuperNodes, 6 steps each with 2 local steps (FADAS: FedAMS; FedBuff and FedAsync: a server SGD of lr 1;
a step every 2 replies, FedAsync every reply). Reported: the median seconds per server step (the app's
``round_seconds``, from step 2 on), the seconds until the last update was applied (the last row's
``elapsed_seconds``), the staleness of the async steps and the final test accuracy. Absolute seconds
measure this machine's two cores as much as pollen (every ClientApp is a Python process importing torch);
compare the two rows with each other.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pollen.testing import local_federation as lf
from pollen.testing.secure_federation import SecureFederation

NODES, SLOW = 4, 3


def base_config(results: Path, name: str) -> dict[str, Any]:
    return {
        "strategy": "fedcams",
        "compressor": "sign",
        "local-steps": 5,
        "batch-size": 32,
        "model": "cnn",
        "partitioner": "iid",
        "fraction-train": 1.0,
        "min-train-nodes": NODES,
        "fraction-evaluate": 0.0,
        "min-evaluate-nodes": 0,
        "test-examples": 1000,
        "plots": False,
        "round-timeout": 600.0,
        "node-wait-seconds": 300.0,
        "results-dir": str(results),
        "run-name": name,
    }


def rule_configs(results: Path) -> dict[str, dict[str, Any]]:
    """FADAS, FedBuff and FedAsync on the real clock, 6 steps each (``--rules``)."""
    sgd = {"strategy": "fedopt", "server-optimizer": "sgd", "server-lr": 1.0}
    rules = {
        "fadas": {"strategy": "fedams", "async-rule": "fadas"},
        "fedbuff": {**sgd, "async-rule": "fedbuff"},
        "fedasync": {**sgd, "async-rule": "fedasync", "buffer-size": 1},
    }
    common = {"driver": "async", "async-clock": "real", "concurrency": NODES, "buffer-size": 2}
    return {
        name: base_config(results, name) | common | {"num-server-rounds": 6, "eval-every": 6, "local-steps": 2} | rule
        for name, rule in rules.items()
    }


def one_run(fed: SecureFederation, config: dict[str, Any], results: Path) -> dict[str, Any]:
    run = fed.start_run(f"flwr-run-{config['run-name']}", config)
    deadline = time.monotonic() + 1800
    while run.poll() is None and time.monotonic() < deadline:
        time.sleep(1)
    if run.poll() != 0:
        raise RuntimeError(f"the run failed:\n{lf.tail(run.output())}")
    rows = lf.load_metrics(results, config["run-name"])["rows"][1:]
    per_step = [row["round_seconds"] for row in rows[1:]] or [rows[0]["round_seconds"]]
    stale = [row.get("method.async_staleness_max", 0) for row in rows]
    return {
        "steps": len(rows),
        "applied": sum(row["replies"] for row in rows),
        "median_step_seconds": statistics.median(per_step),
        "seconds_to_last_update": rows[-1]["elapsed_seconds"],
        "staleness_max": max(stale),
        "staleness_mean_of_steps": statistics.fmean(row.get("method.async_staleness_mean", 0) for row in rows),
        "final_accuracy": rows[-1]["accuracy"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--updates", type=int, default=24, help="client updates each run applies")
    parser.add_argument("--buffer", type=int, default=2, help="async: replies per step")
    parser.add_argument("--slow-delay", type=float, default=16.0, help="seconds the slow node sleeps per job")
    parser.add_argument("--rules", action="store_true", help="run FADAS, FedBuff and FedAsync instead")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not sys.platform.startswith("linux"):
        raise SystemExit("the process helpers read /proc: Linux only")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        procs = lf.Processes(root / "logs")
        try:
            fed = SecureFederation(root, procs, NODES, variant="testing")
            fed.extra_node_config[SLOW] = f"fault-fraction=1.0 fault-kind='timeout' fault-delay={args.slow_delay}"
            fed.register_all()
            for index in range(NODES):
                fed.start_node(index)
            fed.wait_online(NODES)
            results = root / "results"
            if args.rules:
                report = {name: one_run(fed, config, results) for name, config in rule_configs(results).items()}
                for name, row in report.items():
                    print(name, json.dumps(row), flush=True)
                if args.out is not None:
                    args.out.write_text(json.dumps(report, indent=1))
                return
            sync = base_config(results, "sync") | {"num-server-rounds": args.updates // NODES}
            asynchronous = base_config(results, "async") | {
                "driver": "async",
                "async-clock": "real",
                "concurrency": NODES,
                "buffer-size": args.buffer,
                "num-server-rounds": args.updates // args.buffer,
                "eval-every": args.updates // args.buffer,
            }
            sync["eval-every"] = sync["num-server-rounds"]
            report = {"settings": vars(args) | {"out": str(args.out)}}
            for name, config in (("sync", sync), ("async", asynchronous)):
                report[name] = one_run(fed, config, results)
                print(name, json.dumps(report[name]), flush=True)
        finally:
            procs.stop_all()
    s, a = report["sync"], report["async"]
    print()
    print("| driver | steps | updates | median s per step | s to the last update | max staleness | final accuracy |")
    print("|---|---|---|---|---|---|---|")
    for name, row in (("sync", s), ("async", a)):
        print(
            f"| {name} | {row['steps']} | {row['applied']} | {row['median_step_seconds']:.1f} | "
            f"{row['seconds_to_last_update']:.1f} | {row['staleness_max']} | {row['final_accuracy']:.3f} |"
        )
    ratio = a["seconds_to_last_update"] / s["seconds_to_last_update"]
    print(f"\nasync / sync, seconds to the same number of updates: {ratio:.2f}x")
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
