"""``pollen-sweep`` with its warm Ray head and SuperLink: real ``flwr run``s, then everything stopped by id."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pollen.app import sweep
from pollen.core.processes import pids_with_environ

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
PRESET = """
[preset]
title = "Warm sweep test"
scaled = "tiny"
size = "cpu"
supernodes = 4
needs = "fashion-mnist"

[config]
num-server-rounds = 2
model = "mlp"
partitioner = "iid"
fraction-train = 0.5
fraction-evaluate = 0.0
min-evaluate-nodes = 0
local-steps = 3
batch-size = 16
eval-batch-size = 1000

[methods]
fedams = { strategy = "fedams" }
"fedcams-sign" = { strategy = "fedcams", compressor = "sign" }
"""


def test_a_warm_sweep_runs_every_run_on_one_ray_head_and_stops_it(tmp_path: Path, capsys) -> None:
    preset = tmp_path / "warm.toml"
    preset.write_text(PRESET)
    out = tmp_path / "sweep"
    code = sweep.main([str(preset), "--seeds", "1", "--out", str(out), "--app", str(REPO), "--warm"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    head = next(line for line in printed.splitlines() if line.startswith("warm Ray head at "))
    address = head.removeprefix("warm Ray head at ").split()[0]
    assert "sweep wall time" in printed and "(warm)" in printed
    for name in ("fedams-s1", "fedcams-sign-s1"):
        rows = json.loads((out / "runs" / name / "metrics.json").read_text())["rows"]
        assert rows[-1]["round"] == 2
    # the SuperLink, its simulation and the Ray head are gone: nothing runs with their environment
    assert pids_with_environ(f"RAY_ADDRESS={address}".encode()) == []
    assert pids_with_environ(f"FLWR_HOME={out / 'flwr-home'}".encode()) == []
    assert (out / "report.md").is_file()
