"""How much privacy a run has spent: Rényi-DP accounting of its noised server steps (``privacy.md`` §2, §12-13).

A *release* is one noised server step: the clipped sum of the round's (or the flush's) updates plus Gaussian
noise, handed to the optimiser; everything the server keeps after it (moments, tables, the model) is
post-processing and costs nothing more. :class:`PrivacyAccountant` counts releases and turns the count into
the ``epsilon`` spent at the run's ``delta``, with Google's ``dp-accounting`` RDP accountant (the optional
extra ``pollen[dp]``; it is imported when an accountant is built, never when this module is).

The amplification the accountant credits depends on how the clients of a release were chosen, so the
sampling it assumes must be the one the run does (§13.2):

- ``"poisson"``: every client takes part independently with probability ``q = sample_size / population``
  (``sample_size`` is the expected number per release); ``PoissonSampledDpEvent`` under add/remove-one;
- ``"without-replacement"``: exactly ``sample_size`` of ``population`` clients, uniformly;
  ``SampledWithoutReplacementDpEvent``, which is only analysed under replace-one;
- ``"none"``: no amplification (every client in every release, or participation set by availability or
  speed, as in the buffered asynchronous driver, §7); plain ``GaussianDpEvent`` composition.

Accounting a run as Poisson-sampled when it samples a fixed number of clients, or as sampled at all when
clients take part when they are free, reports an ``epsilon`` the run does not have.

The accountant keeps no composed state: ``epsilon`` is recomputed from the release count, as one
``compose(event, count)`` on a fresh ``RdpAccountant`` would (one release's RDP vector, scaled by the count).
So a resumed run (:meth:`PrivacyAccountant.state_dict` holds the setting and the count) continues with the
very same ``epsilon``, bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from numbers import Integral, Real
from typing import Any

from pollen.core import state_fields as checks
from pollen.core.state_fields import StateError

__all__ = ["SAMPLINGS", "PrivacyAccountant", "PrivacySetting"]

#: How the clients of a release are chosen (see the module's docstring).
SAMPLINGS = ("poisson", "without-replacement", "none")

#: The ``kind`` and ``version`` of :meth:`PrivacyAccountant.state_dict`.
STATE_KIND = "rdp-accountant"
STATE_VERSION = 1

_MISSING = (
    "pollen's privacy accountant needs Google's dp-accounting library (module 'dp_accounting'), which is not "
    'installed; install pollen\'s dp extra: pip install "flwr-pollen[dp]" (or pip install "dp-accounting>=0.6,<0.7")'
)
_CACHED = 16  # epsilons kept per accountant: a run asks for the same few counts again and again


def _dp_accounting() -> tuple[Any, Any]:
    """``dp_accounting`` and its ``rdp`` module, imported on first need (an ``ImportError`` saying how to get them)."""
    try:
        import dp_accounting
        from dp_accounting import rdp
    except ImportError as error:
        raise ImportError(_MISSING, name="dp_accounting") from error
    return dp_accounting, rdp


def _whole(value: Any) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


def _invalid(name: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"privacy setting {name}={value!r} is invalid; allowed: {allowed}")


@dataclass(frozen=True)
class PrivacySetting:
    """What the accountant needs to know of a run's mechanism and its client sampling; checked on construction.

    Parameters
    ----------
    noise_multiplier : float
        The standard deviation of one release's Gaussian noise over the L2 sensitivity of the released sum
        under the setting's neighbouring relation (``dp-accounting``'s convention); finite and ``> 0``. See
        :meth:`noise_stddev` for the noise a mechanism must add for this to hold.
    delta : float
        The ``delta`` at which ``epsilon`` is reported, in ``(0, 1)``; ``privacy.md`` §14 recommends
        ``1 / population**1.1`` or at most ``1e-5``.
    sampling : str
        One of :data:`SAMPLINGS`: how the clients of a release are chosen.
    population : int | None (default: None)
        The number of clients that can be chosen (``"poisson"``, ``"without-replacement"``); none for ``"none"``.
    sample_size : int | None (default: None)
        The clients per release, ``1 <= sample_size <= population``: the expected number for ``"poisson"``, the
        exact number for ``"without-replacement"``; none for ``"none"``.

    Sizes given with ``sampling="none"`` are refused rather than ignored: a run that samples but is accounted
    without amplification, or the other way round, should fail where it is configured, not report a budget
    it does not have.
    """

    noise_multiplier: float
    delta: float
    sampling: str
    population: int | None = None
    sample_size: int | None = None

    def __post_init__(self) -> None:
        z, delta = self.noise_multiplier, self.delta
        if not _number(z) or not math.isfinite(z) or z <= 0:
            raise _invalid("noise_multiplier", z, "a finite number > 0")
        if not _number(delta) or not 0 < delta < 1:
            raise _invalid("delta", delta, "a number in (0, 1), exclusive")
        if not isinstance(self.sampling, str) or self.sampling not in SAMPLINGS:
            raise _invalid("sampling", self.sampling, ", ".join(map(repr, SAMPLINGS)))
        # Plain Python numbers, so that the saved setting is JSON and compares exactly with a resumed run's.
        object.__setattr__(self, "noise_multiplier", float(z))
        object.__setattr__(self, "delta", float(delta))
        if self.sampling == "none":
            for name in ("population", "sample_size"):
                if getattr(self, name) is not None:
                    raise _invalid(
                        name, getattr(self, name), "None with sampling='none' (no amplification: no sizes apply)"
                    )
            return
        population, sample_size = self.population, self.sample_size
        if not _whole(population) or population < 1:
            raise _invalid("population", population, f"an integer >= 1 with sampling={self.sampling!r}")
        if not _whole(sample_size) or not 1 <= sample_size <= population:
            what = "expected clients per release" if self.sampling == "poisson" else "clients per release"
            raise _invalid(
                "sample_size",
                sample_size,
                f"an integer in [1, population={population}] ({what}) with sampling={self.sampling!r}",
            )
        object.__setattr__(self, "population", int(population))
        object.__setattr__(self, "sample_size", int(sample_size))

    @property
    def sampling_probability(self) -> float:
        """The chance that one client takes part in a release: ``sample_size / population``; ``1.0`` for ``"none"``."""
        if self.sampling == "none":
            return 1.0
        return self.sample_size / self.population  # type: ignore[operator]

    @property
    def sensitivity_factor(self) -> float:
        """The L2 sensitivity of a sum of updates clipped to norm ``C``, in units of ``C``, under the setting's
        neighbouring relation: ``1`` for add/remove-one (one client's update comes or goes), ``2`` for
        replace-one (one client's update is swapped for another: ``||u - v|| <= 2C``)."""
        return 2.0 if self.sampling == "without-replacement" else 1.0

    def noise_stddev(self, clip_norm: float) -> float:
        """The standard deviation of the Gaussian noise one release must add to the sum of updates each clipped
        to ``clip_norm`` for this accounting to hold: ``noise_multiplier * sensitivity_factor * clip_norm``.

        With ``"without-replacement"`` this is twice what the same ``noise_multiplier`` means with the other
        samplings: ``dp-accounting`` analyses that sampling under replace-one, where the sum's sensitivity is
        ``2C``."""
        if not _number(clip_norm) or not math.isfinite(clip_norm) or clip_norm <= 0:
            raise ValueError(f"clip norm {clip_norm!r} is invalid; allowed: a finite number > 0")
        return self.noise_multiplier * self.sensitivity_factor * float(clip_norm)

    def neighboring_relation(self) -> Any:
        """The ``dp_accounting.NeighboringRelation`` the setting's sampling is analysed under.

        ``ADD_OR_REMOVE_ONE`` for ``"poisson"`` and ``"none"``; ``REPLACE_ONE`` for ``"without-replacement"``,
        the only relation ``dp-accounting`` analyses a fixed-size sample under (the analysis takes the population
        as public, so a neighbouring federation swaps one client's data rather than gaining or losing a client;
        a clipped sum's sensitivity is then ``2C``, see :meth:`noise_stddev`). The two relations are not
        interchangeable: the sampling the accountant assumes must be the one the run does (``privacy.md`` §2,
        §13.2). Needs ``dp-accounting``.
        """
        dp_accounting, _ = _dp_accounting()
        relation = dp_accounting.NeighboringRelation
        return relation.REPLACE_ONE if self.sampling == "without-replacement" else relation.ADD_OR_REMOVE_ONE

    def event(self) -> Any:
        """The ``dp_accounting`` event of ONE release under this setting. Needs ``dp-accounting``."""
        dp_accounting, _ = _dp_accounting()
        gaussian = dp_accounting.GaussianDpEvent(noise_multiplier=self.noise_multiplier)
        if self.sampling == "poisson":
            return dp_accounting.PoissonSampledDpEvent(sampling_probability=self.sampling_probability, event=gaussian)
        if self.sampling == "without-replacement":
            return dp_accounting.SampledWithoutReplacementDpEvent(
                source_dataset_size=self.population, sample_size=self.sample_size, event=gaussian
            )
        return gaussian

    def as_dict(self) -> dict[str, Any]:
        """The setting's fields as a JSON-able dict (what :meth:`PrivacyAccountant.state_dict` saves)."""
        return asdict(self)


def _same(saved: Any, current: Any) -> bool:
    """Whether a saved setting field is exactly the current one (a bool or a str is never a number here)."""
    if current is None or isinstance(current, str):
        return saved is None if current is None else isinstance(saved, str) and saved == current
    return _number(saved) and saved == current


def _count(value: Any, name: str) -> int:
    if not _whole(value) or value < 0:
        raise ValueError(f"{name}={value!r} is invalid; allowed: an integer >= 0")
    return int(value)


class PrivacyAccountant:
    """The ``epsilon`` a run has spent after its releases so far, at its setting's ``delta``.

    Parameters
    ----------
    setting : PrivacySetting
        The run's mechanism and sampling; fixed for the accountant's life (and checked again on resume).
    orders : Sequence[float] | None (default: None)
        The Rényi orders to optimise ``epsilon`` over, each ``> 1``; ``None``: ``dp-accounting``'s default
        orders. They change how tight the reported bound is, not what was spent, so they are not part of the
        saved state; a resumed run that should report the same ``epsilon`` uses the same orders.

    Raises
    ------
    ImportError
        When ``dp-accounting`` is not installed (``pip install "flwr-pollen[dp]"``).

    Examples
    --------
    >>> setting = PrivacySetting(1.0, 1e-5, "poisson", population=1000, sample_size=10)  # doctest: +SKIP
    >>> accountant = PrivacyAccountant(setting)                                           # doctest: +SKIP
    >>> if not accountant.would_exceed(8.0):                                              # doctest: +SKIP
    ...     accountant.record()  # after the noised server step was applied
    """

    def __init__(self, setting: PrivacySetting, *, orders: Sequence[float] | None = None) -> None:
        if not isinstance(setting, PrivacySetting):
            raise TypeError(f"setting is {type(setting).__name__}; expected a PrivacySetting")
        if orders is not None:
            if isinstance(orders, (str, bytes)) or not isinstance(orders, Sequence) or not orders:
                raise ValueError(f"orders={orders!r} is invalid; allowed: a non-empty sequence of numbers > 1")
            for order in orders:
                if not _number(order) or not order > 1:  # NaN fails too
                    raise ValueError(f"RDP order {order!r} is invalid; allowed: a number > 1")
            orders = tuple(float(order) for order in orders)
        _, self._rdp = _dp_accounting()
        self.setting = setting
        self.orders: tuple[float, ...] | None = orders
        self._event = setting.event()
        self._relation = setting.neighboring_relation()
        if not self._fresh().supports(self._event):  # cannot happen with SAMPLINGS; a guard against a new one
            raise ValueError(f"dp-accounting's RDP accountant cannot account sampling={setting.sampling!r}")
        self._releases = 0
        self._epsilons: dict[int, float] = {}
        self._per_release: Any = None  # one release's RDP vector (computed once), False: not available

    @property
    def releases(self) -> int:
        """The releases recorded (noised server steps applied) so far."""
        return self._releases

    def record(self, releases: int = 1) -> None:
        """Count ``releases`` more noised server steps; call it once a step was applied (committed), not before."""
        self._releases += _count(releases, "releases")

    def epsilon(self) -> float:
        """The ``epsilon`` spent so far at the setting's ``delta`` (``0.0`` before any release)."""
        return self._epsilon_of(self._releases)

    def epsilon_after(self, releases: int) -> float:
        """The ``epsilon`` the run would have spent after ``releases`` more releases; the accountant is unchanged.

        What a driver asks *before* a step, to stop a run before its target ``epsilon`` is exceeded rather than
        after."""
        return self._epsilon_of(self._releases + _count(releases, "releases"))

    def would_exceed(self, target_epsilon: float, releases: int = 1) -> bool:
        """Whether ``releases`` more releases would take the run past ``target_epsilon`` (``> 0``; may be ``inf``)."""
        if not _number(target_epsilon) or not target_epsilon > 0:
            raise ValueError(f"target epsilon {target_epsilon!r} is invalid; allowed: a number > 0")
        return self.epsilon_after(releases) > target_epsilon

    def state_dict(self) -> dict[str, Any]:
        """``{"kind", "version", "setting", "releases"}``: JSON, all a resumed run needs to continue the budget."""
        return {
            "kind": STATE_KIND,
            "version": STATE_VERSION,
            "setting": self.setting.as_dict(),
            "releases": self._releases,
        }

    def load_state_dict(self, state: Any, *, where: str = "privacy") -> None:
        """Continue from :meth:`state_dict`'s form, all or nothing; the saved setting must be this accountant's.

        A resumed run must continue the same privacy budget, so a checkpoint saved under another noise
        multiplier, ``delta``, sampling or size is refused (start a new run to change them). Raises
        :class:`~pollen.core.state_fields.StateError` (a ``ValueError``) naming the field that does not fit."""
        state = checks.mapping(state, where, keys=("kind", "version", "setting", "releases"))
        checks.text(state["kind"], checks.join(where, "kind"), allowed=(STATE_KIND,))
        version = checks.whole(state["version"], checks.join(where, "version"))
        if version != STATE_VERSION:
            raise StateError(
                checks.join(where, "version"), f"is {version}; expected {STATE_VERSION} (the only version pollen reads)"
            )
        self._check_setting(state["setting"], checks.join(where, "setting"))
        releases = checks.whole(state["releases"], checks.join(where, "releases"))
        self._releases = releases  # the replay: epsilon is recomputed from the count

    @classmethod
    def from_state(
        cls, state: Any, setting: PrivacySetting, *, orders: Sequence[float] | None = None, where: str = "privacy"
    ) -> PrivacyAccountant:
        """An accountant for ``setting`` that continues from ``state`` (:meth:`load_state_dict`'s checks)."""
        accountant = cls(setting, orders=orders)
        accountant.load_state_dict(state, where=where)
        return accountant

    def _check_setting(self, saved: Any, where: str) -> None:
        names = [field.name for field in fields(PrivacySetting)]
        saved = checks.mapping(saved, where, keys=names)
        current = self.setting.as_dict()
        for name in names:
            value = saved[name]
            if not _same(value, current[name]):
                raise StateError(
                    checks.join(where, name),
                    f"holds {value!r} but this run's privacy setting has {name}={current[name]!r}: the privacy "
                    "setting changed since the checkpoint, and a resumed run must continue the same privacy budget "
                    "(start a new run to change it)",
                )

    def _fresh(self) -> Any:
        return self._rdp.RdpAccountant(orders=self.orders, neighboring_relation=self._relation)

    def _composed_epsilon(self, releases: int) -> float:
        """``compose(event, releases)`` on a fresh accountant, then its epsilon. The RDP of ``releases`` identical
        events is ``releases`` times one event's (the library computes ``0 + count * rdp(event)``), so the
        vector of one release is computed once (the costly part: 0.2 s for a sampling without replacement)
        and scaled, which gives the same bits; a library without that vector composes afresh."""
        if self._per_release is None:
            one = self._fresh()
            one.compose(self._event, 1)
            self._per_release = getattr(one, "_rdp", False)
        compute = getattr(getattr(self._rdp, "rdp_privacy_accountant", None), "compute_epsilon", None)
        if self._per_release is False or compute is None:
            accountant = self._fresh()
            accountant.compose(self._event, releases)
            return float(accountant.get_epsilon(self.setting.delta))
        orders = self._fresh()._orders  # the orders the library uses (its defaults when ours are None)
        return float(compute(orders, 0 + releases * self._per_release, self.setting.delta)[0])

    def _epsilon_of(self, releases: int) -> float:
        if releases == 0:
            return 0.0  # dp-accounting refuses count=0; nothing released, nothing spent
        epsilon = self._epsilons.get(releases)
        if epsilon is None:
            epsilon = self._composed_epsilon(releases)
            if len(self._epsilons) >= _CACHED:
                del self._epsilons[next(iter(self._epsilons))]
            self._epsilons[releases] = epsilon
        return epsilon
