"""``dp=central`` / ``dp=local`` through pollen's app, in-process on real Fashion-MNIST partitions (issue 39).

The ServerApp builds the privacy part from the run-config; every results row carries epsilon (the accountant's,
exactly) and so does what a tracker logs of it; a run stopped after a round and resumed continues the same
budget and ends bit-identical to the uninterrupted run; a method that cannot take DP, and a model with
BatchNorm under central DP, stop before round 1 with one line.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pollen.app.trackers.base import round_metrics
from pollen.privacy import PrivacyAccountant, PrivacySetting
from pollen.testing.inprocess import run_inprocess

pytest.importorskip("dp_accounting")

NODES = 6
SMALL = {
    "model": "mlp",
    "num-server-rounds": 3,
    "local-steps": 2,
    "batch-size": 16,
    "eval-every": 3,
    "eval-batch-size": 500,
    "test-examples": 500,
    "fraction-train": 0.5,
    "fraction-evaluate": 0.0,
    "dp-clip": 0.5,
    "dp-noise-multiplier": 1.2,
    "dp-noise-seed": 7,
}


def _epsilon(releases: int, z: float, sampling: str, draw: tuple[int, int] | None = None) -> float:
    kwargs = {} if draw is None else {"population": draw[0], "sample_size": draw[1]}
    accountant = PrivacyAccountant(PrivacySetting(z, 1e-5, sampling, **kwargs))
    accountant.record(releases)
    return accountant.epsilon()


def test_central_dp_rows_carry_the_accountants_epsilon_and_trackers_get_it(tmp_path: Path) -> None:
    settings = {**SMALL, "strategy": "fedams", "dp": "central", "results-dir": str(tmp_path), "run-name": "c"}
    rows = run_inprocess(settings, NODES)[1:]
    want = [_epsilon(t, 1.2, "without-replacement", (NODES, NODES // 2)) for t in (1, 2, 3)]
    assert [row["method.dp_epsilon"] for row in rows] == want
    assert all(row["method.dp_clip"] == 0.5 for row in rows)
    # the noise on the mean: z * 2C / n (replace-one sensitivity, n = 3 sampled of 6)
    assert all(row["method.dp_noise_std"] == pytest.approx(1.2 * 2 * 0.5 / 3) for row in rows)
    assert round_metrics(rows[-1])["method.dp_epsilon"] == want[-1]


def test_local_dp_with_compressed_error_fed_uploads_reports_each_clients_epsilon(tmp_path: Path) -> None:
    settings = {
        **SMALL,
        "strategy": "fedcams",
        "compressor": "sign",
        "dp": "local",
        "results-dir": str(tmp_path),
        "run-name": "l",
    }
    rows = run_inprocess(settings, NODES)[1:]
    most = [row["method.dp_uploads_max"] for row in rows]
    assert most == sorted(most) and 1 <= most[-1] <= 3
    assert [row["method.dp_epsilon"] for row in rows] == [_epsilon(k, 0.6, "none") for k in most]
    assert all(row["failures"] == 0 for row in rows)


def test_a_resumed_dp_run_continues_its_budget_and_ends_bit_identical(tmp_path: Path) -> None:
    settings = {**SMALL, "strategy": "fedams", "dp": "central", "num-server-rounds": 4, "results-dir": str(tmp_path)}
    full = run_inprocess({**settings, "run-name": "full"}, NODES)
    run_inprocess({**settings, "run-name": "cut", "stop-after-round": 2}, NODES)
    resumed = run_inprocess({**settings, "run-name": "cut", "resume": str(tmp_path / "cut")}, NODES)
    assert [row.get("method.dp_epsilon") for row in resumed] == [row.get("method.dp_epsilon") for row in full]
    want, got = np.load(tmp_path / "full" / "final_model.npz"), np.load(tmp_path / "cut" / "final_model.npz")
    for name in want.files:
        assert want[name].tobytes() == got[name].tobytes(), name


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        ({"strategy": "hafed", "cluster-size": 2, "dp": "central"}, "HAFed does not take central differential privacy"),
        ({"strategy": "fedadavr", "dp": "central"}, "FedAdaVR does not take central differential privacy"),
        ({"strategy": "fedavg", "dp": "central"}, "run-config 'dp' = 'central' does not fit Flower's own"),
        ({"strategy": "fedams", "model": "cnn", "dp": "central"}, "floating-point buffers"),
    ],
    ids=["hafed", "fedadavr", "flower-fedavg", "batchnorm"],
)
def test_what_cannot_take_dp_stops_before_round_1_with_its_reason(tmp_path: Path, extra: dict, reason: str) -> None:
    from pollen.server_app import RunRefused

    settings = {**SMALL, **extra, "results-dir": str(tmp_path), "run-name": "refused"}
    with pytest.raises(RunRefused, match=reason):
        run_inprocess(settings, NODES)
