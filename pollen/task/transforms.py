"""Turning uint8 images into normalised tensors, and cheap batch-level augmentation.

Images are converted once, when a partition is first loaded, and then live in memory as float32
``(N, C, H, W)`` tensors. The loaders fetch whole batches by fancy indexing (``__getitems__``) instead
of one sample at a time, and augmentation (random crop with padding, horizontal flip) is applied to
the batch tensor, so there is no per-sample Python or PIL work in the training loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
from torch.utils.data import TensorDataset
from torch.utils.data._utils.collate import default_collate

__all__ = ["Batch", "BatchAugment", "BatchCollate", "BatchTensorDataset", "to_tensor"]


def to_tensor(x: np.ndarray, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """``uint8`` images ``(N, H, W)`` or ``(N, H, W, C)`` to normalised float32 ``(N, C, H, W)``."""
    # as_tensor copies read-only inputs (cached raw arrays are shared and read-only)
    t = torch.as_tensor(np.asarray(x, dtype=np.float32))
    t = t.unsqueeze(1) if t.ndim == 3 else t.permute(0, 3, 1, 2)
    t = t.div_(255.0)
    m = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
    return t.sub_(m).div_(s).contiguous()


class Batch(NamedTuple):
    """A whole batch fetched in one indexing operation."""

    x: torch.Tensor
    y: torch.Tensor


class BatchTensorDataset(TensorDataset):
    """``TensorDataset`` of ``(images, labels)`` that also serves whole batches at once.

    ``DataLoader`` calls ``__getitems__`` with a batch of indices; use it with :class:`BatchCollate`.
    """

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        super().__init__(x, y)

    def __getitems__(self, indices: list[int]) -> Batch:
        idx = torch.as_tensor(indices, dtype=torch.long)
        return Batch(self.tensors[0][idx], self.tensors[1][idx])


class BatchAugment:
    """Random crop of the original size after ``padding`` pixels of padding, and random h-flips.

    Works on normalised batches: the padding takes the value a black pixel has after normalisation,
    which is what torchvision's ``RandomCrop(size, padding)`` before ``Normalize`` gives. Randomness
    comes from torch's global CPU generator (``train`` seeds it for the duration of a call).
    """

    def __init__(self, mean: Sequence[float], std: Sequence[float], *, padding: int = 4, hflip: bool = True) -> None:
        self.padding = int(padding)
        self.hflip = bool(hflip)
        self.fill = (-torch.tensor(mean, dtype=torch.float32) / torch.tensor(std, dtype=torch.float32)).view(
            1, -1, 1, 1
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        p = self.padding
        if p > 0:
            padded = self.fill.to(x.dtype).expand(b, c, h + 2 * p, w + 2 * p).clone()
            padded[:, :, p : p + h, p : p + w] = x
            oy = torch.randint(0, 2 * p + 1, (b,))
            ox = torch.randint(0, 2 * p + 1, (b,))
            rows = (oy[:, None] + torch.arange(h)[None, :])[:, None, :, None]
            cols = (ox[:, None] + torch.arange(w)[None, :])[:, None, None, :]
            x = padded[torch.arange(b)[:, None, None, None], torch.arange(c)[None, :, None, None], rows, cols]
        if self.hflip:
            flip = torch.rand(b) < 0.5
            x = torch.where(flip[:, None, None, None], x.flip(-1), x)
        return x


class BatchCollate:
    """``collate_fn`` for :class:`BatchTensorDataset` (falls back to ``default_collate``)."""

    def __init__(self, augment: BatchAugment | None = None) -> None:
        self.augment = augment

    def __call__(self, data: Batch | list) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = data if isinstance(data, Batch) else default_collate(data)
        if self.augment is not None:
            x = self.augment(x)
        return x, y
