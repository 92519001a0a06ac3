"""Central differential privacy as an engine part (issue 39; ``privacy.md`` §1, §3-5, §7, §12-13).

``EngineParts(privacy=CentralPrivacy(...))`` makes a round's aggregate the Gaussian mechanism of DP-FedAvg:
each decoded update clipped jointly to ``C_t``, summed, ``N(0, (z s C_t)^2)`` added once, divided by the fixed
sample size, and only then the server optimiser. Checked on a fake grid whose clients return
``x_start + Delta(node, round)`` with a known ``Delta``:

- the optimiser receives exactly ``(sum_i clip(u_i) + noise) / n`` (recomputed here from the replies and the
  seeded noise stream, ``s = 2`` for replace-one, ``1`` without amplification), its first moment is
  ``(1 - beta_1)`` times that release, and the streamed and the kept round give the same bits;
- the noise std on the mean is ``z s C / n`` (§12.4: 0.01 within 0.5 % over 10^6 coordinates);
- clipping bounds each contribution and is recorded; adaptive clipping moves ``C`` the right way (§5.6, §12.6)
  and noises each release with the clip it clipped with (§5.7);
- epsilon is the accountant's after the releases, a skipped or failed round releases nothing, a resumed run
  continues the same budget, ``target_epsilon`` stops the run before a release would exceed it;
- what cannot take central DP is refused with its reason before round 1 (or at the first round for a model
  with float buffers); a population change fails the round unreleased;
- clients are asked to clip (not with adaptive clipping); the asynchronous driver releases once per step;
- the run-config keys (``dp``, ``dp-delta``, ...) are validated and build the part.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from flwr.app import ConfigRecord

pytest.importorskip("dp_accounting")

from pollen.app.config import AppConfig, ConfigError, defaults_from_pyproject  # noqa: E402
from pollen.app.experiment import build_strategy  # noqa: E402
from pollen.app.methods.common import privacy_of  # noqa: E402
from pollen.privacy import PrivacyAccountant, PrivacySetting  # noqa: E402
from pollen.privacy.mechanisms import clip_l2, gaussian_noise, l2_norm, noise_generator  # noqa: E402
from pollen.strategies import FedAdaVR, FedAMS, FedLAMB, FedLazy, HAFed  # noqa: E402
from pollen.strategies.engine.accounting import Accounting  # noqa: E402
from pollen.strategies.engine.buffered import AsyncRule, BufferedAsync  # noqa: E402
from pollen.strategies.engine.parts import ClientSampler, EngineParts, RoundTransaction, UpdateScreen  # noqa: E402
from pollen.strategies.engine.private import CentralPrivacy, PrivateMean, PrivateSum  # noqa: E402
from pollen.strategies.engine.rounds import SetupError  # noqa: E402
from pollen.testing.fakes import (  # noqa: E402
    TRAINABLE,
    FakeGrid,
    capture_flwr_logs,
    config_of,
    full_model_reply,
    global_arrays_of,
    messages_text,
    model_record,
    named_arrays,
    run_train_round,
    split_trainable,
    tiny_model,
)
from pollen.wire import protocol  # noqa: E402

pytestmark = pytest.mark.flower_compat

ROOT = Path(__file__).resolve().parents[2]
D = 19  # tiny_model's trainable values
NODES = 10
DELTA = 1e-5
SEED = 5


# --------------------------------------------------------------------------- a model, clients, strategies
def dp_model() -> OrderedDict[str, np.ndarray]:
    """tiny_model without its buffers: central DP refuses float buffers (they would be averaged un-noised)."""
    model = tiny_model()
    del model["bn.running_mean"], model["bn.num_batches_tracked"]
    return model


def flat32(arrays: dict[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([np.asarray(arrays[name], dtype=np.float32).reshape(-1) for name in TRAINABLE])


def delta_of(node: int, rnd: int, scale: float = 0.3) -> np.ndarray:
    """A client's update: norms around ``scale * sqrt(19)`` (about 1.3 for the default), some above the clip."""
    return (np.random.default_rng([node, rnd]).standard_normal(D) * scale).astype(np.float32)


def unit_delta(node: int, rnd: int) -> np.ndarray:
    """An update of norm 1 (float64 normalised, then float32)."""
    v = np.random.default_rng([node, rnd]).standard_normal(D)
    return (v / np.linalg.norm(v)).astype(np.float32)


def client_with(delta: Any = delta_of, silent: Any = None) -> Any:
    """A client returning ``x_start + delta(node, round)``; ``silent(node, round)`` True: it never answers."""

    def client(msg):  # noqa: ANN001, ANN202
        node, rnd = msg.metadata.dst_node_id, int(config_of(msg)[protocol.CFG_SERVER_ROUND])
        if silent is not None and silent(node, rnd):
            return None
        start = global_arrays_of(msg)
        local = dict(start)
        for name, part in split_trainable(delta(node, rnd), start, TRAINABLE).items():
            local[name] = (start[name] + part).astype(start[name].dtype)
        return full_model_reply(msg, local)

    return client


class Spy(FedAMS):
    """FedAMS that keeps the delta its server optimiser receives each round."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.deltas: dict[int, np.ndarray] = {}

    def apply_server_step(self, server_round: int, delta: np.ndarray) -> None:
        self.deltas[server_round] = np.array(delta, copy=True)
        super().apply_server_step(server_round, delta)


class KeptSpy(Spy):
    """The same, keeping each round's updates apart (``PrivateMean.delta``) instead of streaming them."""

    streaming = False


class FailingStep(Spy):
    """A server step that fails in the rounds named (after the release was computed and staged)."""

    fail_in: tuple[int, ...] = ()

    def apply_server_step(self, server_round: int, delta: np.ndarray) -> None:
        if server_round in self.fail_in:
            raise FloatingPointError("injected failure")
        super().apply_server_step(server_round, delta)


def build(
    privacy: Any,
    *,
    cls: type = Spy,
    n: int = 5,
    min_replies: int = 1,
    driver: Any = None,
    screen: Any = None,
    **kwargs: Any,
) -> Any:
    parts = EngineParts(
        sampler=ClientSampler(seed=3),
        transaction=RoundTransaction(min_replies=min_replies),
        privacy=privacy,
        **({"driver": driver} if driver is not None else {}),
        **({"screen": screen} if screen is not None else {}),
    )
    return cls(
        fraction_train=n / NODES,
        min_train_nodes=n,
        fraction_evaluate=0.0,
        min_evaluate_nodes=0,
        min_available_nodes=n,
        parts=parts,
        **kwargs,
    )


def central(**kwargs: Any) -> CentralPrivacy:
    settings = {"clip": 1.0, "noise_multiplier": 1.0, "seed": SEED, **kwargs}
    return CentralPrivacy(**settings)


def rounds(strategy: Any, grid: FakeGrid, first: int, last: int, arrays: Any) -> tuple[Any, dict[int, list]]:
    """Rounds ``first..last`` as ``Strategy.start`` runs them; the arrays after and each round's replies."""
    replies = {}
    for rnd in range(first, last + 1):
        arrays, _, replies[rnd] = run_train_round(strategy, grid, rnd, arrays)
    return arrays, replies


def column(strategy: Any, name: str) -> list[Any]:
    return [strategy.accounting.rounds[r].method.get(name) for r in sorted(strategy.accounting.rounds)]


def epsilon_after(releases: int, z: float = 1.0, sampling: str = "none", draw: tuple[int, int] | None = None) -> float:
    sizes = {} if draw is None else {"population": draw[0], "sample_size": draw[1]}
    accountant = PrivacyAccountant(PrivacySetting(z, DELTA, sampling, **sizes))
    accountant.record(releases)
    return accountant.epsilon()


def stub_strategy(draw: tuple[int, int] | None) -> SimpleNamespace:
    """What ``CentralPrivacy.release`` reads of a strategy: the sampler's last draw, the async jobs, the stats."""
    return SimpleNamespace(sampler=SimpleNamespace(last_draw=draw), jobs=None, accounting=Accounting())


# --------------------------------------------------------------------------- 1. noise before the optimiser
@pytest.mark.parametrize(("sampling", "factor"), [("without-replacement", 2.0), ("none", 1.0)])
def test_the_optimiser_receives_the_noised_mean_of_clipped_updates_and_its_moments_see_only_it(
    sampling: str, factor: float
) -> None:
    """§4: release = (sum_i clip_C(u_i) + N(0, (z s C)^2)) / n, recomputed here from the replies and the seeded
    noise stream (key: seed, round, release index); FedAMS's m after round 1 is (1 - beta_1) x release."""
    clip, z, n, beta_1, beta_2 = 1.5, 1.0, 5, 0.9, 0.99
    strategy = build(central(clip=clip, sampling=sampling), n=n, beta_1=beta_1, beta_2=beta_2)
    grid = FakeGrid(range(1, NODES + 1), client_with())
    start = model_record(dp_model())
    arrays, replies = rounds(strategy, grid, 1, 1, start)
    x0 = flat32(named_arrays(start))
    updates = [flat32(named_arrays(r.content.array_records[protocol.ARRAYS_RECORD])) - x0 for r in replies[1]]
    assert len(updates) == n

    total = np.zeros(D, dtype=np.float32)
    for u in updates:  # in the order the replies were read (the grid's order)
        total += clip_l2(u, clip)[0]
    noised = total + gaussian_noise(D, z * factor * clip, noise_generator(SEED, 1, 0))
    noised *= np.float32(1.0 / n)
    release = strategy.deltas[1]
    assert release.tobytes() == noised.tobytes()

    # the same in float64, without the product's clip: sum_i u_i min(1, C/||u_i||) + z s C g, over n
    g = noise_generator(SEED, 1, 0).standard_normal(D, dtype=np.float32).astype(np.float64)
    clipped64 = [u.astype(np.float64) * min(1.0, clip / np.linalg.norm(u.astype(np.float64))) for u in updates]
    expected = (np.sum(clipped64, axis=0) + z * factor * clip * g) / n
    np.testing.assert_allclose(release, expected, rtol=1e-5, atol=1e-6)
    clipped = sum(np.linalg.norm(u.astype(np.float64)) > clip for u in updates)
    assert 0 < clipped < n  # the draw has updates on both sides of the clip
    assert column(strategy, "dp_clipped") == [clipped]
    assert column(strategy, "dp_noise_std") == [pytest.approx(z * factor * clip / n)]

    # AMSGrad from zero moments: m = (1 - beta_1) release, v = (1 - beta_2) release^2; never the clean mean
    slots = strategy.opt_state.slots
    np.testing.assert_allclose(slots["m"], (1 - beta_1) * release.astype(np.float64), rtol=1e-6, atol=0)
    np.testing.assert_allclose(slots["v"], (1 - beta_2) * release.astype(np.float64) ** 2, rtol=1e-5, atol=0)
    clean = np.sum(clipped64, axis=0) / n
    assert np.max(np.abs(slots["m"] - (1 - beta_1) * clean)) > 1e-3
    assert flat32(named_arrays(arrays)).tobytes() != x0.tobytes()


@pytest.mark.parametrize("sampling", ["without-replacement", "none"])
def test_a_streamed_and_a_kept_round_release_the_same_bits(sampling: str) -> None:
    """The streamed sink (``PrivateSum`` as replies are read) and the kept path (``PrivateMean.delta`` over the
    round's updates) clip, sum and noise the same way: the same releases and models over three rounds."""
    streamed, kept = build(central(sampling=sampling)), build(central(sampling=sampling), cls=KeptSpy)
    assert isinstance(streamed.round_aggregate, PrivateMean) and isinstance(kept.round_aggregate, PrivateMean)
    out = []
    for strategy in (streamed, kept):
        arrays, _ = rounds(strategy, FakeGrid(range(1, NODES + 1), client_with()), 1, 3, model_record(dp_model()))
        out.append(arrays)
    for rnd in (1, 2, 3):
        assert streamed.deltas[rnd].tobytes() == kept.deltas[rnd].tobytes(), rnd
    assert flat32(named_arrays(out[0])).tobytes() == flat32(named_arrays(out[1])).tobytes()
    assert streamed.privacy.releases == kept.privacy.releases == 3
    assert column(streamed, "dp_epsilon") == column(kept, "dp_epsilon")


def test_each_release_draws_fresh_noise() -> None:
    """Two rounds with the same updates get different noise (the key holds the round and the release index)."""
    strategy = build(central(sampling="none", clip=10.0), n=NODES)
    same = client_with(lambda node, rnd: delta_of(node, 1))
    rounds(strategy, FakeGrid(range(1, NODES + 1), same), 1, 2, model_record(dp_model()))
    assert strategy.deltas[1].tobytes() != strategy.deltas[2].tobytes()


# --------------------------------------------------------------------------- 2. noise std (§12.4)
@pytest.mark.parametrize(
    ("sampling", "draw", "std"), [("none", (10, 10), 0.01), ("without-replacement", (100, 10), 0.02)]
)
def test_the_noise_std_on_the_mean_is_z_s_c_over_n(sampling: str, draw: tuple[int, int], std: float) -> None:
    """§12.4: z = 1, C = 0.1, n = 10 -> std of (release - clean mean) = 0.01 within 0.5 % over 10^6 coordinates
    (0.02 with replace-one's sensitivity factor 2)."""
    privacy = central(clip=0.1, noise_multiplier=1.0, sampling=sampling, seed=11)
    strategy = stub_strategy(draw)
    total = np.random.default_rng(0).uniform(-1.0, 1.0, 1_000_000).astype(np.float32)
    release, commit = privacy.release(strategy, 1, total, count=10, unclipped=10)
    noise = release.astype(np.float64) - total.astype(np.float64) / 10
    assert abs(float(np.std(noise)) / std - 1) < 0.005
    assert abs(float(np.mean(noise))) < 5 * std / 1000
    assert privacy.releases == 0  # nothing recorded before the round commits
    commit()
    assert privacy.releases == 1
    assert strategy.accounting.round(1).method["dp_noise_std"] == pytest.approx(std, rel=1e-12)
    assert strategy.accounting.round(1).method["dp_clip"] == 0.1


# --------------------------------------------------------------------------- 3. clipping
def test_an_update_above_the_clip_contributes_at_most_the_clip_and_is_recorded(monkeypatch) -> None:  # noqa: ANN001
    """An update of norm 5 with C = 1 enters the sum with norm <= 1 (and within 1e-6 of it); its ClientUpdate's
    applied_scale and norm record the clip; method.dp_clipped counts it; the others (norm 0.5) pass unchanged."""
    clipped_out: list[tuple[float, np.ndarray]] = []  # (the update's norm, what it added to the sum)
    taken: list[Any] = []
    real_take = PrivateSum.take

    def spy_take(self: PrivateSum, update: Any) -> None:
        norm, before = l2_norm(update.delta), self.total.astype(np.float64)
        real_take(self, update)
        clipped_out.append((norm, self.total.astype(np.float64) - before))
        taken.append(update)

    monkeypatch.setattr(PrivateSum, "take", spy_take)

    def delta(node: int, rnd: int) -> np.ndarray:
        return unit_delta(node, rnd) * np.float32(5.0 if node == 1 else 0.5)

    strategy = build(central(sampling="none"), n=NODES)
    rounds(strategy, FakeGrid(range(1, NODES + 1), client_with(delta)), 1, 1, model_record(dp_model()))
    assert len(clipped_out) == len(taken) == NODES
    for norm, out in clipped_out:  # what was added, read back through float32 sums: within their rounding
        assert l2_norm(out) <= 1.0 + 1e-5
        if norm > 1.0:
            assert norm == pytest.approx(5.0, rel=1e-6) and l2_norm(out) >= 1.0 - 1e-5
        else:
            assert l2_norm(out) == pytest.approx(0.5, rel=1e-5)
    big = [u for u in taken if u.node_id == 1]
    assert len(big) == 1 and big[0].applied_scale == pytest.approx(0.2, rel=1e-6)
    assert big[0].norm == pytest.approx(1.0, rel=1e-6)
    assert all(u.applied_scale == 1.0 for u in taken if u.node_id != 1)
    assert column(strategy, "dp_clipped") == [1]


# --------------------------------------------------------------------------- 4. adaptive clipping (§3, §12.6)
def adaptive_run(num_rounds: int, **kwargs: Any) -> Any:
    settings = {
        "clip": 0.1,
        "noise_multiplier": 1e-4,
        "sampling": "none",
        "adaptive": True,
        "target_quantile": 0.5,
        "clip_lr": 0.2,
        "count_noise": 1e-3,
        "seed": 1,
        **kwargs,
    }
    strategy = build(CentralPrivacy(**settings), n=NODES)
    grid = FakeGrid(range(1, NODES + 1), client_with(unit_delta), keep_history=False)
    strategy.start(grid=grid, initial_arrays=model_record(dp_model()), num_rounds=num_rounds)
    return strategy


def test_adaptive_clipping_grows_the_clip_to_the_median_norm_and_oscillates_around_it() -> None:
    """§12.6: all norms 1, C_0 = 0.1, eta_C = 0.2, gamma = 0.5, (almost) no count noise: C grows x e^0.1 per
    release (the correct sign; Flower's shrinks it), first reaches C >= 1 after 24 releases (0.1 e^2.4 = 1.102;
    after 23: 0.997) and then alternates around 1. Each release's noise uses C_t, the clip it clipped with."""
    strategy = adaptive_run(34)
    clips = column(strategy, "dp_clip")
    assert len(clips) == 34 and clips[0] == 0.1
    for t in range(24):
        assert clips[t + 1] / clips[t] == pytest.approx(math.exp(0.1), rel=1e-3), t
    assert clips[23] == pytest.approx(0.1 * math.exp(2.3), rel=1e-3) and clips[23] < 1.0
    assert clips[24] == pytest.approx(0.1 * math.exp(2.4), rel=1e-3) and clips[24] >= 1.0
    assert min(t for t, c in enumerate(clips) if c >= 1.0) == 24
    tail = clips[24:]
    assert all(0.99 < c < 1.11 for c in tail)
    assert [c >= 1.0 for c in tail] == [t % 2 == 0 for t in range(len(tail))]  # above, below, above, ...
    assert column(strategy, "dp_clipped") == [10 if c < 1.0 else 0 for c in clips]
    # the values' multiplier leaves room for the count's noise: z_u = (z^-2 - (sigma_b / 0.5)^-2)^-1/2
    z_u = (1e-4**-2 - (1e-3 / 0.5) ** -2) ** -0.5
    for clip, std in zip(clips, column(strategy, "dp_noise_std"), strict=True):
        assert std == pytest.approx(z_u * clip / NODES, rel=1e-12)
    assert strategy.privacy.clip_now == pytest.approx(clips[-1] * math.exp(0.1 if clips[-1] < 1 else -0.1), rel=1e-3)


def test_adaptive_clipping_asks_clients_for_no_clip_and_fixed_clipping_does() -> None:
    """§9: without adaptive clipping each train message asks for pollen.dp.mode = central and pollen.dp.clip = C
    (clients clip Delta + e before compressing); with it, neither (the server must see each norm to count)."""
    for privacy, expected in (
        (central(clip=0.7), {protocol.CFG_DP_MODE: "central", protocol.CFG_DP_CLIP: 0.7}),
        (central(clip=0.7, adaptive=True, count_noise=5.0), {}),
    ):
        strategy = build(privacy)
        grid = FakeGrid(range(1, NODES + 1), client_with())
        messages = list(strategy.configure_train(1, model_record(dp_model()), ConfigRecord(), grid))
        assert len(messages) == 5
        for message in messages:
            config = config_of(message)
            got = {key: config[key] for key in (protocol.CFG_DP_MODE, protocol.CFG_DP_CLIP) if key in config}
            assert got == expected


def test_a_count_noise_too_small_for_the_noise_multiplier_is_refused_with_its_reason() -> None:
    """The count's noise must leave the values a real multiplier (sigma_b / s_b > z): else the run stops at its
    first round, before any message is sent, with the numbers."""
    with pytest.raises(SetupError) as refused:
        adaptive_run(2, count_noise=1e-5)
    text = str(refused.value)
    assert text.startswith("central DP with 10 clients a round: adaptive clipping: the count's noise (1e-05)")
    assert "too small for noise_multiplier=0.0001" in text
    assert "allowed: count_noise (run-config dp-count-noise) > 5e-05" in text


# --------------------------------------------------------------------------- 5. accounting
@pytest.mark.parametrize("sampling", ["without-replacement", "none"])
def test_epsilon_is_the_accountants_after_the_releases(sampling: str) -> None:
    """method.dp_epsilon after T rounds = PrivacyAccountant(z, delta, sampling, N, n) after T releases, exactly
    (replace-one with the pinned draw 5 of 10, or no amplification)."""
    strategy = build(central(sampling=sampling, noise_multiplier=1.3, delta=DELTA))
    rounds(strategy, FakeGrid(range(1, NODES + 1), client_with()), 1, 3, model_record(dp_model()))
    draw = (NODES, 5) if sampling != "none" else None
    assert column(strategy, "dp_epsilon") == [epsilon_after(t, 1.3, sampling, draw) for t in (1, 2, 3)]
    assert strategy.privacy.releases == 3 and strategy.privacy.draw == draw
    assert strategy.privacy.epsilon() == epsilon_after(3, 1.3, sampling, draw)
    if sampling != "none":  # amplification by sampling 5 of 10 (replace-one) beats no amplification here
        assert epsilon_after(3, 1.3, sampling, draw) < epsilon_after(3, 1.3)


def test_a_skipped_or_failed_round_releases_nothing() -> None:
    """Round 2 has fewer replies than min_replies (skipped), round 3's server step fails after its release was
    staged (rolled back): neither records a release, neither moves the model; round 4 is the second release."""
    # 5 sampled, min_replies 5: one silent client skips the round
    strategy = build(central(sampling="none"), cls=FailingStep, min_replies=5, n=5)
    strategy.fail_in = (3,)
    grid = FakeGrid(range(1, NODES + 1), client_with(silent=lambda node, rnd: rnd == 2 and node % 2 == 0))
    arrays = model_record(dp_model())
    arrays, _ = rounds(strategy, grid, 1, 1, arrays)
    after_one = strategy.params.copy()
    eps_one = strategy.privacy.epsilon()
    for rnd in (2, 3):
        arrays, _ = rounds(strategy, grid, rnd, rnd, arrays)
        assert strategy.privacy.releases == 1 and strategy.privacy.epsilon() == eps_one, rnd
        assert strategy.params.tobytes() == after_one.tobytes(), rnd
        assert "dp_epsilon" not in strategy.accounting.rounds[rnd].method, rnd
    assert strategy.accounting.rounds[2].replies < 5
    assert any("injected failure" in why for why in strategy.accounting.rounds[3].failure_reasons)
    rounds(strategy, grid, 4, 4, arrays)
    assert strategy.privacy.releases == 2
    assert column(strategy, "dp_epsilon") == [epsilon_after(1), None, None, epsilon_after(2)]


# --------------------------------------------------------------------------- 6. resume
def resumed_run(sampling: str) -> None:
    privacy = {"sampling": sampling, "noise_multiplier": 1.1}
    whole = build(central(**privacy))
    grid = FakeGrid(range(1, NODES + 1), client_with())
    end, _ = rounds(whole, grid, 1, 5, model_record(dp_model()))

    first = build(central(**privacy))
    middle, _ = rounds(first, FakeGrid(range(1, NODES + 1), client_with()), 1, 3, model_record(dp_model()))
    state = first.state_dict()
    assert state["privacy"]["releases"] == 3
    second = build(central(**privacy))
    second.load_state_dict(state, server_round=3)
    assert (second.privacy.releases, second.privacy.draw) == (3, first.privacy.draw)
    resumed_end, _ = rounds(second, FakeGrid(range(1, NODES + 1), client_with()), 4, 5, middle)
    assert flat32(named_arrays(resumed_end)).tobytes() == flat32(named_arrays(end)).tobytes()
    assert second.privacy.releases == whole.privacy.releases == 5
    assert second.privacy.epsilon() == whole.privacy.epsilon()
    assert column(second, "dp_epsilon")[-2:] == column(whole, "dp_epsilon")[-2:]


def test_a_resumed_run_continues_the_same_budget_and_model_without_amplification() -> None:
    resumed_run("none")


def test_a_resumed_run_continues_the_same_budget_and_model_with_a_pinned_draw() -> None:
    """The saved draw (population, sample size) is checked on load; today that check raises TypeError."""
    resumed_run("without-replacement")


def three_rounds_state(**privacy: Any) -> dict[str, Any]:
    strategy = build(central(**privacy))
    rounds(strategy, FakeGrid(range(1, NODES + 1), client_with()), 1, 3, model_record(dp_model()))
    return strategy.state_dict()


@pytest.mark.parametrize(
    ("field", "changed"),
    [("clip", 2.0), ("noise_multiplier", 2.0), ("delta", 1e-6), ("sampling", "without-replacement")],
)
def test_a_changed_privacy_setting_is_refused_on_resume_naming_it(field: str, changed: Any) -> None:
    state = three_rounds_state(sampling="none")
    other = build(central(**{"sampling": "none", field: changed}))
    with pytest.raises(ValueError, match=rf"privacy/settings/{field}.*a resumed run must continue the same privacy"):
        other.load_state_dict(state, server_round=3)
    assert other.privacy.releases == 0


def test_a_state_with_privacy_needs_a_strategy_with_privacy_and_the_other_way_round() -> None:
    private_state = three_rounds_state(sampling="none")
    with pytest.raises(ValueError, match=r"strategy/privacy' is not a field of Spy's state"):
        build(None).load_state_dict(private_state, server_round=3)
    plain = build(None)
    rounds(plain, FakeGrid(range(1, NODES + 1), client_with()), 1, 1, model_record(dp_model()))
    private = build(central(sampling="none"))
    with pytest.raises(ValueError, match=r"strategy/privacy' is missing"):
        private.load_state_dict(plain.state_dict(), server_round=1)
    assert private.privacy.releases == 0 and private.params is None


# --------------------------------------------------------------------------- 7. target epsilon
def test_target_epsilon_stops_the_run_before_the_release_that_would_exceed_it() -> None:
    eps = [epsilon_after(t) for t in range(1, 8)]
    target = (eps[4] + eps[5]) / 2  # five releases fit, the sixth would not
    strategy = build(central(sampling="none", target_epsilon=target))
    grid = FakeGrid(range(1, NODES + 1), client_with())
    with capture_flwr_logs() as records:
        result = strategy.start(grid=grid, initial_arrays=model_record(dp_model()), num_rounds=20)
    assert sorted(strategy.accounting.rounds) == [1, 2, 3, 4, 5]
    assert len(grid.train_messages()) == 5 * 5  # round 6 sent nothing
    last = column(strategy, "dp_epsilon")[-1]
    assert last == eps[4] <= target
    assert strategy.privacy.accountant().epsilon_after(1) == eps[5] > target
    text = messages_text(records)
    assert "Stopping before round 6: its release would spend epsilon" in text and "dp-target-epsilon" in text
    assert flat32({k: a.numpy() for k, a in result.arrays.items()}).tobytes() == strategy.params.tobytes()


def test_a_target_below_one_release_releases_nothing() -> None:
    """The first release is a release too: when its epsilon alone exceeds the target it is not made (the round
    fails unreleased, the model unchanged) and the run stops before its next round."""
    assert epsilon_after(1) > 0.5
    strategy = build(central(sampling="none", target_epsilon=0.5))
    grid = FakeGrid(range(1, NODES + 1), client_with())
    strategy.start(grid=grid, initial_arrays=model_record(dp_model()), num_rounds=4)
    assert strategy.privacy.releases == 0 and strategy.privacy.epsilon() <= 0.5


# --------------------------------------------------------------------------- 8. refusals
@pytest.mark.parametrize(
    ("make", "kwargs", "reason"),
    [
        (HAFed, {}, r"^HAFed does not take central differential privacy: its clusters gossip models"),
        (FedLAMB, {}, r"^FedLAMB does not take central differential privacy: its clients share their Adam/LAMB"),
        (FedLazy, {}, r"^FedLazy does not take central differential privacy: the server keeps each client's last"),
        (FedAdaVR, {}, r"^FedAdaVR does not take central differential privacy: its stored-update table puts each"),
        (
            FedAMS,
            {"aggregation": "weighted"},
            r"^FedAMS: central DP needs aggregation='mean'.*got aggregation='weighted'",
        ),
        (FedAMS, {"aggregator": "median"}, r"^FedAMS: central DP needs the mean aggregator.*got aggregator='median'"),
        (
            FedAMS,
            {"parts_screen": UpdateScreen(rule="reject")},
            r"^FedAMS: central DP needs the outlier screen off.*got rule='reject'",
        ),
    ],
    ids=["hafed", "fedlamb", "fedlazy", "fedadavr", "weighted", "median", "reject-screen"],
)
def test_what_cannot_take_central_dp_is_refused_with_its_reason(make: type, kwargs: dict, reason: str) -> None:
    kwargs = dict(kwargs)
    screen = kwargs.pop("parts_screen", None)
    privacy = central()
    with pytest.raises(ValueError, match=reason) as refused:
        make(parts=EngineParts(privacy=privacy, **({"screen": screen} if screen is not None else {})), **kwargs)
    assert "\n" not in str(refused.value)
    assert privacy.releases == 0


def test_the_default_screen_with_central_dp_is_off_and_the_aggregate_is_the_private_mean() -> None:
    strategy = FedAMS(parts=EngineParts(privacy=central()))
    assert strategy.screen.rule == "off"
    assert isinstance(strategy.round_aggregate, PrivateMean) and strategy.round_aggregate.privacy is strategy.privacy
    assert FedAMS().screen.rule == "clip"  # without DP the default screen stays


def test_a_model_with_float_buffers_is_refused_at_the_first_round() -> None:
    strategy = build(central())
    grid = FakeGrid(range(1, NODES + 1), client_with())
    with pytest.raises(SetupError, match=r"floating-point buffers \(bn\.running_mean\).*norm='gn'"):
        strategy.configure_train(1, model_record(tiny_model()), ConfigRecord(), grid)
    assert grid.sent == []


def test_a_population_change_fails_the_round_unreleased() -> None:
    """The draw (10 clients, 5 sampled) is pinned at the first release; a node joining makes round 2 a draw of
    5 of 11, which the accountant does not cover: the round fails, the model stays, the reason is counted."""
    strategy = build(central(sampling="without-replacement"))
    grid = FakeGrid(range(1, NODES + 1), client_with())
    arrays, _ = rounds(strategy, grid, 1, 1, model_record(dp_model()))
    before, eps = strategy.params.copy(), strategy.privacy.epsilon()
    grid.node_ids.append(NODES + 1)
    arrays, _ = rounds(strategy, grid, 2, 2, arrays)
    stats = strategy.accounting.rounds[2]
    assert stats.failures == 1
    assert "this round drew 5 of 11 clients but the accountant assumes 5 of 10" in stats.failure_reasons[0]
    assert strategy.params.tobytes() == before.tobytes()
    assert (strategy.privacy.releases, strategy.privacy.draw, strategy.privacy.epsilon()) == (1, (10, 5), eps)
    assert 2 not in strategy.deltas  # the optimiser never saw round 2


# --------------------------------------------------------------------------- 10. the asynchronous driver
def test_the_async_driver_releases_once_per_step_over_its_buffered_jobs() -> None:
    """§7: one release per flush, denominator M = the step's buffered jobs, no amplification."""
    seen: list[int] = []

    class AsyncSpy(Spy):
        def apply_server_step(self, server_round: int, delta: np.ndarray) -> None:
            seen.append(len(self.jobs.bases))
            super().apply_server_step(server_round, delta)

    driver = BufferedAsync(concurrency=4, buffer_size=2, rule=AsyncRule.fadas())
    strategy = build(central(sampling="none", clip=0.8, noise_multiplier=1.2), cls=AsyncSpy, driver=driver)
    grid = FakeGrid(range(1, NODES + 1), client_with(), arrival_seed=1)
    strategy.start(grid=grid, initial_arrays=model_record(dp_model()), num_rounds=4)
    assert seen == [2, 2, 2, 2]
    assert column(strategy, "dp_noise_std") == [pytest.approx(1.2 * 0.8 / 2)] * 4
    assert column(strategy, "dp_epsilon") == [epsilon_after(t, 1.2) for t in (1, 2, 3, 4)]
    assert strategy.privacy.releases == 4 and strategy.privacy.draw is None


def test_the_async_driver_with_sampling_without_replacement_fails_each_step_with_its_reason() -> None:
    driver = BufferedAsync(concurrency=4, buffer_size=2, rule=AsyncRule.fadas())
    strategy = build(central(sampling="without-replacement"), driver=driver)
    grid = FakeGrid(range(1, NODES + 1), client_with(), arrival_seed=1)
    strategy.start(grid=grid, initial_arrays=model_record(dp_model()), num_rounds=2)
    for stats in strategy.accounting.rounds.values():
        assert stats.failures == 1
        assert "needs the sampler's uniform draw; this round has none" in stats.failure_reasons[0]
    assert strategy.privacy.releases == 0 and strategy.deltas == {}
    np.testing.assert_array_equal(strategy.params, flat32(dp_model()))


# --------------------------------------------------------------------------- the part's own checks
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"clip": 0.0}, r"^dp clip=0\.0 is out of range"),
        ({"noise_multiplier": -1.0}, r"^dp noise_multiplier=-1\.0 is out of range"),
        ({"delta": 1.0}, r"^dp delta=1\.0 is out of range; allowed: a number in \(0, 1\)"),
        ({"sampling": "poisson"}, r"^dp sampling='poisson' is unknown; allowed: without-replacement, none"),
        ({"target_quantile": 1.5}, r"^dp target_quantile=1\.5 is out of range"),
        ({"seed": -1}, r"^dp seed=-1 is invalid"),
        ({"clip": float("nan")}, r"^dp clip=nan is out of range"),
    ],
)
def test_central_privacy_refuses_bad_settings(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        central(**kwargs)


# --------------------------------------------------------------------------- run-config
@pytest.fixture(scope="module")
def defaults() -> dict:
    return defaults_from_pyproject(str(ROOT / "pyproject.toml"))


@pytest.mark.parametrize(
    ("key", "value"),
    [("dp", "global"), ("dp-delta", 1.5), ("dp-noise-seed", -2), ("dp-clip", 0.0), ("dp-sampling", "poisson")],
)
def test_run_config_dp_keys_are_validated_naming_the_key(defaults: dict, key: str, value: Any) -> None:
    with pytest.raises(ConfigError) as refused:
        AppConfig.from_run_config({**defaults, key: value})
    message = str(refused.value)
    assert f"'{key}'" in message and repr(value) in message and "allowed" in message and "\n" not in message


def test_flowers_own_fedavg_refuses_dp_with_its_reason(defaults: dict) -> None:
    cfg = AppConfig.from_run_config({**defaults, "strategy": "fedavg", "dp": "central"})
    with pytest.raises(ValueError, match=r"'dp' = 'central' does not fit Flower's own FedAvg: .*allowed: dp = 'none'"):
        build_strategy(cfg)


@pytest.mark.parametrize(("driver", "sampling"), [("sync", "without-replacement"), ("async", "none")])
def test_privacy_of_builds_the_central_part_with_auto_sampling(defaults: dict, driver: str, sampling: str) -> None:
    changes = {
        "dp": "central",
        "driver": driver,
        "dp-clip": 0.3,
        "dp-noise-multiplier": 1.7,
        "dp-delta": 1e-6,
        "dp-target-epsilon": 8.0,
        "dp-adaptive-clip": True,
        "dp-target-quantile": 0.6,
        "dp-clip-lr": 0.1,
        "dp-noise-seed": 9,
    }
    privacy = privacy_of(AppConfig.from_run_config({**defaults, **changes}))
    assert isinstance(privacy, CentralPrivacy)
    got = (privacy.clip, privacy.noise_multiplier, privacy.delta, privacy.sampling, privacy.target_epsilon)
    assert got == (0.3, 1.7, 1e-6, sampling, 8.0)
    assert (privacy.adaptive, privacy.target_quantile, privacy.clip_lr, privacy.seed) == (True, 0.6, 0.1, 9)
    plain = privacy_of(AppConfig.from_run_config({**defaults, "dp": "central", "driver": driver}))
    assert (plain.seed, plain.target_epsilon, plain.adaptive) == (None, None, False)  # -1 and 0: none
    explicit = {**defaults, "dp": "central", "driver": driver, "dp-sampling": "none"}
    assert privacy_of(AppConfig.from_run_config(explicit)).sampling == "none"


def test_privacy_of_builds_the_local_part_or_none(defaults: dict) -> None:
    from pollen.strategies.engine.local_privacy import LocalPrivacy

    assert privacy_of(AppConfig.from_run_config(defaults)) is None
    cfg = {**defaults, "dp": "local", "dp-clip": 0.4, "dp-noise-multiplier": 2.0, "dp-noise-seed": 3}
    privacy = privacy_of(AppConfig.from_run_config(cfg))
    assert isinstance(privacy, LocalPrivacy)
    assert (privacy.clip, privacy.noise_multiplier, privacy.delta, privacy.seed) == (0.4, 2.0, 1e-5, 3)


def test_a_run_config_with_central_dp_builds_a_private_strategy_with_the_screen_off(defaults: dict) -> None:
    cfg = AppConfig.from_run_config({**defaults, "strategy": "fedams", "dp": "central", "outlier-rule": "reject"})
    strategy = build_strategy(cfg)
    assert isinstance(strategy.privacy, CentralPrivacy) and strategy.screen.rule == "off"
