"""FedAdaVR stored-update table at scale: measured memory per precision, and per-round server time vs N.

Model: the niid_bench LeNet (CNNMnist), d = 44,426 parameters in 10 tensors, so 10,000 clients in FP32 is
1.78 GB. For N = 100, 1,000, 10,000 clients and each precision the table is filled with one update per
client through ``UpdateTable.replace`` and its memory is *measured*: the arrays' ``nbytes``, the process's
anonymous RSS growth, and for the memory-mapped backend the file's size and the blocks really allocated on
disk. Then the server work of one round (``vr_aggregate`` + ``replace_many`` for M = 5 replies) is timed;
it must not grow with N. The naive O(N d) recomputation of the table sum is timed for contrast.

Run: ``python benchmarks/bench_table_scale.py`` (about 40 s on 2 cores, ~2 GB RAM, ~4 GB of /tmp).
MB = 10**6 bytes. "RSS anon" is the growth of the process's anonymous resident memory while the table is
built (from /proc/self/status); a memory-mapped table adds ~0 there, its rows live in the file.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time

import numpy as np

from pollen.compression.quant import PRECISIONS
from pollen.vr import UpdateTable, vr_aggregate

LENET = [150, 6, 2400, 16, 30720, 120, 10080, 84, 840, 10]  # conv1 w/b, conv2 w/b, fc1 w/b, fc2 w/b, fc3 w/b
M = 5


def rss_kib(field: str = "RssAnon") -> int:
    """Current resident memory of this process from /proc (kB), or -1 where /proc is not available."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


def fill(table: UpdateTable, n: int, pool: np.ndarray, rng: np.random.Generator) -> None:
    sizes = rng.integers(20, 200, size=n)
    for k in range(n):
        table.replace(k, pool[k % len(pool)] * np.float32(1.0 + (k % 7) / 7), weight=float(sizes[k]))


def time_rounds(table: UpdateTable, n: int, pool: np.ndarray, rng: np.random.Generator, rounds: int) -> str:
    """``"median/min"`` milliseconds of aggregate + replace for M replies (min: the least disturbed round)."""
    times = []
    for _ in range(rounds):
        sampled = rng.choice(n, size=M, replace=False)
        ys = {int(k): pool[int(k) % len(pool)] * np.float32(rng.uniform(0.5, 1.5)) for k in sampled}
        ws = {int(k): float(rng.integers(20, 200)) for k in sampled}
        t0 = time.perf_counter()
        delta = vr_aggregate(ys, table, num_clients=n, weights=ws, client_lr=0.01)
        table.replace_many(ys, ws)
        times.append(time.perf_counter() - t0)
        assert delta.shape == (table.dim,)
    return f"{1e3 * np.median(times):.2f}/{1e3 * np.min(times):.2f}"


def main() -> None:
    if sys.platform.startswith("linux") and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        # A fixed mmap threshold stops glibc from recycling freed table arrays from its heap, so the RSS
        # growth below is the table's own (with the default dynamic threshold small tables show ~0).
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(1 << 20)
        os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", str(1 << 26))  # no heap trim / page-fault churn per round
        os.execv(sys.executable, [sys.executable, *sys.argv])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[100, 1_000, 10_000])
    parser.add_argument("--rounds", type=int, default=30, help="timed rounds per (N, precision)")
    parser.add_argument("--tmpdir", default=None, help="where the memory-mapped tables go (default: system temp)")
    args = parser.parse_args()

    d = sum(LENET)
    rng = np.random.default_rng(0)
    pool = rng.standard_normal((32, d)).astype(np.float32)
    print(f"LeNet d = {d:,} in {len(LENET)} tensors; FP32 row = {4 * d:,} B; M = {M} replies per round\n")

    print("RAM backend: table memory measured after filling N rows (capacity = N)")
    print(
        f"{'N':>7} {'prec':>5} {'arrays (MB)':>12} {'RSS anon +MB':>13} {'B/client':>9} {'vs fp32':>8} "
        f"{'round ms med/min':>17} {'naive sum (ms)':>15}"
    )
    fp32_row = 4 * d
    for n in args.clients:
        for precision in PRECISIONS:
            gc.collect()
            before = rss_kib()
            table = UpdateTable(d, LENET, precision, initial_capacity=n)
            fill(table, n, pool, rng)
            grown = rss_kib() - before
            rep = table.memory_report()
            arrays = rep["data_bytes"] + rep["scale_bytes"]
            per_client = arrays / n
            round_ms = time_rounds(table, n, pool, rng, args.rounds)
            t0 = time.perf_counter()
            full = table.recompute_running_sum()
            naive_ms = 1e3 * (time.perf_counter() - t0)
            drift = np.max(np.abs(full - table.running_sum)) / np.max(np.abs(full))
            assert drift < 1e-9, drift
            print(
                f"{n:>7,} {precision:>5} {arrays / 1e6:>12.2f} {grown * 1024 / 1e6:>13.1f} {per_client:>9,.0f} "
                f"{per_client / fp32_row:>8.4f} {round_ms:>17} {naive_ms:>15.1f}"
            )
            del table, full
        print()

    n = max(args.clients)
    print(f"memmap backend, N = {n:,} (initial capacity 1, doubling): file on disk vs anonymous RAM")
    print(
        f"{'prec':>5} {'capacity':>9} {'file (MB)':>10} {'allocated (MB)':>15} {'used/fp32':>10} "
        f"{'RSS anon +MB':>13} {'round ms med/min':>17}"
    )
    with tempfile.TemporaryDirectory(dir=args.tmpdir) as tmp:
        for precision in PRECISIONS:
            gc.collect()
            before = rss_kib()
            path = os.path.join(tmp, f"table_{precision}.bin")
            table = UpdateTable(d, LENET, precision, path=path, initial_capacity=1)
            fill(table, n, pool, rng)
            round_ms = time_rounds(table, n, pool, rng, args.rounds)
            rep = table.memory_report()
            grown = rss_kib() - before
            print(
                f"{precision:>5} {rep['capacity']:>9,} {rep['data_bytes'] / 1e6:>10.1f} "
                f"{rep['data_allocated_bytes'] / 1e6:>15.1f} {rep['row_bytes'] / fp32_row:>10.4f} "
                f"{grown * 1024 / 1e6:>13.1f} {round_ms:>17}"
            )
            table.close()
            del table
            os.remove(path)


if __name__ == "__main__":
    main()
