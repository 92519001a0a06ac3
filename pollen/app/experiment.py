"""Build what a run needs from the validated run-config: strategy, data config, model.

Shared by the ServerApp, the ClientApp, the tests and the benchmarks, so "the same
config" means the same objects everywhere.
"""

from __future__ import annotations

from typing import Any

from pollen.app import registry
from pollen.app.config import AppConfig


def build_strategy(cfg: AppConfig, methods: registry.Table | None = None) -> Any:
    """The server strategy named by ``strategy``, with the run-config's settings.

    ``methods``: the method table (:mod:`pollen.app.registry`); default: the config's own, else the product's.
    """
    return registry.build_strategy(cfg, methods if methods is not None else cfg.methods)


def data_config(cfg: AppConfig, num_partitions: int, data_dir: str | None = None) -> Any:
    """The task layer's ``DataConfig`` for this run (``data_dir`` from node-config wins)."""
    from pollen.task.data import DataConfig

    return DataConfig(
        dataset=cfg["dataset"],
        partitioner=cfg["partitioner"],
        num_partitions=num_partitions,
        alpha=cfg["dirichlet-alpha"],
        classes_per_partition=cfg["classes-per-partition"],
        shards_per_partition=cfg["shards-per-partition"],
        val_fraction=cfg["val-fraction"],
        seed=cfg["seed"],
        data_dir=cfg["data-dir"] if data_dir is None else data_dir,
    )


def build_model(cfg: AppConfig, seed: int | None = None) -> Any:
    """The model named by ``model`` for ``dataset``, initialised from ``seed``."""
    import torch

    from pollen.task.data import dataset_info
    from pollen.task.models import build_model as build

    torch.manual_seed(cfg["seed"] if seed is None else seed)
    return build(cfg["model"], dataset_info(cfg["dataset"]), norm=cfg["norm"])


def client_train_config(cfg: AppConfig) -> dict[str, Any]:
    """The local-training settings every train message carries."""
    return {
        "local-lr": cfg["local-lr"],
        "local-epochs": cfg["local-epochs"],
        "local-steps": cfg["local-steps"],
        "batch-size": cfg["batch-size"],
        "momentum": cfg["momentum"],
        "weight-decay": cfg["weight-decay"],
    }
