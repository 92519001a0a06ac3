"""PlainSGD takes torch.optim.SGD's step bit for bit, and local training never imports torch._dynamo."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from pollen.task.sgd import PlainSGD


def _model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))


def _run(make_optimizer, steps: int = 12) -> list[torch.Tensor]:
    model = _model()
    optimizer = make_optimizer(model.parameters())
    gen = torch.Generator().manual_seed(11)
    for _ in range(steps):
        x, y = torch.randn(8, 6, generator=gen), torch.randint(0, 3, (8,), generator=gen)
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("momentum, weight_decay", [(0.0, 0.0), (0.9, 0.0), (0.0, 1e-3), (0.5, 1e-2)])
def test_plain_sgd_equals_torch_sgd_bit_for_bit(momentum, weight_decay):
    ours = _run(lambda p: PlainSGD(p, lr=0.05, momentum=momentum, weight_decay=weight_decay))
    torchs = _run(lambda p: torch.optim.SGD(p, lr=0.05, momentum=momentum, weight_decay=weight_decay))
    for a, b in zip(ours, torchs):
        assert torch.equal(a, b)


def test_plain_sgd_skips_frozen_parameters_and_clears_gradients():
    model = _model()
    model[0].weight.requires_grad_(False)
    frozen = model[0].weight.detach().clone()
    optimizer = PlainSGD(model.parameters(), lr=0.1, momentum=0.9)
    nn.functional.cross_entropy(model(torch.randn(4, 6)), torch.tensor([0, 1, 2, 0])).backward()
    optimizer.step()
    assert torch.equal(model[0].weight, frozen)
    optimizer.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in optimizer.params)
    optimizer.zero_grad()
    assert all(p.grad is None for p in optimizer.params)


@pytest.mark.parametrize("kwargs", [{"lr": -1.0}, {"lr": 0.1, "momentum": 1.0}, {"lr": 0.1, "weight_decay": -0.1}])
def test_plain_sgd_refuses_out_of_range_settings(kwargs):
    with pytest.raises(ValueError, match="out of range; allowed"):
        PlainSGD(_model().parameters(), **kwargs)


_FRESH_PROCESS = """
import sys, torch
from torch.utils.data import DataLoader, TensorDataset
from pollen.task.train import train
data = TensorDataset(torch.randn(16, 6), torch.randint(0, 3, (16,)))
train(torch.nn.Linear(6, 3), DataLoader(data, batch_size=4, shuffle=True), lr=0.1, local_steps=3, momentum=0.9)
print("torch._dynamo" in sys.modules)
"""


def test_local_training_in_a_fresh_process_does_not_import_the_compiler():
    """A SuperNode pays every import per message (one process each): torch.optim's first optimiser
    imports torch._dynamo (about 1.5 s); pollen's SGD must not."""
    done = subprocess.run([sys.executable, "-c", _FRESH_PROCESS], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "False"
