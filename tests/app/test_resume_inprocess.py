"""Resume in-process: a run stopped after round 1 and resumed from its checkpoint ends as the uninterrupted one.

The fast layer's check of the whole resume path (the checkpoint with its digest, every field validated on
load, the app's result rows with their per-record byte counts, the strategy's ledger), which the
``flwr run`` test in ``tests/e2e`` repeats through Flower's processes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pollen.testing.inprocess import run_inprocess

SMALL = {
    "strategy": "fedcams",
    "compressor": "sign",
    "model": "mlp",
    "num-server-rounds": 3,
    "local-steps": 2,
    "batch-size": 16,
    "eval-every": 3,
    "eval-batch-size": 500,
    "fraction-train": 1.0,
    "fraction-evaluate": 0.0,
}


def test_a_resumed_run_equals_the_uninterrupted_one(tmp_path: Path) -> None:
    """FedCAMS's error feedback lives in client state files (``state-dir``), as on real SuperNodes."""
    full = run_inprocess(
        {**SMALL, "results-dir": str(tmp_path), "run-name": "full", "state-dir": str(tmp_path / "clients-full")}, 3
    )
    settings = {**SMALL, "results-dir": str(tmp_path), "state-dir": str(tmp_path / "clients")}
    run_inprocess({**settings, "run-name": "cut", "stop-after-round": 1}, 3)
    cut = tmp_path / "cut"
    assert (cut / "checkpoint.npz").is_file() and (cut / "checkpoint.npz.sha256").is_file()
    resumed = run_inprocess({**settings, "run-name": "cut", "resume": str(cut)}, 3)
    assert [row["round"] for row in resumed] == [row["round"] for row in full]
    want, got = np.load(tmp_path / "full" / "final_model.npz"), np.load(cut / "final_model.npz")
    for name in want.files:
        assert want[name].tobytes() == got[name].tobytes(), name
