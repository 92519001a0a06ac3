"""One round of local training on CUDA matches the same round on CPU (issue 5's GPU check).

Skipped, with the reason stated, on machines without a CUDA device (like CI's).
"""

from __future__ import annotations

import pytest
import torch

from pollen.app.config import AppConfig, defaults_from_pyproject
from pollen.app.experiment import build_model, data_config
from pollen.task.data import load_partition
from pollen.task.train import train
from pollen.testing.flwr_cli import REPO

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


def _one_round(device: str) -> dict[str, torch.Tensor]:
    cfg = AppConfig.from_run_config({**defaults_from_pyproject(str(REPO / "pyproject.toml")), "partitioner": "iid"})
    loader, _ = load_partition(data_config(cfg, num_partitions=10), 0, 32)
    model = build_model(cfg, seed=0)
    train(model, loader, lr=0.01, local_steps=20, device=torch.device(device), seed=7)
    return {k: v.detach().to("cpu", torch.float64) for k, v in model.state_dict().items()}


def test_local_round_on_cuda_matches_cpu():
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.allow_tf32 = False  # TF32 convolutions would differ by ~1e-3 relative
    torch.backends.cuda.matmul.allow_tf32 = False
    cpu, gpu = _one_round("cpu"), _one_round("cuda")
    for name, expected in cpu.items():
        torch.testing.assert_close(gpu[name], expected, rtol=1e-3, atol=1e-4, msg=name)
