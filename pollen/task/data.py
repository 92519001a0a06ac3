"""Federated datasets for the app: config, validation, per-client loaders and the server's test set.

Everything expensive is cached per process: the raw arrays per ``(dataset, data_dir)``, the partition
table per :class:`DataConfig`, and each partition's tensors per ``(config, partition_id)``. A client
process that trains many times (simulation workers) converts its data once; every call returns fresh
``DataLoader`` objects over the same cached tensors.
"""

from __future__ import annotations

import functools
import numbers
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader

from pollen.task.partitions import PARTITIONERS, make_partitions, split_train_val
from pollen.task.sources import (
    SPECS,
    DatasetInfo,
    DataSourceError,
    RawData,
    expected_files,
    find_in_dir,
    load_raw,
)
from pollen.task.transforms import BatchAugment, BatchCollate, BatchTensorDataset, to_tensor

__all__ = [
    "DATASETS",
    "PARTITIONERS",
    "DataConfig",
    "DataSourceError",
    "DatasetInfo",
    "clear_caches",
    "dataset_info",
    "describe_source",
    "load_partition",
    "load_test_set",
    "validate_data_config",
]

DATASETS = ("fashion-mnist", "mnist", "cifar10", "cifar100")


@dataclass(frozen=True)
class DataConfig:
    """How to build the federated dataset. Field ``x_y`` is run-config key ``x-y`` in messages
    (``alpha`` is ``dirichlet-alpha``).

    Attributes
    ----------
    dataset : str
        One of :data:`DATASETS`.
    partitioner : str
        One of :data:`PARTITIONERS` (see :mod:`pollen.task.partitions`).
    num_partitions : int
        Number of clients the training split is divided among.
    alpha : float
        Dirichlet concentration (``dirichlet`` only); smaller is more skewed.
    classes_per_partition : int
        Classes per client (``pathological`` only).
    shards_per_partition : int
        Label-sorted shards per client (``shards`` only).
    val_fraction : float
        Share of each partition held out for validation, in ``[0, 1)``.
    seed : int
        Seed for the shuffle, the partitioner and the train/validation split.
    data_dir : str
        Directory holding the dataset; empty to search the machine, the hub and the package.
    """

    dataset: str = "fashion-mnist"
    partitioner: str = "iid"
    num_partitions: int = 10
    alpha: float = 0.5
    classes_per_partition: int = 2
    shards_per_partition: int = 2
    val_fraction: float = 0.1
    seed: int = 0
    data_dir: str = ""


_KEYS = {"alpha": "dirichlet-alpha"}  # the app's run-config name for DataConfig.alpha


def _key(field_name: str) -> str:
    return _KEYS.get(field_name, field_name.replace("_", "-"))


def _bad(field_name: str, value: object, allowed: str) -> ValueError:
    return ValueError(f"{_key(field_name)}={value!r} is not allowed; allowed: {allowed}")


def _is_int(v: object) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_real(v: object) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def validate_data_config(cfg: DataConfig) -> None:
    """Raise ``ValueError`` naming the key, the bad value and what is allowed; ``None`` if fine.

    Only cheap checks: a ``data-dir`` is checked for the expected files but nothing is loaded.
    """
    if cfg.dataset not in DATASETS:
        raise _bad("dataset", cfg.dataset, ", ".join(DATASETS))
    if cfg.partitioner not in PARTITIONERS:
        raise _bad("partitioner", cfg.partitioner, ", ".join(PARTITIONERS))
    if not _is_int(cfg.num_partitions) or cfg.num_partitions < 1:
        raise _bad("num_partitions", cfg.num_partitions, "an integer >= 1")
    if not _is_real(cfg.alpha) or not np.isfinite(cfg.alpha) or cfg.alpha <= 0:
        raise _bad("alpha", cfg.alpha, "a finite number > 0")
    num_classes = SPECS[cfg.dataset].info.num_classes
    if not _is_int(cfg.classes_per_partition) or not 1 <= cfg.classes_per_partition <= num_classes:
        raise _bad("classes_per_partition", cfg.classes_per_partition, f"an integer in 1..{num_classes} for {cfg.dataset}")
    if not _is_int(cfg.shards_per_partition) or cfg.shards_per_partition < 1:
        raise _bad("shards_per_partition", cfg.shards_per_partition, "an integer >= 1")
    if not _is_real(cfg.val_fraction) or not 0.0 <= cfg.val_fraction < 1.0:
        raise _bad("val_fraction", cfg.val_fraction, "a number in [0, 1)")
    if not _is_int(cfg.seed) or cfg.seed < 0:
        raise _bad("seed", cfg.seed, "an integer >= 0")
    if not isinstance(cfg.data_dir, str):
        raise _bad("data_dir", cfg.data_dir, "a directory path (string), or empty")
    if cfg.data_dir:
        root = Path(cfg.data_dir).expanduser()
        spec = SPECS[cfg.dataset]
        if not root.is_dir():
            raise DataSourceError(
                f"data-dir={cfg.data_dir!r} is not a directory; it should hold {cfg.dataset}: {expected_files(spec)}"
            )
        if find_in_dir(spec, root) is None:
            raise DataSourceError(
                f"data-dir={cfg.data_dir!r} does not hold {cfg.dataset}: expected {expected_files(spec)}"
            )


def dataset_info(name: str) -> DatasetInfo:
    """Channels, image size and number of classes of dataset ``name``."""
    if name not in SPECS:
        raise _bad("dataset", name, ", ".join(DATASETS))
    return SPECS[name].info


# --------------------------------------------------------------------------- caches


@functools.lru_cache(maxsize=4)
def _raw(dataset: str, data_dir: str) -> RawData:
    return load_raw(dataset, data_dir)


def describe_source(cfg: DataConfig) -> str:
    """One line naming the source the data comes from (loads and caches it; raises if none)."""
    validate_data_config(cfg)
    return f"{cfg.dataset}: {_raw(cfg.dataset, cfg.data_dir).source}"


@functools.lru_cache(maxsize=8)
def _partition_table(cfg: DataConfig) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
    raw = _raw(cfg.dataset, cfg.data_dir)
    parts = make_partitions(
        raw.y_train,
        cfg.partitioner,
        num_partitions=cfg.num_partitions,
        alpha=cfg.alpha,
        classes_per_partition=cfg.classes_per_partition,
        shards_per_partition=cfg.shards_per_partition,
        seed=cfg.seed,
    )
    return tuple(split_train_val(idx, cfg.val_fraction, cfg.seed, pid) for pid, idx in enumerate(parts))


def partition_indices(cfg: DataConfig) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
    """``(train_indices, val_indices)`` into the training split for every partition (cached)."""
    validate_data_config(cfg)
    return _partition_table(cfg)


def _tensors(raw_x: np.ndarray, raw_y: np.ndarray, dataset: str) -> BatchTensorDataset:
    spec = SPECS[dataset]
    return BatchTensorDataset(to_tensor(raw_x, spec.mean, spec.std), torch.from_numpy(np.asarray(raw_y, dtype=np.int64)))


@functools.lru_cache(maxsize=256)
def _partition_datasets(cfg: DataConfig, partition_id: int) -> tuple[BatchTensorDataset, BatchTensorDataset]:
    raw = _raw(cfg.dataset, cfg.data_dir)
    train_idx, val_idx = _partition_table(cfg)[partition_id]
    return (
        _tensors(raw.x_train[train_idx], raw.y_train[train_idx], cfg.dataset),
        _tensors(raw.x_train[val_idx], raw.y_train[val_idx], cfg.dataset),
    )


@functools.lru_cache(maxsize=4)
def _test_dataset(dataset: str, data_dir: str) -> BatchTensorDataset:
    raw = _raw(dataset, data_dir)
    return _tensors(raw.x_test, raw.y_test, dataset)


def clear_caches() -> None:
    """Forget every cached dataset, partition table and tensor (for tests and long-lived processes)."""
    for fn in (_raw, _partition_table, _partition_datasets, _test_dataset):
        fn.cache_clear()


# --------------------------------------------------------------------------- public loaders


def _check_batch_size(batch_size: int) -> None:
    if not _is_int(batch_size) or batch_size < 1:
        raise ValueError(f"batch-size={batch_size!r} is not allowed; allowed: an integer >= 1")


def load_partition(
    cfg: DataConfig, partition_id: int, batch_size: int, *, augment: bool = False
) -> tuple[DataLoader, DataLoader]:
    """Loaders over partition ``partition_id``: ``(train, val)``.

    The train loader shuffles (``train`` reseeds the shuffle per call); the validation loader does
    not. With ``augment=True`` training batches get a random crop after 4 pixels of padding, plus a
    horizontal flip for datasets where that keeps the label (not MNIST digits).
    """
    validate_data_config(cfg)
    _check_batch_size(batch_size)
    if not _is_int(partition_id) or not 0 <= partition_id < cfg.num_partitions:
        raise ValueError(
            f"partition-id={partition_id!r} is not allowed; allowed: an integer in 0..{cfg.num_partitions - 1}"
        )
    train_ds, val_ds = _partition_datasets(cfg, int(partition_id))
    spec = SPECS[cfg.dataset]
    aug = BatchAugment(spec.mean, spec.std, padding=4, hflip=spec.hflip) if augment else None
    gen = torch.Generator().manual_seed((int(cfg.seed) * 1_000_003 + int(partition_id)) % 2**63)
    train = DataLoader(train_ds, batch_size=batch_size, shuffle=True, generator=gen, collate_fn=BatchCollate(aug))
    val = DataLoader(val_ds, batch_size=batch_size, shuffle=False, collate_fn=BatchCollate())
    return train, val


def load_test_set(cfg: DataConfig, batch_size: int) -> DataLoader:
    """Loader over the dataset's whole test split (the server's centralised evaluation)."""
    validate_data_config(cfg)
    _check_batch_size(batch_size)
    dataset = _test_dataset(cfg.dataset, cfg.data_dir)
    return DataLoader(dataset, batch_size=batch_size, shuffle=False, collate_fn=BatchCollate())


def config_keys() -> tuple[str, ...]:
    """The run-config key for every :class:`DataConfig` field (``num_partitions`` -> ``num-partitions``)."""
    return tuple(_key(f.name) for f in fields(DataConfig))
