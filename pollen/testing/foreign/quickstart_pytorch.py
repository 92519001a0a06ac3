"""Flower's ``examples/quickstart-pytorch``, with local CIFAR-like data instead of the hub's CIFAR-10.

The example as written: LeNet ("Deep Learning with PyTorch: A 60 Minute Blitz"), ``train`` with
``SGD(lr, momentum=0.9)``, batches of 32, one local epoch, ``test`` giving loss and accuracy, IID
partitions with an 80/20 train/validation split, the server's ``lr`` of 0.01 in every train message,
every node trained each round (4 SuperNodes). The data: 32x32x3 images in about [-2.5, 2.5] (as after
the example's normalisation) of 10 classes, each class a colour texture seen through a random shift
and heavy Gaussian noise, so that FedAvg needs several rounds (chance 0.1 after round 0).
"""

from __future__ import annotations

from functools import cache

import numpy as np
import torch
import torch.nn.functional as F

from pollen.testing.foreign.project import Project, batches, example_client_app

NUM_CLIENTS = 4
EXAMPLES_PER_CLIENT = 1250  # 1,000 to train on (31 batches), 250 to validate
TEST_SIZE = 1000
NUM_CLASSES = 10
NOISE = 3.0
CONTRAST = 0.7
SHIFT = 4


class Net(torch.nn.Module):
    """The example's model (a simple CNN adapted from 'PyTorch: A 60 Minute Blitz')."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 6, 5)
        self.pool = torch.nn.MaxPool2d(2, 2)
        self.conv2 = torch.nn.Conv2d(6, 16, 5)
        self.fc1 = torch.nn.Linear(16 * 5 * 5, 120)
        self.fc2 = torch.nn.Linear(120, 84)
        self.fc3 = torch.nn.Linear(84, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 5 * 5)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def images_of(labels: np.ndarray, rng: np.random.Generator, seed: int) -> np.ndarray:
    """Class ``k``'s images: random 32x32 crops of its smooth colour texture plus noise of sd ``NOISE``."""
    fields = np.random.default_rng(1000 + seed).normal(size=(NUM_CLASSES, 3, 8, 8)).astype(np.float32)
    textures = F.interpolate(
        torch.from_numpy(fields), size=(32 + SHIFT, 32 + SHIFT), mode="bilinear", align_corners=False
    ).numpy()
    dy, dx = rng.integers(0, SHIFT + 1, size=(2, len(labels)))
    images = np.stack([CONTRAST * textures[k, :, y : y + 32, x : x + 32] for k, y, x in zip(labels, dy, dx)])
    images += rng.normal(0.0, NOISE, size=images.shape).astype(np.float32)
    return np.clip(images, -4.0, 4.0).astype(np.float32)


@cache
def dataset(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every client's examples (IID, in partition order), then the server's test set."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, NUM_CLASSES, size=NUM_CLIENTS * EXAMPLES_PER_CLIENT + TEST_SIZE)
    return torch.from_numpy(images_of(labels, rng, seed)), torch.from_numpy(labels.astype(np.int64))


def load_data(partition_id: int, num_partitions: int, seed: int) -> tuple[tuple, tuple]:
    """The partition's train and validation parts (the example's 80/20 ``train_test_split``)."""
    x, y = dataset(seed)
    size = len(x[: NUM_CLIENTS * EXAMPLES_PER_CLIENT]) // num_partitions
    start, cut = partition_id * size, partition_id * size + int(0.8 * size)
    return (x[start:cut], y[start:cut]), (x[cut : start + size], y[cut : start + size])


def test_set(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = dataset(seed)
    return x[-TEST_SIZE:], y[-TEST_SIZE:]


def train(net: torch.nn.Module, data: tuple, config: dict) -> float:
    """The example's ``train``: cross-entropy, ``SGD(lr, momentum=0.9)``, shuffled batches of 32."""
    images, labels = data
    criterion = torch.nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(net.parameters(), lr=float(config["lr"]), momentum=0.9)
    net.train()
    running_loss, steps = 0.0, 0
    for _ in range(int(config.get("local-epochs", 1))):
        for batch in batches(len(images), 32, shuffle=True):
            optimizer.zero_grad()
            loss = criterion(net(images[batch]), labels[batch])
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
            steps += 1
    return running_loss / steps


def test(net: torch.nn.Module, data: tuple) -> tuple[float, float]:
    """The example's ``test``: mean cross-entropy and top-1 accuracy."""
    images, labels = data
    net.eval()
    with torch.no_grad():
        logits = net(images)
    return float(F.cross_entropy(logits, labels)), float((logits.argmax(1) == labels).float().mean())


PROJECT = Project(
    name="quickstart-pytorch",
    make_app=lambda mods: example_client_app(mods, Net, load_data, train, test),
    net=Net,
    test_set=test_set,
    evaluate=test,
    num_clients=NUM_CLIENTS,
    fraction_train=1.0,
    train_config={"lr": 0.01},
)
