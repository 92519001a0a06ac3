"""The lazy family's per-client bookkeeping at scale: server memory and time per round for 1,000 and 10,000 clients.

FedBNLACA keeps, per client that ever took part, its last upload ``ref_i``, its model mirror ``x_i`` and its
last downlink increment ``c_prev_i`` (:class:`pollen.strategies.lazy_book.ClientBook`, FedAdaVR's table storage).
Model: the papers' Fashion-MNIST CNN size, d = 29,034 (one flat float32 tensor here; the bookkeeping does not
care about shapes). The book is first filled with N clients' rows (N = 0, 1,000, 10,000; each row written
through the same ``put`` a round uses), then 10 rounds run with M = 50 sampled clients out of 200 connected
fake clients (pollen's ``lazy_mod`` around a numpy "training" step, top-k 1/8 both ways, NLA thresholds that
fire). Timed: the server's ``configure_train`` + ``aggregate_train`` per round (the clients' work is not in
it), median and slowest round (a table that doubles its capacity copies its rows once). FedCAMS on the same
clients is shown for scale: it keeps nothing per client and sends one shared dense model, while FedBNLACA
must top-k ``theta - x_i`` and check a copy for every sampled client, so its round costs more; what must hold
is that its round does not grow with N.
Memory: the book's bytes (:meth:`ClientBook.memory_bytes`) and the process's anonymous RSS growth. The
10,000-client book is memory-mapped in a temporary directory (3 x 10,000 x 116 kB = 3.5 GB of file).

    python benchmarks/bench_lazy_bookkeeping.py [--rounds 10]

About 2 minutes on 2 cores. MB = 10**6 bytes.
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import statistics
import tempfile
import time

import numpy as np
from flwr.app import ConfigRecord, MetricRecord, RecordDict  # noqa: E402

from pollen.clientside.compression_mod import compression_mod  # noqa: E402
from pollen.clientside.lazy_mod import lazy_mod  # noqa: E402
from pollen.strategies import FedCAMS, FedLazy  # noqa: E402
from pollen.testing.fakes import FakeGrid, make_context  # noqa: E402
from pollen.wire import protocol  # noqa: E402
from pollen.wire.records import arrays_to_record, record_to_arrays  # noqa: E402

D = 29_034
CONNECTED, M = 200, 50
SERVER = dict(eta=0.1, eps=1e-3, fraction_train=M / CONNECTED, min_train_nodes=M, fraction_evaluate=0.0, seed=3)


def rss_anon_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1e3
    return float("nan")


def train_fn(msg, context):  # noqa: ANN001, ANN201
    """A cheap stand-in for local training: one step towards a per-client centre."""
    node = msg.metadata.dst_node_id
    start = record_to_arrays(msg.content.array_records[protocol.ARRAYS_RECORD])["w"]
    centre = np.random.default_rng(node).standard_normal(D).astype(np.float32)
    local = (start - np.float32(0.3) * (start - centre)).astype(np.float32)
    metrics = MetricRecord({protocol.NUM_EXAMPLES: 10, "num-steps": 1})
    return type(msg)(
        content=RecordDict({protocol.ARRAYS_RECORD: arrays_to_record({"w": local}), protocol.METRICS_RECORD: metrics}),
        reply_to=msg,
    )


def run(strategy, mod, rounds: int) -> list[float]:  # noqa: ANN001
    contexts = {n: make_context(n) for n in range(1, CONNECTED + 1)}
    grid = FakeGrid(
        list(contexts),
        lambda msg: mod(copy.deepcopy(msg), contexts[msg.metadata.dst_node_id], train_fn),
        client_ids={n: f"client-{n}" for n in contexts},
    )
    arrays = arrays_to_record({"w": np.zeros(D, dtype=np.float32)})
    seconds = []
    for r in range(1, rounds + 1):
        t0 = time.perf_counter()
        messages = list(strategy.configure_train(r, arrays, ConfigRecord(), grid))
        t1 = time.perf_counter()
        replies = list(grid.send_and_receive(messages, timeout=60))
        t2 = time.perf_counter()
        new, _ = strategy.aggregate_train(r, replies)
        t3 = time.perf_counter()
        arrays = new or arrays
        seconds.append((t1 - t0) + (t3 - t2))
    return seconds


def fill(strategy: FedLazy, n: int) -> float:
    """Give ``n`` clients that are not connected a row in every table; seconds per client."""
    strategy._adopt_global_model(arrays_to_record({"w": np.zeros(D, dtype=np.float32)}))
    row = np.random.default_rng(0).standard_normal(D).astype(np.float32)
    started = time.perf_counter()
    for i in range(n):
        for kind in ("up-ref", "x", "c-prev"):
            strategy.book.put(kind, f"absent-{i}", row)
    return (time.perf_counter() - started) / max(n, 1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    print(
        f"d = {D}, {M} of {CONNECTED} connected clients per round, top-k 1/8 both ways, {args.rounds} rounds; "
        "server time = configure_train + aggregate_train (median round)\n"
    )
    cams = FedCAMS(compressor="topk", topk_ratio=0.125, **SERVER)
    base = statistics.median(run(cams, compression_mod, args.rounds)[1:])
    print(
        "| clients with rows (N) | book | book MB | RSS anon growth MB | fill ms / client | server s / round (median) "
        "| slowest round s |"
    )
    print("|---|---|---|---|---|---|---|")
    print(f"| FedCAMS (no book, dense downlink) | - | - | - | - | {base:.3f} | - |", flush=True)
    for n in (0, 1_000, 10_000):
        with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as folder:
            on_disk = n >= 10_000
            gc.collect()
            before = rss_anon_mb()
            lazy = FedLazy(
                up_rule="nla",
                up_tau=1.2,
                compressor="topk",
                topk_ratio=0.125,
                down_compressor="topk",
                down_rule="nla",
                down_tau=0.65,
                down_topk_ratio=0.125,
                bookkeeping_dir=folder if on_disk else None,
                **SERVER,
            )
            per_client = fill(lazy, n)
            filled = rss_anon_mb() - before
            rounds = run(lazy, lazy_mod, args.rounds)[1:]
            where = "memory-mapped" if on_disk else "RAM"
            print(
                f"| {n:,} | {where} | {lazy.book.memory_bytes() / 1e6:.0f} | {filled:.0f} | {per_client * 1e3:.2f} | "
                f"{statistics.median(rounds):.3f} | {max(rounds):.3f} |",
                flush=True,
            )
            del lazy
            gc.collect()


if __name__ == "__main__":
    main()
