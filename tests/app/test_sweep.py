"""``pollen-sweep``: planning, resuming, progress lines and the report, with a stand-in for ``flwr run``
(no torch, no Ray)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from pollen.app import sweep
from pollen.app.config import AppConfig, ConfigError, defaults_from_pyproject
from pollen.app.preset import apply_preset, load_preset
from tests.app.test_results import fake_rows, record_run

pytestmark = pytest.mark.flower_compat

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
PRESET = """
# a tiny preset for the tests
[preset]
title = "Test preset"
scaled = "nothing"
size = "cpu"
supernodes = 6
needs = "fashion-mnist"

[config]
num-server-rounds = 4
model = "mlp"
fraction-train = 0.5

[methods]
fedams = { strategy = "fedams" }
"fedcams-sign" = { strategy = "fedcams", compressor = "sign" }
"""


@pytest.fixture
def preset_file(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text(PRESET)
    return path


def fake_flwr(gains: dict[str, float], calls: list[list[str]]):  # noqa: ANN201
    """Stands in for ``flwr run``: writes the results a run of that config would write."""

    def run(command: list[str], log: Path) -> int:
        calls.append(command)
        config = dict(sweep.parse_assignment(part) for part in shlex.split(command[command.index("--run-config") + 1]))
        out = Path(config["results-dir"]) / config["run-name"]
        gain = gains[config["strategy"]] + 0.01 * config["seed"]
        record_run(
            out, config, fake_rows(config["num-server-rounds"], 1000 if config["strategy"] == "fedams" else 40, gain)
        )
        log.write_text("ok\n")
        return 0

    return run


def test_a_sweep_runs_every_method_and_seed_once_then_reports(preset_file: Path, tmp_path: Path) -> None:
    preset = load_preset(str(preset_file))
    out = tmp_path / "sweep"
    runs = sweep.plan(preset, list(preset.methods), [1, 2], {"local-epochs": 2}, None, out)
    assert [(r.group, r.seed) for r in runs] == [("fedams", 1), ("fedcams-sign", 1), ("fedams", 2), ("fedcams-sign", 2)]
    calls: list[list[str]] = []
    lines: list[str] = []
    runner = fake_flwr({"fedams": 0.2, "fedcams": 0.1}, calls)
    assert sweep.execute(runs, app=".", supernodes=6, runner=runner, say=lines.append) == []
    assert lines[0] == "4 runs, 0 already finished, 4 to run"
    assert lines[1].startswith("[1/4] fedams seed 1: final accuracy 0.9") and "min left" in lines[1]
    assert len(calls) == 4 and all("num-supernodes=6" in call for call in calls)
    config = dict(sweep.parse_assignment(part) for part in shlex.split(calls[1][-1]))
    assert config["compressor"] == "sign" and config["local-epochs"] == 2 and config["model"] == "mlp"
    AppConfig.from_run_config({**defaults_from_pyproject(str(PYPROJECT)), **config})  # every value is valid
    # resumed: nothing runs again
    again: list[str] = []
    assert sweep.execute(runs, app=".", supernodes=6, runner=runner, say=again.append) == []
    assert again == ["4 runs, 4 already finished, 0 to run"] and len(calls) == 4

    table = sweep.write_report(
        {"fedams": [runs[0].run_dir, runs[2].run_dir], "fedcams-sign": [runs[1].run_dir, runs[3].run_dir]},
        out,
        title="t",
        commands=["flwr run ."],
        target=0.5,
    )
    rows = [line for line in table.splitlines() if line.startswith("| fed")]
    assert rows[0].startswith("| fedams | 2 | ") and "± " in rows[0]
    assert "2.0 (2/2 reached)" in rows[0]  # 0.1 + 0.21 r and 0.1 + 0.22 r pass 0.5 at round 2
    assert "4.0 (2/2 reached)" in rows[1]  # 0.1 + 0.11 r, 0.1 + 0.12 r: round 4
    report = (out / "report.md").read_text()
    assert "accuracy_vs_total_bytes.png" in report and "flwr run ." in report
    summaries = json.loads((out / "report.json").read_text())
    assert summaries[1]["group"] == "fedcams-sign"
    for summary, group in zip(
        summaries, ([runs[0], runs[2]], [runs[1], runs[3]])
    ):  # the table's numbers are the runs' own
        metrics = [json.loads((run.run_dir / "metrics.json").read_text())["rows"] for run in group]
        assert summary["final_accuracy"] == [rows[-1]["accuracy"] for rows in metrics]
        assert summary["uplink_bytes"] == sum(rows[-1]["cum_uplink_bytes"] for rows in metrics) / 2
    assert (out / "commands.sh").read_text().endswith("flwr run .\n")


def test_sweep_cli_dry_run_and_swept_setting(preset_file: Path, tmp_path: Path, capsys) -> None:
    code = sweep.main(
        [
            str(preset_file),
            "--methods",
            "fedcams-sign",
            "--seeds",
            "3",
            "--sweep",
            "topk-ratio=0.125,0.5",
            "--out",
            str(tmp_path / "s"),
            "--dry-run",
        ]
    )
    assert code == 0
    commands = capsys.readouterr().out.strip().splitlines()
    assert len(commands) == 2
    assert "topk-ratio=0.125" in commands[0] and "topk-ratio=0.5" in commands[1] and "seed=3" in commands[0]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["no-such-preset"], "preset 'no-such-preset' is unknown; allowed:"),
        (["{preset}", "--methods", "fedyogi"], "has no method 'fedyogi'; it has: fedams, fedcams-sign"),
        (["{preset}", "--sweep", "topk-ratio="], "names no values"),
    ],
)
def test_sweep_cli_refuses_bad_input_in_one_line(preset_file: Path, capsys, argv, message) -> None:
    assert sweep.main([a.format(preset=preset_file) for a in argv] + ["--dry-run"]) == 2
    assert message in capsys.readouterr().err


def test_a_preset_fills_defaults_and_the_command_line_wins(preset_file: Path) -> None:
    defaults = defaults_from_pyproject(str(PYPROJECT))
    given = {**defaults, "preset": str(preset_file), "fraction-train": 0.25}
    merged = apply_preset(given, defaults)
    assert merged["model"] == "mlp" and merged["num-server-rounds"] == 4  # from the preset
    assert merged["fraction-train"] == 0.25  # given on the command line
    cfg = AppConfig.from_run_config(given)
    assert cfg["model"] == "mlp" and cfg["fraction-train"] == 0.25
    with pytest.raises(ConfigError, match="run-config 'preset': preset 'nope' is unknown"):
        AppConfig.from_run_config({**defaults, "preset": "nope"})


def test_a_key_given_on_the_command_line_wins_even_at_its_default(preset_file: Path) -> None:
    """``local-epochs=1`` equals the pyproject default; given explicitly it must still beat the preset's value."""
    defaults = defaults_from_pyproject(str(PYPROJECT))
    text = preset_file.read_text().replace('model = "mlp"', 'model = "mlp"\nlocal-epochs = 3')
    preset_file.write_text(text)
    run_config = {**defaults, "preset": str(preset_file), "local-epochs": defaults["local-epochs"]}
    assert AppConfig.from_run_config(run_config)["local-epochs"] == 3  # not known as given: the preset fills it
    assert (
        AppConfig.from_run_config(run_config, given={"preset", "local-epochs"})["local-epochs"]
        == defaults["local-epochs"]
    )


def test_a_finished_run_with_other_settings_is_run_again(preset_file: Path, tmp_path: Path) -> None:
    preset = load_preset(str(preset_file))
    out = tmp_path / "sweep"
    calls: list[list[str]] = []
    runner = fake_flwr({"fedams": 0.2, "fedcams": 0.1}, calls)
    first = sweep.plan(preset, ["fedams"], [1], {}, None, out)
    sweep.execute(first, app=".", supernodes=6, runner=runner, say=lambda line: None)
    changed = sweep.plan(preset, ["fedams"], [1], {"local-epochs": 2}, None, out)
    assert not sweep.is_finished(changed[0]) and sweep.is_finished(first[0])
    sweep.execute(changed, app=".", supernodes=6, runner=runner, say=lambda line: None)
    assert len(calls) == 2 and sweep.is_finished(changed[0])


def test_runs_draw_no_plots_of_their_own_unless_asked_and_plots_never_rerun_a_run(
    preset_file: Path, tmp_path: Path
) -> None:
    """The report plots every run together; a run's own PNGs (about 2 s of its ServerApp) only on request."""
    preset = load_preset(str(preset_file))
    out = tmp_path / "sweep"
    calls: list[list[str]] = []
    runner = fake_flwr({"fedams": 0.2, "fedcams": 0.1}, calls)
    quiet = sweep.plan(preset, ["fedams"], [1], {}, None, out)
    assert quiet[0].config["plots"] is False
    sweep.execute(quiet, app=".", supernodes=6, runner=runner, say=lambda line: None)
    assert "plots=false" in calls[0][-1]
    drawn = sweep.plan(preset, ["fedams"], [1], {"plots": True}, None, out)
    assert drawn[0].config["plots"] is True and sweep.is_finished(drawn[0])  # a finished run stays finished
