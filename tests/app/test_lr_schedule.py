"""The local learning-rate schedule (run-config ``lr-schedule``): factors per round, the client's rate, bad input."""

from __future__ import annotations

import pytest

from pollen.app.config import AppConfig, ConfigError, defaults_from_pyproject
from pollen.optim.schedule import local_lr, lr_factor, parse_decay_rounds

pytestmark = pytest.mark.flower_compat


def test_step_decay_divides_by_ten_at_30_and_70():
    factors = {r: lr_factor("step", (30, 70), 0.1, r) for r in (1, 29, 30, 69, 70, 100)}
    assert factors == pytest.approx({1: 1.0, 29: 1.0, 30: 0.1, 69: 0.1, 70: 0.01, 100: 0.01})
    assert lr_factor("constant", (30, 70), 0.1, 100) == 1.0


def test_local_lr_follows_the_run_config():
    cfg = {
        **defaults_from_pyproject("pyproject.toml"),
        "local-lr": 0.5,
        "lr-schedule": "step",
        "lr-decay-rounds": "3",
        "lr-decay-factor": 0.5,
    }
    assert [local_lr(cfg, r) for r in (1, 2, 3, 4)] == [0.5, 0.5, 0.25, 0.25]


def test_the_client_scales_the_messages_base_rate():
    from flwr.app import ConfigRecord

    from pollen.clientside.steps import LocalWork

    settings = {
        **defaults_from_pyproject("pyproject.toml"),
        "local-lr": 1.0,
        "lr-schedule": "step",
        "lr-decay-rounds": "2,4",
    }

    def work(server_round: int, config: dict) -> LocalWork:
        return LocalWork(
            task=None,
            msg=None,
            config=ConfigRecord(config),
            state=None,
            server_round=server_round,
            seed=0,
            settings=settings,
        )

    assert work(1, {"local-lr": 0.2}).setting("local-lr") == pytest.approx(0.2)
    assert work(3, {"local-lr": 0.2}).setting("local-lr") == pytest.approx(0.02)
    assert work(5, {}).setting("local-lr") == pytest.approx(0.01)
    assert work(5, {"momentum": 0.5}).setting("momentum") == 0.5


@pytest.mark.parametrize("text", ["30,x", "70,30", "30,30", "1", "-5"])
def test_bad_decay_rounds_are_refused_with_what_is_allowed(text):
    with pytest.raises(ValueError, match="lr-decay-rounds"):
        parse_decay_rounds(text)
    cfg = {**defaults_from_pyproject("pyproject.toml"), "lr-schedule": "step", "lr-decay-rounds": text}
    with pytest.raises(ConfigError, match="strictly increasing"):
        AppConfig.from_run_config(cfg, check_strategy=False)


def test_step_without_rounds_and_bad_factor_are_refused():
    base = defaults_from_pyproject("pyproject.toml")
    with pytest.raises(ConfigError, match="needs 'lr-decay-rounds'"):
        AppConfig.from_run_config({**base, "lr-schedule": "step"}, check_strategy=False)
    with pytest.raises(ConfigError, match=r"lr-decay-factor.*\(0, 1\]"):
        AppConfig.from_run_config({**base, "lr-decay-factor": 0.0}, check_strategy=False)
    with pytest.raises(ConfigError, match="lr-schedule"):
        AppConfig.from_run_config({**base, "lr-schedule": "cosine"}, check_strategy=False)


def test_fedadavr_reads_its_table_in_the_scheduled_clients_rate():
    from pollen.strategies import FedAdaVR

    strategy = FedAdaVR(client_lr=0.1, client_lr_factor=lambda r: 0.5 ** (r - 1))
    assert [strategy.client_lr_at(r) for r in (1, 2, 3)] == pytest.approx([0.1, 0.05, 0.025])
    assert FedAdaVR(client_lr=0.1).client_lr_at(9) == pytest.approx(0.1)
