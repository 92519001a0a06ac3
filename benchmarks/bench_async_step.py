"""What an asynchronous server step costs at ResNet-18 size, against a synchronous round on the same replies.

For d = 11,173,962 (ResNet-18 for CIFAR-10, real layer shapes and buffers) and M dense full-model replies,
FedAMS runs ``--steps`` rounds on the synchronous driver and ``--steps`` steps on the buffered asynchronous
driver (FADAS rule, concurrency = buffer = M, new jobs at each step: every step aggregates the same M
replies a round does), both through ``Strategy.start`` on the in-process grid, in the same process, one
after the other. The clients' replies are built once per node (a fixed local model, as a cheap client) and
handed back as new reply messages each time, so what is timed is the server: sending (the async driver's
``push_messages``, the sync driver's ``send_and_receive``), reading and screening the replies, the
transaction, the AMSGrad step, and the async driver's own work (its job book, the snapshot of the model
each job starts from, the per-step staleness record). A step's time is the interval between two calls of
``evaluate_fn`` (which does nothing); the median of steps 2.. is reported, with the ratio async/sync and
both divided by one ``np.copyto`` of a d-vector timed in the same run (the memory-bandwidth yardstick).
The reply records are built once per node and reused (both drivers alike): cheaper than fresh records
from the network, so compare the two drivers' times with each other, not with other benchmarks.

Run: ``python benchmarks/bench_async_step.py [--steps 6] [--replies 10]``
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from bench_round import copyto_seconds, resnet_arrays  # this script's folder is on sys.path when run by path
from flwr.app import Message, MetricRecord, RecordDict

from pollen.strategies import AsyncRule, BufferedAsync, EngineParts, FedAMS
from pollen.strategies.engine.parts import ClientSampler
from pollen.strategies.engine.screening import UpdateScreen
from pollen.testing.fakes import FakeGrid, model_record
from pollen.wire import protocol


class FixedReplies:
    """Each node answers every train message with its own fixed local model (built once)."""

    def __init__(self, arrays: dict[str, np.ndarray], nodes: list[int]) -> None:
        rng = np.random.default_rng(1)
        self.contents = {}
        for node in nodes:
            local = {
                k: (v + rng.standard_normal(v.shape).astype(v.dtype) * 1e-3) if v.dtype.kind == "f" else v
                for k, v in arrays.items()
            }
            self.contents[node] = RecordDict(
                {
                    protocol.ARRAYS_RECORD: model_record(local),
                    protocol.METRICS_RECORD: MetricRecord({protocol.NUM_EXAMPLES: 10}),
                }
            )

    def __call__(self, msg: Message) -> Message:
        return Message(content=self.contents[msg.metadata.dst_node_id], reply_to=msg)


def step_seconds(
    driver: object | None, arrays: dict[str, np.ndarray], replies: FixedReplies, steps: int
) -> list[float]:
    nodes = sorted(replies.contents)
    parts = {"sampler": ClientSampler(seed=0), "screen": UpdateScreen(rule="off")}
    if driver is not None:
        parts["driver"] = driver
    strategy = FedAMS(
        fraction_train=1.0,
        min_train_nodes=len(nodes),
        fraction_evaluate=0.0,
        min_evaluate_nodes=0,
        min_available_nodes=len(nodes),
        parts=EngineParts(**parts),
    )
    marks: list[float] = []

    def mark(server_round: int, _arrays: object) -> None:
        marks.append(time.perf_counter())

    grid = FakeGrid(nodes, replies, keep_history=False)
    strategy.start(grid=grid, initial_arrays=model_record(arrays), num_rounds=steps, evaluate_fn=mark)
    return [b - a for a, b in zip(marks, marks[1:])]  # marks[0] is the initial evaluation


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--replies", type=int, default=10)
    args = parser.parse_args()
    import logging

    logging.getLogger("flwr").setLevel(logging.WARNING)
    arrays = resnet_arrays()
    dim = sum(v.size for k, v in arrays.items() if v.dtype.kind == "f" and "running" not in k)
    replies = FixedReplies(arrays, list(range(1, args.replies + 1)))
    m = args.replies
    sync = step_seconds(None, arrays, replies, args.steps)
    driver = BufferedAsync(concurrency=m, buffer_size=m, refill="flush", rule=AsyncRule.fadas())
    asynchronous = step_seconds(driver, arrays, replies, args.steps)
    copy = copyto_seconds(dim)
    s, a = statistics.median(sync[1:]), statistics.median(asynchronous[1:])
    print(f"ResNet-18, d ~ {dim:,}, {m} dense replies a step, median of steps 2..{args.steps}")
    print(f"  sync round   {s * 1e3:8.1f} ms  ({s / copy:5.1f} copies of d)")
    print(f"  async step   {a * 1e3:8.1f} ms  ({a / copy:5.1f} copies of d)")
    print(f"  async / sync {a / s:8.2f}x")
    print(f"  np.copyto(d) {copy * 1e3:8.2f} ms")


if __name__ == "__main__":
    main()
