"""Federated datasets for the app: config, validation, per-client loaders and the server's test set.

Everything expensive is cached per process: the raw arrays per ``(dataset, data_dir)``, the partition
table per :class:`DataConfig`, and each partition's tensors per ``(config, partition_id)``. A client
process that trains many times (simulation workers) converts its data once; every call returns fresh
``DataLoader`` objects over the same cached tensors.

Each partition's images and labels are also cached on disk (:func:`partition_cache_dir`), because in
deployment a SuperNode starts a new ClientApp process per message: with a warm cache such a process
reads one small ``.npz`` instead of reading and partitioning the whole dataset. The file name holds a
hash of everything the partition depends on (see :func:`partition_cache_key`); a file that does not
load, check out or match its key is rebuilt, never used.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import numbers
import os
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader

from pollen.core.files import NpzError, read_npz, write_npz_atomic
from pollen.task import partitions as _partitions_module
from pollen.task import sources as _sources_module
from pollen.task.catalog import DATASETS
from pollen.task.partitions import (
    PARTITIONER_SETTINGS,
    PARTITIONERS,
    make_partitions,
    split_train_val,
)
from pollen.task.sources import (
    SPECS,
    DatasetInfo,
    DataSourceError,
    RawData,
    expected_files,
    find_in_dir,
    load_raw,
    source_fingerprint,
)
from pollen.task.transforms import (
    BatchAugment,
    BatchCollate,
    BatchTensorDataset,
    to_tensor,
)

__all__ = [
    "CACHE_ENV",
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
    "partition_cache_dir",
    "partition_cache_key",
    "validate_data_config",
]


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
        raise _bad(
            "classes_per_partition", cfg.classes_per_partition, f"an integer in 1..{num_classes} for {cfg.dataset}"
        )
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
    return BatchTensorDataset(
        to_tensor(raw_x, spec.mean, spec.std), torch.from_numpy(np.asarray(raw_y, dtype=np.int64))
    )


@functools.lru_cache(maxsize=256)
def _partition_datasets(cfg: DataConfig, partition_id: int) -> tuple[BatchTensorDataset, BatchTensorDataset]:
    arrays = _partition_arrays(cfg, partition_id)
    return (
        _tensors(arrays["x_train"], arrays["y_train"], cfg.dataset),
        _tensors(arrays["x_val"], arrays["y_val"], cfg.dataset),
    )


def _partition_arrays(cfg: DataConfig, partition_id: int) -> dict[str, np.ndarray]:
    """One partition's uint8 images and int64 labels: from the disk cache, else built (and stored)."""
    path, key = _cache_entry(cfg, partition_id)
    if path is not None:
        cached = _read_cached(path, key, cfg.dataset)
        if cached is not None:
            return cached
    raw = _raw(cfg.dataset, cfg.data_dir)
    train_idx, val_idx = _partition_table(cfg)[partition_id]
    arrays = {
        "x_train": raw.x_train[train_idx],
        "y_train": raw.y_train[train_idx],
        "x_val": raw.x_train[val_idx],
        "y_val": raw.y_train[val_idx],
    }
    if path is not None:
        _write_cached(path, key, arrays)
    return arrays


@functools.lru_cache(maxsize=4)
def _test_dataset(dataset: str, data_dir: str) -> BatchTensorDataset:
    raw = _raw(dataset, data_dir)
    return _tensors(raw.x_test, raw.y_test, dataset)


def clear_caches() -> None:
    """Forget every dataset, partition table and tensor cached in this process (for tests and
    long-lived processes); the on-disk partition cache stays (see :func:`partition_cache_dir`)."""
    for fn in (_raw, _partition_table, _partition_datasets, _test_dataset, _test_subset):
        fn.cache_clear()


# --------------------------------------------------------------------------- partition cache on disk

#: Environment variable naming the directory of the on-disk partition cache; ``off`` disables it.
CACHE_ENV = "POLLEN_CACHE_DIR"
_DEFAULT_CACHE_DIR = "~/.cache/pollen/partitions"
_CACHE_OFF = frozenset({"off", "none", "no", "false", "0", "disable", "disabled"})
_CACHE_FORMAT = 1  # bump when the file layout changes

# What ``flwr.common.log`` writes to, without importing Flower into the task layer.
_flwr_log = logging.getLogger("flwr")


def partition_cache_dir() -> Path | None:
    """Where partitions are cached on disk: ``$POLLEN_CACHE_DIR``, else ``~/.cache/pollen/partitions``.

    ``POLLEN_CACHE_DIR=off`` (or ``none``, ``0``, ``false``) turns the disk cache off; ``None`` then.
    """
    value = os.environ.get(CACHE_ENV, "").strip()
    if value.lower() in _CACHE_OFF:
        return None
    return Path(value or _DEFAULT_CACHE_DIR).expanduser()


@functools.cache
def _code_identity() -> dict[str, str]:
    """Hashes of the code that turns files into partitions, and the versions of the libraries it uses.

    A changed reader, partitioner or split gives new cache keys instead of stale partitions.
    """
    import importlib.metadata  # noqa: PLC0415

    out = {}
    for module in (_sources_module, _partitions_module):
        out[module.__name__] = hashlib.sha256(Path(module.__file__).read_bytes()).hexdigest()[:16]
    try:
        out["flwr-datasets"] = importlib.metadata.version("flwr-datasets")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover
        out["flwr-datasets"] = "unknown"
    out["numpy"] = np.__version__
    return out


def partition_cache_key(cfg: DataConfig, partition_id: int) -> str | None:
    """The text the disk cache keys partition ``partition_id`` of ``cfg`` on (canonical JSON).

    It holds the dataset, the identity of the files it is read from (paths, sizes, modification times),
    the partitioner and the settings it reads, the seed, the number of partitions, the validation
    fraction, the partition id, and the code and library versions that build partitions. ``None`` when
    the source cannot be identified without loading it (the Hugging Face hub or cache, the embedded
    subset): those partitions are cached in memory only.
    """
    source = source_fingerprint(cfg.dataset, cfg.data_dir)
    if source is None:
        return None
    key = {
        "format": _CACHE_FORMAT,
        "code": _code_identity(),
        "dataset": cfg.dataset,
        "source": source,
        "partitioner": cfg.partitioner,
        "settings": {
            name: float(getattr(cfg, name)) if name == "alpha" else int(getattr(cfg, name))
            for name in PARTITIONER_SETTINGS[cfg.partitioner]
        },
        "seed": int(cfg.seed),
        "num_partitions": int(cfg.num_partitions),
        "val_fraction": float(cfg.val_fraction),
        "partition_id": int(partition_id),
    }
    return json.dumps(key, sort_keys=True, separators=(",", ":"))


def _cache_entry(cfg: DataConfig, partition_id: int) -> tuple[Path | None, str]:
    cache_dir = partition_cache_dir()
    key = partition_cache_key(cfg, partition_id) if cache_dir is not None else None
    if cache_dir is None or key is None:
        return None, ""
    digest = hashlib.sha256(key.encode()).hexdigest()[:32]
    return cache_dir / f"{cfg.dataset}-{cfg.partitioner}-{partition_id}-of-{cfg.num_partitions}-{digest}.npz", key


def _image_shape(dataset: str) -> tuple[int, ...]:
    info = SPECS[dataset].info
    return (info.image_size, info.image_size) + ((info.num_channels,) if info.num_channels > 1 else ())


def _cache_spec(dataset: str) -> dict[str, tuple[tuple[int | None, ...], np.dtype | None]]:
    """What a cache file of ``dataset`` holds, as :func:`pollen.core.files.read_npz` checks it from the headers."""
    x, y = ((None, *_image_shape(dataset)), np.dtype(np.uint8)), ((None,), np.dtype(np.int64))
    return {"key": ((), None), "x_train": x, "y_train": y, "x_val": x, "y_val": y}


def _check_cached(arrays: dict[str, np.ndarray], key: str, dataset: str) -> None:
    """``ValueError`` saying what is wrong when a loaded cache file is not the partition asked for."""
    stored = arrays["key"]
    if stored.dtype.kind != "U" or stored.ndim != 0 or str(stored[()]) != key:
        raise ValueError("its stored key does not match")
    info = SPECS[dataset].info
    shape = _image_shape(dataset)
    for split in ("train", "val"):
        x, y = arrays[f"x_{split}"], arrays[f"y_{split}"]
        if x.dtype != np.uint8 or x.shape[1:] != shape:
            raise ValueError(f"x_{split} is {x.dtype} {x.shape}, expected uint8 (N, {', '.join(map(str, shape))})")
        if y.dtype != np.int64 or y.shape != (len(x),):
            raise ValueError(f"y_{split} is {y.dtype} {y.shape}, expected int64 ({len(x)},)")
        if len(y) and (y.min() < 0 or y.max() >= info.num_classes):
            raise ValueError(f"y_{split} spans {y.min()}..{y.max()}, {dataset} has {info.num_classes} classes")
    if len(arrays["x_train"]) == 0:
        raise ValueError("x_train is empty")


def _read_cached(path: Path, key: str, dataset: str) -> dict[str, np.ndarray] | None:
    """The cached partition, or ``None`` (absent, or unusable: then one warning and it gets rebuilt)."""
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as err:
        _flwr_log.warning("[pollen] partition cache %s cannot be opened (%s); rebuilding it", path, err)
        return None
    try:
        with f:  # no pickle; every header checked against its bytes and the expected shapes first
            arrays = read_npz(f, expected=_cache_spec(dataset))
        _check_cached(arrays, key, dataset)
    except Exception as err:  # noqa: BLE001 - any failure: rebuild, never use
        reason = " ".join((err.why if isinstance(err, NpzError) else f"{type(err).__name__}: {err}").split())[:200]
        _flwr_log.warning("[pollen] partition cache %s is unusable (%s); rebuilding it", path, reason)
        return None
    del arrays["key"]
    return arrays


def _write_cached(path: Path, key: str, arrays: dict[str, np.ndarray]) -> None:
    """Store a partition atomically: temp file in the same directory, fsync, ``os.replace``.

    Processes that build the same partition at once each write a whole file and the last rename wins;
    a reader sees the old file or the new one, never a part. A failure costs a warning, not the run.
    """
    try:
        # readable by other users' nodes on the machine
        write_npz_atomic(path, {"key": np.array(key), **arrays}, mode=0o644)
    except OSError as err:
        _flwr_log.warning("[pollen] cannot write partition cache %s (%s); continuing without it", path, err)


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

    The partition comes from memory, else from the on-disk cache (:func:`partition_cache_dir`), else it
    is built from the dataset and stored there.
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


def load_test_set(cfg: DataConfig, batch_size: int, examples: int = 0) -> DataLoader:
    """Loader over the dataset's test split (the server's centralised evaluation).

    ``examples`` > 0 keeps that many test examples, drawn at random without replacement from
    ``cfg.seed`` and kept in the split's order: the same subset every round and in every run with that
    seed, for quick runs whose evaluation would otherwise cost more than their training. 0 keeps the
    whole split.
    """
    validate_data_config(cfg)
    _check_batch_size(batch_size)
    if not _is_int(examples) or examples < 0:
        raise ValueError(f"test-examples={examples!r} is not allowed; allowed: an integer >= 0 (0: the whole split)")
    if examples:
        dataset = _test_subset(cfg.dataset, cfg.data_dir, examples, cfg.seed)
    else:
        dataset = _test_dataset(cfg.dataset, cfg.data_dir)
    return DataLoader(dataset, batch_size=batch_size, shuffle=False, collate_fn=BatchCollate())


@functools.lru_cache(maxsize=8)
def _test_subset(dataset: str, data_dir: str, examples: int, seed: int) -> BatchTensorDataset:
    whole = _test_dataset(dataset, data_dir)
    size = len(whole)
    if examples > size:
        raise ValueError(
            f"test-examples={examples} but {dataset}'s test split has {size} examples; "
            f"allowed: 0 (the whole split) or 1 to {size}"
        )
    keep = torch.from_numpy(np.sort(np.random.default_rng(seed).choice(size, size=examples, replace=False)))
    return BatchTensorDataset(whole.tensors[0][keep], whole.tensors[1][keep])


def config_keys() -> tuple[str, ...]:
    """The run-config key for every :class:`DataConfig` field (``num_partitions`` -> ``num-partitions``)."""
    return tuple(_key(f.name) for f in fields(DataConfig))
