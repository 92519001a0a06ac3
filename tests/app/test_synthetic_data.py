"""Synthetic datasets (``pollen.testing.synthetic_data``) are read back by pollen's real loaders, shapes intact."""

from __future__ import annotations

import numpy as np
import pytest

from pollen.task.sources import load_raw
from pollen.testing.synthetic_data import write_synthetic


@pytest.mark.parametrize(
    ("dataset", "train_shape", "test_shape"),
    [("cifar10", (500, 32, 32, 3), (100, 32, 32, 3)), ("fashion-mnist", (600, 28, 28), (100, 28, 28))],
)
def test_written_files_load_through_data_dir(tmp_path, dataset, train_shape, test_shape):
    write_synthetic(tmp_path, dataset, seed=3, scale=0.01)
    raw = load_raw(dataset, str(tmp_path))
    assert raw.source.startswith("data-dir"), raw.source
    assert raw.x_train.shape == train_shape and raw.x_test.shape == test_shape
    assert raw.x_train.dtype == np.uint8 and raw.x_test.dtype == np.uint8
    assert set(np.unique(raw.y_train)) <= set(range(10)) and len(np.unique(raw.y_train)) == 10


def test_classes_are_learnable_from_the_pixels(tmp_path):
    """Images of one class share a prototype: the nearest class mean labels most test images right."""
    write_synthetic(tmp_path, "cifar10", seed=0, scale=0.02)
    raw = load_raw("cifar10", str(tmp_path))
    x_train = raw.x_train.reshape(len(raw.x_train), -1).astype(np.float32)
    x_test = raw.x_test.reshape(len(raw.x_test), -1).astype(np.float32)
    means = np.stack([x_train[raw.y_train == c].mean(0) for c in range(10)])
    predicted = np.argmin(((x_test[:, None, :] - means[None]) ** 2).sum(-1), axis=1)
    assert (predicted == raw.y_test).mean() > 0.9


def test_same_seed_same_files_and_bad_input_refused(tmp_path):
    a, b = (
        write_synthetic(tmp_path / "a", "mnist", seed=1, scale=0.01),
        write_synthetic(tmp_path / "b", "mnist", seed=1, scale=0.01),
    )
    for name in ("train-images-idx3-ubyte", "t10k-labels-idx1-ubyte"):
        assert (a / "mnist" / name).read_bytes() == (b / "mnist" / name).read_bytes()
    with pytest.raises(ValueError, match="dataset='cifar100' has no synthetic writer; allowed: cifar10"):
        write_synthetic(tmp_path, "cifar100")
    with pytest.raises(ValueError, match="scale=0 is not allowed"):
        write_synthetic(tmp_path, "mnist", scale=0)
