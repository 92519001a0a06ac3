"""What a server round costs at ResNet-18 size: pollen's strategies vs Flower's own FedAdam, same replies.

For d = 11,173,962 (ResNet-18 for CIFAR-10, real layer shapes and buffers), M client replies built
once per reply kind (dense full models as any Flower ClientApp sends them; scaled-sign and top-k
1/64 payloads from pollen's mod), then rounds of ``configure_train`` + ``aggregate_train`` through
the Message API with the in-process grid, exactly as ``Strategy.start`` drives them. The grid frees
every message once its round is over (``FakeGrid(keep_history=False)``), as a real ServerApp does: a
grid that keeps every message alive makes each round's allocations page-fault on fresh memory and
doubled Flower's FedAdam time (907 vs 428 ms on the same replies).

- Flower's ``FedAdam`` (``flwr.serverapp.strategy``, unmetered) on the dense replies,
- pollen's ``FedAMS`` on the same dense replies,
- pollen's ``FedCAMS`` on sign and on top-k replies, ``FedAdaVR`` with an Int4 and an FP32 table (dense replies).

Times are medians over rounds 2.. (round 1 has no outlier history and keeps every delta); each
is also divided by one ``np.copyto`` of a d-vector timed in the same run (memory-bandwidth
yardstick), and turned into the bandwidth the round achieves: the bytes it cannot avoid moving (every
reply's records read once, the new model written once) over its time, as a fraction of the machine's
copy bandwidth measured in the same run (STREAM's "copy": read and write of a 4d-byte vector, best of 9).
Memory: the peak that ``tracemalloc`` sees during one steady-state ``aggregate_train``,
in units of one d-size float32 vector (the replies themselves are allocated before and not counted).

Run: ``python benchmarks/bench_round.py [--rounds 6] [--replies 10] [--memory-replies 10 50]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
import tracemalloc

import numpy as np
from flwr.app import ConfigRecord, Context, RecordDict
from flwr.serverapp.strategy import FedAdam

from pollen.clientside import compression_mod
from pollen.strategies import FedAdaVR, FedAMS, FedCAMS
from pollen.testing.fakes import FakeGrid, full_model_reply, global_arrays_of, model_record


def resnet_arrays() -> dict[str, np.ndarray]:
    import torch

    from pollen.task.data import dataset_info
    from pollen.task.models import build_model

    torch.manual_seed(0)
    model = build_model("resnet18", dataset_info("cifar10"))
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


class ReplyBank:
    """Replies of one kind for M nodes: each node's model is the global model it was sent plus its own
    fixed move (drawn once), so every round's updates look alike to the outlier screen, as a real
    round's would (replies made from a fixed local model would drift away from a moving global model
    and be screened out)."""

    def __init__(self, arrays: dict[str, np.ndarray], nodes: list[int], codec: str | None) -> None:
        rng = np.random.default_rng(1)
        self.moves = {
            node: {
                k: rng.standard_normal(v.shape).astype(v.dtype) * 1e-3 for k, v in arrays.items() if v.dtype.kind == "f"
            }
            for node in nodes
        }
        self.codec = codec
        self.dtypes = {k: v.dtype for k, v in arrays.items()}

    def local_model(self, msg) -> dict[str, np.ndarray]:  # noqa: ANN001
        """The node's model in the model's own dtypes, as a PyTorch client's ``load_state_dict`` + ``state_dict``
        returns it: Flower 1.39's ``FedAdam`` sends float64 arrays from round 2 on, which a real client reads
        into its float32 model (a reply kept in float64 would double what Flower's strategy reads)."""
        moves = self.moves[msg.metadata.dst_node_id]
        return {
            k: (v + moves[k] if k in moves else v).astype(self.dtypes[k], copy=False)
            for k, v in global_arrays_of(msg).items()
        }

    def client(self, msg):  # noqa: ANN001, ANN201
        local = self.local_model(msg)
        if self.codec is None:
            return full_model_reply(msg, local)
        node = msg.metadata.dst_node_id
        context = Context(run_id=1, node_id=node, node_config={}, state=RecordDict(), run_config={})
        return compression_mod(msg, context, lambda m, c: full_model_reply(m, local))


def run(
    strategy,
    arrays: dict[str, np.ndarray],
    bank: ReplyBank,
    nodes: list[int],
    rounds: int,
    reply_bytes: list | None = None,
) -> list[float]:
    """Seconds of configure_train + aggregate_train per round (the replies' making is not timed); ``reply_bytes``
    receives each round's bytes of reply records (counted outside the timing)."""
    grid = FakeGrid(nodes, bank.client, keep_history=False)
    record = model_record(arrays)
    times = []
    for server_round in range(1, rounds + 1):
        started = time.perf_counter()
        messages = list(strategy.configure_train(server_round, record, ConfigRecord(), grid))
        configured = time.perf_counter() - started
        replies = list(grid.send_and_receive(messages))  # the clients' work: not timed
        if reply_bytes is not None:
            reply_bytes.append(sum(int(rec.count_bytes()) for msg in replies for rec in msg.content.values()))
        started = time.perf_counter()
        new, _ = strategy.aggregate_train(server_round, replies)
        times.append(configured + time.perf_counter() - started)
        record = new if new is not None else record
        del messages, replies  # freed after the round, as a ServerApp frees them
    return times


def copy_bandwidth(dim: int) -> float:
    """Bytes per second of ``np.copyto`` of a float32 d-vector, read plus written (STREAM's copy), best of 9."""
    a, b = np.ones(dim, np.float32), np.empty(dim, np.float32)
    np.copyto(b, a)
    best = float("inf")
    for _ in range(9):
        started = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - started)
    return 2 * 4 * dim / best


def copyto_seconds(dim: int) -> float:
    a, b = np.ones(dim, np.float32), np.empty(dim, np.float32)
    np.copyto(b, a)
    samples = []
    for _ in range(9):
        started = time.perf_counter()
        np.copyto(b, a)
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def peak_vectors(strategy, arrays, bank, nodes, dim: int) -> float:
    """Peak tracemalloc bytes of one steady-state aggregate_train, in d-size float32 vectors."""
    grid = FakeGrid(nodes, bank.client, keep_history=False)
    record = model_record(arrays)
    for server_round in (1, 2):
        replies = list(
            grid.send_and_receive(list(strategy.configure_train(server_round, record, ConfigRecord(), grid)))
        )
        if server_round == 2:
            tracemalloc.start()
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
        new, _ = strategy.aggregate_train(server_round, replies)
        record = new if new is not None else record
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    return peak / (4 * dim)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--replies", type=int, default=10)
    parser.add_argument("--memory-replies", type=int, nargs="*", default=[10, 50])
    args = parser.parse_args()
    arrays = resnet_arrays()
    dim = sum(
        v.size for k, v in arrays.items() if v.dtype.kind == "f" and not k.endswith(("running_mean", "running_var"))
    )
    nodes = list(range(1, args.replies + 1))
    common = dict(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=len(nodes))
    dense = ReplyBank(arrays, nodes, None)
    cases = [
        ("Flower FedAdam, dense", lambda: FedAdam(**common), dense),
        ("pollen FedAMS, dense", lambda: FedAMS(eta=0.1, **common), dense),
        (
            "pollen FedCAMS, sign",
            lambda: FedCAMS(compressor="sign", eta=0.1, granularity="model", **common),
            ReplyBank(arrays, nodes, "sign"),
        ),
        (
            "pollen FedCAMS, top-k 1/64",
            lambda: FedCAMS(compressor="topk", eta=0.1, **common),
            ReplyBank(arrays, nodes, "topk"),
        ),
        ("pollen FedAdaVR, int4 table", lambda: FedAdaVR(table_precision="int4", eta=0.01, **common), dense),
        ("pollen FedAdaVR, fp32 table", lambda: FedAdaVR(table_precision="fp32", eta=0.01, **common), dense),
    ]
    yardstick, bandwidth = copyto_seconds(dim), copy_bandwidth(dim)
    print(f"d = {dim:,}, {len(nodes)} replies per round; one np.copyto of a d-vector: {1e3 * yardstick:.1f} ms")
    print(f"copy bandwidth (read + write, best of 9): {bandwidth / 1e9:.2f} GB/s")
    print(
        f"{'aggregate_train':<30} {'median ms':>10} {'x copyto':>9} {'x FedAdam':>10} {'must move':>10} "
        f"{'GB/s':>6} {'of copy bw':>10}"
    )
    flower = None
    for name, make, bank in cases:
        reply_bytes: list[int] = []
        times = run(make(), arrays, bank, nodes, args.rounds, reply_bytes)[1:]
        median = statistics.median(times)
        flower = median if flower is None else flower
        moved = statistics.median(reply_bytes[1:]) + 4 * dim  # each reply read once, the new model written once
        achieved = moved / median
        print(
            f"{name:<30} {1e3 * median:>10.0f} {median / yardstick:>9.1f} {median / flower:>10.2f} "
            f"{moved / 1e6:>8.0f}MB {achieved / 1e9:>6.2f} {achieved / bandwidth:>9.1%}"
        )
    for count in args.memory_replies:
        member_nodes = list(range(1, count + 1))
        bank = ReplyBank(arrays, member_nodes, None)
        settings = {**common, "min_available_nodes": count}
        for name, make in (
            ("Flower FedAdam", lambda settings=settings: FedAdam(**settings)),
            ("pollen FedAMS", lambda settings=settings: FedAMS(eta=0.1, **settings)),
            ("pollen FedAdaVR int4", lambda settings=settings: FedAdaVR(table_precision="int4", eta=0.01, **settings)),
            ("pollen FedAdaVR fp32", lambda settings=settings: FedAdaVR(table_precision="fp32", eta=0.01, **settings)),
        ):
            strategy = make()
            vectors = peak_vectors(strategy, arrays, bank, member_nodes, dim)
            staged = ""
            if isinstance(strategy, FedAdaVR):  # the round's new rows, held until the step (the method needs them)
                row = strategy.table.memory_report()["row_bytes"]
                staged = f" (of which the {count} staged new rows: {count * row / (4 * dim):.2f})"
            print(
                f"peak extra memory during aggregate_train, M = {count:>2}, {name:<20}: "
                f"{vectors:5.2f} d-size float32 vectors{staged}"
            )


if __name__ == "__main__":
    main()
