"""Local training and evaluation loops, and device resolution."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from pollen.task import DatasetInfo, available_devices, build_model, evaluate, resolve_device, train
from pollen.task.transforms import BatchCollate, BatchTensorDataset

INFO = DatasetInfo(1, 28, 10)


def _loader(n=96, batch=16, shuffle=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 10
    prototypes = torch.randn(10, 1, 28, 28, generator=g)  # one random image per class, plus noise
    x = prototypes[y] + 0.5 * torch.randn(n, 1, 28, 28, generator=g)
    return DataLoader(BatchTensorDataset(x, y), batch_size=batch, shuffle=shuffle, collate_fn=BatchCollate())


def _model(name="mlp", seed=0):
    torch.manual_seed(seed)
    return build_model(name, INFO)


@pytest.mark.parametrize("name,lr,momentum", [("mlp", 0.02, 0.9), ("cnn", 0.05, 0.0)])
def test_training_reduces_loss_on_a_tiny_set(name, lr, momentum):
    loader = _loader()
    model = _model(name)
    before, acc_before, n = evaluate(model, loader, "cpu")
    res = train(model, loader, lr=lr, local_epochs=3, momentum=momentum, device="cpu", seed=0)
    after, acc_after, _ = evaluate(model, loader, "cpu")
    assert n == 96
    assert after < 0.5 * before and acc_after > 0.9 > acc_before
    assert res.num_steps == 3 * 6 and res.num_examples == 96 and res.examples_seen == 288
    assert res.train_loss > 0


def test_local_steps_cycle_the_loader():
    loader = _loader(n=40, batch=16)  # 3 batches per epoch: 16, 16, 8
    res = train(_model(), loader, lr=0.01, local_steps=7, device="cpu", seed=1)
    assert res.num_steps == 7
    assert res.examples_seen == 16 + 16 + 8 + 16 + 16 + 8 + 16
    res = train(_model(), loader, lr=0.01, local_epochs=2, device="cpu", seed=1)
    assert res.num_steps == 6 and res.examples_seen == 80 and res.num_examples == 40


def test_training_is_deterministic_in_the_seed_and_leaves_global_rng_alone():
    loader = _loader()
    torch.manual_seed(123)
    state = torch.get_rng_state()
    a, b, c = _model(), _model(), _model()
    torch.set_rng_state(state)
    ra = train(a, loader, lr=0.1, local_steps=5, device="cpu", seed=42)
    assert torch.equal(torch.get_rng_state(), state)
    rb = train(b, loader, lr=0.1, local_steps=5, device="cpu", seed=42)
    train(c, loader, lr=0.1, local_steps=5, device="cpu", seed=43)
    assert ra == rb
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not all(torch.equal(p, q) for p, q in zip(a.parameters(), c.parameters()))


def test_train_argument_errors():
    with pytest.raises(ValueError, match="exactly one"):
        train(_model(), _loader(), lr=0.1, device="cpu", seed=0)
    with pytest.raises(ValueError, match="exactly one"):
        train(_model(), _loader(), lr=0.1, local_steps=1, local_epochs=1, device="cpu", seed=0)
    with pytest.raises(ValueError, match="local-steps=0"):
        train(_model(), _loader(), lr=0.1, local_steps=0, device="cpu", seed=0)


def test_evaluate_counts_and_empty_loader():
    loader = _loader(n=30, batch=8, shuffle=False)
    loss, acc, n = evaluate(_model(), loader, "cpu")
    assert n == 30 and 0.0 <= acc <= 1.0 and loss > 0
    empty = DataLoader(
        BatchTensorDataset(torch.zeros(0, 1, 28, 28), torch.zeros(0, dtype=torch.long)),
        batch_size=4,
        collate_fn=BatchCollate(),
    )
    assert evaluate(_model(), empty, "cpu") == (0.0, 0.0, 0)


def test_resolve_device_on_this_machine():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(" CPU ") == torch.device("cpu")
    auto = resolve_device("auto")
    if torch.cuda.is_available():
        assert auto.type == "cuda"
    elif "mps" in available_devices():
        assert auto.type == "mps"
    else:
        assert auto == torch.device("cpu")
    assert available_devices()[0] == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_unavailable_cuda_is_a_clear_error():
    for spec in ("cuda", "cuda:0", "cuda:3"):
        with pytest.raises(ValueError, match=rf"device='{spec}' is not available.*it has: cpu"):
            resolve_device(spec)


def test_unknown_device_names_the_choices():
    with pytest.raises(ValueError, match=r"device='tpu' is not allowed; allowed: auto, cpu, cuda, cuda:N, mps"):
        resolve_device("tpu")
    with pytest.raises(ValueError, match="device='cuda:x'"):
        resolve_device("cuda:x")


@pytest.mark.skipif("mps" in available_devices(), reason="this machine has MPS")
def test_unavailable_mps_is_a_clear_error():
    with pytest.raises(ValueError, match="device='mps' is not available"):
        resolve_device("mps")
