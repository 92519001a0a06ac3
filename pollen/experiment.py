"""Build what a run needs from the validated run-config: strategy, data config, model.

Shared by the ServerApp, the ClientApp, the tests and the benchmarks, so "the same
config" means the same objects everywhere.
"""

from __future__ import annotations

from typing import Any

from pollen.config import AppConfig

# Which implementation each strategy name maps to (also in the README).
STRATEGY_IMPLEMENTATIONS = {
    "fedavg": "flwr.serverapp.strategy.FedAvg (Flower's own, metered)",
    "fedadam": "flwr.serverapp.strategy.FedAdam (Flower's own, metered)",
    "fedyogi": "flwr.serverapp.strategy.FedYogi (Flower's own, metered)",
    "fedadagrad": "flwr.serverapp.strategy.FedAdagrad (Flower's own, metered)",
    "fedams": "pollen.strategies.FedAMS (Option 1 unless eps-mode=add)",
    "fedamsgrad": "pollen.strategies.FedAMS(option=2)",
    "fedcams": "pollen.strategies.FedCAMS",
    "fedadavr": "pollen.strategies.FedAdaVR (table-precision != fp32 is FedAdaVR-Quant)",
    "mifa": "pollen.strategies.FedAdaVR(variant='mifa')",
    "fedvarp": "pollen.strategies.FedAdaVR(variant='fedvarp')",
    "fedadavr-novr": "pollen.strategies.FedAdaVR(variant='novr')",
    "fedadavr-noopt": "pollen.strategies.FedAdaVR(variant='noopt')",
}

VR_VARIANTS = {
    "fedadavr": "fedadavr",
    "mifa": "mifa",
    "fedvarp": "fedvarp",
    "fedadavr-novr": "novr",
    "fedadavr-noopt": "noopt",
}


def build_strategy(cfg: AppConfig) -> Any:
    """The server strategy named by ``strategy``, with the run-config's settings."""
    from pollen.strategies import FedAdaVR, FedAMS, FedCAMS, MeteredFedAdagrad, MeteredFedAdam, MeteredFedAvg, MeteredFedYogi

    sampling = dict(
        fraction_train=cfg["fraction-train"],
        fraction_evaluate=cfg["fraction-evaluate"],
        min_train_nodes=cfg["min-train-nodes"],
        min_evaluate_nodes=cfg["min-evaluate-nodes"] if cfg["fraction-evaluate"] > 0 else 0,
        min_available_nodes=cfg["min-train-nodes"],
    )
    name = cfg["strategy"]
    if name == "fedavg":
        return MeteredFedAvg(**sampling)
    flower_opt = dict(eta=cfg["server-lr"], eta_l=cfg["local-lr"], beta_1=cfg["beta1"], beta_2=cfg["beta2"], tau=cfg["eps"])
    if name == "fedadam":
        return MeteredFedAdam(**sampling, **flower_opt)
    if name == "fedyogi":
        return MeteredFedYogi(**sampling, **flower_opt)
    if name == "fedadagrad":
        flower_opt.pop("beta_1"), flower_opt.pop("beta_2")
        return MeteredFedAdagrad(**sampling, **flower_opt)
    if name in VR_VARIANTS:
        variant = VR_VARIANTS[name]
        adaptive = variant == "fedadavr"
        return FedAdaVR(
            **sampling,
            variant=variant,
            server_optimizer=cfg["server-optimizer"] if adaptive else None,
            server_lr=cfg["server-lr"],
            client_lr=cfg["local-lr"],
            beta_1=cfg["beta1"],
            beta_2=cfg["beta2"],
            eps=cfg["eps"],
            vr_weighting=cfg["vr-weighting"] if variant in ("fedadavr", "noopt") else None,
            table_precision=cfg["table-precision"] if variant in ("fedadavr", "noopt") else None,
            table_path=cfg["table-path"] or None,
            num_clients=cfg["num-clients"] or None,
            seed=cfg["seed"],
        )
    option = 2 if name == "fedamsgrad" or cfg["eps-mode"] == "add" else 1
    fedams = dict(
        **sampling,
        eta=cfg["server-lr"],
        beta_1=cfg["beta1"],
        beta_2=cfg["beta2"],
        eps=cfg["eps"],
        option=option,
        bias_correction=cfg["bias-correction"],
        aggregation=cfg["aggregation"],
        seed=cfg["seed"],
        identify_clients=True,
    )
    if name in ("fedams", "fedamsgrad"):
        return FedAMS(**fedams)
    return FedCAMS(
        **fedams,
        compressor=cfg["compressor"],
        topk_ratio=cfg["topk-ratio"],
        error_feedback=cfg["error-feedback"],
        granularity=cfg["compression-granularity"],
    )


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
