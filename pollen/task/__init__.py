"""Task layer: datasets, partitions, models, local training and evaluation, device choice.

Flower-free apart from ``flwr_datasets`` (partitioners and the hub loader). Public API::

    from pollen.task import DataConfig, load_partition, load_test_set, build_model, train, evaluate
"""

from pollen.task.data import (
    DATASETS,
    PARTITIONERS,
    DataConfig,
    DatasetInfo,
    DataSourceError,
    clear_caches,
    dataset_info,
    describe_source,
    load_partition,
    load_test_set,
    partition_indices,
    validate_data_config,
)
from pollen.task.device import available_devices, resolve_device
from pollen.task.models import MODELS, NORMS, build_model, num_parameters
from pollen.task.train import TrainResult, evaluate, train

__all__ = [
    "DATASETS",
    "MODELS",
    "NORMS",
    "PARTITIONERS",
    "DataConfig",
    "DataSourceError",
    "DatasetInfo",
    "TrainResult",
    "available_devices",
    "build_model",
    "clear_caches",
    "dataset_info",
    "describe_source",
    "evaluate",
    "load_partition",
    "load_test_set",
    "num_parameters",
    "partition_indices",
    "resolve_device",
    "train",
    "validate_data_config",
]
