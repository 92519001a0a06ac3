"""Datasets of the real shapes and file formats, made on the spot, for machines that cannot download one.

A GPU machine without internet (or a test) still needs CIFAR-10's or Fashion-MNIST's files where pollen
looks for them: :func:`write_synthetic` writes the CIFAR *binary* version (``cifar-10-batches-bin``) or the
IDX files of (Fashion-)MNIST into ``data_dir``, and ``data-dir=<data_dir>`` then reads them through the
same code path as the real files. Images are class-dependent patterns plus noise, so a model can learn
them and the accuracy column of a timing run means something (nothing about the real dataset's accuracy).
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

__all__ = ["SHAPES", "write_synthetic"]

#: dataset -> (channels, side, classes, train images, test images) of the real dataset.
SHAPES: dict[str, tuple[int, int, int, int, int]] = {
    "cifar10": (3, 32, 10, 50_000, 10_000),
    "fashion-mnist": (1, 28, 10, 60_000, 10_000),
    "mnist": (1, 28, 10, 60_000, 10_000),
}


def _images(n: int, prototypes: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    """``n`` images around the class ``prototypes`` (one per class, shared by both splits) and their labels."""
    classes, channels, side = prototypes.shape[0], prototypes.shape[1], prototypes.shape[2]
    labels = rng.integers(0, classes, size=n, dtype=np.uint8)
    noise = rng.normal(0.0, 48.0, size=(n, channels, side, side)).astype(np.float32)
    images = np.clip(prototypes[labels] * 0.6 + 50.0 + noise, 0, 255).astype(np.uint8)
    return images, labels


def _write_idx(path: Path, array: np.ndarray) -> None:
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    path.write_bytes(header + np.ascontiguousarray(array, dtype=np.uint8).tobytes())


def write_synthetic(data_dir: str | Path, dataset: str, seed: int = 0, scale: float = 1.0) -> Path:
    """Write ``dataset``'s files (real shapes and formats, synthetic pixels) under ``data_dir``; return it.

    ``scale`` shrinks both splits (e.g. 0.01 for a test); the image shape and file layout stay the real ones.
    """
    if dataset not in SHAPES:
        raise ValueError(f"dataset={dataset!r} has no synthetic writer; allowed: {', '.join(SHAPES)}")
    if not 0 < scale <= 1:
        raise ValueError(f"scale={scale!r} is not allowed; allowed: 0 < scale <= 1")
    channels, side, classes, n_train, n_test = SHAPES[dataset]
    n_train, n_test = max(classes, int(n_train * scale)), max(classes, int(n_test * scale))
    rng = np.random.default_rng(seed)
    prototypes = rng.integers(0, 256, size=(classes, channels, side, side)).astype(np.float32)
    x_train, y_train = _images(n_train, prototypes, rng)
    x_test, y_test = _images(n_test, prototypes, rng)
    root = Path(data_dir)
    if dataset == "cifar10":
        folder = root / "cifar-10-batches-bin"
        folder.mkdir(parents=True, exist_ok=True)
        batches = np.array_split(np.arange(n_train), 5)
        splits = [(f"data_batch_{i + 1}.bin", idx, x_train, y_train) for i, idx in enumerate(batches)]
        splits.append(("test_batch.bin", np.arange(n_test), x_test, y_test))
        for name, idx, x, y in splits:
            records = np.concatenate([y[idx, None], x[idx].reshape(len(idx), -1)], axis=1)
            (folder / name).write_bytes(records.astype(np.uint8).tobytes())
        return root
    folder = root / dataset
    folder.mkdir(parents=True, exist_ok=True)
    _write_idx(folder / "train-images-idx3-ubyte", x_train[:, 0])
    _write_idx(folder / "train-labels-idx1-ubyte", y_train)
    _write_idx(folder / "t10k-images-idx3-ubyte", x_test[:, 0])
    _write_idx(folder / "t10k-labels-idx1-ubyte", y_test)
    return root
