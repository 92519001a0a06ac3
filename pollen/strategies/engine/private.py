"""Central differential privacy as an engine part: clip, sum, noise, divide, and only then the optimiser.

``EngineParts(privacy=CentralPrivacy(clip=..., noise_multiplier=...))`` (run-config ``dp=central``) makes a
round's aggregate the Gaussian mechanism of DP-FedAvg (``privacy.md`` §1, §4) in place of the mean::

    u_i <- u_i * min(1, C_t / ||u_i||)          each decoded update, all trainable tensors jointly
    release = (sum_i u_i + N(0, sigma^2 I)) / n  sigma = z * s * C_t; n fixed: the round's sample size
    x, m, v, v_hat <- optimiser(x, release)      the moments, tables and model see only the release

so the server optimiser (AMSGrad for FedAMS/FedCAMS, any of FedOpt's) is post-processing of DP outputs, which
Flower's DP wrappers around an adaptive strategy are not (they noise the model after the optimiser stepped on
the noiseless mean). ``s`` is the sensitivity factor of the sampling the accountant assumes
(:meth:`~pollen.privacy.PrivacySetting.noise_stddev`): 1 for add-or-remove-one (``sampling="none"``, the
asynchronous driver), 2 for replace-one (``"without-replacement"``: pollen's sampler draws a fixed number of
clients uniformly without replacement, which ``dp-accounting`` analyses under replace-one). The denominator is
fixed (a client that drops out leaves the sum, never the denominator), so one client changes the release by at
most ``s C_t / n``.

What must hold for that sensitivity, checked before round 1 with a one-line refusal:

- the aggregate is a plain mean of client updates (not a stored-update table, whose rows re-enter every later
  release, not Flower's or a weighted mean, not a robust aggregator, not HA-Fed's gossip or the lazy family's
  stored copies: each method says why in its ``privacy_refusal``);
- the outlier screen is off (``UpdateScreen(rule="off")``; the default with DP): the screen judges each update
  against the *others'* norms, so one client would decide whether another is kept; clipping bounds every
  client's influence instead. The hard limit on a coordinate (a client's own update only) stays.

Each round's draw is checked against the accountant's assumption: with ``"without-replacement"`` the
population and sample size are pinned at the first release, and a round drawn otherwise (a node joined or
left) is not released (the round fails, the model is unchanged), so the accounting holds for every release.

**Adaptive clipping** (``adaptive=True``; Andrew et al. 2021, with the sign ``privacy.md`` §5.6 finds Flower
gets wrong): ``b~ = (sum_i (b_i - 1/2) + N(0, sigma_b^2)) / n + 1/2`` with ``b_i = 1[||u_i|| <= C_t]``, then
``C_{t+1} = C_t exp(-eta_C (b~ - gamma))``: too many unclipped updates shrink the clip, too few grow it. The
count's noise spends part of the budget, so the values get ``z_u = (z^-2 - (sigma_b / s_b)^-2)^-1/2`` with
``s_b`` the count's sensitivity (1/2 add-or-remove, 1 replace-one) and the pair together is the Gaussian
mechanism with multiplier ``z``. The noise of a release uses the clip it clipped with, ``C_t``.

**Accounting**: one release per committed server step (a skipped or rolled-back round released nothing);
epsilon at the run's delta in every results row (``method.dp_epsilon``); ``target_epsilon`` stops the run
before a step that would exceed it (:meth:`allows_release`). The state (releases, pinned draw, ``C_t``) is
checkpointed and a resumed run continues its budget exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.common import log

from pollen.core import state_fields as fields
from pollen.privacy import PrivacyAccountant, PrivacySetting
from pollen.privacy.mechanisms import clip_factor, gaussian_noise, l2_norm, noise_generator
from pollen.strategies.engine.replies import ClientUpdate, ReplyRejected
from pollen.strategies.engine.round_aggregate import MeanAggregate
from pollen.strategies.engine.screening import UpdateScreen
from pollen.strategies.engine.sinks import ScreenedSink
from pollen.wire import protocol

#: How the accountant reads the run's sampling (``"poisson"`` needs a Poisson sampler, which pollen's is not).
DP_SAMPLINGS = ("without-replacement", "none")
STATE_KIND, STATE_VERSION = "central-dp", 1


def _positive(value: Any, what: str, *, below: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{what}={value!r} is out of range; allowed: a finite number > 0")
    if below is not None and value >= below:
        raise ValueError(f"{what}={value!r} is out of range; allowed: a number in (0, {below:g})")
    return float(value)


class CentralPrivacy:
    """Central DP for a strategy whose aggregate is a mean of client updates (module docstring).

    Parameters
    ----------
    clip : float
        ``C`` (``C_0`` when adaptive): the L2 bound of each client's whole update, in update units
        (``x_local - x_global``), > 0.
    noise_multiplier : float
        ``z``: the release's noise std is ``z * s * C_t`` (``s``: the sampling's sensitivity factor), > 0.
    delta : float (default: 1e-5)
        The ``delta`` epsilon is reported at, in (0, 1).
    sampling : str (default: "without-replacement")
        What the accountant assumes: ``"without-replacement"`` (pollen's sampler: a fixed number of clients
        uniformly; amplified by ``n / N``) or ``"none"`` (no amplification: any participation, the
        asynchronous driver's).
    target_epsilon : float | None (default: None)
        Stop the run before a release would make epsilon exceed it.
    adaptive : bool (default: False)
        Quantile-based adaptive clipping.
    target_quantile, clip_lr : float (default: 0.5, 0.2)
        ``gamma`` in (0, 1) and ``eta_C`` > 0 of adaptive clipping.
    count_noise : float | None (default: None)
        ``sigma_b`` of the noised unclipped count; ``None``: the round's sample size / 20.
    seed : int | None (default: None)
        Seeds the server's noise for a reproducible simulation (predictable: never in deployment); ``None``
        draws every release's noise key from the OS's randomness.
    """

    mode = "central"

    def __init__(  # noqa: PLR0913 - the mechanism's settings
        self,
        *,
        clip: float,
        noise_multiplier: float,
        delta: float = 1e-5,
        sampling: str = "without-replacement",
        target_epsilon: float | None = None,
        adaptive: bool = False,
        target_quantile: float = 0.5,
        clip_lr: float = 0.2,
        count_noise: float | None = None,
        seed: int | None = None,
    ) -> None:
        self.clip = _positive(clip, "dp clip")
        self.noise_multiplier = _positive(noise_multiplier, "dp noise_multiplier")
        self.delta = _positive(delta, "dp delta", below=1.0)
        if sampling not in DP_SAMPLINGS:
            raise ValueError(f"dp sampling={sampling!r} is unknown; allowed: {', '.join(DP_SAMPLINGS)}")
        self.sampling = sampling
        self.target_epsilon = None if target_epsilon is None else _positive(target_epsilon, "dp target_epsilon")
        self.adaptive = bool(adaptive)
        self.target_quantile = _positive(target_quantile, "dp target_quantile", below=1.0)
        self.clip_lr = _positive(clip_lr, "dp clip_lr")
        self.count_noise = None if count_noise is None else _positive(count_noise, "dp count_noise")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise ValueError(f"dp seed={seed!r} is invalid; allowed: an integer >= 0 or None")
        self.seed = seed
        #: ``C_t``: the clip of the next release.
        self.clip_now = self.clip
        #: ``(population, sample size)`` pinned at the first release (``"without-replacement"``).
        self.draw: tuple[int, int] | None = None
        self.releases = 0
        self._accountant: PrivacyAccountant | None = None
        #: A release was refused for the target epsilon: the run stops before its next round.
        self.exhausted = False

    # ------------------------------------------------------------------ checks
    def check_fits(self, strategy: Any, round_aggregate: Any, screen: UpdateScreen) -> None:
        """``ValueError`` with the reason when ``strategy`` (with the parts it is given) cannot run with central
        DP: at construction, before round 1."""
        name = type(strategy).__name__
        if (why := getattr(strategy, "privacy_refusal", None)) is not None:
            raise ValueError(f"{name} does not take central differential privacy: {why}")
        if (why := getattr(round_aggregate, "privacy_refusal", None)) is not None:
            raise ValueError(f"{name} does not take central differential privacy: {why}")
        if type(round_aggregate) is not MeanAggregate and not isinstance(round_aggregate, PrivateMean):
            kind = type(round_aggregate).__name__
            raise ValueError(
                f"{name} does not take central differential privacy: its round aggregate ({kind}) is not a mean of "
                "the round's client updates; DP here needs every release to be a clipped sum of this round's updates"
            )
        if strategy.aggregation != "mean":
            raise ValueError(
                f"{name}: central DP needs aggregation='mean' (a weighted mean lets one client's num-examples "
                f"scale its influence beyond the clip); got aggregation={strategy.aggregation!r}"
            )
        if not strategy.aggregator.streams:
            raise ValueError(
                f"{name}: central DP needs the mean aggregator (a robust aggregator needs each update apart and is "
                f"no sum the noise can cover); got aggregator={strategy.aggregator.name!r}"
            )
        if screen.rule != "off":
            raise ValueError(
                f"{name}: central DP needs the outlier screen off (UpdateScreen(rule='off'): it judges each update "
                "against the others' norms, so one client would decide whether another is kept; the clip bounds "
                f"every client's influence instead); got rule={screen.rule!r}"
            )

    def check_layout(self, layout: Any, name: str) -> None:
        """``SetupError`` for a model with floating-point buffers (BatchNorm statistics): they are averaged
        apart from the clipped update, so no clip bounds them and no noise covers them (``privacy.md`` §13.4)."""
        from pollen.strategies.engine.rounds import SetupError  # rounds imports the parts

        floats = [spec.name for spec in layout.buffers if np.issubdtype(spec.dtype, np.floating)]
        if floats:
            raise SetupError(
                f"{name} with central DP: the model's floating-point buffers ({', '.join(floats[:3])}"
                f"{', ...' if len(floats) > 3 else ''}) are averaged outside the clipped, noised update, so the "
                "guarantee would not cover them; allowed: a model without them (GroupNorm instead of BatchNorm: "
                "run-config norm='gn')"
            )

    def train_config(self) -> dict[str, Any]:
        """What clients are asked for: clip ``p = Delta + e`` to ``C`` before compressing (so the residual keeps
        no clipped-away mass and what is sent has norm ``<= C``). Not with adaptive clipping, whose count needs
        the server to see each update's own norm: the server alone clips then."""
        if self.adaptive:
            return {}
        return {protocol.CFG_DP_MODE: "central", protocol.CFG_DP_CLIP: self.clip_now}

    def sent(self, clients: Any, stats: Any) -> None:
        """Central DP accounts releases, not uploads; with adaptive clipping, the first round's sample size tells
        whether the count's noise leaves the values any (``SetupError`` before anything is released)."""
        if self.adaptive and self.releases == 0:
            from pollen.strategies.engine.rounds import SetupError  # rounds imports the parts

            try:
                self.value_multiplier(max(len(clients), 1))
            except ValueError as err:
                raise SetupError(f"central DP with {len(clients)} clients a round: {err}") from None

    def setting(self, draw: tuple[int, int] | None) -> PrivacySetting:
        """What the accountant assumes for a release drawn as ``draw`` (population, sample size)."""
        if self.sampling == "none" or draw is None:
            return PrivacySetting(self.noise_multiplier, self.delta, "none")
        return PrivacySetting(self.noise_multiplier, self.delta, self.sampling, population=draw[0], sample_size=draw[1])

    def accountant(self) -> PrivacyAccountant:
        """The run's accountant, holding its releases so far (one per setting, kept: its RDP is computed once)."""
        setting = self.setting(self.draw)
        if self._accountant is None or self._accountant.setting != setting:
            self._accountant = PrivacyAccountant(setting)
        self._accountant.record(self.releases - self._accountant.releases)
        return self._accountant

    def epsilon(self) -> float:
        return self.accountant().epsilon() if self.releases else 0.0

    def allows_release(self, server_round: int) -> bool:
        """Whether one more release stays within ``target_epsilon`` (always without one); logs the stop."""
        if self.target_epsilon is None or (self.releases == 0 and not self.exhausted):
            return True  # the first release's draw is not known yet: release() checks it
        after = self.accountant().epsilon_after(1)
        if after <= self.target_epsilon:
            return True
        log(
            WARNING,
            "Stopping before round %d: its release would spend epsilon %.4g > dp-target-epsilon %.4g "
            "(spent %.4g at delta %g after %d releases)",
            server_round,
            after,
            self.target_epsilon,
            self.epsilon(),
            self.delta,
            self.releases,
        )
        return False

    # ------------------------------------------------------------------ one release
    def sensitivity_factor(self) -> float:
        return 2.0 if self.sampling == "without-replacement" else 1.0

    def value_multiplier(self, sample_size: int) -> float:
        """``z`` of the values: all of it, or with adaptive clipping what the noised count leaves (docstring)."""
        if not self.adaptive:
            return self.noise_multiplier
        count_z = self.count_std(sample_size) / (1.0 if self.sampling == "without-replacement" else 0.5)
        if count_z <= self.noise_multiplier:
            raise ValueError(
                f"adaptive clipping: the count's noise ({self.count_std(sample_size):g}) is too small for "
                f"noise_multiplier={self.noise_multiplier:g}; allowed: count_noise (run-config dp-count-noise) > "
                f"{self.noise_multiplier * (1.0 if self.sampling == 'without-replacement' else 0.5):g}, or a smaller "
                "noise multiplier"
            )
        return (self.noise_multiplier**-2 - count_z**-2) ** -0.5

    def count_std(self, sample_size: int) -> float:
        return self.count_noise if self.count_noise is not None else sample_size / 20.0

    def release(
        self, strategy: Any, server_round: int, total: np.ndarray, count: int, unclipped: int
    ) -> tuple[np.ndarray, Callable[[], None]]:
        """The noised mean of the round's clipped ``total`` (``count`` updates, ``unclipped`` within ``C_t``) and
        the commit that records the release (staged in the round's transaction by the caller)."""
        draw = strategy.sampler.last_draw if strategy.jobs is None else None
        if draw is None and self.sampling != "none":
            raise ValueError(
                "central DP with sampling='without-replacement' needs the sampler's uniform draw; this round has "
                "none (an asynchronous step or a sampling plan): use sampling='none'"
            )
        if self.sampling != "none" and self.draw is not None and draw != self.draw:
            raise ValueError(
                f"this round drew {draw[1]} of {draw[0]} clients but the accountant assumes {self.draw[1]} of "
                f"{self.draw[0]} (pinned at the first release); the round is not released (model unchanged)"
            )
        pinned = self.draw if self.draw is not None else draw
        if self.target_epsilon is not None:
            setting = self.setting(pinned)
            accountant = self.accountant() if setting == self.setting(self.draw) else PrivacyAccountant(setting)
            after = accountant.epsilon_after(1)
            if after > self.target_epsilon:
                self.exhausted = True  # the driver stops before the next round
                raise ValueError(
                    f"this round's release would spend epsilon {after:.4g} > dp-target-epsilon "
                    f"{self.target_epsilon:g}; it is not released (model unchanged) and the run stops"
                )
        # fixed denominators: the round's sample size, or an asynchronous step's number of buffered jobs
        sample_size = draw[1] if draw is not None else max(count, 1)
        if strategy.jobs is not None:
            sample_size = max(len(strategy.jobs.bases), 1)
        std = self.value_multiplier(sample_size) * self.sensitivity_factor() * self.clip_now
        rng = noise_generator(self.seed, server_round, self.releases)
        noised = total + gaussian_noise(total.size, std, rng)
        noised *= np.float32(1.0 / sample_size)
        new_clip = self.clip_now
        if self.adaptive:
            count_noise = float(rng.standard_normal()) * self.count_std(sample_size)
            fraction = (unclipped - 0.5 * count + count_noise) / sample_size + 0.5
            new_clip = self.clip_now * math.exp(-self.clip_lr * (fraction - self.target_quantile))
        stats = strategy.accounting.round(server_round)
        used_clip = self.clip_now

        def commit() -> None:
            self.draw = pinned if self.sampling != "none" else None
            self.releases += 1
            self.clip_now = new_clip
            stats.method.update(
                {
                    "dp_epsilon": self.epsilon(),
                    "dp_clip": used_clip,
                    "dp_noise_std": std / sample_size,
                    "dp_clipped": count - unclipped,
                }
            )
            log(
                INFO,
                "central DP: release %d, %d updates clipped to %.4g (%d clipped), noise std %.3g on the mean, "
                "epsilon %.4g at delta %g",
                self.releases,
                count,
                used_clip,
                count - unclipped,
                std / sample_size,
                stats.method["dp_epsilon"],
                self.delta,
            )

        return noised, commit

    # ------------------------------------------------------------------ state
    def describe(self) -> str:
        clip = f"adaptive from {self.clip:g} (gamma {self.target_quantile:g})" if self.adaptive else f"{self.clip:g}"
        target = "" if self.target_epsilon is None else f", stop before epsilon {self.target_epsilon:g}"
        return (
            f"central DP: clip {clip}, noise multiplier {self.noise_multiplier:g}, delta {self.delta:g}, "
            f"sampling {self.sampling}{target}"
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": STATE_KIND,
            "version": STATE_VERSION,
            "settings": self._settings(),
            "releases": self.releases,
            "clip_now": self.clip_now,
            "draw": list(self.draw) if self.draw is not None else None,
        }

    def _settings(self) -> dict[str, Any]:
        return {
            "clip": self.clip,
            "noise_multiplier": self.noise_multiplier,
            "delta": self.delta,
            "sampling": self.sampling,
            "adaptive": self.adaptive,
        }

    def prepare_load(self, state: Any, where: str = "privacy", last_round: int | None = None) -> Callable[[], None]:
        """Check a saved state against this run's settings; the commit that loads it (nothing changes before)."""
        others = ("releases", "clip_now", "draw")
        check_saved_privacy(state, where, (STATE_KIND, STATE_VERSION), self._settings(), others)
        high = fields.MAX_COUNT if last_round is None else last_round
        releases = fields.whole(state["releases"], fields.join(where, "releases"), high=high)
        clip_now = fields.finite_number(state["clip_now"], fields.join(where, "clip_now"), low=1e-300)
        draw = state["draw"]
        if draw is not None:
            pair = fields.sequence(draw, fields.join(where, "draw"), length=2)
            population = fields.whole(pair[0], fields.join(where, "draw", "0"), low=1, high=fields.MAX_COUNT)
            size = fields.whole(pair[1], fields.join(where, "draw", "1"), low=1, high=population)
            draw = (population, size)

        def commit() -> None:
            self.releases, self.clip_now, self.draw = releases, clip_now, draw

        return commit


def check_saved_privacy(
    state: Any, where: str, kind: tuple[str, int], settings: dict[str, Any], others: tuple[str, ...]
) -> None:
    """A privacy part's saved state: exactly its fields (``kind``, ``version``, ``settings`` and ``others``), of
    its kind and version, saved under this run's ``settings`` (a resumed run continues the same budget);
    ``StateError`` naming the field otherwise."""
    fields.mapping(state, where, keys=("kind", "version", "settings", *others))
    if (state["kind"], state["version"]) != kind:
        raise fields.StateError(where, f"is a {state['kind']!r} v{state['version']!r}; expected {kind[0]} v{kind[1]}")
    saved = fields.mapping(state["settings"], fields.join(where, "settings"))
    for key, value in settings.items():
        if saved.get(key) != value:
            raise fields.StateError(
                fields.join(where, "settings", key),
                f"is {saved.get(key)!r} but this run has {value!r}: a resumed run must continue the same "
                "privacy budget (start a new run to change it)",
            )


class PrivateMean(MeanAggregate):
    """The round aggregate under central DP: the noised mean of clipped updates, streamed or kept alike."""

    def __init__(self, privacy: CentralPrivacy) -> None:
        self.privacy = privacy

    def sink(self, strategy: Any, server_round: int, bound: float) -> ScreenedSink:
        return PrivateSum(strategy, server_round, strategy.screen, bound)

    def delta(self, strategy: Any, server_round: int, updates: list[ClientUpdate]) -> np.ndarray:
        running = PrivateSum(strategy, server_round, strategy.screen, float("inf"))
        for update in updates:
            if update.delta is not None:
                running.take(update)
        return running.mean()


class PrivateSum(ScreenedSink):
    """Each update clipped to ``C_t`` and summed as it is read; :meth:`mean` is the release (noised, fixed
    denominator), whose accounting is staged in the round's transaction."""

    def __init__(self, strategy: Any, server_round: int, screen: UpdateScreen, bound: float) -> None:
        super().__init__(screen, bound)
        self.strategy, self.server_round = strategy, server_round
        self.privacy: CentralPrivacy = strategy.privacy
        self.total = np.zeros(strategy.layout.dim, dtype=np.float32)
        self.count = self.unclipped = 0
        self.scratch: np.ndarray | None = None

    def take(self, update: ClientUpdate) -> None:
        """Add ``update`` clipped to ``C_t`` (:func:`~pollen.privacy.mechanisms.clip_l2`'s bits, scaled into one
        scratch vector instead of a new one per update)."""
        norm = l2_norm(update.delta)
        if not np.isfinite(norm):
            raise ReplyRejected("the update's norm is not finite; it cannot be clipped")
        factor = clip_factor(norm, self.privacy.clip_now)
        self.count += 1
        if factor is None:
            self.total += update.delta
            self.unclipped += 1
            return
        if self.scratch is None:
            self.scratch = np.empty_like(self.total)
        np.multiply(update.delta, factor, out=self.scratch)
        self.total += self.scratch
        scale = self.privacy.clip_now / norm
        update.applied_scale *= scale
        update.norm *= scale

    def mean(self) -> np.ndarray:
        release, commit = self.privacy.release(self.strategy, self.server_round, self.total, self.count, self.unclipped)
        self.strategy.transaction.stage(self.server_round, commit)
        return release


def private_screen() -> UpdateScreen:
    """The screen a strategy with central DP gets by default: hard limit only (module docstring)."""
    return UpdateScreen(rule="off")
