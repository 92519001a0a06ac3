"""Local training (SGD for K steps or E epochs) and evaluation."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler

from pollen.task.sgd import PlainSGD

__all__ = ["TrainResult", "evaluate", "train"]


@dataclass(frozen=True)
class TrainResult:
    """What one call of :func:`train` did.

    Attributes
    ----------
    train_loss : float
        Mean cross-entropy per example over every batch seen (before each step's update).
    num_steps : int
        Optimiser steps taken.
    num_examples : int
        Size of the training set (``len(loader.dataset)``): the weight FedAvg-style aggregation uses.
    examples_seen : int
        Examples processed over all steps (``num_steps`` batches).
    """

    train_loss: float
    num_steps: int
    num_examples: int
    examples_seen: int


def _seeded(loader: DataLoader, seed: int) -> DataLoader:
    """The same loader with its shuffle driven by ``torch.Generator().manual_seed(seed)``."""
    if not isinstance(loader.sampler, RandomSampler) or loader.batch_size is None:
        return loader
    return DataLoader(
        loader.dataset,
        batch_size=loader.batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(seed),
        collate_fn=loader.collate_fn,
        drop_last=loader.drop_last,
        num_workers=loader.num_workers,
        pin_memory=loader.pin_memory,
    )


def train(
    model: nn.Module,
    loader: DataLoader,
    *,
    lr: float,
    local_steps: int | None = None,
    local_epochs: int | None = None,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    device: torch.device | str = "cpu",
    seed: int = 0,
    optimizer: torch.optim.Optimizer | None = None,
) -> TrainResult:
    """Train ``model`` in place with SGD (or the given ``optimizer``) on ``loader``.

    The SGD is :class:`~pollen.task.sgd.PlainSGD`: ``torch.optim.SGD``'s step bit for bit, without the
    ~1.5 s a fresh process (a SuperNode's ``flwr-clientapp``, one per message) pays for torch's first optimiser.

    Give exactly one of ``local_steps`` (K optimiser steps, cycling through the loader as often as
    needed) or ``local_epochs`` (E full passes). The shuffle order and any batch augmentation depend
    only on ``seed``: the global RNG state of the caller is left as it was. An ``optimizer`` built by
    the caller over ``model``'s parameters (e.g. :class:`pollen.clientside.lamb.LocalLAMB`) replaces
    the SGD one; ``lr``, ``momentum`` and ``weight_decay`` then belong to it.
    """
    if (local_steps is None) == (local_epochs is None):
        raise ValueError("give exactly one of local_steps (K) or local_epochs (E)")
    for key, value in (("local-steps", local_steps), ("local-epochs", local_epochs)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{key}={value!r} is not allowed; allowed: an integer >= 1")
    num_examples = len(loader.dataset)  # type: ignore[arg-type]
    if num_examples == 0:
        raise ValueError("cannot train on an empty dataset")
    device = torch.device(device)
    model.to(device)
    model.train()
    optimiser = optimizer or PlainSGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    criterion = nn.CrossEntropyLoss()
    loader = _seeded(loader, seed)

    total_loss = torch.zeros((), dtype=torch.float64, device=device)
    steps = seen = 0
    epochs = 0
    with torch.random.fork_rng(devices=[]):  # CPU RNG only: batch augmentation draws from it
        torch.default_generator.manual_seed(seed + 1)
        while True:
            for x, y in loader:
                x = x.to(device, non_blocking=True)
                y = y.to(device, non_blocking=True)
                optimiser.zero_grad(set_to_none=True)
                loss = criterion(model(x), y)
                loss.backward()
                optimiser.step()
                total_loss += loss.detach().to(torch.float64) * len(y)
                steps += 1
                seen += len(y)
                if local_steps is not None and steps >= local_steps:
                    break
            epochs += 1
            if seen == 0:
                raise ValueError("the loader yields no batches (drop_last with fewer examples than batch_size?)")
            if local_steps is not None and steps >= local_steps:
                break
            if local_epochs is not None and epochs >= local_epochs:
                break
    return TrainResult(float(total_loss.item()) / seen, steps, num_examples, seen)


@torch.no_grad()
def evaluate(model: nn.Module, loader: DataLoader, device: torch.device | str = "cpu") -> tuple[float, float, int]:
    """``(mean cross-entropy, accuracy, number of examples)`` of ``model`` on ``loader``.

    An empty loader gives ``(0.0, 0.0, 0)``.
    """
    device = torch.device(device)
    model.to(device)
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    correct = torch.zeros((), dtype=torch.int64, device=device)
    n = 0
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        logits = model(x)
        loss_sum += nn.functional.cross_entropy(logits, y, reduction="sum").to(torch.float64)
        correct += (logits.argmax(dim=1) == y).sum()
        n += len(y)
    if n == 0:
        return 0.0, 0.0, 0
    return float(loss_sum.item()) / n, float(correct.item()) / n, n
