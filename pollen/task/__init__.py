"""Task layer: datasets, partitions, models, local training and evaluation, device choice.

Flower-free apart from ``flwr_datasets`` (partitioners and the hub loader). Public API::

    from pollen.task import DataConfig, load_partition, load_test_set, build_model, train, evaluate

The names are loaded on first use (PEP 562): importing :mod:`pollen.task.catalog` (the names of the
datasets, models, ... that the run-config checks) must not pull in torch, which the modules behind
these names need.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from pollen.core.lazy_exports import lazy_exports

#: Public name -> the submodule of this package that defines it.
_HOMES = {
    "DATASETS": "catalog",
    "MODELS": "catalog",
    "NORMS": "catalog",
    "PARTITIONERS": "catalog",
    "DataConfig": "data",
    "DataSourceError": "data",
    "DatasetInfo": "data",
    "clear_caches": "data",
    "dataset_info": "data",
    "describe_source": "data",
    "load_partition": "data",
    "load_test_set": "data",
    "partition_indices": "data",
    "validate_data_config": "data",
    "available_devices": "device",
    "resolve_device": "device",
    "build_model": "models",
    "num_parameters": "models",
    "TrainResult": "train",
    "evaluate": "train",
    "train": "train",
}

__all__ = sorted(_HOMES)

__getattr__ = lazy_exports(__name__, {name: f"{__name__}.{home}" for name, home in _HOMES.items()})


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _TaskPackage(types.ModuleType):
    """``pollen.task`` itself: its attribute ``train`` stays the function when ``pollen.task.train`` is imported.

    Importing a submodule binds it as an attribute of its package; for ``train`` (a submodule and the
    public function it defines) that would make ``from pollen.task import train`` return the module
    whenever ``pollen.task.train`` was imported first. (Before loading became lazy, ``__init__``
    imported the submodule and then bound the function over it.)
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if _HOMES.get(name) is not None and isinstance(value, types.ModuleType):
            return  # a submodule with the name of a public function: the function wins (see __getattr__)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _TaskPackage
