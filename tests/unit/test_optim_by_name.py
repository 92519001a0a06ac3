"""A server optimiser by name (pollen.optim.by_name): what each name takes, in the one spelling, and how a
setting it has no use for is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from pollen.optim import (
    BY_NAME,
    SERVER_OPTIMIZERS,
    adam,
    make_server_optimizer,
    refuse_unused,
    settings_of,
)

STRATEGIES = Path(__file__).resolve().parents[2] / "pollen" / "strategies"


def test_every_registered_name_is_offered_in_the_order_defined() -> None:
    assert SERVER_OPTIMIZERS == tuple(BY_NAME)
    assert SERVER_OPTIMIZERS == ("sgd", "adam", "yogi", "adagrad", "adabelief", "lamb", "amsgrad", "adpfed_adam")


def test_what_a_name_takes_is_its_aliases_keyword_settings() -> None:
    assert settings_of("sgd") == ("eta", "momentum")
    assert settings_of("adam") == ("eta", "beta_1", "beta_2", "eps", "bias_correction")
    assert settings_of("amsgrad") == (
        "eta",
        "beta_1",
        "beta_2",
        "eps",
        "eps_mode",
        "bias_correction",
        "max_stabilisation",
    )
    assert "segments" in settings_of("lamb") and "layerwise" in settings_of("lamb")


def test_the_moment_decays_have_flowers_spelling_everywhere() -> None:
    """``beta_1`` / ``beta_2`` as Flower's FedAdam; no optimiser takes another spelling of them (or ``tau``)."""
    taken = {setting for name in SERVER_OPTIMIZERS for setting in settings_of(name)}
    assert {"eta", "beta_1", "beta_2", "eps"} <= taken
    assert not {"beta1", "beta2", "tau", "lr"} & taken


def test_an_unknown_name_is_refused_with_the_allowed_names() -> None:
    with pytest.raises(ValueError) as err:
        settings_of("rmsprop")
    assert str(err.value) == f"server optimizer 'rmsprop' is unknown; allowed: {', '.join(SERVER_OPTIMIZERS)}"


def test_a_setting_the_optimiser_has_no_use_for_is_refused_with_its_name_and_the_allowed_ones() -> None:
    with pytest.raises(ValueError) as err:
        make_server_optimizer("sgd", eta=1.0, beta_1=0.9)
    assert str(err.value) == "sgd takes no setting beta_1=0.9; allowed: eta, momentum"
    with pytest.raises(ValueError, match="adam takes no setting beta1=0.9; allowed: eta, beta_1, beta_2, eps"):
        make_server_optimizer("adam", beta1=0.9)


def test_the_allowed_list_names_only_what_the_caller_offers() -> None:
    """A strategy that lets a user set ``eta`` and the moments never lists sgd's ``momentum`` as allowed."""
    offered = ("eta", "beta_1", "beta_2", "eps")
    with pytest.raises(ValueError) as err:
        refuse_unused("sgd", {"eta": 1.0, "beta_2": 0.99}, offered=offered)
    assert str(err.value) == "sgd takes no setting beta_2=0.99; allowed: eta"
    refuse_unused("adam", {"eta": 0.1, "beta_1": 0.5}, offered=offered)  # all taken: no error


def test_built_by_name_is_the_alias_with_the_same_settings() -> None:
    settings = dict(eta=0.01, beta_1=0.8, beta_2=0.95, eps=1e-6, bias_correction=True)
    built = make_server_optimizer("adam", **settings)
    assert built.name == "adam"
    assert built.hyperparameters() == adam(**settings).hyperparameters()
    assert list(built.hyperparameters())[:5] == list(settings_of("adam"))


def test_no_strategy_asks_an_optimisers_signature_or_spells_its_settings_itself() -> None:
    """One place resolves a name's settings (pollen.optim.by_name): the strategies only ask it."""
    for path in STRATEGIES.rglob("*.py"):
        text = path.read_text()
        assert "BY_NAME" not in text, path
        for old in ("beta1=", "beta2=", '"beta1"', '"beta2"'):
            assert old not in text, (path, old)
