"""Many clients: 10,000 in a real ``flwr run`` simulation, 100,000 for the server's structures in-process.

Two stages (``--stage``):

- ``partition``: the seconds to deal Fashion-MNIST's 60,000 training images to N clients (IID and
  Dirichlet(0.5)), which every simulation worker pays once per dataset and N (then the partition cache
  serves it), for N = 1,000, 10,000, 100,000.
- ``simulation``: ``flwr run`` of pollen's app on Flower's local simulation (Ray, the local SuperLink,
  two workers of one CPU each), N = 1,000 and 10,000 clients, 100 sampled per round, ``--rounds`` (50)
  rounds, the MLP on Fashion-MNIST (IID, 2 local steps of batch 8). ``--sim-mode population`` (the default):
  run-config ``population`` = N played by ``--sim-workers`` (100) simulated SuperNodes, bound anew each round,
  the clients' own state in files under ``state-dir``; ``--sim-mode nodes``: N simulated SuperNodes, one client
  each (Flower's simulation engine scans every node's queue each sweep, so this stops scaling in N). Methods:
  FedAdaVR with its stored-update table in Int4, memory-mapped (``table-path``), and FedBNLACA, whose
  per-client book (references, mirrors, downlink residuals) is memory-mapped (``bookkeeping-dir``); in node
  mode also FedBNLACA with its clients' state in files (``client-state-in-memory=false``). From the run's own
  results rows: median seconds per round after round 1, round 1 (start-up, partitioning included), the
  resident memory of the process that runs the ServerApp (with Flower's per-node contexts) at round 10
  and at the last round, the same less the pages of files (``server_anon_rss_bytes``: a memory-mapped
  table's or book's pages are resident but are the file's), and the table's or book's bytes (on disk).
- ``server``: the server alone, in-process (the test suite's fake grid; clients are numpy stand-ins, so
  nothing but the strategy is measured), N = 1,000, 10,000, 100,000 connected clients, 100 per round,
  ``--rounds`` rounds, d = 29,034 (the CNN's size): FedAMS (keeps nothing per client), FedAdaVR Int4
  memory-mapped, FedBNLACA memory-mapped. Server seconds per round (``configure_train`` +
  ``aggregate_train``, median after round 10), the growth of the process's anonymous resident memory at
  round 10 and at the end, what the harness's lazy clients keep in their ``context.state`` (in the same
  process, so part of that growth), and the table's or book's bytes.

    python benchmarks/bench_scale_clients.py --stage partition server simulation [--rounds 50]
        [--sim-mode population|nodes] [--sim-workers 100] [--sim-clients 1000 10000]

MB = 10**6 bytes.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from pollen.strategies.engine.parts import ClientSampler, EngineParts

M = 100
D = 29_034


def rss_anon_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1e3
    return float("nan")


# ------------------------------------------------------------------------------------------ partition
def stage_partition() -> None:
    from pollen.task.data import _raw
    from pollen.task.partitions import make_partitions

    labels = _raw("fashion-mnist", "").y_train
    print("| clients (N) | IID s | Dirichlet(0.5) s | images per client |")
    print("|---|---|---|---|")
    for n in (1_000, 10_000, 100_000):
        seconds = {}
        for partitioner in ("iid", "dirichlet"):
            started = time.perf_counter()
            try:
                parts = make_partitions(labels, partitioner, num_partitions=n, alpha=0.5, seed=0)
            except ValueError as err:  # the partitioner's own refusal is the result
                seconds[partitioner] = f"refused: {str(err).split(':')[0]}"
                continue
            seconds[partitioner] = f"{time.perf_counter() - started:.2f}"
            assert len(parts) == n
        print(f"| {n:,} | {seconds['iid']} | {seconds['dirichlet']} | {len(labels) / n:g} |", flush=True)


# ------------------------------------------------------------------------------------------ simulation
SIM_SETUP = {
    "dataset": "fashion-mnist",
    "model": "mlp",
    "partitioner": "iid",
    "local-steps": 2,
    "batch-size": 8,
    "val-fraction": 0.0,
    "fraction-evaluate": 0.0,
    "min-evaluate-nodes": 0,
    "eval-batch-size": 2000,
    "min-train-nodes": M,
    "seed": 1,
}


def sim_methods(folder: Path, n: int, mode: str) -> dict[str, dict]:
    methods = {
        "FedAdaVR Int4 (memory-mapped)": {
            "strategy": "fedadavr",
            "table-precision": "int4",
            "table-path": str(folder / f"table-{mode}-{n}.bin"),
        },
        "FedBNLACA (book memory-mapped)": {
            "strategy": "fedbnlaca",
            "bookkeeping-dir": str(folder / f"book-{mode}-{n}"),
        },
    }
    if mode == "population":  # the clients' own state follows them in files (the only way in this mode)
        for name, method in methods.items():
            method.update({"population": n, "state-dir": str(folder / f"client-state-{mode}-{name[:8]}-{n}")})
        return methods
    # the clients' own state (a model mirror, increments, residuals) in files instead of Flower's node
    # contexts, which a simulation keeps for every node in the process that runs the ServerApp
    methods["FedBNLACA (book memory-mapped, client state in files)"] = {
        "strategy": "fedbnlaca",
        "bookkeeping-dir": str(folder / f"book-files-{n}"),
        "state-dir": str(folder / f"client-state-{n}"),
        "client-state-in-memory": False,
    }
    return methods


def stage_simulation(
    rounds: int, sizes: list[int], only: list[str] | None = None, mode: str = "population", workers: int = M
) -> None:
    from pollen.testing.flwr_cli import LocalFlower

    with tempfile.TemporaryDirectory(prefix="pollen-scale-") as tmp:
        folder = Path(tmp)
        flower = LocalFlower(folder / "flwr-home")
        print(
            f"mode {mode}" + (f", {workers} simulated SuperNodes play the clients" if mode == "population" else ""),
        )
        print(
            "| method | clients (N) | s / round (median, rounds 2+) | round 1 s | ServerApp RSS round 10 | "
            "at round {0} | own memory (RSS less file pages) round 10 | at round {0} | table / book | "
            "final accuracy |".format(rounds)
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
        try:
            for n in sizes:
                for name, method in sim_methods(folder, n, mode).items():
                    if only and not any(word.lower() in name.lower() for word in only):
                        continue
                    run_name = f"{method['strategy']}-{mode}-{n}" + ("-files" if "state-dir" in method else "")
                    config = {
                        **SIM_SETUP,
                        **method,
                        "num-server-rounds": rounds,
                        "eval-every": rounds,
                        "fraction-train": M / n,
                        "results-dir": str(folder / "results"),
                        "run-name": run_name,
                    }
                    started = time.perf_counter()
                    supernodes = workers if mode == "population" else n
                    proc = flower.run(config, num_supernodes=supernodes, client_cpus=1, timeout=3600)
                    wall = time.perf_counter() - started
                    if proc.returncode != 0:
                        print(f"| {name} | {n:,} | failed: {proc.stderr[-500:]!r} |", flush=True)
                        continue
                    rows = json.loads((folder / "results" / run_name / "metrics.json").read_text())["rows"]
                    by_round = {row["round"]: row for row in rows}
                    steady = [by_round[r]["round_seconds"] for r in range(2, rounds + 1)]
                    marks = (min(10, rounds), rounds)
                    rss = {r: by_round[r]["server_rss_bytes"] / 1e6 for r in marks}
                    anon = {r: by_round[r]["server_anon_rss_bytes"] / 1e6 for r in marks}
                    print(
                        f"| {name} | {n:,} | {statistics.median(steady):.2f} | {by_round[1]['round_seconds']:.1f} | "
                        f"{rss[marks[0]]:.0f} MB | {rss[rounds]:.0f} MB | {anon[marks[0]]:.0f} MB | "
                        f"{anon[rounds]:.0f} MB | "
                        f"{by_round[rounds]['server_state_bytes'] / 1e6:.0f} MB | {by_round[rounds]['accuracy']:.4f} |"
                        f" (wall {wall:.0f} s)",
                        flush=True,
                    )
        finally:
            flower.stop()


# ------------------------------------------------------------------------------------------ server
def _plain_client(msg):  # noqa: ANN001, ANN202
    from pollen.testing.fakes import config_of, full_model_reply, global_arrays_of
    from pollen.wire import protocol

    rnd = int(config_of(msg)[protocol.CFG_SERVER_ROUND])
    rng = np.random.default_rng([msg.metadata.dst_node_id, rnd])
    local = {k: v + rng.standard_normal(v.shape).astype(np.float32) * 0.01 for k, v in global_arrays_of(msg).items()}
    return full_model_reply(msg, local, num_examples=50)


def _lazy_train(msg, context):  # noqa: ANN001, ANN202
    """One step towards a per-client centre (a cheap stand-in for local training)."""
    from flwr.app import MetricRecord, RecordDict

    from pollen.wire import protocol
    from pollen.wire.records import arrays_to_record, record_to_arrays

    start = record_to_arrays(msg.content.array_records[protocol.ARRAYS_RECORD])["w"]
    centre = np.random.default_rng(msg.metadata.dst_node_id).standard_normal(D).astype(np.float32)
    local = (start - np.float32(0.3) * (start - centre)).astype(np.float32)
    metrics = MetricRecord({protocol.NUM_EXAMPLES: 10, "num-steps": 1})
    content = RecordDict({protocol.ARRAYS_RECORD: arrays_to_record({"w": local}), protocol.METRICS_RECORD: metrics})
    return type(msg)(content=content, reply_to=msg)


class LazyClients:
    """The lazy family's clients, each with its own context made when first asked (the harness's memory)."""

    def __init__(self) -> None:
        self.contexts: dict[int, object] = {}

    def __call__(self, msg):  # noqa: ANN001, ANN204
        from pollen.clientside.lazy_mod import lazy_mod
        from pollen.testing.fakes import make_context

        node = msg.metadata.dst_node_id
        context = self.contexts.setdefault(node, make_context(node))
        return lazy_mod(copy.deepcopy(msg), context, _lazy_train)

    def state_mb(self) -> float:
        return sum(r.count_bytes() for c in self.contexts.values() for r in c.state.values()) / 1e6


def _server_run(strategy, clients, n: int, rounds: int) -> tuple[list[float], float, float]:  # noqa: ANN001
    from flwr.app import ConfigRecord

    from pollen.testing.fakes import FakeGrid
    from pollen.wire.records import arrays_to_record

    grid = FakeGrid(range(1, n + 1), clients, client_ids={i: f"client-{i}" for i in range(1, n + 1)})
    arrays = arrays_to_record({"w": np.random.default_rng(0).standard_normal(D).astype(np.float32) * 0.1})
    harness = getattr(clients, "state_mb", lambda: 0.0)
    seconds, rss_10 = [], float("nan")
    for r in range(1, rounds + 1):
        t0 = time.perf_counter()
        messages = list(strategy.configure_train(r, arrays, ConfigRecord(), grid))
        t1 = time.perf_counter()
        replies = list(grid.send_and_receive(messages, timeout=60))
        t2 = time.perf_counter()
        new, _ = strategy.aggregate_train(r, replies)
        seconds.append((t1 - t0) + time.perf_counter() - t2)
        arrays = new or arrays
        grid.sent.clear(), grid.replies.clear(), grid.calls.clear()  # the fake grid's log is not the server's
        del messages, replies
        if r == 10:
            rss_10 = rss_anon_mb()
    return seconds, rss_10, rss_anon_mb(), harness()


def server_methods(n: int, tmp: str) -> dict:
    """Name -> a function making (strategy, clients) for ``n`` connected clients, files under ``tmp``."""
    from pollen.strategies import FedAdaVR, FedAMS, FedLazy

    common = {"fraction_evaluate": 0.0, "min_train_nodes": M, "seed": 3, "fraction_train": M / n}
    lazy = {"up_rule": "nla", "up_tau": 1.3, "compressor": "topk", "topk_ratio": 0.125}
    lazy.update(down_compressor="topk", down_rule="nla", down_tau=0.65, down_topk_ratio=0.125)
    return {
        "FedAMS": lambda: (
            FedAMS(eta=0.1, parts=EngineParts(sampler=ClientSampler(identify_clients=True)), **common),
            _plain_client,
        ),
        "FedAdaVR Int4 (memory-mapped)": lambda: (
            FedAdaVR(table_precision="int4", table_path=f"{tmp}/table.bin", eta=0.01, **common),
            _plain_client,
        ),
        "FedBNLACA (book memory-mapped)": lambda: (
            FedLazy(**lazy, bookkeeping_dir=f"{tmp}/book", eta=0.1, eps=1e-3, **common),
            LazyClients(),
        ),
    }


def stage_server(rounds: int, sizes: list[int]) -> None:
    print(
        f"| method | connected clients (N) | server s / round (median after 10) | RSS anon round 10 "
        f"| at round {rounds} | of it, the harness's clients' state | table / book |"
    )
    print("|---|---|---|---|---|---|---|")
    for n in sizes:
        with tempfile.TemporaryDirectory(prefix="pollen-scale-") as tmp:
            makes = server_methods(n, tmp)
            for name, make in makes.items():
                gc.collect()
                base = rss_anon_mb()
                strategy, clients = make()
                seconds, rss_10, rss_end, clients_mb = _server_run(strategy, clients, n, rounds)
                store = getattr(strategy, "table", None) or getattr(strategy, "book", None)
                stored = f"{store.memory_bytes() / 1e6:.0f} MB" if store is not None else "-"
                print(
                    f"| {name} | {n:,} | {statistics.median(seconds[10:]):.3f} | {rss_10 - base:+.0f} MB | "
                    f"{rss_end - base:+.0f} MB | {clients_mb:.0f} MB | {stored} |",
                    flush=True,
                )
                del strategy, clients
                gc.collect()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", nargs="+", choices=("partition", "simulation", "server"), default=["partition"])
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--sim-clients", type=int, nargs="+", default=[1_000, 10_000])
    parser.add_argument("--server-clients", type=int, nargs="+", default=[1_000, 10_000, 100_000])
    parser.add_argument(
        "--sim-methods", nargs="*", default=None, help="run only the simulation methods whose names hold one of these"
    )
    parser.add_argument("--sim-mode", choices=("population", "nodes"), default="population")
    parser.add_argument("--sim-workers", type=int, default=M, help="population mode: simulated SuperNodes")
    args = parser.parse_args()
    if "partition" in args.stage:
        stage_partition()
    if "server" in args.stage:
        stage_server(args.rounds, args.server_clients)
    if "simulation" in args.stage:
        stage_simulation(args.rounds, args.sim_clients, args.sim_methods, args.sim_mode, args.sim_workers)


if __name__ == "__main__":
    main()
