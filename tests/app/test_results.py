"""Results a person can read: RunRecorder's files and pollen-compare (matplotlib only, no torch)."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest

from pollen.app import compare
from pollen.app.results import COLUMNS, RunRecorder, human_bytes, load_rows

pytestmark = pytest.mark.flower_compat

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PLOTS = ("accuracy_vs_round.png", "accuracy_vs_uplink.png", "accuracy_vs_downlink.png", "accuracy_vs_total_bytes.png")


def fake_rows(num_rounds: int, uplink_per_round: int, accuracy_gain: float) -> list[dict]:
    rows = []
    cum_up = cum_down = 0
    for r in range(num_rounds + 1):
        up = 0 if r == 0 else uplink_per_round
        down = 0 if r == 0 else 8 * uplink_per_round
        cum_up += up
        cum_down += down
        rows.append(
            {
                "round": r,
                "accuracy": min(0.1 + accuracy_gain * r, 0.99),
                "loss": 2.3 / (1 + r),
                "fed_accuracy": float("nan") if r == 0 else 0.1 + accuracy_gain * r,
                "train_loss": "" if r == 0 else 1.0 / r,
                "sampled": 0 if r == 0 else 4,
                "replies": 0 if r == 0 else 4,
                "failures": 0,
                "uplink_bytes": up,
                "compression_ratio": 1.0,
                "downlink_bytes": down,
                "cum_uplink_bytes": cum_up,
                "cum_downlink_bytes": cum_down,
                "round_seconds": 0.5,
                "elapsed_seconds": 0.5 * r,
            }
        )
    return rows


def record_run(out_dir: Path, config: dict, rows: list[dict]) -> RunRecorder:
    recorder = RunRecorder(out_dir, config, plots=config.get("plots", True))
    for row in rows:
        recorder.record(row)
    final = {"fc.weight": np.arange(6, dtype=np.float32).reshape(2, 3), "bn.num_batches_tracked": np.array(7)}
    recorder.finish(final, {"final_accuracy": rows[-1]["accuracy"], "rounds": len(rows) - 1})
    return recorder


def test_without_plots_a_run_ends_with_its_metrics_files_only(tmp_path):
    """Run-config ``plots = false``: the numbers are all there; no PNG is drawn (pollen-compare draws them)."""
    out = tmp_path / "quiet"
    recorder = RunRecorder(out, {"strategy": "fedams"}, plots=False)
    for row in fake_rows(3, 1000, 0.2):
        recorder.record(row)
    recorder.finish({"w": np.zeros(2, dtype=np.float32)}, {"final_accuracy": 0.5})
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "final_model.npz", "metrics.csv", "metrics.json"]
    assert len(load_rows(out)) == 4


def test_run_recorder_writes_every_file(tmp_path):
    config = {"strategy": "fedams", "server-lr": 0.1, "seed": 42}
    rows = fake_rows(3, 1000, 0.2)
    out = tmp_path / "fedams-run"
    recorder = RunRecorder(out, config)
    # config.json and the CSV header exist before the first round finishes.
    assert json.loads((out / "config.json").read_text()) == config
    with open(out / "metrics.csv", newline="") as handle:
        assert next(csv.reader(handle)) == list(COLUMNS)

    for i, row in enumerate(rows, start=1):
        recorder.record(row)
        # Written as the run goes: a crashed run still has its numbers.
        assert len(json.loads((out / "metrics.json").read_text())["rows"]) == i
    recorder.finish(
        {"fc.weight": np.arange(6, dtype=np.float32).reshape(2, 3), "bn.num_batches_tracked": np.array(7)},
        {"final_accuracy": 0.7, "best_accuracy": np.float32(0.7)},
    )

    with open(out / "metrics.csv", newline="") as handle:
        table = list(csv.DictReader(handle))
    assert [int(r["round"]) for r in table] == [0, 1, 2, 3]
    assert float(table[3]["accuracy"]) == pytest.approx(0.7)
    assert int(table[3]["cum_uplink_bytes"]) == 3000
    assert table[0]["uplink_update_bytes"] == ""  # a column the row did not have stays empty

    data = json.loads((out / "metrics.json").read_text())
    assert [r["round"] for r in data["rows"]] == [0, 1, 2, 3]
    assert data["summary"]["final_accuracy"] == 0.7
    assert data["summary"]["best_accuracy"] == pytest.approx(0.7)
    assert math.isnan(data["rows"][0]["fed_accuracy"])
    assert load_rows(out)[2]["cum_uplink_bytes"] == 2000

    with np.load(out / "final_model.npz") as model:
        assert set(model.files) == {"fc.weight", "bn.num_batches_tracked"}
        np.testing.assert_array_equal(model["fc.weight"], np.arange(6, dtype=np.float32).reshape(2, 3))
        assert model["bn.num_batches_tracked"].dtype.kind == "i"

    for name in PLOTS:
        assert (out / name).read_bytes()[:8] == PNG_MAGIC
        assert (out / name).stat().st_size > 1000


def test_a_methods_counters_get_columns_of_their_own(tmp_path):
    """``method.<name>`` columns follow COLUMNS, appear with the first row that has them, and survive a resume."""
    out = tmp_path / "lazy-run"
    recorder = RunRecorder(out, {"strategy": "fednlaca"})
    rows = fake_rows(2, 1000, 0.1)
    recorder.record(rows[0])
    recorder.record({**rows[1], "method.lazy_events": {"up-send": 4, "up-skip": 1}, "method.relayed_bytes": 700})
    recorder.record({**rows[2], "method.lazy_events": {"up-send": 3}, "method.lazy_rel": {"up": [0.5]}})
    extra = ["method.lazy_events", "method.relayed_bytes", "method.lazy_rel"]
    with open(out / "metrics.csv", newline="") as handle:
        table = list(csv.reader(handle))
    assert table[0] == [*COLUMNS, *extra]
    assert len(table) == 4 and all(len(line) == len(table[0]) for line in table)
    by_name = [dict(zip(table[0], line)) for line in table[1:]]
    assert by_name[0]["method.lazy_events"] == "" and by_name[1]["method.relayed_bytes"] == "700"
    assert json.loads(by_name[1]["method.lazy_events"]) == {"up-send": 4, "up-skip": 1}
    assert json.loads(by_name[2]["method.lazy_rel"]) == {"up": [0.5]} and by_name[2]["method.relayed_bytes"] == ""
    data = json.loads((out / "metrics.json").read_text())["rows"]
    assert [set(row) for row in data] == [set(COLUMNS) | set(extra)] * 3
    assert data[2]["method.lazy_events"] == {"up-send": 3}

    resumed = RunRecorder(out, {"strategy": "fednlaca"}, fresh=False)
    resumed.restore(data[:2])  # a checkpoint after round 1
    assert resumed.columns == [*COLUMNS, *extra]
    resumed.record({**rows[2], "method.lazy_events": {"up-send": 3}, "method.lazy_rel": {"up": [0.5]}})
    with open(out / "metrics.csv", newline="") as handle:
        assert next(csv.reader(handle)) == [*COLUMNS, *extra]
    assert json.loads((out / "metrics.json").read_text())["rows"] == data


def test_compare_two_runs(tmp_path, capsys):
    run_a = tmp_path / "fedams-a"
    run_b = tmp_path / "fedcams-sign-b"
    record_run(run_a, {"strategy": "fedams", "compressor": "sign"}, fake_rows(4, 400_000, 0.15))
    record_run(run_b, {"strategy": "fedcams", "compressor": "sign"}, fake_rows(4, 12_500, 0.12))
    out = tmp_path / "compare"

    code = compare.main([str(run_a), str(run_b), "--out", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    for text in ("fedams-a", "fedcams-sign-b", "| run |", human_bytes(1_600_000), human_bytes(50_000)):
        assert text in printed
    table = (out / "comparison.md").read_text()
    lines = [line for line in table.splitlines() if line.startswith("| fed")]
    assert len(lines) == 2
    assert "| fedams |" in lines[0] and "| - |" in lines[0]  # no uplink codec for FedAMS
    assert "| fedcams | sign |" in lines[1]
    assert "0.5800" in lines[1] and "0.7000" in lines[0]  # final accuracies, 4 decimals
    summaries = json.loads((out / "comparison.json").read_text())
    assert [s["run"] for s in summaries] == ["fedams-a", "fedcams-sign-b"]
    assert summaries[1]["uplink_bytes"] == 50_000 and summaries[0]["rounds"] == 4
    for name in PLOTS:
        assert (out / name).read_bytes()[:8] == PNG_MAGIC


def test_compare_reads_each_runs_codecs_from_its_method():
    """The method (pollen.app.methods) says which run-config keys are its codecs; no list of names in compare."""
    assert compare._codecs({"strategy": "fedams", "compressor": "sign"}) == "-"
    assert compare._codecs({"strategy": "fedcams", "compressor": "topk"}) == "topk"
    assert compare._codecs({"strategy": "fednlaa", "compressor": "topk"}) == "-"  # lazy, uncompressed
    assert compare._codecs({"strategy": "fedaca", "compressor": "fp16", "compressor-down": "topk"}) == "fp16"
    assert (
        compare._codecs({"strategy": "fedbaca", "compressor": "topk", "compressor-down": "sign"}) == "topk / down sign"
    )
    assert compare._codecs({"strategy": "relay-demo", "compressor": "sign"}) == "-"  # not a method of the product
    assert compare._codecs({}) == "-"


def test_compare_refuses_a_folder_without_metrics(tmp_path, capsys):
    good = tmp_path / "good"
    record_run(good, {"strategy": "fedams"}, fake_rows(2, 100, 0.1))
    empty = tmp_path / "not-a-run"
    empty.mkdir()
    out = tmp_path / "compare"
    assert compare.main([str(good), str(empty), "--out", str(out)]) == 2
    assert "not-a-run" in capsys.readouterr().err
    assert not (out / "comparison.md").exists()


def test_gradient_evaluation_claims_from_clients_are_believed_only_when_sane():
    from pollen.strategies.engine.accounting import RoundStats, grad_evals_of

    assert grad_evals_of({"grad-evals": 12}) == 12 and grad_evals_of({"num-steps": 5}) == 5
    for bad in (float("nan"), float("inf"), -3, True, [1, 2], "7", 10**12):
        assert grad_evals_of({"grad-evals": bad}) == 0, bad
    stats = RoundStats(1)
    stats.count_grad_evals([{"grad-evals": 4}, None, {"grad-evals": float("inf")}, {"num-steps": 2}])
    assert stats.grad_evals == 6


def test_the_plots_are_titled_tell_twelve_runs_apart_and_keep_the_legend_off_the_data(tmp_path, monkeypatch):
    """Each figure has a title, whole-round ticks or byte units, distinct (colour, marker) per run, the legend
    right of the axes."""
    from pollen.app import plotstyle
    from pollen.app.results import plot_runs

    figures = {}
    real_save = plotstyle.save

    def keep(fig, path, **kwargs):
        fig.canvas.draw()
        ax = fig.axes[0]
        figures[Path(path).name] = {
            "title": ax.get_title(),
            "styles": [(line.get_color(), line.get_marker(), line.get_linestyle()) for line in ax.get_lines()],
            "legend_left": ax.get_legend().get_window_extent().x0,
            "axes_right": ax.get_window_extent().x1,
            "xticks": [t.get_text() for t in ax.get_xticklabels() if t.get_text()],
        }
        return real_save(fig, path, **kwargs)

    monkeypatch.setattr(plotstyle, "save", keep)
    runs = {f"run {i}": fake_rows(6, 1000 * (i + 1), 0.05) for i in range(12)}
    paths = plot_runs(runs, tmp_path, title="twelve runs")
    assert sorted(p.name for p in paths) == sorted(PLOTS)
    for name, seen in figures.items():
        assert seen["title"].startswith("Test accuracy vs") and "twelve runs" in seen["title"], name
        assert len(set(seen["styles"])) == 12, f"{name}: two runs share a colour and marker"
        assert len({colour for colour, _, _ in seen["styles"]}) == 12, name
        assert seen["legend_left"] > seen["axes_right"], f"{name}: the legend overlaps the axes"
    assert all(t.lstrip("−-").isdigit() for t in figures["accuracy_vs_round.png"]["xticks"])
    assert any(t.endswith(("kB", "MB")) for t in figures["accuracy_vs_uplink.png"]["xticks"])


def test_series_styles_stay_distinct_past_the_twelfth():
    from pollen.app.plotstyle import series_style

    styles = [tuple(sorted(series_style(i).items())) for i in range(36)]
    assert len(set(styles)) == 36
    with pytest.raises(ValueError, match="negative"):
        series_style(-1)
