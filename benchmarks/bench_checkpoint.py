"""Checkpoint cost per round: size on disk and seconds to write, as a share of the round.

For the papers' CNN (d = 29,034) and ResNet-18 (d = 11.2 M): FedAMS with 10 clients through the
in-process grid of the test suite (dense full-model replies), a checkpoint after every round
(``RunCheckpoint``: global model, AMSGrad's three moments, sampler, accounting, results). The round
figure it is compared with is what a round costs a user: one client's local training of
``--local-steps`` SGD steps of batch 32 on this CPU (clients train in parallel on their own
machines, so one client's training is the round's critical path) plus the server's
``aggregate_train`` of the 10 replies. Run: ``python benchmarks/bench_checkpoint.py``.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np
import torch  # noqa: E402
from flwr.app import ArrayRecord  # noqa: E402

from pollen.strategies import FedAMS, RunCheckpoint  # noqa: E402
from pollen.task.data import dataset_info  # noqa: E402
from pollen.task.models import build_model  # noqa: E402
from pollen.testing.fakes import FakeGrid, full_model_reply, global_arrays_of  # noqa: E402

NODES = list(range(1, 11))


def local_training_seconds(model: torch.nn.Module, steps: int, shape: tuple[int, ...]) -> float:
    """One client's ``steps`` SGD steps of batch 32 on random data (the critical path of a round)."""
    torch.manual_seed(0)
    optimiser = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, *shape), torch.randint(0, 10, (32,))
    model.train()
    started = time.perf_counter()
    for _ in range(steps):
        optimiser.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimiser.step()
    return time.perf_counter() - started


def measure(name: str, dataset: str, steps: int, rounds: int) -> dict[str, float]:
    torch.manual_seed(0)
    info = dataset_info(dataset)
    model = build_model(name, info)
    arrays = ArrayRecord(model.state_dict())
    rng = np.random.default_rng(0)

    def client(msg):  # noqa: ANN001, ANN202
        local = {
            k: (v + rng.standard_normal(v.shape).astype(v.dtype) * 1e-3) if v.dtype.kind == "f" else v
            for k, v in global_arrays_of(msg).items()
        }
        return full_model_reply(msg, local)

    strategy = FedAMS(eta=0.1, fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=len(NODES))
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = RunCheckpoint(tmp)
        sizes, writes, aggregates = [], [], []
        real_aggregate = strategy.aggregate_train

        def timed_aggregate(server_round, replies):  # noqa: ANN001, ANN202
            started = time.perf_counter()
            out = real_aggregate(server_round, replies)
            aggregates.append(time.perf_counter() - started)
            return out

        strategy.aggregate_train = timed_aggregate
        real_save = checkpoint.save

        def timed_save(*args):  # noqa: ANN002, ANN202
            real_save(*args)
            sizes.append(checkpoint.last_bytes)
            writes.append(checkpoint.last_seconds)

        checkpoint.save = timed_save
        strategy.start(grid=FakeGrid(NODES, client), initial_arrays=arrays, num_rounds=rounds, checkpoint=checkpoint)
    train = local_training_seconds(model, steps, (info.num_channels, info.image_size, info.image_size))
    write = float(np.median(writes))
    aggregate = float(np.median(aggregates))
    return {
        "d": strategy.layout.dim,
        "bytes": sizes[-1],
        "write": write,
        "aggregate": aggregate,
        "train": train,
        "share": write / (train + aggregate + write),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--local-steps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(2)
    print(f"{'model':<10} {'d':>11} {'checkpoint':>12} {'write s':>8} {'aggregate s':>12} {'train s':>8} {'share':>7}")
    for name, dataset in (("cnn", "fashion-mnist"), ("resnet18", "cifar10")):
        row = measure(name, dataset, args.local_steps, args.rounds)
        print(
            f"{name:<10} {row['d']:>11,} {row['bytes'] / 1e6:>9.1f} MB {row['write']:>8.3f} {row['aggregate']:>12.3f} "
            f"{row['train']:>8.2f} {100 * row['share']:>6.1f}%"
        )


if __name__ == "__main__":
    main()
