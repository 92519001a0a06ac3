"""Flower's ``examples/advanced-pytorch``, on real Fashion-MNIST read from disk instead of the hub.

The example as written: its CNN for Fashion-MNIST (conv 16 and 32 channels, 5x5, two pools, 128
hidden units), ``train`` with ``SGD(lr, momentum=0.9)`` over shuffled batches of 32 with the example's
augmentation (a random 28x28 crop of the image padded by 4, a random horizontal flip), normalisation
(0.1307, 0.3081), Dirichlet(1.0) label skew over 10 SuperNodes with an 80/20 train/validation split,
the server's learning rate 0.1 and half the nodes trained each round. The data: Debian's
``dataset-fashion-mnist`` (IDX files under ``/usr/share/datasets/fashion-mnist/``); each client keeps
its first ``EXAMPLES_PER_CLIENT`` examples of its Dirichlet share (a smaller federation, for time).
"""

from __future__ import annotations

import gzip
from functools import cache
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from pollen.testing.foreign.project import Project, batches, example_client_app

DATA_DIR = Path("/usr/share/datasets/fashion-mnist")
NUM_CLIENTS = 10
EXAMPLES_PER_CLIENT = 750  # 600 to train on (19 batches), 150 to validate
TEST_SIZE = 2000
ALPHA = 1.0
MEAN, STD = 0.1307, 0.3081


class Net(torch.nn.Module):
    """The example's model (a simple CNN adapted for Fashion-MNIST)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 16, 5)
        self.pool = torch.nn.MaxPool2d(2, 2)
        self.conv2 = torch.nn.Conv2d(16, 32, 5)
        self.fc1 = torch.nn.Linear(32 * 4 * 4, 128)
        self.fc2 = torch.nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 32 * 4 * 4)
        x = F.relu(self.fc1(x))
        return self.fc2(x)


def available() -> bool:
    """Whether Debian's Fashion-MNIST is on this machine (``apt-get install dataset-fashion-mnist``)."""
    return (DATA_DIR / "train-images-idx3-ubyte.gz").is_file()


def _idx(name: str, header: int) -> np.ndarray:
    with gzip.open(DATA_DIR / name, "rb") as f:
        return np.frombuffer(f.read(), dtype=np.uint8, offset=header)


@cache
def split(which: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``"train"`` or ``"t10k"``: normalised images ``(n, 1, 28, 28)`` and labels."""
    images = _idx(f"{which}-images-idx3-ubyte.gz", 16).reshape(-1, 1, 28, 28).astype(np.float32) / 255.0
    labels = _idx(f"{which}-labels-idx1-ubyte.gz", 8).astype(np.int64)
    return torch.from_numpy((images - MEAN) / STD), torch.from_numpy(labels)


@cache
def partitions(seed: int) -> list[np.ndarray]:
    """Each client's training-set indices: a Dirichlet(``ALPHA``) share of every class, the first ones kept."""
    labels = split("train")[1].numpy()
    rng = np.random.default_rng(42 + seed)
    shares: list[list[int]] = [[] for _ in range(NUM_CLIENTS)]
    for k in range(10):
        idx = rng.permutation(np.flatnonzero(labels == k))
        cuts = (np.cumsum(rng.dirichlet([ALPHA] * NUM_CLIENTS)) * len(idx)).astype(int)[:-1]
        for client, part in enumerate(np.split(idx, cuts)):
            shares[client].extend(part.tolist())
    return [rng.permutation(np.array(s))[:EXAMPLES_PER_CLIENT] for s in shares]


def load_data(partition_id: int, num_partitions: int, seed: int) -> tuple[tuple, tuple]:
    """The partition's train and validation parts (80/20)."""
    x, y = split("train")
    idx = torch.from_numpy(partitions(seed)[partition_id])
    cut = int(0.8 * len(idx))
    return (x[idx[:cut]], y[idx[:cut]]), (x[idx[cut:]], y[idx[cut:]])


def test_set(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = split("t10k")
    return x[:TEST_SIZE], y[:TEST_SIZE]


def augment(images: torch.Tensor) -> torch.Tensor:
    """The example's ``RandomCrop(28, padding=4)`` and ``RandomHorizontalFlip()``, per image."""
    padded = F.pad(images, (4, 4, 4, 4), value=float(-MEAN / STD))
    dy, dx = torch.randint(0, 9, (2, len(images)))
    out = torch.stack([padded[i, :, y : y + 28, x : x + 28] for i, (y, x) in enumerate(zip(dy, dx))])
    flip = torch.rand(len(images)) < 0.5
    out[flip] = out[flip].flip(-1)
    return out


def train(net: torch.nn.Module, data: tuple, config: dict) -> float:
    """The example's ``train``: cross-entropy, ``SGD(lr, momentum=0.9)``, augmented shuffled batches of 32."""
    images, labels = data
    criterion = torch.nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(net.parameters(), lr=float(config["lr"]), momentum=0.9)
    net.train()
    running_loss, steps = 0.0, 0
    for batch in batches(len(images), 32, shuffle=True):
        optimizer.zero_grad()
        loss = criterion(net(augment(images[batch])), labels[batch])
        loss.backward()
        optimizer.step()
        running_loss += loss.item()
        steps += 1
    return running_loss / steps


def test(net: torch.nn.Module, data: tuple) -> tuple[float, float]:
    images, labels = data
    net.eval()
    with torch.no_grad():
        logits = net(images)
    return float(F.cross_entropy(logits, labels)), float((logits.argmax(1) == labels).float().mean())


PROJECT = Project(
    name="advanced-pytorch",
    make_app=lambda mods: example_client_app(mods, Net, load_data, train, test),
    net=Net,
    test_set=test_set,
    evaluate=test,
    num_clients=NUM_CLIENTS,
    fraction_train=0.5,
    train_config={"lr": 0.1},
)
