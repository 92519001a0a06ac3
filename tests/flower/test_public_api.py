"""The declared public API: what ``pollen``, ``pollen.strategies`` and ``pollen.clientside`` export.

Names a user imports resolve; plumbing (the engine's parts) is not exported; importing the math
layer through the package does not import Flower or torch.
"""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_the_package_exports_its_public_names_and_a_version() -> None:
    import pollen

    assert pollen.__version__
    for name in pollen.__all__:
        assert getattr(pollen, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'ReplyCollector'"):
        pollen.ReplyCollector  # noqa: B018


def test_strategies_export_strategies_and_what_a_user_builds_from_not_the_engine_parts() -> None:
    import pollen.strategies as strategies

    exported = set(strategies.__all__)
    assert {
        "FedAMS",
        "FedCAMS",
        "FedOpt",
        "FedAdaVR",
        "FedLAMB",
        "HAFed",
        "FedLazy",
        "AdaptiveStrategy",
        "Uplink",
        "ReplySpec",
    } <= exported
    assert not exported & {
        "Accounting",
        "RoundStats",
        "ClientSampler",
        "ReplyCollector",
        "Transport",
        "GlobalModel",
        "ServerStep",
        "build_strategy",
        "register",
        "strategy_names",
        "RelayAverage",
    }


def test_the_client_side_exports_the_mods_and_local_lamb() -> None:
    import pollen.clientside as clientside

    assert {"compression_mod", "lazy_mod", "LocalLAMB", "ClientState"} <= set(clientside.__all__)


def test_the_gossip_package_exports_what_its_mixing_module_does() -> None:
    import pollen.gossip as gossip
    from pollen.gossip import mixing

    assert gossip.__all__ == mixing.__all__
    for name in gossip.__all__:
        assert getattr(gossip, name) is getattr(mixing, name), name


def test_the_math_imports_without_flower_or_torch() -> None:
    code = (
        "import sys\n"
        "import pollen, pollen.optim, pollen.compression, pollen.vr, pollen.gossip, pollen.lazy, pollen.core.layout\n"
        "pollen.make_server_optimizer('adam')\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('flwr', 'torch'))\n"
        "assert not loaded, loaded[:5]\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
