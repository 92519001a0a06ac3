"""Local (client-level) differential privacy: each client clips and noises its own upload; the server accounts.

``EngineParts(privacy=LocalPrivacy(clip=..., noise_multiplier=...))`` (run-config ``dp=local``) is for a
federation that does not trust its server. Every train message asks the client for ``pollen.dp.mode = local``
with the clip ``C`` and multiplier ``z``; the client's upload step (pollen's ClientApp, or ``compression_mod``
in any ClientApp) sends ``Compress(clip(Delta + e) + N(0, (zC)^2 I))`` with fresh noise for every upload and
keeps only post-processed values in its residual (:mod:`pollen.privacy.mechanisms`). Everything the server
does after that (the screen, the mean, AMSGrad, FedAdaVR's table) is post-processing. A SuperNode operator
holds the server to a floor of their own with node-config ``dp-min-noise-multiplier`` / ``dp-max-clip``: a
train message asking for less is refused by the node.

**What is accounted**: one client's upload on its own is the Gaussian mechanism on ``clip(p)``, whose value
can change by up to ``2C`` when the client's data change (two vectors in the ball of radius ``C``), so each
upload has noise multiplier ``z / 2`` against that sensitivity. A client's epsilon composes its uploads without
amplification (the server sees who answered): the part counts the train messages each client was sent (an
upload refused later still left the client) and reports the largest epsilon of any client at the run's
``delta`` (``method.dp_epsilon``), and how many uploads that client made (``method.dp_uploads_max``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from pollen.core import state_fields as fields
from pollen.privacy import PrivacyAccountant, PrivacySetting
from pollen.wire import protocol

STATE_KIND, STATE_VERSION = "local-dp", 1


class LocalPrivacy:
    """Client-level DP (module docstring).

    Parameters
    ----------
    clip : float
        ``C``, the L2 bound of each client's whole upload (of ``Delta + e``), > 0.
    noise_multiplier : float
        ``z``: every coordinate of an upload gets ``N(0, (zC)^2)``, > 0.
    delta : float (default: 1e-5)
        The ``delta`` each client's epsilon is reported at, in (0, 1).
    seed : int | None (default: None)
        Seeds the clients' noise for a reproducible simulation (anyone who knows it can remove the noise: never
        in deployment); ``None``: each upload's noise key comes from the client's OS.
    """

    mode = "local"

    def __init__(self, *, clip: float, noise_multiplier: float, delta: float = 1e-5, seed: int | None = None) -> None:
        from pollen.strategies.engine.private import _positive

        self.clip = _positive(clip, "dp clip")
        self.noise_multiplier = _positive(noise_multiplier, "dp noise_multiplier")
        self.delta = _positive(delta, "dp delta", below=1.0)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise ValueError(f"dp seed={seed!r} is invalid; allowed: an integer >= 0 or None")
        self.seed = seed
        #: Train messages sent to each client (by client key): its uploads, as far as privacy is concerned.
        self.uploads: dict[str, int] = {}
        self._epsilon_of: dict[int, float] = {}
        self._accountant: PrivacyAccountant | None = None

    def check_fits(self, strategy: Any, round_aggregate: Any, screen: Any) -> None:
        """``ValueError`` when ``strategy``'s clients send something the local mechanism does not cover."""
        if (why := getattr(strategy, "privacy_refusal", None)) is not None:
            raise ValueError(f"{type(strategy).__name__} does not take local differential privacy: {why}")

    def check_layout(self, layout: Any, name: str) -> None:
        """Nothing to refuse here: a client with buffers refuses the message itself (they would leave un-noised)."""

    def train_config(self) -> dict[str, Any]:
        config: dict[str, Any] = {
            protocol.CFG_DP_MODE: "local",
            protocol.CFG_DP_CLIP: self.clip,
            protocol.CFG_DP_NOISE: self.noise_multiplier,
        }
        if self.seed is not None:
            config[protocol.CFG_DP_SEED] = self.seed
        return config

    def sent(self, clients: Iterable[str], stats: Any) -> None:
        """Count one upload for each client sent a train message (this round's ``stats`` get the epsilon columns)."""
        for client in clients:
            self.uploads[client] = self.uploads.get(client, 0) + 1
        self.report(stats)

    def setting(self) -> PrivacySetting:
        """One upload against a client's own data: sensitivity ``2C``, so multiplier ``z / 2``; no amplification."""
        return PrivacySetting(self.noise_multiplier / 2.0, self.delta, "none")

    def epsilon_of(self, uploads: int) -> float:
        """Epsilon of a client after ``uploads`` uploads (cached per count)."""
        if uploads == 0:
            return 0.0
        if uploads not in self._epsilon_of:
            if self._accountant is None:
                self._accountant = PrivacyAccountant(self.setting())
            self._epsilon_of[uploads] = self._accountant.epsilon_after(uploads)
        return self._epsilon_of[uploads]

    def report(self, stats: Any) -> None:
        """The round's results columns: the largest client epsilon so far and that client's uploads."""
        most = max(self.uploads.values(), default=0)
        stats.method.update({"dp_epsilon": self.epsilon_of(most), "dp_uploads_max": most})

    def allows_release(self, server_round: int) -> bool:
        return True

    def describe(self) -> str:
        seeded = "" if self.seed is None else f", noise seeded {self.seed} (simulation only)"
        return (
            f"local DP (each client clips to {self.clip:g} and adds noise of multiplier {self.noise_multiplier:g}), "
            f"delta {self.delta:g}{seeded}"
        )

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": STATE_KIND,
            "version": STATE_VERSION,
            "settings": self._settings(),
            "uploads": dict(sorted(self.uploads.items())),
        }

    def _settings(self) -> dict[str, Any]:
        return {"clip": self.clip, "noise_multiplier": self.noise_multiplier, "delta": self.delta}

    def prepare_load(self, state: Any, where: str = "privacy", last_round: int | None = None) -> Callable[[], None]:
        from pollen.strategies.engine.private import check_saved_privacy

        check_saved_privacy(state, where, (STATE_KIND, STATE_VERSION), self._settings(), ("uploads",))
        high = fields.MAX_COUNT if last_round is None else last_round
        saved_uploads = fields.mapping(state["uploads"], fields.join(where, "uploads"))
        uploads = {
            fields.text(client, fields.join(where, "uploads"), most=4096): fields.whole(
                count, fields.join(where, "uploads", client), high=high
            )
            for client, count in saved_uploads.items()
        }

        def commit() -> None:
            self.uploads = uploads

        return commit
