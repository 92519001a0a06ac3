"""Run pollen's real ServerApp and ClientApp in one process, without Ray or a SuperLink.

The grid is the in-process ``FakeGrid`` of the test suite: every message goes to
``pollen.client_app.app(message, context)`` of its node, with a per-node ``Context``
whose ``state`` persists across rounds (error-feedback residuals live there), exactly
the objects a SuperNode would hand the ClientApp. Used by the quality benchmarks,
where dozens of runs through ``flwr run`` would cost mostly start-up time.
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flwr.app import Context, RecordDict  # noqa: E402

from pollen.config import defaults_from_pyproject, effective_run_config  # noqa: E402
from tests.flower_fakes import FakeGrid  # noqa: E402

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def run_inprocess(overrides: dict[str, Any], num_nodes: int, threads: int = 1) -> list[dict[str, Any]]:
    """Run one experiment; return its metrics rows (also written under results-dir/run-name).

    ``threads`` caps torch's intra-op threads: clients train one after another here, and
    on a small shared machine one thread per benchmark process is the fastest setting
    (two threads were 2.2x slower per LeNet step under load).
    """
    import torch

    torch.set_num_threads(threads)
    import pollen.client_app as client_module
    import pollen.server_app as server_module

    run_config = {**defaults_from_pyproject(str(PYPROJECT)), **overrides}
    effective = effective_run_config(run_config, set(overrides))  # a preset's values, as the ClientApps see them
    contexts = {
        node: Context(
            run_id=1,
            node_id=node,
            node_config={"partition-id": node - 1, "num-partitions": num_nodes},
            state=RecordDict(),
            run_config=run_config,
        )
        for node in range(1, num_nodes + 1)
    }
    grid = FakeGrid(
        list(contexts),
        lambda msg: client_module.app(msg, contexts[msg.metadata.dst_node_id]),
        client_ids={node: f"partition-{node - 1}" for node in contexts},
        cluster_ids={node: str((node - 1) // size) for node in contexts} if (size := int(effective.get("cluster-size", 0))) else None,
    )
    grid.set_run(SimpleNamespace(override_config=dict(overrides)))  # what Flower's run record says was given
    server_context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=run_config)
    server_module.main(grid, server_context)
    out = Path(run_config["results-dir"]).expanduser().resolve() / run_config["run-name"]
    return json.loads((out / "metrics.json").read_text())["rows"]
