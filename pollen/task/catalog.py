"""What the task layer offers, by name: datasets, partitioners, models, norms, devices (no torch).

The tuples live here, apart from the modules that implement them, so that the app can check a
run-config (``pollen.app.config``) without importing torch: a ClientApp checks its run-config for
every message, and a SuperNode starts a fresh ``flwr-clientapp`` process per message. The modules
that implement the names (:mod:`pollen.task.data`, :mod:`pollen.task.partitions`,
:mod:`pollen.task.models`, :mod:`pollen.task.device`) import them from here.
"""

from __future__ import annotations

import re

__all__ = ["DATASETS", "DEVICES", "MODELS", "NORMS", "PARTITIONERS", "is_device"]

#: Datasets :func:`pollen.task.data.load_partition` can read.
DATASETS = ("fashion-mnist", "mnist", "cifar10", "cifar100")
#: How :func:`pollen.task.partitions.make_partitions` splits a dataset over clients.
PARTITIONERS = ("iid", "dirichlet", "pathological", "shards")
#: Models :func:`pollen.task.models.build_model` builds.
MODELS = ("mlp", "cnn", "lenet5", "resnet18", "convmixer")
#: Normalisation layers of the models that have one (ResNet-18): BatchNorm or GroupNorm.
NORMS = ("bn", "gn")
#: Device names :func:`pollen.task.device.resolve_device` accepts (``cuda:N`` is any GPU index).
DEVICES = ("auto", "cpu", "cuda", "cuda:N", "mps")

_CUDA_N = re.compile(r"cuda:\d+")


def is_device(spec: str) -> bool:
    """Whether ``spec`` is one of :data:`DEVICES` (``cuda:N`` with a whole number N);
    not whether this machine has it."""
    return spec in DEVICES[:3] + DEVICES[4:] or bool(_CUDA_N.fullmatch(spec))
