"""``secagg=true`` through pollen's app, in-process on real Fashion-MNIST partitions (issue 40).

FedAMS, FedCAMS and FedOpt run their rounds on the securely aggregated sum (every round's survivors, masked
integers on the wire and no model); what cannot take it stops before round 1 with one line.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pollen.testing.inprocess import run_inprocess

NODES = 4
SMALL = {
    "model": "mlp",
    "num-server-rounds": 2,
    "local-steps": 2,
    "batch-size": 16,
    "eval-every": 2,
    "eval-batch-size": 500,
    "test-examples": 500,
    "fraction-train": 1.0,
    "fraction-evaluate": 0.0,
    "secagg": True,
    "secagg-bits": 8,
}


@pytest.mark.parametrize("strategy", ["fedams", "fedcams", "fedopt"])
def test_fedams_fedcams_and_fedopt_run_on_the_secure_sum(tmp_path: Path, strategy: str) -> None:
    rows = run_inprocess({**SMALL, "strategy": strategy, "results-dir": str(tmp_path), "run-name": strategy}, NODES)
    for row in rows[1:]:
        assert row["replies"] == NODES and row["method.secagg_survivors"] == NODES
        up = row["uplink_by_record"]
        assert "arrays" not in up and "pollen.update" not in up, up  # no model or compressed update in the clear
        assert (
            row["uplink_fp32_bytes"] / 2
            <= up["secagg-masked-input/pollen.secagg"]
            < row["uplink_fp32_bytes"] / 2 + 400 * NODES
        )
    assert rows[-1]["accuracy"] > rows[0]["accuracy"]


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        ({"strategy": "fedadavr"}, "FedAdaVR does not take secure aggregation: its stored-update table"),
        ({"strategy": "fedbnlaca"}, "does not take secure aggregation: the server keeps a copy of each client's last"),
        ({"strategy": "fedams", "driver": "async"}, "secure aggregation needs the synchronous round driver"),
        ({"strategy": "fedams", "dp": "local"}, "secure aggregation does not take a differential-privacy part"),
        ({"strategy": "fedavg"}, "run-config 'secagg' = true does not fit Flower's own"),
        ({"strategy": "fedams", "model": "cnn", "norm": "bn"}, "floating-point buffers"),
        ({"strategy": "fedams", "aggregator": "median"}, "secure aggregation needs the mean aggregator"),
    ],
    ids=["fedadavr", "lazy", "async", "local-dp", "flower-fedavg", "batchnorm", "median"],
)
def test_what_cannot_aggregate_securely_stops_before_round_1_with_its_reason(
    tmp_path: Path, extra: dict, reason: str
) -> None:
    from pollen.server_app import RunRefused

    with pytest.raises(RunRefused, match=reason) as err:
        run_inprocess({**SMALL, **extra, "results-dir": str(tmp_path), "run-name": "refused"}, NODES)
    assert "\n" not in str(err.value)
