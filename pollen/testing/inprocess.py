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
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from flwr.app import Context, RecordDict  # noqa: E402

from pollen.app.config import defaults_from_pyproject, effective_run_config  # noqa: E402
from pollen.app.paths import resolve  # noqa: E402
from pollen.testing.fakes import FakeGrid  # noqa: E402

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def run_inprocess(
    overrides: dict[str, Any],
    num_nodes: int,
    threads: int = 1,
    *,
    server_main: Any = None,
    client_app: Any = None,
    shuffle_seed: int | None = None,
    arrival_seed: int | None = None,
    plots: bool = False,
) -> list[dict[str, Any]]:
    """Run one experiment; return its metrics rows (also written under results-dir/run-name).

    ``threads`` caps torch's intra-op threads: clients train one after another here, and
    on a small shared machine one thread per benchmark process is the fastest setting
    (two threads were 2.2x slower per LeNet step under load). ``server_main`` (a ServerApp's main
    function, ``main(grid, context)``) and ``client_app`` (a ``ClientApp``) replace pollen's own,
    e.g. a user's apps with a method of their own. ``shuffle_seed`` hands each round's replies back in a
    seeded random order (:class:`FakeGrid`), as clients finishing in another order would; ``arrival_seed``
    does the same for the asynchronous driver's pulls (each waiting reply comes with probability 1/2). ``plots``: the
    run-config ``plots`` unless ``overrides`` sets it; off by default, since callers read the metrics files and
    drawing the four PNGs took 1.7 s of a 2-second run of the MLP.
    """
    import torch

    torch.set_num_threads(threads)
    import pollen.client_app as client_module
    import pollen.server_app as server_module

    client_app = client_app if client_app is not None else client_module.app
    server_main = server_main if server_main is not None else server_module.main
    run_config = {**defaults_from_pyproject(str(PYPROJECT)), "plots": plots, **overrides}
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
        lambda msg: client_app(msg, contexts[msg.metadata.dst_node_id]),
        client_ids={node: f"partition-{node - 1}" for node in contexts},
        cluster_ids={node: str((node - 1) // size) for node in contexts}
        if (size := int(effective.get("cluster-size", 0)))
        else None,
        shuffle_seed=shuffle_seed,
        arrival_seed=arrival_seed,
    )
    grid.set_run(SimpleNamespace(override_config=dict(overrides)))  # what Flower's run record says was given
    server_context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=run_config)
    server_main(grid, server_context)
    out = resolve(run_config["results-dir"]) / run_config["run-name"]  # as the ServerApp resolves it
    return json.loads((out / "metrics.json").read_text())["rows"]


def run_parallel(function: Any, calls: list[tuple], jobs: int) -> None:
    """Call ``function(*args)`` for each ``args`` in ``calls``, ``jobs`` at a time, each in a fresh process.

    A run uses one torch thread (:func:`run_inprocess`), so on a machine with ``jobs`` idle cores this
    finishes a list of independent runs about ``jobs`` times sooner. Each call gets a process of its own
    (spawned, not forked: no torch or Flower state is shared), and results are left on disk by the
    runs themselves. ``jobs=1`` calls them here, one after another. A call that raises stops the rest
    and the error is raised here. ``function`` must be importable by a new process (a module-level
    function of a script file or module, not of code fed on standard input): spawn imports it again.
    """
    if jobs <= 1:
        for args in calls:
            function(*args)
        return
    import multiprocessing
    from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait

    context = multiprocessing.get_context("spawn")
    fresh = {"max_tasks_per_child": 1} if sys.version_info >= (3, 11) else {}  # 3.10 reuses a worker
    with ProcessPoolExecutor(max_workers=jobs, mp_context=context, **fresh) as pool:
        futures = [pool.submit(function, *args) for args in calls]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        for future in done:
            if future.exception() is not None:
                for pending in futures:
                    pending.cancel()
                raise future.exception()
