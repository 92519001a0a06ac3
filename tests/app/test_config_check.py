"""A misspelt or unquoted key is named, with the nearest allowed key, wherever pollen reads keys.

Flower 1.39 refuses both before pollen's code runs (an unquoted string in ``flwr run`` itself, an unknown key
in the SuperLink with "[code: 15] Invalid run configuration."), so ``python -m pollen.app.check`` says it
before the run; the ServerApp and presets say it too.
"""

from __future__ import annotations

import pytest
from flwr.common.config import parse_config_args

from pollen.app import check
from pollen.app.config import SCHEMA, AppConfig, ConfigError, defaults_from_pyproject
from pollen.app.preset import PresetError, apply_preset
from pollen.app.spec import nearest, unknown_name
from pollen.testing.flwr_cli import REPO

DEFAULTS = defaults_from_pyproject(str(REPO / "pyproject.toml"))


@pytest.mark.parametrize(
    "typed, meant",
    [
        ("compresor", "compressor"),
        ("sever-lr", "server-lr"),
        ("server_lr", "server-lr"),
        ("num-rounds", "num-server-rounds"),
        ("SERVER-LR", "server-lr"),
        ("beta1", "beta-1"),  # the old spellings of the moment decays
        ("beta2", "beta-2"),
        ("beta_1", "beta-1"),  # the strategies' spelling
    ],
)
def test_nearest_allowed_key(typed: str, meant: str) -> None:
    assert nearest(typed, SCHEMA) == meant
    assert f"is unknown; nearest allowed: '{meant}'; allowed: " in unknown_name("run-config key", typed, SCHEMA)


def test_nothing_near_gives_no_guess() -> None:
    message = unknown_name("run-config key", "zzzz", SCHEMA)
    assert "nearest" not in message and message.startswith("run-config key 'zzzz' is unknown; allowed: ")


def test_the_app_config_names_the_nearest_key() -> None:
    with pytest.raises(ConfigError) as err:
        AppConfig.from_run_config({**DEFAULTS, "compresor": "topk"})
    assert str(err.value).startswith("run-config key 'compresor' is unknown; nearest allowed: 'compressor'; allowed:")


def test_the_old_spelling_of_a_moment_decay_is_refused_with_the_new_one() -> None:
    with pytest.raises(ConfigError) as err:
        AppConfig.from_run_config({**DEFAULTS, "beta1": 0.9})
    assert str(err.value).startswith("run-config key 'beta1' is unknown; nearest allowed: 'beta-1'; allowed:")


def test_a_preset_with_a_misspelt_key_names_the_nearest(tmp_path) -> None:
    preset = tmp_path / "mine.toml"
    head = 'title = "t"\nscaled = "s"\nsize = "cpu"\nsupernodes = 4\nneeds = "n"'
    preset.write_text(f"[preset]\n{head}\n[config]\nserver_lr = 0.5\n")
    with pytest.raises(PresetError, match="run-config key 'server_lr' is unknown; nearest allowed: 'server-lr'"):
        apply_preset({**DEFAULTS, "preset": str(preset)}, DEFAULTS)


@pytest.mark.parametrize(
    "text, said",
    [
        ("strategy='fedcams' compressor=topk", "run-config 'compressor' = topk is not a TOML value"),
        ("strategy = 'fedcams'", "--run-config text 'strategy' is not key=value"),
        (
            "strategy='fedcams' compresor='topk'",
            "run-config key 'compresor' is unknown to this app (Flower's SuperLink refuses it: '[code: 15] Invalid "
            "run configuration.'); nearest allowed: 'compressor'",
        ),
        ("num-server-rounds=0", "run-config 'num-server-rounds' = 0 is out of range; allowed: an integer >= 1"),
        ("data-dir='data'", "an absolute path or one starting with ~"),
    ],
)
def test_check_names_the_first_mistake(text: str, said: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert check.main([str(REPO), "--run-config", text]) == 1
    out = capsys.readouterr()
    assert out.out == "" and out.err.startswith("pollen: ") and said in out.err and out.err.count("\n") == 1


def test_what_check_refuses_as_unreadable_flower_refuses_or_drops() -> None:
    """The two parse cases are Flower's own: an unquoted string fails its parser; text with spaces is dropped."""
    with pytest.raises(Exception, match="invalid format"):
        parse_config_args(["compressor=topk"])
    assert parse_config_args(["strategy = 'fedcams'"]) == {}


def test_check_accepts_a_valid_config(capsys: pytest.CaptureFixture[str]) -> None:
    text = "strategy='fedcams' compressor='topk' topk-ratio=0.0078125 num-server-rounds=30 plots=false"
    assert check.main([str(REPO), "-c", text]) == 0
    assert capsys.readouterr().out == "ok: fedcams on fashion-mnist, 5 keys given; pollen accepts this run-config\n"


def test_check_reads_a_toml_file_as_flwr_run_does(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "run.toml"
    config.write_text('strategy = "fedcams"\ncompresor = "topk"\n')
    assert check.main([str(REPO), "--run-config", str(config)]) == 1
    assert "nearest allowed: 'compressor'" in capsys.readouterr().err
