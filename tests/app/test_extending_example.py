"""The contributors' page (docs/extending.md) is true: its FedProx example runs as written.

The page's Python blocks after "## A new method with its own client step" are executed in order in one
namespace, then the user's apps it defines run two rounds in-process (pollen's real handlers, the fake
grid): the method is picked by its run-config name and its clients run the proximal step.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

PAGE = Path(__file__).resolve().parents[2] / "docs" / "extending.md"


def example_namespace() -> dict:
    text = PAGE.read_text()
    section = text[text.index("## A new method with its own client step") :]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 3, "the FedProx example has three code blocks"
    namespace: dict = {"__name__": "fedprox_example"}
    for block in blocks:
        exec(compile(block, str(PAGE), "exec"), namespace)  # noqa: S102 - our own documentation
    return namespace


def test_the_composition_example_builds() -> None:
    text = PAGE.read_text()
    block = re.findall(r"```python\n(.*?)```", text, flags=re.S)[0]
    namespace: dict = {}
    exec(compile(block, str(PAGE), "exec"), namespace)  # noqa: S102
    strategy = namespace["strategy"]
    assert strategy.optimizer_name == "adabelief" and strategy.uplink.codec == "topk"


def test_the_proximal_step_pulls_towards_the_round_start() -> None:
    import torch

    ns = example_namespace()
    w = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    optimizer = ns["ProximalSGD"]([w], lr=0.1, mu=0.5)
    for _ in range(2):
        optimizer.zero_grad()
        (w * torch.tensor([1.0, 1.0])).sum().backward()  # gradient 1 everywhere
        optimizer.step()
    # step 1: w - 0.1 * 1; step 2: the gradient gets mu (w - w_t) = 0.5 * (-0.1)
    expected = torch.tensor([1.0, -2.0]) - 0.1 - 0.1 * (1.0 + 0.5 * -0.1)
    torch.testing.assert_close(w.detach(), expected)


@pytest.mark.slow  # two in-process runs of two rounds on the tiny CNN
def test_the_fedprox_example_runs_in_the_users_apps(tmp_path: Path) -> None:
    from pollen.testing.inprocess import run_inprocess

    ns = example_namespace()
    calls = []

    def counted(work):  # noqa: ANN001, ANN202
        calls.append(float(work.config["fedprox.mu"]))
        return ns["fedprox_step"](work)

    ns["local_steps"] = {**ns["local_steps"], "fedprox": counted}  # the ClientApp reads its table at call time
    settings = {
        "strategy": "fedprox",
        "num-server-rounds": 2,
        "local-steps": 3,
        "batch-size": 16,
        "model": "mlp",
        "partitioner": "iid",
        "fraction-train": 1.0,
        "fraction-evaluate": 0.0,
        "min-evaluate-nodes": 0,
        "eval-batch-size": 500,
        "results-dir": str(tmp_path),
        "run-name": "fedprox",
    }
    rows = run_inprocess(settings, num_nodes=3, server_main=ns["main"], client_app=ns["clientapp"])
    assert [row["round"] for row in rows] == [0, 1, 2]
    assert rows[-1]["replies"] == 3 and rows[-1]["failures"] == 0
    assert np.isfinite(rows[-1]["loss"])
    assert calls == [0.01] * 6  # 3 clients x 2 rounds ran the proximal step with the strategy's mu
