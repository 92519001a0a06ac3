"""The papers' models, for any ``C x H x W`` image input.

=========  ================================================================================  ==========
name       architecture (source)                                                             d (28x28x1
                                                                                             / 32x32x3,
                                                                                             10 classes)
=========  ================================================================================  ==========
mlp        Flatten -> Linear(C*H*W, 64) -> ReLU -> Linear(64, classes)                       50,890
           (FedBACA / FedCAMS lineage, papers/fedbaca.md "Models")                           / 197,322
cnn        [Conv(C->16, 5x5, pad 2) -> Norm -> ReLU -> MaxPool2] ->                          29,034
           [Conv(16->32, 5x5, pad 2) -> Norm -> ReLU -> MaxPool2] -> Linear(32*H/4*W/4, k)   / 34,634
           (the FedCAMS code's Fashion-MNIST CNN, papers/fedbaca.md)
lenet5     Conv(C->6, 5) -> ReLU -> MaxPool2 -> Conv(6->16, 5) -> ReLU -> MaxPool2 ->        44,426
           FC(16*5*5 or 16*4*4 -> 120) -> ReLU -> FC(120->84) -> ReLU -> FC(84->classes)     / 62,006
           (Flower niid_bench CNNMnist / CNNCifar, papers/fedadavr.md §Models)
resnet18   kuangliu's CIFAR ResNet-18: 3x3 stem, no max-pool, [2,2,2,2] BasicBlocks of       11,172,810
           64/128/256/512 channels, global average pool, Linear(512, classes)                / 11,173,962
           (papers/fedcams.md §5.2)
convmixer  ConvMixer-256-8, kernel 5, patch 2: Conv(C->256, 2, stride 2) -> GELU -> Norm,    592,138
           8 x [Residual(DWConv5 -> GELU -> Norm) -> Conv1x1 -> GELU -> Norm], avg pool,     / 594,186
           Linear(256, classes) (papers/fedcams.md §5.2)
=========  ================================================================================  ==========

``d`` counts trainable parameters; BatchNorm running statistics are buffers, not parameters.
``norm="gn"`` swaps every BatchNorm for ``GroupNorm(gn_groups, channels)`` (same parameter count),
as in FedAdaVR's GN-ResNet-18. Initialisation is PyTorch's default; seed it with
``torch.manual_seed`` before calling :func:`build_model`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pollen.task.catalog import MODELS, NORMS
from pollen.task.sources import DatasetInfo

__all__ = ["MODELS", "NORMS", "build_model", "num_parameters"]


def num_parameters(model: nn.Module) -> int:
    """Number of trainable scalars (the ``d`` of the papers)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _norm(kind: str, channels: int, groups: int) -> nn.Module:
    return nn.BatchNorm2d(channels) if kind == "bn" else nn.GroupNorm(groups, channels)


class MLP(nn.Module):
    def __init__(self, info: DatasetInfo, hidden: int = 64) -> None:
        super().__init__()
        d_in = info.num_channels * info.image_size * info.image_size
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, info.num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class CNN(nn.Module):
    def __init__(self, info: DatasetInfo, norm: str, groups: int) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(info.num_channels, 16, kernel_size=5, padding=2),
            _norm(norm, 16, groups),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, kernel_size=5, padding=2),
            _norm(norm, 32, groups),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        side = info.image_size // 4
        self.fc = nn.Linear(32 * side * side, info.num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.features(x), 1))


class LeNet5(nn.Module):
    def __init__(self, info: DatasetInfo) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(info.num_channels, 6, kernel_size=5),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(6, 16, kernel_size=5),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        side = ((info.image_size - 4) // 2 - 4) // 2
        self.classifier = nn.Sequential(
            nn.Linear(16 * side * side, 120),
            nn.ReLU(),
            nn.Linear(120, 84),
            nn.ReLU(),
            nn.Linear(84, info.num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int, norm: str, groups: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = _norm(norm, c_out, groups)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, stride=1, padding=1, bias=False)
        self.bn2 = _norm(norm, c_out, groups)
        self.shortcut: nn.Module = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), _norm(norm, c_out, groups)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet18(nn.Module):
    def __init__(self, info: DatasetInfo, norm: str, groups: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(info.num_channels, 64, 3, stride=1, padding=1, bias=False)
        self.bn1 = _norm(norm, 64, groups)
        layers, c_in = [], 64
        for c_out, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            blocks = (BasicBlock(c_in, c_out, stride, norm, groups), BasicBlock(c_out, c_out, 1, norm, groups))
            layers.append(nn.Sequential(*blocks))
            c_in = c_out
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.linear = nn.Linear(512, info.num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layer4(self.layer3(self.layer2(self.layer1(out))))
        # kuangliu uses avg_pool2d(out, 4): the same on 32x32 inputs (a 4x4 map); adaptive for others.
        out = F.adaptive_avg_pool2d(out, 1)
        return self.linear(torch.flatten(out, 1))


class Residual(nn.Module):
    def __init__(self, fn: nn.Module) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x) + x


def _convmixer(
    info: DatasetInfo, norm: str, groups: int, dim: int = 256, depth: int = 8, kernel: int = 5, patch: int = 2
) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(info.num_channels, dim, kernel_size=patch, stride=patch),
        nn.GELU(),
        _norm(norm, dim, groups),
        *[
            nn.Sequential(
                Residual(
                    nn.Sequential(
                        nn.Conv2d(dim, dim, kernel, groups=dim, padding="same"),
                        nn.GELU(),
                        _norm(norm, dim, groups),
                    )
                ),
                nn.Conv2d(dim, dim, kernel_size=1),
                nn.GELU(),
                _norm(norm, dim, groups),
            )
            for _ in range(depth)
        ],
        nn.AdaptiveAvgPool2d((1, 1)),
        nn.Flatten(),
        nn.Linear(dim, info.num_classes),
    )


_NORM_CHANNELS = {"mlp": (), "lenet5": (), "cnn": (16, 32), "resnet18": (64, 128, 256, 512), "convmixer": (256,)}


def build_model(name: str, info: DatasetInfo, *, norm: str = "bn", gn_groups: int = 2) -> nn.Module:
    """Model ``name`` for inputs/outputs described by ``info`` (see the module table).

    Raises ``ValueError`` naming the key (``model``, ``norm``, ``gn-groups``) for a bad value.
    """
    if name not in MODELS:
        raise ValueError(f"model={name!r} is not allowed; allowed: {', '.join(MODELS)}")
    if norm not in NORMS:
        raise ValueError(f"norm={norm!r} is not allowed; allowed: {', '.join(NORMS)}")
    if norm == "gn":
        channels = _NORM_CHANNELS[name]
        ok = isinstance(gn_groups, int) and not isinstance(gn_groups, bool) and gn_groups >= 1
        if not ok or any(c % gn_groups for c in channels):
            allowed = f"an integer >= 1 dividing {', '.join(map(str, channels))}" if channels else "an integer >= 1"
            raise ValueError(f"gn-groups={gn_groups!r} is not allowed for model={name!r}; allowed: {allowed}")
    if name == "mlp":
        return MLP(info)
    if name == "cnn":
        return CNN(info, norm, gn_groups)
    if name == "lenet5":
        if info.image_size < 16:
            raise ValueError(f"model='lenet5' needs images of at least 16x16, not {info.image_size}x{info.image_size}")
        return LeNet5(info)
    if name == "resnet18":
        return ResNet18(info, norm, gn_groups)
    return _convmixer(info, norm, gn_groups)
