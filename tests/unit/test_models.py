"""Model architectures: exact parameter counts from the papers, forward shapes, norms, errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pollen.task import DatasetInfo, build_model, dataset_info, num_parameters
from pollen.task.models import MODELS

FMNIST = DatasetInfo(1, 28, 10)
CIFAR10 = DatasetInfo(3, 32, 10)
CIFAR100 = DatasetInfo(3, 32, 100)


@pytest.mark.parametrize(
    "name,info,d",
    [
        ("mlp", FMNIST, 50_890),  # fedbaca.md: MLP 784-64-10
        ("cnn", FMNIST, 29_034),  # fedbaca.md: CNN for Fashion-MNIST
        ("lenet5", FMNIST, 44_426),  # fedadavr.md: niid_bench CNNMnist
        ("lenet5", CIFAR10, 62_006),  # the 16*5*5 -> 120 variant for 32x32x3
        ("resnet18", CIFAR10, 11_173_962),  # fedcams.md §5.2
        ("resnet18", CIFAR100, 11_220_132),
        ("convmixer", CIFAR10, 594_186),  # fedcams.md §5.2
        ("convmixer", CIFAR100, 617_316),
    ],
)
def test_parameter_counts(name, info, d):
    assert num_parameters(build_model(name, info)) == d


@pytest.mark.parametrize("name", ["cnn", "resnet18", "convmixer"])
def test_groupnorm_keeps_the_count_and_drops_batchnorm(name):
    bn = build_model(name, CIFAR10, norm="bn")
    gn = build_model(name, CIFAR10, norm="gn", gn_groups=2)
    assert num_parameters(bn) == num_parameters(gn)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in gn.modules())
    assert all(m.num_groups == 2 for m in gn.modules() if isinstance(m, nn.GroupNorm))
    assert sum(isinstance(m, nn.GroupNorm) for m in gn.modules()) == sum(
        isinstance(m, nn.BatchNorm2d) for m in bn.modules()
    )


def test_batchnorm_buffers_are_not_parameters():
    m = build_model("cnn", FMNIST)
    buffers = dict(m.named_buffers())
    assert any(k.endswith("running_mean") for k in buffers)
    assert any(b.dtype == torch.int64 for b in buffers.values())  # num_batches_tracked


@pytest.mark.parametrize("dataset", ["fashion-mnist", "mnist", "cifar10", "cifar100"])
@pytest.mark.parametrize("name", MODELS)
def test_forward_shapes(name, dataset):
    info = dataset_info(dataset)
    torch.manual_seed(0)
    model = build_model(name, info).eval()
    x = torch.randn(2, info.num_channels, info.image_size, info.image_size)
    with torch.no_grad():
        out = model(x)
    assert out.shape == (2, info.num_classes) and torch.isfinite(out).all()


def test_seeded_init_is_reproducible():
    torch.manual_seed(7)
    a = build_model("lenet5", FMNIST)
    torch.manual_seed(7)
    b = build_model("lenet5", FMNIST)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_bad_model_norm_and_groups():
    with pytest.raises(ValueError, match=r"model='vgg'.*mlp, cnn, lenet5, resnet18, convmixer"):
        build_model("vgg", FMNIST)
    with pytest.raises(ValueError, match=r"norm='ln'.*bn, gn"):
        build_model("cnn", FMNIST, norm="ln")
    with pytest.raises(ValueError, match=r"gn-groups=3 .*dividing 16, 32"):
        build_model("cnn", FMNIST, norm="gn", gn_groups=3)
