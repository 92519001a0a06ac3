"""Server under load: 1,000 simulated clients x 100 rounds, memory and time per round (in-process).

The clients are numpy functions behind the test suite's in-process grid (full-model replies with a
seeded update, a LeNet-sized model, d = 44,426), so what is measured is the server: sampling over
N connected clients, reading and screening M = 10 replies, the server step, FedAdaVR's table. For
N = 100 and N = 1,000 at the same M per round: the process's resident memory after round 10 and
after the last round (flat after warm-up, except FedAdaVR's table, which grows by one row per new
client and is reported apart), and the median seconds per round (flat in N).

Run: ``python benchmarks/bench_load.py [--rounds 100]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
from flwr.app import ConfigRecord  # noqa: E402

from pollen.strategies import FedAdaVR, FedAMS  # noqa: E402
from pollen.strategies.engine.parts import ClientSampler, EngineParts
from pollen.testing.fakes import FakeGrid, config_of, full_model_reply, global_arrays_of, model_record  # noqa: E402
from pollen.wire import protocol  # noqa: E402

M = 10
SHAPES = {
    "conv1.weight": (6, 1, 5, 5),
    "conv1.bias": (6,),
    "conv2.weight": (16, 6, 5, 5),
    "conv2.bias": (16,),
    "fc1.weight": (120, 256),
    "fc1.bias": (120,),
    "fc2.weight": (84, 120),
    "fc2.bias": (84,),
    "fc3.weight": (10, 84),
    "fc3.bias": (10,),
}


def rss_mb() -> float:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def client(msg):  # noqa: ANN001, ANN201
    rnd = int(config_of(msg)[protocol.CFG_SERVER_ROUND])
    rng = np.random.default_rng([msg.metadata.dst_node_id, rnd])
    local = {k: (v + rng.standard_normal(v.shape).astype(np.float32) * 0.01) for k, v in global_arrays_of(msg).items()}
    return full_model_reply(msg, local, num_examples=50)


def measure(make, num_clients: int, rounds: int) -> tuple[float, float, float, float]:
    rng = np.random.default_rng(0)
    arrays = {k: rng.standard_normal(s).astype(np.float32) * 0.1 for k, s in SHAPES.items()}
    ids = {n: f"client-{n}" for n in range(num_clients)}
    grid = FakeGrid(range(num_clients), client, client_ids=ids)
    strategy = make(M / num_clients)
    record = model_record(arrays)
    times, rss_warm = [], 0.0
    for server_round in range(1, rounds + 1):
        started = time.perf_counter()
        replies = list(
            grid.send_and_receive(list(strategy.configure_train(server_round, record, ConfigRecord(), grid)))
        )
        new, _ = strategy.aggregate_train(server_round, replies)
        times.append(time.perf_counter() - started)
        record = new if new is not None else record
        (
            grid.sent.clear(),
            grid.replies.clear(),
            grid.calls.clear(),
        )  # the fake grid's own log is not the server's memory
        if server_round == 10:
            rss_warm = rss_mb()
    table = getattr(strategy, "table", None)
    table_mb = table.memory_bytes() / 1e6 if table is not None else 0.0
    return statistics.median(times[10:]), rss_warm, rss_mb(), table_mb


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=100)
    args = parser.parse_args()
    makes = {
        "FedAMS": lambda f: FedAMS(
            eta=0.1,
            fraction_train=f,
            fraction_evaluate=0.0,
            min_train_nodes=M,
            parts=EngineParts(sampler=ClientSampler(identify_clients=True)),
        ),
        "FedAdaVR int4": lambda f: FedAdaVR(
            table_precision="int4", eta=0.01, fraction_train=f, fraction_evaluate=0.0, min_train_nodes=M
        ),
    }
    print(f"{'strategy':<14} {'N':>6} {'s/round':>8} {'RSS r10 MB':>11} {'RSS end MB':>11} {'table MB':>9}")
    for name, make in makes.items():
        for num_clients in (100, 1000):
            per_round, warm, end, table = measure(make, num_clients, args.rounds)
            print(f"{name:<14} {num_clients:>6} {per_round:>8.4f} {warm:>11.1f} {end:>11.1f} {table:>9.2f}")


if __name__ == "__main__":
    main()
