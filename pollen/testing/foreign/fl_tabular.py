"""Flower's ``examples/fl-tabular``, with census-like tabular data made here instead of the hub's Adult Income.

The example as written: ``IncomeClassifier`` (14 standardised features -> 128 -> 64 -> 1, ReLU, a
sigmoid output), ``train`` with ``Adam(lr=0.001)`` and ``BCELoss`` over shuffled batches of 32 for one
epoch, an 80/20 train/test split per partition, IID partitions over 5 SuperNodes, and the server's
``FedAvg()`` with no arguments (every node trained each round). The data: 14 correlated standardised
features; the label (about a quarter positive, as in Adult Income) from a noisy non-linear score.
"""

from __future__ import annotations

from functools import cache

import numpy as np
import torch

from pollen.testing.foreign.project import Project, batches, example_client_app

NUM_CLIENTS = 5
EXAMPLES_PER_CLIENT = 2000
TEST_SIZE = 2000
NUM_FEATURES = 14


class IncomeClassifier(torch.nn.Module):
    """The example's model."""

    def __init__(self, input_dim: int = NUM_FEATURES) -> None:
        super().__init__()
        self.layer1 = torch.nn.Linear(input_dim, 128)
        self.layer2 = torch.nn.Linear(128, 64)
        self.output = torch.nn.Linear(64, 1)
        self.relu = torch.nn.ReLU()
        self.sigmoid = torch.nn.Sigmoid()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.layer1(x))
        x = self.relu(self.layer2(x))
        return self.sigmoid(self.output(x))


@cache
def dataset(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every client's rows (IID, in partition order), then the server's test rows; labels are ``(n, 1)`` floats."""
    rng = np.random.default_rng(seed)
    n = NUM_CLIENTS * EXAMPLES_PER_CLIENT + TEST_SIZE
    mixing = np.random.default_rng(2000 + seed).normal(size=(NUM_FEATURES, NUM_FEATURES)) / np.sqrt(NUM_FEATURES)
    x = rng.normal(size=(n, NUM_FEATURES)) @ mixing
    x = (x - x.mean(0)) / x.std(0)  # the example's StandardScaler
    w = np.random.default_rng(3000 + seed).normal(size=NUM_FEATURES)
    score = x @ w + 1.5 * x[:, 0] * x[:, 1] - np.abs(x[:, 2]) + rng.normal(0.0, 1.0, size=n)
    labels = (score > np.quantile(score, 0.76)).astype(np.float32)
    return torch.from_numpy(x.astype(np.float32)), torch.from_numpy(labels).view(-1, 1)


def load_data(partition_id: int, num_partitions: int, seed: int) -> tuple[tuple, tuple]:
    """The partition's train and test parts (the example's ``train_test_split(test_size=0.2)``)."""
    x, y = dataset(seed)
    size = NUM_CLIENTS * EXAMPLES_PER_CLIENT // num_partitions
    start, cut = partition_id * size, partition_id * size + int(0.8 * size)
    return (x[start:cut], y[start:cut]), (x[cut : start + size], y[cut : start + size])


def test_set(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = dataset(seed)
    return x[-TEST_SIZE:], y[-TEST_SIZE:]


def train(model: torch.nn.Module, data: tuple, config: dict) -> float:
    """The example's ``train``: ``BCELoss``, ``Adam(lr=0.001)``, shuffled batches of 32, one epoch."""
    features, labels = data
    criterion = torch.nn.BCELoss()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.001)
    model.train()
    running_loss, steps = 0.0, 0
    for batch in batches(len(features), 32, shuffle=True):
        optimizer.zero_grad()
        loss = criterion(model(features[batch]), labels[batch])
        loss.backward()
        optimizer.step()
        running_loss += loss.item()
        steps += 1
    return running_loss / steps


def evaluate(model: torch.nn.Module, data: tuple) -> tuple[float, float]:
    """The example's ``evaluate``: mean ``BCELoss`` and accuracy at threshold 0.5."""
    features, labels = data
    model.eval()
    with torch.no_grad():
        outputs = model(features)
    loss = float(torch.nn.functional.binary_cross_entropy(outputs.clamp(1e-7, 1 - 1e-7), labels))
    return loss, float(((outputs > 0.5).float() == labels).float().mean())


PROJECT = Project(
    name="fl-tabular",
    make_app=lambda mods: example_client_app(mods, IncomeClassifier, load_data, train, evaluate),
    net=IncomeClassifier,
    test_set=test_set,
    evaluate=evaluate,
    num_clients=NUM_CLIENTS,
    fraction_train=1.0,
)
