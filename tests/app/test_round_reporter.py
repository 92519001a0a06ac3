"""The ServerApp's per-round reporter: evaluation cadence, rows, and what a skipped round records."""

from __future__ import annotations

import json

import torch
from flwr.app import ArrayRecord
from torch.utils.data import DataLoader, TensorDataset

from pollen.app.config import AppConfig, defaults_from_pyproject
from pollen.app.reporter import RoundReporter
from pollen.app.results import RunRecorder
from pollen.strategies.engine.accounting import Accounting
from pollen.testing.flwr_cli import REPO


class _Strategy:
    def __init__(self) -> None:
        self.accounting = Accounting()


def test_eval_every_evaluates_on_schedule_and_after_the_last_round(tmp_path):
    cfg = AppConfig.from_run_config(
        {
            **defaults_from_pyproject(str(REPO / "pyproject.toml")),
            "eval-every": 2,
            "num-server-rounds": 5,
            "device": "cpu",
        }
    )
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 3))
    loader = DataLoader(TensorDataset(torch.randn(12, 4), torch.randint(0, 3, (12,))), batch_size=4)
    strategy = _Strategy()
    for r in range(1, 6):
        stats = strategy.accounting.round(r)
        stats.uplink_bytes, stats.downlink_bytes, stats.sampled, stats.replies = 100 * r, 1000, 2, 2
    recorder = RunRecorder(tmp_path / "run", cfg.as_dict())
    reporter = RoundReporter(cfg, strategy, recorder, model, loader)
    arrays = ArrayRecord(model.state_dict())
    results = [reporter(r, arrays) for r in range(0, 6)]
    evaluated = [r for r, res in enumerate(results) if res is not None]
    assert evaluated == [0, 2, 4, 5]
    rows = json.loads((tmp_path / "run" / "metrics.json").read_text())["rows"]
    assert [row["round"] for row in rows] == [0, 1, 2, 3, 4, 5]
    assert rows[1]["accuracy"] is None and isinstance(rows[2]["accuracy"], float)
    assert [row["cum_uplink_bytes"] for row in rows] == [0, 100, 300, 600, 1000, 1500]
    assert rows[5]["cum_downlink_bytes"] == 5000


def test_the_round_log_names_each_record_kind_only_when_there_is_more_than_the_model():
    from pollen.app.reporter import _records_in_words

    plain = {"arrays": 1000, "metrics": 50, "pollen.client-info": 40}
    assert _records_in_words(plain, {"arrays": 1000, "config": 80}) == ""
    words = _records_in_words({**plain, "pollen.x.v": 2000}, {"arrays": 1000, "config": 80, "pollen.x.v_hat": 2000})
    assert words == "up arrays 1.00 KB, v 2.00 KB | down arrays 1.00 KB, v_hat 2.00 KB"
    assert "hafed-gossip/arrays 3.00 KB" in _records_in_words(plain, {"arrays": 1000, "hafed-gossip/arrays": 3000})


def test_round_log_names_each_methods_counters_without_knowing_them():
    from pollen.app.reporter import _method_in_words

    events = {
        "up-send": 3,
        "up-skip": 2,
        "up-flags": 2,
        "down-full": 1,
        "down-send": 3,
        "down-skip": 1,
        "down-flags": 1,
        "resync": 1,
    }
    assert _method_in_words({"lazy_events": events}) == (
        "lazy_events up-send 3, up-skip 2, up-flags 2, down-full 1, down-send 3, down-skip 1, down-flags 1, resync 1"
    )
    assert (
        _method_in_words({"lazy_events": {"up-send": 4, "up-skip": 0, "down-dense": 4}})
        == "lazy_events up-send 4, down-dense 4"
    )
    assert (
        _method_in_words({"lazy_events": {}, "lazy_rel": {"up": [0.5, 0.125, 0.25], "down": []}})
        == "lazy_rel up 3 in [0.125, 0.5]"
    )
    assert (
        _method_in_words({"relayed_bytes": 1_200_000, "peer_bytes": 3_400_000})
        == "relayed_bytes 1.20 MB | peer_bytes 3.40 MB"
    )
    assert _method_in_words({"relayed_bytes": 0, "merges": 2, "share": 0.123456}) == "merges 2 | share 0.1235"
    assert _method_in_words({}) == ""


def test_a_methods_counters_become_method_columns_of_the_row(tmp_path):
    cfg = AppConfig.from_run_config({**defaults_from_pyproject(str(REPO / "pyproject.toml")), "device": "cpu"})
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 3))
    loader = DataLoader(TensorDataset(torch.randn(4, 4), torch.randint(0, 3, (4,))), batch_size=4)
    strategy = _Strategy()
    stats = strategy.accounting.round(1)
    stats.method["relayed_bytes"] = 500
    stats.method["lazy_events"] = {"up-send": 2}
    stats.method["lazy_rel"] = {"up": [0.25]}
    recorder = RunRecorder(tmp_path / "run", cfg.as_dict())
    reporter = RoundReporter(cfg, strategy, recorder, model, loader)
    arrays = ArrayRecord(model.state_dict())
    reporter(0, arrays)
    reporter(1, arrays)
    stats.method["lazy_events"]["up-send"] = 99  # the row keeps the round's values, not a live view
    rows = json.loads((tmp_path / "run" / "metrics.json").read_text())["rows"]
    assert rows[1]["method.relayed_bytes"] == 500 and rows[1]["method.lazy_events"] == {"up-send": 2}
    assert rows[1]["method.lazy_rel"] == {"up": [0.25]}
    assert rows[0]["method.relayed_bytes"] == ""  # round 0 had none: the column is there, empty
    assert recorder.rows[1]["method.lazy_events"] == {"up-send": 2}


def test_anonymous_resident_memory_leaves_out_a_memory_mapped_files_pages(tmp_path):
    """A memory-mapped table's pages count in the resident set but not in the process's own memory."""
    import sys

    import numpy as np
    import pytest

    from pollen.app.reporter import anonymous_resident_bytes, resident_bytes

    if not sys.platform.startswith("linux"):
        pytest.skip("/proc is Linux's")
    size = 64 * 2**20
    path = tmp_path / "table.bin"
    path.write_bytes(b"\x01" * size)
    rss, anon = resident_bytes(), anonymous_resident_bytes()
    assert 0 < anon < rss
    table = np.memmap(path, dtype=np.uint8, mode="r")
    assert int(table.sum(dtype=np.int64)) == size  # every page read, so mapped in
    assert resident_bytes() - rss > size * 0.9
    assert anonymous_resident_bytes() - anon < size * 0.1
    own = np.ones(size, dtype=np.uint8)
    assert anonymous_resident_bytes() - anon > size * 0.9
    del table, own
