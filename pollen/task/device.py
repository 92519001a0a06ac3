"""Choosing the torch device from a config string (node-config key ``device``)."""

from __future__ import annotations

import re

import torch

from pollen.task.catalog import DEVICES

__all__ = ["available_devices", "resolve_device"]

_CUDA_N = re.compile(r"cuda:(\d+)")


def _mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def available_devices() -> list[str]:
    """The devices this machine has, e.g. ``["cpu", "cuda:0", "cuda:1"]``."""
    out = ["cpu"]
    if torch.cuda.is_available():
        out += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if _mps_available():
        out.append("mps")
    return out


def resolve_device(spec: str) -> torch.device:
    """``"auto"`` (CUDA, else Apple MPS, else CPU), ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or ``"mps"``.

    An unknown value, or an explicit device this machine lacks, is a ``ValueError`` naming the key
    ``device``, the value, and what the machine has.
    """
    s = spec.strip().lower() if isinstance(spec, str) else spec
    if s == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if _mps_available():
            return torch.device("mps")
        return torch.device("cpu")
    if s == "cpu":
        return torch.device("cpu")
    have = ", ".join(available_devices())
    if s == "cuda" or (isinstance(s, str) and _CUDA_N.fullmatch(s)):
        if not torch.cuda.is_available():
            raise ValueError(f"device={spec!r} is not available: this machine has no CUDA device (it has: {have})")
        if s != "cuda" and int(s.split(":")[1]) >= torch.cuda.device_count():
            raise ValueError(f"device={spec!r} is not available: this machine has {have}")
        return torch.device(s)
    if s == "mps":
        if not _mps_available():
            raise ValueError(f"device={spec!r} is not available: this machine has no Apple MPS device (it has: {have})")
        return torch.device("mps")
    raise ValueError(f"device={spec!r} is not allowed; allowed: {', '.join(DEVICES)} (this machine has: {have})")
