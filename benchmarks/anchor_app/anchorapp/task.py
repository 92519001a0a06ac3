"""The model, the data and the training loop (what a quickstart user writes, no pollen)."""

import gzip
import struct
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    """pollen's 'cnn' for 28x28x1 inputs, 10 classes (copied, not imported: d = 29,034)."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, kernel_size=5, padding=2),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, kernel_size=5, padding=2),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.fc = nn.Linear(32 * 7 * 7, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.features(x), 1))


def read_idx(path: Path) -> np.ndarray:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    dims = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def _find(data_dir: Path, stem: str) -> Path:
    for name in (stem, stem + ".gz"):
        if (data_dir / name).exists():
            return data_dir / name
    raise FileNotFoundError(f"{stem}[.gz] not in {data_dir}")


def load_data(data_dir: str, partition_id: int, num_partitions: int, seed: int, batch_size: int) -> DataLoader:
    """An IID share of the Fashion-MNIST training set: numpy permutation with ``seed``, equal parts."""
    root = Path(data_dir)
    x = read_idx(_find(root, "train-images-idx3-ubyte"))
    y = read_idx(_find(root, "train-labels-idx1-ubyte"))
    idx = np.array_split(np.random.default_rng(seed).permutation(len(y)), num_partitions)[partition_id]
    images = torch.from_numpy(x[idx].astype(np.float32) / 255.0).unsqueeze(1)
    images = (images - 0.2860) / 0.3530
    labels = torch.from_numpy(y[idx].astype(np.int64))
    return DataLoader(TensorDataset(images, labels), batch_size=batch_size, shuffle=True)


def train(model: nn.Module, loader: DataLoader, steps: int, lr: float) -> float:
    """``steps`` SGD steps (cycling through the loader); mean training loss."""
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    criterion = nn.CrossEntropyLoss()
    done, total = 0, 0.0
    while done < steps:
        for images, labels in loader:
            optimizer.zero_grad()
            loss = criterion(model(images), labels)
            loss.backward()
            optimizer.step()
            total += loss.item()
            done += 1
            if done == steps:
                break
    return total / steps
