"""``client-state-in-memory = false``: a stateful method's run is bit-identical with its client state in files only.

Every client of FedBNLACA keeps a model mirror, its last increment and residuals between rounds; with the state
in its ``state-dir`` file only (none in Flower's ``context.state``, which in a simulation lives in one process
for every node) the final model must not change by a bit.
"""

from __future__ import annotations

import numpy as np

from pollen.testing.inprocess import run_inprocess

SMALL = {
    "strategy": "fedbnlaca",
    "num-server-rounds": 3,
    "local-steps": 2,
    "batch-size": 16,
    "model": "mlp",
    "partitioner": "iid",
    "fraction-train": 1.0,
    "fraction-evaluate": 0.0,
    "min-evaluate-nodes": 0,
    "eval-every": 3,
}


def test_file_only_client_state_ends_bit_identical(tmp_path):
    for name, in_memory in (("memory", True), ("file-only", False)):
        run_inprocess(
            {
                **SMALL,
                "results-dir": str(tmp_path),
                "run-name": name,
                "state-dir": str(tmp_path / f"clients-{name}"),
                "client-state-in-memory": in_memory,
            },
            4,
        )
    want, got = np.load(tmp_path / "memory" / "final_model.npz"), np.load(tmp_path / "file-only" / "final_model.npz")
    assert sorted(want.files) == sorted(got.files)
    for name in want.files:
        assert want[name].tobytes() == got[name].tobytes(), name
    assert len(list((tmp_path / "clients-file-only").rglob("*.npz"))) == 4  # one state file per client
