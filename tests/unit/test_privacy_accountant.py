"""The privacy accountant (issue 39): its epsilon is dp-accounting's own and the spec's (``privacy.md`` §12.7),
it grows with the releases, it can be asked ahead without changing, and a resumed run continues the very same
budget, or is refused when its privacy setting changed."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

dp_accounting = pytest.importorskip("dp_accounting")
from dp_accounting import rdp  # noqa: E402

from pollen.core.state_fields import StateError  # noqa: E402
from pollen.privacy import SAMPLINGS, PrivacyAccountant, PrivacySetting  # noqa: E402

NR = dp_accounting.NeighboringRelation
POISSON = PrivacySetting(1.0, 1e-5, "poisson", population=1000, sample_size=10)  # q = 0.01
WOR = PrivacySetting(1.0, 1e-4, "without-replacement", population=100, sample_size=10)
NONE = PrivacySetting(1.0, 1e-5, "none")


def _library_epsilon(event, relation, count: int, delta: float) -> float:
    """Epsilon straight from dp-accounting, as its own documentation composes it."""
    accountant = rdp.RdpAccountant(neighboring_relation=relation)
    accountant.compose(event, count)
    return accountant.get_epsilon(delta)


def _gaussian(z: float):
    return dp_accounting.GaussianDpEvent(noise_multiplier=z)


# (setting, releases, the same accounting written directly with dp-accounting, the spec's value, its decimals)
SPEC_CASES = [
    pytest.param(
        POISSON,
        1000,
        (dp_accounting.PoissonSampledDpEvent(0.01, _gaussian(1.0)), NR.ADD_OR_REMOVE_ONE),
        2.101,
        3,
        id="poisson-q0.01-z1-T1000",
    ),
    pytest.param(
        PrivacySetting(2.0, 1e-4, "poisson", population=100, sample_size=10),
        200,
        (dp_accounting.PoissonSampledDpEvent(0.1, _gaussian(2.0)), NR.ADD_OR_REMOVE_ONE),
        3.197,
        3,
        id="poisson-q0.1-z2-T200",
    ),
    pytest.param(
        WOR,
        200,
        (dp_accounting.SampledWithoutReplacementDpEvent(100, 10, _gaussian(1.0)), NR.REPLACE_ONE),
        18.41,
        2,
        id="wor-N100-n10-z1-T200",
    ),
    pytest.param(NONE, 100, (_gaussian(1.0), NR.ADD_OR_REMOVE_ONE), 96.12, 2, id="none-z1-T100"),
]


@pytest.mark.parametrize(("setting", "releases", "library", "spec", "decimals"), SPEC_CASES)
def test_epsilon_is_dp_accountings_and_the_specs(setting, releases, library, spec, decimals):
    accountant = PrivacyAccountant(setting)
    accountant.record(releases)
    epsilon = accountant.epsilon()
    event, relation = library
    assert epsilon == _library_epsilon(event, relation, releases, setting.delta)
    assert round(epsilon, decimals) == spec


def test_event_and_relation_follow_the_sampling():
    assert POISSON.sampling_probability == 0.01
    assert POISSON.event() == dp_accounting.PoissonSampledDpEvent(0.01, _gaussian(1.0))
    assert POISSON.neighboring_relation() is NR.ADD_OR_REMOVE_ONE
    assert WOR.sampling_probability == 0.1
    assert WOR.event() == dp_accounting.SampledWithoutReplacementDpEvent(100, 10, _gaussian(1.0))
    assert WOR.neighboring_relation() is NR.REPLACE_ONE
    assert NONE.sampling_probability == 1.0
    assert NONE.event() == _gaussian(1.0)
    assert NONE.neighboring_relation() is NR.ADD_OR_REMOVE_ONE
    # The noise a mechanism must add for the accounting to hold: replace-one doubles a clipped sum's sensitivity.
    assert POISSON.noise_stddev(0.1) == NONE.noise_stddev(0.1) == pytest.approx(0.1)
    assert WOR.noise_stddev(0.1) == pytest.approx(0.2)


def test_epsilon_starts_at_zero_and_grows_with_every_release():
    accountant = PrivacyAccountant(POISSON)
    assert accountant.releases == 0 and accountant.epsilon() == 0.0
    epsilons = []
    for _ in range(8):
        accountant.record()
        epsilons.append(accountant.epsilon())
    assert accountant.releases == 8
    assert epsilons[0] > 0 and all(later > earlier for earlier, later in zip(epsilons, epsilons[1:]))
    accountant.record(0)  # nothing released, nothing spent
    assert accountant.epsilon() == epsilons[-1]


def test_asking_ahead_changes_nothing_and_would_exceed_is_epsilon_after():
    accountant = PrivacyAccountant(NONE)
    accountant.record(5)
    before = accountant.epsilon()
    ahead = accountant.epsilon_after(3)
    assert accountant.releases == 5 and accountant.epsilon() == before
    assert accountant.epsilon_after(0) == before
    other = PrivacyAccountant(NONE)
    other.record(8)
    assert ahead == other.epsilon() > before
    for target in (before, (before + ahead) / 2, ahead, ahead * 1.01, float("inf")):
        assert accountant.would_exceed(target, 3) is (ahead > target)
    assert accountant.would_exceed(accountant.epsilon_after(1) - 1e-9) is True  # the default: one more release
    assert accountant.would_exceed(accountant.epsilon_after(1)) is False  # reaching the target is allowed
    assert accountant.releases == 5
    for target in (0, -1.0, float("nan"), True, "8"):
        with pytest.raises(ValueError, match="target epsilon"):
            accountant.would_exceed(target)


@pytest.mark.parametrize("count", [-1, True, 1.0, "2"])
def test_a_count_of_releases_is_a_whole_number(count):
    accountant = PrivacyAccountant(NONE)
    with pytest.raises(ValueError, match=r"releases=.*allowed: an integer >= 0"):
        accountant.record(count)
    with pytest.raises(ValueError, match=r"releases=.*allowed: an integer >= 0"):
        accountant.epsilon_after(count)
    assert accountant.releases == 0


@pytest.mark.parametrize("setting", [POISSON, NONE], ids=["poisson", "none"])
def test_a_resumed_accountant_continues_the_same_epsilon_bit_for_bit(setting):
    uninterrupted = PrivacyAccountant(setting)
    uninterrupted.record(50)
    first = PrivacyAccountant(setting)
    for _ in range(37):
        first.record()
    saved = json.loads(json.dumps(first.state_dict()))  # what a checkpoint file holds
    assert saved == {"kind": "rdp-accountant", "version": 1, "setting": setting.as_dict(), "releases": 37}
    resumed = PrivacyAccountant.from_state(saved, setting)
    assert resumed.releases == 37 and resumed.epsilon() == first.epsilon()
    resumed.record(13)
    assert resumed.releases == 50
    assert resumed.epsilon() == uninterrupted.epsilon()  # exactly, not approximately
    again = PrivacyAccountant(setting)
    again.load_state_dict(resumed.state_dict())
    assert again.epsilon() == uninterrupted.epsilon()


@pytest.mark.parametrize(
    ("changed", "field"),
    [
        (replace(POISSON, noise_multiplier=1.1), "noise_multiplier"),
        (replace(POISSON, delta=1e-6), "delta"),
        (replace(POISSON, sampling="without-replacement"), "sampling"),
        (replace(POISSON, population=2000), "population"),
        (replace(POISSON, sample_size=20), "sample_size"),
        (NONE, "sampling"),  # the same z and delta: the sampling is the first field that differs
    ],
    ids=["noise_multiplier", "delta", "sampling", "population", "sample_size", "poisson-to-none"],
)
def test_a_changed_privacy_setting_is_refused_on_resume(changed, field):
    saved = PrivacyAccountant(POISSON)
    saved.record(37)
    accountant = PrivacyAccountant(changed)
    accountant.record(2)
    with pytest.raises(StateError, match=rf"'privacy/setting/{field}'.*privacy setting changed since the checkpoint"):
        accountant.load_state_dict(saved.state_dict())
    assert accountant.releases == 2  # nothing changed


def _state(**changes):
    state = {"kind": "rdp-accountant", "version": 1, "setting": POISSON.as_dict(), "releases": 3}
    for key, value in changes.items():
        if value is KeyError:
            del state[key]
        else:
            state[key] = value
    return state


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ([], r"'privacy' is .*expected a mapping"),
        (_state(kind="pld-accountant"), r"'privacy/kind' is 'pld-accountant'; expected one of 'rdp-accountant'"),
        (_state(version=2), r"'privacy/version' is 2; expected 1"),
        (_state(version="1"), r"'privacy/version' is .*expected an integer"),
        (_state(releases=-1), r"'privacy/releases' is -1; expected an integer in \[0,"),
        (_state(releases=True), r"'privacy/releases' is .*bool.*expected an integer"),
        (_state(releases=3.0), r"'privacy/releases' is .*float.*expected an integer"),
        (_state(releases=KeyError), r"'privacy/releases' is missing"),
        (_state(setting=KeyError), r"'privacy/setting' is missing"),
        (_state(extra=1), r"'privacy/extra' is not a field"),
        (_state(setting={**POISSON.as_dict(), "sampling": "none"}), r"'privacy/setting/sampling' holds 'none'"),
        (
            _state(setting={k: v for k, v in POISSON.as_dict().items() if k != "delta"}),
            r"'privacy/setting/delta' is missing",
        ),
        (_state(setting={**POISSON.as_dict(), "population": True}), r"'privacy/setting/population' holds True"),
        (_state(setting={**POISSON.as_dict(), "noise_multiplier": "1.0"}), r"'privacy/setting/noise_multiplier'"),
    ],
    ids=[
        "not-a-mapping",
        "kind",
        "version",
        "version-str",
        "negative",
        "bool",
        "float",
        "no-releases",
        "no-setting",
        "extra-key",
        "setting-sampling",
        "setting-missing-field",
        "setting-bool",
        "setting-str",
    ],
)
def test_a_bad_state_is_refused_with_the_field_named(state, message):
    accountant = PrivacyAccountant(POISSON)
    accountant.record(2)
    with pytest.raises(StateError, match=message):
        accountant.load_state_dict(state)
    assert accountant.releases == 2  # all or nothing
    assert isinstance(StateError("x", "y"), ValueError)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"noise_multiplier": 0.0}, r"noise_multiplier=0.0 is invalid; allowed: a finite number > 0"),
        ({"noise_multiplier": float("inf")}, r"noise_multiplier=inf is invalid; allowed: a finite number > 0"),
        ({"noise_multiplier": True}, r"noise_multiplier=True is invalid"),
        ({"delta": 0.0}, r"delta=0.0 is invalid; allowed: a number in \(0, 1\)"),
        ({"delta": 1.0}, r"delta=1.0 is invalid; allowed: a number in \(0, 1\)"),
        ({"delta": float("nan")}, r"delta=nan is invalid"),
        ({"sampling": "uniform"}, r"sampling='uniform' is invalid; allowed: 'poisson', 'without-replacement', 'none'"),
        ({"population": None}, r"population=None is invalid; allowed: an integer >= 1 with sampling='poisson'"),
        ({"population": 0}, r"population=0 is invalid; allowed: an integer >= 1"),
        ({"population": 10.0}, r"population=10.0 is invalid; allowed: an integer >= 1"),
        ({"sample_size": None}, r"sample_size=None is invalid; allowed: an integer in \[1, population=1000\]"),
        ({"sample_size": 0}, r"sample_size=0 is invalid; allowed: an integer in \[1, population=1000\] \(expected"),
        ({"sample_size": 1001}, r"sample_size=1001 is invalid; allowed: an integer in \[1, population=1000\]"),
        ({"sampling": "none"}, r"population=1000 is invalid; allowed: None with sampling='none'"),
        ({"sampling": "none", "population": None}, r"sample_size=10 is invalid; allowed: None with sampling='none'"),
        ({"sampling": "without-replacement", "sample_size": 2000}, r"sample_size=2000 is invalid.*\(clients per"),
    ],
)
def test_an_invalid_setting_names_the_field_and_what_is_allowed(kwargs, message):
    fields = {**POISSON.as_dict(), **kwargs}
    with pytest.raises(ValueError, match=message):
        PrivacySetting(**fields)


def test_a_setting_holds_plain_numbers():
    setting = PrivacySetting(1, 1e-5, "poisson", population=1000, sample_size=10)
    assert type(setting.noise_multiplier) is float and setting == POISSON
    assert SAMPLINGS == ("poisson", "without-replacement", "none")
    with pytest.raises(ValueError, match="clip norm"):
        POISSON.noise_stddev(0.0)


def test_orders_are_checked_and_used():
    orders = [2.0, 4.0, 8.0, 16.0, 32.0]
    accountant = PrivacyAccountant(POISSON, orders=orders)
    accountant.record(100)
    reference = rdp.RdpAccountant(orders=orders)
    reference.compose(POISSON.event(), 100)
    assert accountant.epsilon() == reference.get_epsilon(POISSON.delta)
    for bad in ([], [1.0], [float("nan")], "2.0"):
        with pytest.raises(ValueError, match="order"):
            PrivacyAccountant(POISSON, orders=bad)


def test_without_dp_accounting_building_an_accountant_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "dp_accounting", None)
    monkeypatch.setitem(sys.modules, "dp_accounting.rdp", None)
    PrivacySetting(1.0, 1e-5, "none")  # a setting needs no library
    with pytest.raises(ImportError, match=r"dp-accounting.*pip install \"flwr-pollen\[dp\]\"") as caught:
        PrivacyAccountant(NONE)
    assert "dp-accounting>=0.6,<0.7" in str(caught.value)


def test_importing_the_package_does_not_import_dp_accounting():
    code = "import sys, pollen.privacy; assert 'dp_accounting' not in sys.modules, 'dp_accounting was imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
